"""The one-kernel chunk-parallel backward (`ops/chunk_bwd_fused.py`): the fp64 references on CPU through the
interpreter, its tiles compiled for sm90 on any machine, and on the GPU against the two kernels it replaces and
inside the GDN op."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from megatron_muon.ops import chunk_bwd_fused, kernel_choice
from tests.interpreter import run_under_interpreter
from tests.ops.helpers import assert_op_on_kernels_matches_torch_backend, chunk_kernel_inputs

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SM90_SHARED_MEMORY_PER_BLOCK = 227 * 1024
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (key heads, value heads, key dim, value dim): Qwen3-Next's GDN heads and the hybrid-1.5B's
GPU_SHAPES = {"qwen3-next": (16, 32, 128, 128), "hybrid-1.5b": (6, 6, 256, 512)}


def test_kernel_under_triton_interpreter():
    run_under_interpreter(Path(__file__).with_name("_chunk_bwd_fused_interpret_check.py"))


def test_gdn_chunk_op_on_our_kernels_matches_the_recurrence_under_the_interpreter():
    """The op's forward and backward with our kernels throughout (no FLA): o, the final state, dq, dk, dv, dg, dβ and
    dh0 against the fp64 token-by-token recurrence and its autograd, dense and GVA, with initial and final states."""
    run_under_interpreter(Path(__file__).with_name("_gdn_chunk_op_interpret_check.py"))


@pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                    reason="needs flash-linear-attention (the gdn extra) for FLA's WY kernel")
def test_kernel_equals_the_two_kernels_it_replaces_under_the_interpreter():
    """Our dqkwg and FLA's own WY backward, run by the interpreter, give the same gradients (dq and dv bit for bit)."""
    run_under_interpreter(Path(__file__).with_name("_chunk_bwd_fused_fla_interpret_check.py"))


def test_cpu_tensors_do_not_qualify_without_the_interpreter():
    x, v = torch.zeros(1, 64, 1, 64, dtype=torch.float16), torch.zeros(1, 64, 1, 64, dtype=torch.float16)
    gates, a_inverse = torch.zeros(1, 64, 1), torch.zeros(1, 64, 1, 64, dtype=torch.float16)
    h = torch.zeros(1, 1, 1, 64, 64, dtype=torch.float16)
    inputs = (x, x, v, v, gates, gates, a_inverse, h, v, h, v)
    assert chunk_bwd_fused.qualifies(*inputs, None, 64) == chunk_bwd_fused._INTERPRETING


def test_the_kernel_choice_names_it():
    assert kernel_choice.GdnKernels(output_grads="fused").output_grads == "fused"
    assert kernel_choice.GdnKernels().output_grads == "ours"  # the measured default until fused measures faster
    with pytest.raises(ValueError, match="GDN output-gradient kernels 'one'; valid choices"):
        kernel_choice.GdnKernels(output_grads="one")


def test_every_tile_compiles_for_sm90_without_transposed_products():
    """Each tile compiled for sm90 (Triton's ptxas, no GPU needed) at both reference shapes: within the block's
    shared memory, with tensor-core (wgmma) products and no transpose of their results (the pattern Triton 3.4 to
    3.7.0 miscompile on Hopper, FLA issue #640); the first tile spills no registers."""
    pytest.importorskip("triton", reason="ptxas comes with Triton")
    sys.path.insert(0, str(BENCHMARKS))
    import state_kernel_sass

    for shape in state_kernel_sass.FUSED_SHAPES:
        for index, config in enumerate(chunk_bwd_fused.CONFIGS):
            kernel = state_kernel_sass.fused_backward(shape, *config)
            assert "warp_group_dot" in kernel.asm["ttgir"], (shape, config)
            assert state_kernel_sass.transposed_products(kernel) == [], (shape, config)
            used = state_kernel_sass.resources(kernel)
            assert used["shared"] <= SM90_SHARED_MEMORY_PER_BLOCK, (shape, config, used)
            if index == 0:
                assert used["stack"] == 0, (shape, used)


