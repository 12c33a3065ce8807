"""The warp-specialized Gluon fused chunk forward: compiled for sm90 on any machine, the forward's choice between it
and the Triton kernel (with the fallback when Gluon's front end rejects it), and on a Hopper GPU its outputs against
the Triton fused kernel and the fp32 chunk references."""

import re
import sys
import warnings

import pytest
import torch

from megatron_muon.ops import chunk_fwd_fused, chunk_fwd_fused_ws, fla_backend, kernel_choice, state_ws
from megatron_muon.ops.reference import chunk_output_reference, chunk_state_forward_reference
from tests.ops.test_state_tma import _relative
from tests.ops.helpers import chunk_kernel_inputs
from tests.ops.test_chunk_fwd_fused import BENCHMARKS
from tests.ops.test_state_ws import SHARED_MEMORY_LIMIT, needs_gluon, needs_hopper


@needs_gluon
@pytest.mark.parametrize("store_states", [False, True], ids=["", "states-kept"])
def test_the_kernel_compiles_for_hopper_within_shared_memory(store_states):
    """No GPU needed, at Qwen3-Next's heads (K = V = 128, GVA): the products lower to wgmma (64 × 32 and the 64 × 64
    scores) within an sm90 block's shared memory, without spilled registers."""
    sys.path.insert(0, str(BENCHMARKS))
    import state_kernel_sass

    kernel = state_kernel_sass.fused_forward_gluon("qwen3-next", store_states)
    assert kernel.metadata.shared <= SHARED_MEMORY_LIMIT
    assert state_kernel_sass.resources(kernel)["stack"] == 0
    ptx = kernel.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.bf16", ptx)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16", ptx)


def test_cpu_tensors_and_wide_keys_are_never_ready():
    key = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    value = torch.zeros(1, 64, 1, 32, dtype=torch.bfloat16)
    assert not chunk_fwd_fused_ws.ready(key, key, key, value)
    wide = torch.zeros(1, 64, 1, 256, dtype=torch.bfloat16)
    assert not chunk_fwd_fused_ws.ready(wide, wide, wide, value)


def _stub_fused_kernels(monkeypatch, gluon_error=None):
    calls = []

    def recorder(name, error=None):
        def run(*args):
            calls.append(name)
            if error is not None:
                raise error
            return name
        return run

    monkeypatch.setattr(chunk_fwd_fused_ws, "chunk_fwd_fused", recorder("gluon", gluon_error))
    monkeypatch.setattr(chunk_fwd_fused, "chunk_fwd_fused", recorder("triton"))
    monkeypatch.setattr(chunk_fwd_fused_ws, "ready", lambda *tensors: chunk_fwd_fused_ws.SWITCH.available())
    monkeypatch.setattr(chunk_fwd_fused_ws.SWITCH, "why", [])
    return calls


@needs_gluon
@pytest.mark.parametrize("states, kernel", [("gluon", "gluon"), ("triton", "triton")])
def test_the_fused_forward_follows_the_state_kernel_choice(monkeypatch, states, kernel):
    calls = _stub_fused_kernels(monkeypatch)
    monkeypatch.setattr(kernel_choice, "_chosen", kernel_choice.GdnKernels(states, "ours", "fused"))
    assert fla_backend._fused_forward(*[None] * 9) == kernel and calls == [kernel]


@needs_gluon
def test_a_rejected_gluon_fused_forward_warns_once_and_hands_every_call_to_triton(monkeypatch):
    calls = _stub_fused_kernels(monkeypatch, TypeError("warp_specialize() got an unexpected keyword argument"))
    monkeypatch.setattr(kernel_choice, "_chosen", kernel_choice.GdnKernels.named("fused"))
    with pytest.warns(UserWarning, match="fused chunk forward failed to compile"):
        assert fla_backend._fused_forward(*[None] * 9) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fla_backend._fused_forward(*[None] * 9) == "triton"
    assert calls == ["gluon", "triton", "triton"]
    assert not chunk_fwd_fused_ws.SWITCH.available() and state_ws.SWITCH.available()


