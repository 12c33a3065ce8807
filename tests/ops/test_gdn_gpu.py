"""On a CUDA GPU: the selected FLA backend (Triton or TileLang) against the torch backend, forward and backward."""

import pytest
import torch

from megatron_muon.ops import backend, causal_conv1d, chunk_gated_delta_rule, gated_rms_norm, l2norm
from tests.ops.helpers import FLA_TOLERANCES, assert_ratio, error_ratio, gdn_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def restore_backend():
    yield
    backend.set_backend(None)


def _with_backend(name, fn, tensors):
    backend.set_backend(name)
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    outputs = fn(*leaves)
    return outputs, leaves


def _both_backends(fn, tensors, grad_outputs):
    results = {}
    for name in ("auto", "torch"):
        outputs, leaves = _with_backend(name, fn, tensors)
        loss = sum((o.float() * d).sum() for o, d in zip(outputs, grad_outputs))
        loss.backward()
        results[name] = (outputs, [None if leaf is None else leaf.grad for leaf in leaves])
    return results["auto"], results["torch"]


def test_selected_backend_is_a_correct_fast_one(restore_backend):
    backend.set_backend(None)
    name = backend.selected_backend()
    assert name in ("fla-triton", "fla-tilelang")
    if not backend.hardware().fla_triton_correct:
        assert name == "fla-tilelang", f"{backend.hardware()} needs the TileLang backward"


@pytest.mark.parametrize(
    "batch, seq_len, heads, value_heads, key_dim, value_dim, varlen",
    [(1, 1000, 6, 6, 256, 512, False), (1, 700, 2, 4, 256, 512, True)],  # the benchmark's head sizes (shared JIT)
)
def test_fla_gdn_matches_torch_backend(restore_backend, batch, seq_len, heads, value_heads, key_dim, value_dim,
                                       varlen):
    cu_seqlens = torch.tensor([0, 100, 355, 700], device="cuda") if varlen else None
    num_states = 3 if varlen else batch
    q, k, v, g, beta, h0 = gdn_inputs(batch, seq_len, heads, value_heads, key_dim, value_dim, dtype=torch.bfloat16,
                                      num_states=num_states, device="cuda", seed=seq_len)

    def run(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)

    backend.set_backend(None)
    fast_name = backend.selected_backend()
    do, dht = torch.randn_like(v, dtype=torch.float32), torch.randn_like(h0)
    (fast, fast_grads), (ref, ref_grads) = _both_backends(run, (q, k, v, g, beta, h0), (do, dht))
    pairs = [("o", ref[0], fast[0]), ("ht", ref[1], fast[1])]
    pairs += list(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ref_grads, fast_grads))
    ratios = {name: error_ratio(expected, got) for name, expected, got in pairs}
    print(f"{fast_name} vs torch error ratios:", {k: f"{v:.2e}" for k, v in ratios.items()})
    for name, expected, got in pairs:
        assert_ratio(name, expected, got, FLA_TOLERANCES[name])


def test_fla_conv_and_norms_match_torch_backend(restore_backend):
    torch.manual_seed(0)
    x = torch.randn(2, 300, 96, device="cuda", dtype=torch.bfloat16)
    weight, bias = torch.randn(96, 4, device="cuda") * 0.5, torch.randn(96, device="cuda")
    gate = torch.randn(2, 300, 96, device="cuda", dtype=torch.bfloat16)
    norm_weight = 1 + 0.1 * torch.randn(96, device="cuda")

    def run(x, weight, bias, gate, norm_weight):
        conv = causal_conv1d(x, weight.to(x.dtype), bias.to(x.dtype))
        return conv, l2norm(conv), gated_rms_norm(conv, gate, norm_weight)

    grad_outputs = [torch.randn(2, 300, 96, device="cuda") for _ in range(3)]
    (fast, fast_grads), (ref, ref_grads) = _both_backends(run, (x, weight, bias, gate, norm_weight), grad_outputs)
    for name, expected, got in zip(("conv", "l2norm", "gated_norm"), ref, fast):
        assert_ratio(name, expected, got, 0.005)
    for name, expected, got in zip(("dx", "dweight", "dbias", "dgate", "dnorm_weight"), ref_grads, fast_grads):
        assert_ratio(name, expected, got, 0.008)
