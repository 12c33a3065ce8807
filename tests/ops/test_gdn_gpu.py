"""On a CUDA GPU: the selected FLA backend (Triton or TileLang) against the torch backend, forward and backward.

Every case uses the benchmark's GDN sizes (6 heads, key dim 256, value dim 512; conv width 6144; norm width 512) and
sequence lengths that are multiples of 16 like the benchmark's 16384: FLA's autotune keys and Triton's integer
specializations then match across cases and with the benchmark, so only the first case pays for autotuning/JIT.
"""

import pytest
import torch

from megatron_muon.ops import backend, causal_conv1d, chunk_gated_delta_rule, gated_rms_norm, l2norm
from tests.ops.helpers import FLA_TOLERANCES, assert_ratio, error_ratio, gdn_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS, KEY_DIM, VALUE_DIM = 6, 256, 512
CONV_WIDTH = 2 * HEADS * KEY_DIM + HEADS * VALUE_DIM


@pytest.fixture
def restore_backend():
    yield
    backend.set_backend(None)


def _both_backends(fn, tensors, grad_outputs):
    """(outputs, input grads) with the automatic (fast) backend and with the torch backend, on copies of `tensors`."""
    results = {}
    for name in ("auto", "torch"):
        backend.set_backend(name)
        leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
        outputs = fn(*leaves)
        loss = sum((o.float() * d).sum() for o, d in zip(outputs, grad_outputs))
        loss.backward()
        results[name] = (outputs, [None if leaf is None else leaf.grad for leaf in leaves])
    backend.set_backend(None)
    return results["auto"], results["torch"]


def test_selected_backend_is_a_correct_fast_one(restore_backend):
    backend.set_backend(None)
    name = backend.selected_backend()
    assert name in ("fla-triton", "fla-tilelang")
    if not backend.hardware().fla_triton_correct:
        # Where Triton miscompiles FLA's output-gradient kernel, TileLang takes it when installed; without TileLang
        # our own kernel replaces it and FLA's Triton path is correct for dense batches.
        expected = "fla-tilelang" if backend._fla_will_use_tilelang() else "fla-triton"
        assert name == expected, f"{backend.hardware()}: expected {expected}"


@pytest.mark.parametrize(
    "seq_len, keep_states, with_state, varlen, qk_heads",
    [(1008, True, True, False, HEADS), (1008, False, True, False, HEADS), (496, True, False, False, HEADS),
     (1008, True, True, True, HEADS), (1008, True, True, False, HEADS // 2)],
    ids=["kept-states", "recomputed-states", "no-initial-state", "varlen", "gva"],
)
def test_fla_gdn_matches_torch_backend(restore_backend, seq_len, keep_states, with_state, varlen, qk_heads):
    cu_seqlens = torch.tensor([0, 100, 355, seq_len], device="cuda") if varlen else None
    num_states = 3 if varlen else 1
    q, k, v, g, beta, h0 = gdn_inputs(1, seq_len, qk_heads, HEADS, KEY_DIM, VALUE_DIM, dtype=torch.bfloat16,
                                      num_states=num_states, device="cuda", seed=seq_len + varlen + qk_heads)
    h0 = h0 if with_state else None

    def run(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                      keep_states_for_backward=keep_states)

    backend.set_backend(None)
    fast_name = backend.selected_backend()
    do = torch.randn_like(v, dtype=torch.float32)
    dht = torch.randn(num_states, HEADS, KEY_DIM, VALUE_DIM, device="cuda")
    if varlen and not backend.hardware().fla_triton_correct and not backend._fla_will_use_tilelang():
        # Our output-gradient kernel covers dense batches only; FLA stops packed ones and says what to install.
        with pytest.raises(RuntimeError, match=r"3\.7\.1.*tilelang"):
            _both_backends(run, (q, k, v, g, beta, h0), (do, dht))
        return
    (fast, fast_grads), (ref, ref_grads) = _both_backends(run, (q, k, v, g, beta, h0), (do, dht))
    pairs = [("o", ref[0], fast[0]), ("ht", ref[1], fast[1])]
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    pairs += [(name, r, f) for name, r, f in zip(names, ref_grads, fast_grads) if r is not None]
    ratios = {name: error_ratio(expected, got) for name, expected, got in pairs}
    print(f"{fast_name} vs torch error ratios:", {k: f"{v:.2e}" for k, v in ratios.items()})
    for name, expected, got in pairs:
        assert_ratio(name, expected, got, FLA_TOLERANCES[name])


def test_fla_conv_and_norms_match_torch_backend(restore_backend):
    torch.manual_seed(0)
    seq_len = 304
    x = torch.randn(1, seq_len, CONV_WIDTH, device="cuda", dtype=torch.bfloat16)
    weight, bias = torch.randn(CONV_WIDTH, 4, device="cuda") * 0.5, torch.randn(CONV_WIDTH, device="cuda")
    gate = torch.randn(1, seq_len, HEADS, VALUE_DIM, device="cuda", dtype=torch.bfloat16)
    norm_weight = 1 + 0.1 * torch.randn(VALUE_DIM, device="cuda")

    def run(x, weight, bias, gate, norm_weight):
        conv = causal_conv1d(x, weight.to(x.dtype), bias.to(x.dtype))
        q, _, v = conv.split([HEADS * KEY_DIM, HEADS * KEY_DIM, HEADS * VALUE_DIM], dim=-1)  # strided like the layer
        return conv, l2norm(q.unflatten(-1, (HEADS, KEY_DIM))), gated_rms_norm(
            v.unflatten(-1, (HEADS, VALUE_DIM)), gate, norm_weight)

    grad_outputs = [torch.randn(1, seq_len, CONV_WIDTH, device="cuda"),
                    torch.randn(1, seq_len, HEADS, KEY_DIM, device="cuda"),
                    torch.randn(1, seq_len, HEADS, VALUE_DIM, device="cuda")]
    (fast, fast_grads), (ref, ref_grads) = _both_backends(run, (x, weight, bias, gate, norm_weight), grad_outputs)
    for name, expected, got in zip(("conv", "l2norm", "gated_norm"), ref, fast):
        assert_ratio(name, expected, got, 0.005)
    for name, expected, got in zip(("dx", "dweight", "dbias", "dgate", "dnorm_weight"), ref_grads, fast_grads):
        assert_ratio(name, expected, got, 0.008)