def _gpu_inputs(shape: str, seq_len: int):
    """Inputs as the backward hands them over: states and state gradients from our kernels, the inverse from the
    fp64 reference (rounded as FLA stores it)."""
    from megatron_muon.ops import state_tma
    from megatron_muon.ops.reference import chunk_wy_inverse_reference

    key_heads, heads, key_dim, value_dim = GPU_SHAPES[shape]
    torch.manual_seed(seq_len + heads)
    q, k, w, u, do, dv, g, _ = chunk_kernel_inputs(1, seq_len, key_heads, heads, key_dim, value_dim)
    beta = torch.rand(1, seq_len, heads, device="cuda")
    v = torch.randn_like(u)
    a_inverse = chunk_wy_inverse_reference(k.cpu(), g.cpu(), beta.cpu(), value_heads=heads).to(k.dtype).cuda()
    scale = key_dim**-0.5
    h, v_new, _ = state_tma.chunk_fwd_h(k, w, u, g)
    dh, _, du = state_tma.chunk_dhu(q, k, w, g, do, dv, scale)
    return (q, k, v, v_new, beta, g, a_inverse, h, do, dh, du), scale, w


def _two_kernels(q, k, v, v_new, beta, g, a_inverse, h, do, dh, du, scale, w):
    """What the "ours" output gradients run: our dqkwg, FLA's WY backward, the adds and FLA's reverse cumsum."""
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
    from fla.ops.utils import chunk_local_cumsum

    from megatron_muon.ops import dqkwg, fla_backend
    from megatron_muon.ops.group_sum import group_sum

    gva = v.shape[2] != q.shape[2]
    dq, dk, dw, dg = dqkwg.chunk_dqkwg(q, k, v_new, w, g, h, do, dh, du, scale, dk_per_value_head=gva)
    if gva:
        dk2, dv, dbeta, dg2 = fla_backend._wy_backward_per_value_head(k, v, beta, g, a_inverse, dw, du)
        dk = group_sum(dk, q.shape[2], dk2)
    else:
        dk2, dv, dbeta, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=a_inverse, dw=dw, du=du)
        dk = dk + dk2
    return dq, dk, dv, dbeta, chunk_local_cumsum(dg + dg2, chunk_size=64, reverse=True)


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("config", [None, *chunk_bwd_fused.CONFIGS], ids=str)
def test_fused_backward_equals_the_two_kernels(shape, config):
    """bf16, every tile (None: the autotuned choice): within 1e-2 of the two-kernel path at 16k tokens; at 2k no
    further from the fp64 references than twice the two-kernel path's error."""
    pytest.importorskip("fla", reason="needs flash-linear-attention for FLA's WY backward")
    from tests.ops._chunk_bwd_fused_interpret_check import expected

    for seq_len in (16384, 2048):
        inputs, scale, w = _gpu_inputs(shape, seq_len)
        assert chunk_bwd_fused.qualifies(*inputs, None, 64)
        ours = chunk_bwd_fused.chunk_bwd_fused(*inputs, scale, config=config)
        split = _two_kernels(*inputs, scale, w)
        for name, got, want in zip(("dq", "dk", "dv", "dbeta", "dg"), ours, split):
            assert got.shape == want.shape and _relative(got, want) < 1e-2, name
        if seq_len == 2048:
            q, k, v, v_new, beta, g, _, h, do, dh, du = (t.cpu() for t in inputs)
            reference = expected(q, k, v, v_new, beta, g, h, do, dh, du, scale)
            for name, got, theirs, want in zip(("dq", "dk", "dv", "dbeta", "dg"), ours, split, reference):
                assert _relative(got.cpu(), want) < 2 * _relative(theirs.cpu(), want) + 1e-3, name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seq_len, keep_states, gva", [(1008, True, False), (1008, False, False), (1008, True, True)],
                         ids=["kept-states", "recomputed-states", "gva"])
def test_gdn_op_on_the_fused_backward_matches_the_torch_backend(monkeypatch, seq_len, keep_states, gva):
    """The GDN custom op with output_grads "fused": outputs and all gradients within FLA's tolerances of the torch
    backend, and the one kernel really ran."""
    kernels = kernel_choice.GdnKernels(output_grads="fused")
    assert_op_on_kernels_matches_torch_backend(monkeypatch, chunk_bwd_fused, "chunk_bwd_fused", kernels, seq_len,
                                               keep_states, gva)