@pytest.mark.gpu
@needs_hopper
@needs_gluon
@pytest.mark.parametrize("batch, seq_len, key_heads, heads, key_dim, value_dim, store_states",
                         [(1, 16384, 16, 32, 128, 128, False), (1, 2048, 16, 32, 128, 128, True),
                          (1, 1000, 2, 2, 64, 96, True), (2, 1024, 1, 3, 128, 64, False)],
                         ids=["qwen3-next-16k", "qwen3-next-2k-states-kept", "partial-chunk-k64", "two-sequences-gva"])
def test_the_gluon_fused_forward_matches_the_triton_one_and_the_references(batch, seq_len, key_heads, heads, key_dim,
                                                                          value_dim, store_states):
    """bf16 with initial and final states: within 1e-2 of the Triton fused kernel; at up to 2k tokens no further
    from the fp32 chunk references than twice its error."""
    torch.manual_seed(seq_len + key_dim)
    scale = key_dim**-0.5
    q, k, w, u, _, _, g, state = chunk_kernel_inputs(batch, seq_len, key_heads, heads, key_dim, value_dim)
    assert chunk_fwd_fused.qualifies(q, k, w, u, g, None, 64) and chunk_fwd_fused_ws.ready(q, k, w, u)
    ours = chunk_fwd_fused_ws.chunk_fwd_fused(q, k, w, u, g, scale, state, True, store_states)
    theirs = chunk_fwd_fused.chunk_fwd_fused(q, k, w, u, g, scale, state, True, store_states)
    assert (ours[2] is None) == (ours[3] is None) == (theirs[2] is None) == (not store_states)
    for got, want in zip(ours, theirs):
        if got is not None:
            assert _relative(got, want) < 1e-2
    if seq_len <= 2048:
        groups = heads // key_heads
        ref_h, ref_v_new, ref_final = chunk_state_forward_reference(
            *(t.cpu() for t in (k.repeat_interleave(groups, dim=2), w, u, g, state)))
        ref_o = chunk_output_reference(q.cpu(), k.cpu(), ref_v_new, ref_h, g.cpu(), scale)
        for got, other, want in zip(ours, theirs, (ref_o, ref_final, ref_h, ref_v_new)):
            if got is not None:
                assert _relative(got.cpu(), want) < 2 * _relative(other.cpu(), want) + 1e-3


@needs_gluon
def test_the_host_wrapper_launches_the_forward_kernel_with_the_output(monkeypatch):
    """No GPU needed: the fused forward is `state_ws`'s forward kernel with WITH_OUTPUT, every argument on the
    parameter of its name, h and v_new left out unless kept, GVA's group from the heads."""
    batch, seq_len, key_heads, heads, key_dim, value_dim = 1, 1000, 2, 4, 128, 64
    launches = []
    kernel = state_ws._chunk_state_fwd_ws_kernel
    recorder = type("Recorder", (), {"__getitem__": lambda self, grid: lambda *args, **options: launches.append(
        (grid, dict(zip(kernel.arg_names, args))))})()
    monkeypatch.setattr(state_ws, "_chunk_state_fwd_ws_kernel", recorder)
    key = torch.zeros(batch, seq_len, key_heads, key_dim, dtype=torch.bfloat16)
    w = torch.zeros(batch, seq_len, heads, key_dim, dtype=torch.bfloat16)
    u = torch.zeros(batch, seq_len, heads, value_dim, dtype=torch.bfloat16)
    gates = torch.zeros(batch, seq_len, heads)
    for store_states in (False, True):
        o, final, h, v_new = chunk_fwd_fused_ws.chunk_fwd_fused(key, key, w, u, gates, 0.25, None, True, store_states)
        grid, args = launches[-1]
        assert grid == (value_dim // state_ws.BLOCK_V, batch * heads)
        assert args["WITH_OUTPUT"] and args["STORE_STATES"] == store_states and args["scale"] == 0.25
        assert (args["H"], args["GROUP"], args["K"], args["V"], args["NT"]) == (heads, 2, key_dim, value_dim, 16)
        assert args["ht"] is final and not args["USE_INITIAL_STATE"] and o.shape == u.shape
        assert (h is None and v_new is None) if not store_states else (h.shape == (batch, 16, heads, value_dim,
                                                                                    key_dim) and v_new.shape == u.shape)
