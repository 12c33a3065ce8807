"""Shared input builders and FLA's error-ratio check for the GDN op tests."""

import torch
import torch.nn.functional as F

# FLA's tests/ops/test_gated_delta.py::test_chunk tolerances (rmse(diff) / rmse(ref)).
FLA_TOLERANCES = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dbeta": 0.02, "dg": 0.02,
                  "dh0": 0.008}


def error_ratio(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return ((ref - got).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8)).item()


def assert_ratio(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> None:
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = error_ratio(ref, got)
    assert err < ratio, f"{name}: error ratio {err:.2e} >= {ratio}"


def gdn_inputs(batch, seq_len, heads, value_heads, key_dim, value_dim, *, dtype=torch.float32, gate_scale=1.0,
               num_states=None, device="cpu", seed=0):
    """Fresh random inputs like FLA's tests: unit-norm keys, log-sigmoid decays, sigmoid betas, random h0."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = randn(batch, seq_len, heads, key_dim)
    k = F.normalize(randn(batch, seq_len, heads, key_dim), p=2, dim=-1)
    v = randn(batch, seq_len, value_heads, value_dim)
    g = F.logsigmoid(rand(batch, seq_len, value_heads)) * gate_scale
    beta = rand(batch, seq_len, value_heads).sigmoid()
    h0 = randn(num_states or batch, value_heads, key_dim, value_dim)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return [x.to(device) for x in (q, k, v, g, beta, h0)]
