"""The one-pass chunk backward (`ops/chunk_bwd_onepass.py`): the fp64 references on CPU through the interpreter
(alone and inside the GDN op: `test_chunk_bwd_fused.py`'s op check runs it too), compiled for sm90 on any machine,
and on the GPU against the split path it replaces and inside the GDN op."""

import sys
from pathlib import Path

import pytest
import torch

from megatron_muon.ops import chunk_bwd_onepass, kernel_choice
from tests.interpreter import run_under_interpreter
from tests.ops.helpers import assert_op_on_kernels_matches_torch_backend, chunk_kernel_inputs

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SM90_SHARED_MEMORY_PER_BLOCK = 227 * 1024
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_kernel_under_triton_interpreter():
    run_under_interpreter(Path(__file__).with_name("_chunk_bwd_onepass_interpret_check.py"))


def test_cpu_tensors_do_not_qualify_without_the_interpreter():
    x, v = torch.zeros(1, 64, 1, 64, dtype=torch.float16), torch.zeros(1, 64, 1, 64, dtype=torch.float16)
    gates, a_inverse = torch.zeros(1, 64, 1), torch.zeros(1, 64, 1, 64, dtype=torch.float16)
    h = torch.zeros(1, 1, 1, 64, 64, dtype=torch.float16)
    inputs = (x, x, v, v, x, gates, gates, a_inverse, h, v)
    assert chunk_bwd_onepass.qualifies(*inputs, None, 64) == chunk_bwd_onepass._INTERPRETING


def test_the_kernel_choice_names_it():
    assert kernel_choice.GdnKernels(output_grads="one-pass").output_grads == "one-pass"
    assert kernel_choice.GdnKernels().output_grads == "ours"  # the measured default until one-pass measures faster


@pytest.mark.parametrize("warps", chunk_bwd_onepass.WARPS)
def test_it_compiles_for_sm90_without_transposed_products(warps):
    """At Qwen3-Next's heads (Triton's ptxas, no GPU needed): within the block's shared memory, with tensor-core
    (wgmma) products and no transpose of their results (FLA issue #640's pattern). Register spills are reported in
    `benchmarks/results/gdn_chunk_onepass_resources.md`, not asserted: the GPU timing decides."""
    pytest.importorskip("triton", reason="ptxas comes with Triton")
    sys.path.insert(0, str(BENCHMARKS))
    import state_kernel_sass

    kernel = state_kernel_sass.onepass_backward("qwen3-next", warps)
    assert "warp_group_dot" in kernel.asm["ttgir"]
    assert state_kernel_sass.transposed_products(kernel) == []
    assert state_kernel_sass.resources(kernel)["shared"] <= SM90_SHARED_MEMORY_PER_BLOCK


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("warps", [None, *chunk_bwd_onepass.WARPS], ids=str)
def test_onepass_backward_equals_the_split_path(warps):
    """bf16 at Qwen3-Next's heads (16 q/k, 32 value heads of 128), with the final state's gradient, in one pass and
    on segments side by side: within 1e-2 of our state-gradient kernel followed by the one-kernel chunk-parallel
    backward at 16k tokens; at 2k no further from the fp64 references than twice the split path's error."""
    from megatron_muon.ops import chunk_bwd_fused, state_tma
    from megatron_muon.ops.reference import chunk_wy_inverse_reference
    from tests.ops._chunk_bwd_onepass_interpret_check import split_path

    for seq_len in (16384, 2048):
        torch.manual_seed(seq_len)
        q, k, w, u, do, _, g, dht = chunk_kernel_inputs(1, seq_len, 16, 32, 128, 128)
        beta = torch.rand(1, seq_len, 32, device="cuda")
        v = torch.randn_like(u)
        a_inverse = chunk_wy_inverse_reference(k.cpu(), g.cpu(), beta.cpu(), value_heads=32).to(k.dtype).cuda()
        scale = 128**-0.5
        h, v_new, _ = state_tma.chunk_fwd_h(k, w, u, g)
        inputs = (q, k, v, v_new, w, beta, g, a_inverse, h, do)
        assert chunk_bwd_onepass.qualifies(*inputs, None, 64)
        ours = chunk_bwd_onepass.chunk_bwd_onepass(*inputs, scale, dht=dht, want_dh0=True, num_warps=warps)
        dh, dh0, du = state_tma.chunk_dhu(q, k, w, g, do, None, scale, dht=dht, want_dh0=True)
        segments = chunk_bwd_onepass.segments_for(q, v)
        assert segments > 1  # 32 value heads leave SMs idle at one program each
        on_segments = chunk_bwd_onepass.chunk_bwd_onepass(
            *inputs, scale, want_dh0=True, num_warps=warps,
            ends=chunk_bwd_onepass.segment_ends(dh, dht, segments))
        split = (*chunk_bwd_fused.chunk_bwd_fused(q, k, v, v_new, beta, g, a_inverse, h, do, dh, du, scale), dh0)
        names = ("dq", "dk", "dv", "dbeta", "dg", "dh0")
        for name, got, cut, want in zip(names, ours, on_segments, split):
            assert got.shape == cut.shape == want.shape and _relative(got, want) < 1e-2, name
            assert _relative(cut, want) < 1e-2, name
        if seq_len == 2048:
            reference = split_path(*(t.cpu() for t in (q, k, v, v_new, w, beta, g, h, do, dht)), scale)
            for name, got, theirs, want in zip(names, ours, split, reference):
                assert _relative(got.cpu(), want) < 2 * _relative(theirs.cpu(), want) + 1e-3, name


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seq_len, keep_states, gva", [(1008, True, False), (1008, False, False), (1008, True, True),
                                                     (1024, True, True)],
                         ids=["kept-states", "recomputed-states", "gva", "gva-segments"])
def test_gdn_op_on_the_onepass_backward_matches_the_torch_backend(monkeypatch, seq_len, keep_states, gva):
    """The GDN custom op with output_grads "one-pass" at key and value dims of 128 (the kernel's): outputs and all
    gradients within FLA's tolerances of the torch backend, and the one kernel really ran."""
    from tests.ops import test_gdn_gpu

    monkeypatch.setattr(test_gdn_gpu, "KEY_DIM", 128)
    monkeypatch.setattr(test_gdn_gpu, "VALUE_DIM", 128)
    kernels = kernel_choice.GdnKernels(output_grads="one-pass")
    assert_op_on_kernels_matches_torch_backend(monkeypatch, chunk_bwd_onepass, "chunk_bwd_onepass", kernels, seq_len,
                                               keep_states, gva)
