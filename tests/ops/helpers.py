"""Shared input builders and FLA's error-ratio check for the GDN op tests."""

import importlib.util

import pytest
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


def chunk_kernel_inputs(batch, seq_len, key_heads, heads, key_dim, value_dim, dtype=torch.bfloat16, device="cuda"):
    """The chunk-state kernels' inputs as the GDN op hands them over (seeded by the caller): unit-norm q, k
    [B, T, key_heads, K], w [B, T, heads, K], u, do, dv [B, T, heads, V], chunk-local cumulative log2 gates g
    [B, T, heads] (fp32) and an fp32 value-first state [B, heads, V, K]."""
    key_shape = (batch, seq_len, key_heads, key_dim)
    q, k = (F.normalize(torch.randn(key_shape, device=device), dim=-1).to(dtype) for _ in range(2))
    w = (torch.randn(batch, seq_len, heads, key_dim, device=device) * 0.05).to(dtype)
    u, do, dv = (torch.randn(batch, seq_len, heads, value_dim, device=device).to(dtype) for _ in range(3))
    steps = -torch.rand(batch, seq_len, heads, device=device) * 0.1
    g = torch.cat([steps[:, i : i + 64].cumsum(1) for i in range(0, seq_len, 64)], dim=1) / 0.6931471805599453
    state = torch.randn(batch, heads, value_dim, key_dim, device=device) * 0.1
    return q, k, w, u, do, dv, g, state


def _why_flas_gpu_backward_cannot_run() -> str | None:
    """None where FLA's gated output-gradient kernel runs correctly: FLA installed on a GPU, and Triton does not
    miscompile it on this device or FLA sends it to TileLang (FLA raises otherwise, FLA issue #640)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("fla") is None:
        return "needs flash-linear-attention (the gdn extra)"
    from megatron_muon.ops import backend

    if backend.hardware().fla_triton_correct or backend._fla_will_use_tilelang():
        return None
    return ("compares with FLA's GPU backward, which on Hopper with Triton < 3.7.1 runs only through TileLang "
            "(pip install tilelang==0.1.15)")


_FLA_BACKWARD_MISSING = _why_flas_gpu_backward_cannot_run()
needs_flas_gpu_backward = pytest.mark.skipif(_FLA_BACKWARD_MISSING is not None, reason=_FLA_BACKWARD_MISSING or "")


def assert_op_on_kernels_matches_torch_backend(monkeypatch, module, function: str, kernels, seq_len: int,
                                               keep_states: bool, gva: bool) -> None:
    """The GDN custom op with `kernels` (a `GdnKernels`) chosen: outputs and all gradients within FLA's tolerances of
    the torch backend (`test_gdn_gpu`'s case), and `module.function` really ran."""
    from megatron_muon.ops import kernel_choice
    from tests.ops import test_gdn_gpu

    calls = []
    original = getattr(module, function)
    monkeypatch.setattr(module, function, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    monkeypatch.setattr(kernel_choice, "_chosen", kernels)
    qk_heads = test_gdn_gpu.HEADS // 2 if gva else test_gdn_gpu.HEADS
    test_gdn_gpu.test_fla_gdn_matches_torch_backend(None, seq_len, keep_states, True, False, qk_heads)
    assert calls, f"{module.__name__}.{function} did not run"
