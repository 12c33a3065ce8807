"""The chunk output-gradient kernel (`ops/dqkwg.py`): the autograd reference on CPU through the interpreter, and
FLA's kernel (TileLang on Hopper) on the GPU at the hybrid-1.5B shape."""

import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_muon.ops import dqkwg
from tests.interpreter import run_under_interpreter
from tests.ops.helpers import needs_flas_gpu_backward
from tests.ops.test_state_tma import _hybrid_inputs, _relative, needs_gpu


def test_kernel_under_triton_interpreter():
    run_under_interpreter(Path(__file__).with_name("_dqkwg_interpret_check.py"))


@pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                    reason="needs flash-linear-attention (the gdn extra) for FLA's Triton kernel")
def test_the_reference_matches_flas_triton_kernel_under_the_interpreter():
    """FLA's own Triton kernel, run by the interpreter (where Hopper's miscompile does not arise), agrees with the
    autograd reference: the reference states FLA's semantics, dg's natural-log units included."""
    run_under_interpreter(Path(__file__).with_name("_dqkwg_fla_interpret_check.py"))


def test_cpu_tensors_do_not_qualify_without_the_interpreter():
    x = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    h = torch.zeros(1, 1, 1, 128, 64, dtype=torch.bfloat16)
    v = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    assert dqkwg.qualifies(x, x, v, x, torch.zeros(1, 64, 1), h, v, h, v, None, 64) == dqkwg._INTERPRETING


def _hybrid_grad_inputs(seq_len):
    """Realistic h and dh from our state kernels at the hybrid-1.5B GDN shape."""
    from megatron_muon.ops import state_tma

    q, k, w, u, do, dv, g, _ = _hybrid_inputs(seq_len)
    h, v_new, _ = state_tma.chunk_fwd_h(k, w, u, g)
    dh, _, dv2 = state_tma.chunk_dhu(q, k, w, g, do, dv, 256**-0.5)
    return q, k, v_new, w, g, h, do, dh, dv2


@pytest.mark.gpu
@needs_gpu
@needs_flas_gpu_backward
@pytest.mark.parametrize("config", [None, *dqkwg.CONFIGS], ids=str)
def test_output_gradients_equal_flas_kernel_at_the_hybrid_shape(config):
    """bf16, 6 heads, key 256, value 512: at 16k tokens within 1e-2 of FLA's kernel; at 2k no further from the fp32
    reference than twice FLA's error (None: the autotuned choice)."""
    pytest.importorskip("fla", reason="needs flash-linear-attention")
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg

    from megatron_muon.ops.reference import chunk_output_grads_reference

    scale = 256**-0.5
    for seq_len in (16384, 2048):
        q, k, v_new, w, g, h, do, dh, dv = inputs = _hybrid_grad_inputs(seq_len)
        assert dqkwg.qualifies(*inputs, None, 64)
        ours = dqkwg.chunk_dqkwg(*inputs, scale, config=config)
        fla = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=scale,
                              state_v_first=True, chunk_size=64)
        for got, want in zip(ours, fla):
            assert _relative(got, want) < 1e-2
        if seq_len == 2048:
            reference = chunk_output_grads_reference(*(t.cpu() for t in inputs), scale)
            for got, theirs, want in zip(ours, fla, reference):
                assert _relative(got.cpu(), want) < 2 * _relative(theirs.cpu(), want) + 1e-3


@pytest.mark.skipif(dqkwg.triton is None, reason="needs Triton")
def test_the_autotuner_only_tries_key_blocks_that_fit_the_key_dim():
    """A 128-row key block at key dim 64 would launch no program and leave dq, dk and dw unwritten."""
    configs = dqkwg._dqkwg_tuned.configs
    assert dqkwg._dqkwg_tuned.early_config_prune is dqkwg._fitting_tiles
    assert {c.kwargs["BK"] for c in configs} == {64, 128}
    assert all(c.kwargs["BK"] == 64 for c in dqkwg._fitting_tiles(configs, {}, K=64))
    assert dqkwg._fitting_tiles(configs, {}, K=256) == configs


def test_a_pinned_tile_that_does_not_divide_the_dims_names_the_fix():
    q = torch.zeros(1, 64, 1, 64, dtype=torch.float16)
    v = torch.zeros(1, 64, 1, 128, dtype=torch.float16)
    h = torch.zeros(1, 1, 1, 128, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CONFIGS"):
        dqkwg.chunk_dqkwg(q, q, v, q, torch.zeros(1, 64, 1), h, v, h, v, 0.125, config=(128, 64, 8, 2))
