"""The fused chunk forward (state recurrence and output in one kernel): its references against the token-by-token
recurrence, the kernel on CPU through the interpreter, every tile compiled for sm90 by ptxas on any machine, and on
the GPU against the split kernels (ours for the states, FLA's for the output) and inside the GDN op."""

import math
import sys
from pathlib import Path

import pytest
import torch

from megatron_muon.kernels.gluon_support import SM90_SHARED_MEMORY_PER_BLOCK
from megatron_muon.ops import chunk_fwd_fused, kernel_choice
from megatron_muon.ops.reference import (
    chunk_output_reference,
    chunk_state_forward_reference,
    chunk_wy_reference,
    naive_recurrent_gated_delta_rule,
)
from tests.interpreter import run_under_interpreter
from tests.ops.helpers import chunk_kernel_inputs

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_chunk_references_compose_to_the_token_by_token_recurrence():
    """fp64, GVA (two value heads per key head), a partial last chunk, an initial state: WY terms, then the state
    recurrence, then the chunk output give the naive recurrence's output and final state."""
    gen = torch.Generator().manual_seed(3)
    batch, seq_len, heads, value_heads, key_dim, value_dim = 2, 150, 1, 2, 16, 8

    def unit_rows():
        return torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, key_dim, generator=gen,
                                                         dtype=torch.float64), dim=-1)

    q, k = unit_rows(), unit_rows()
    v = torch.randn(batch, seq_len, value_heads, value_dim, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(batch, seq_len, value_heads, generator=gen, dtype=torch.float64))
    beta = torch.rand(batch, seq_len, value_heads, generator=gen, dtype=torch.float64)
    h0 = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen, dtype=torch.float64)
    scale = key_dim**-0.5
    want_o, want_final = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, h0, output_final_state=True)
    log2_gates = torch.cat([g[:, i : i + 64].cumsum(1) for i in range(0, seq_len, 64)], dim=1) / math.log(2)
    w, u = chunk_wy_reference(k, v, log2_gates, beta)
    h, v_new, final = chunk_state_forward_reference(k.repeat_interleave(2, dim=2), w, u, log2_gates,
                                                    h0.transpose(-1, -2))
    o = chunk_output_reference(q, k, v_new, h, log2_gates, scale)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final.transpose(-1, -2), want_final, rtol=1e-10, atol=1e-10)


def test_fused_forward_under_triton_interpreter():
    """Partial last chunks, key dims 64 / 128 / 256, GVA, with and without kept states and initial / final states;
    and the GDN op's routing to it."""
    pytest.importorskip("triton", reason="the interpreter comes with Triton")
    run_under_interpreter(Path(__file__).with_name("_chunk_fwd_fused_interpret_check.py"))


def test_every_fused_tile_fits_an_sm90_block():
    """Each tile of the fused forward (with and without kept states) and of the state-gradient kernel with the local
    value gradient inside, compiled for sm90 (Triton's ptxas, no GPU needed) at both reference shapes: within the
    block's shared memory; the default tiles spill no registers."""
    pytest.importorskip("triton", reason="ptxas comes with Triton")
    sys.path.insert(0, str(BENCHMARKS))
    import state_kernel_sass

    from megatron_muon.ops.state_tma import LOCAL_DV_CONFIGS

    for shape in state_kernel_sass.FUSED_SHAPES:
        kernels = [(index, lambda c=config, s=store: state_kernel_sass.fused_forward(shape, *c, s))
                   for index, config in enumerate(chunk_fwd_fused.FUSED_CONFIGS) for store in (False, True)]
        kernels += [(index, lambda c=config: state_kernel_sass.backward_kernel(shape, *c, local_dv=True))
                    for index, config in enumerate(LOCAL_DV_CONFIGS)]
        for index, build in kernels:
            used = state_kernel_sass.resources(build())
            assert used["shared"] <= SM90_SHARED_MEMORY_PER_BLOCK, (shape, index, used)
            if index == 0:
                assert used["stack"] == 0, (shape, used)


def test_the_fused_preset_and_its_errors():
    assert kernel_choice.GdnKernels.named("fused") == kernel_choice.GdnKernels("gluon", "ours", "fused")
    assert kernel_choice.GdnKernels().output_terms == "fla"  # the measured default until fused measures faster
    with pytest.raises(ValueError, match="GDN output-term kernels 'one'; valid choices"):
        kernel_choice.GdnKernels(output_terms="one")


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (key heads, value heads, key dim, value dim): Qwen3-Next's GDN heads and the hybrid-1.5B's
GPU_SHAPES = {"qwen3-next": (16, 32, 128, 128), "hybrid-1.5b": (6, 6, 256, 512)}


def _gpu_inputs(shape: str, seq_len: int):
    key_heads, heads, key_dim, value_dim = GPU_SHAPES[shape]
    torch.manual_seed(seq_len + heads)
    q, k, w, u, _, _, g, state = chunk_kernel_inputs(1, seq_len, key_heads, heads, key_dim, value_dim)
    return q, k, w, u, g, state


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("config", chunk_fwd_fused.FUSED_CONFIGS, ids=str)
def test_fused_forward_equals_the_split_kernels(shape, config):
    """bf16, every tile, with initial and final states and the states kept: within 1e-2 of the split kernels
    (`state_tma.chunk_fwd_h`, then FLA's `chunk_fwd_o`) at 16k tokens; at 2k no further from the fp32 references
    than twice the split kernels' error."""
    pytest.importorskip("fla", reason="needs flash-linear-attention")
    from fla.ops.common.chunk_o import chunk_fwd_o

    from megatron_muon.ops import state_tma

    for seq_len in (16384, 2048):
        q, k, w, u, g, state = _gpu_inputs(shape, seq_len)
        scale = q.shape[-1] ** -0.5
        o, final, h, v_new = chunk_fwd_fused.chunk_fwd_fused(q, k, w, u, g, scale, state, True, store_states=True,
                                                             config=config)
        split_h, split_v_new, split_final = state_tma.chunk_fwd_h(k, w, u, g, state, True)
        split_o = chunk_fwd_o(q=q, k=k, v=split_v_new, h=split_h, g=g, scale=scale, state_v_first=True,
                              chunk_size=64)
        ours, split = (o, final, h, v_new), (split_o, split_final, split_h, split_v_new)
        for got, want in zip(ours, split):
            assert _relative(got, want) < 1e-2
        if seq_len == 2048:
            cpu = [t.cpu() for t in (q, k, w, u, g, state)]
            groups = w.shape[2] // k.shape[2]
            ref_h, ref_v_new, ref_final = chunk_state_forward_reference(cpu[1].repeat_interleave(groups, dim=2),
                                                                        *cpu[2:])
            ref_o = chunk_output_reference(cpu[0], cpu[1], ref_v_new, ref_h, cpu[4], scale)
            for got, theirs, want in zip(ours, split, (ref_o, ref_final, ref_h, ref_v_new)):
                assert _relative(got.cpu(), want) < 2 * _relative(theirs.cpu(), want) + 1e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seq_len, keep_states, gva", [(1008, True, False), (1008, False, False), (1008, True, True)],
                         ids=["kept-states", "recomputed-states", "gva"])
def test_gdn_op_on_the_fused_forward_matches_the_torch_backend(monkeypatch, seq_len, keep_states, gva):
    """The GDN custom op with the "fused" kernels: outputs and all gradients within FLA's tolerances of the torch
    backend, and both fused kernels really ran (the forward, and the state gradients with dv None)."""
    from megatron_muon.ops import state_tma, state_ws
    from tests.ops import test_gdn_gpu

    calls = []
    forward = chunk_fwd_fused.chunk_fwd_fused
    monkeypatch.setattr(chunk_fwd_fused, "chunk_fwd_fused", lambda *a, **kw: calls.append("fwd") or forward(*a, **kw))
    for module in (state_tma, state_ws):  # the state gradients run on Gluon where it is there
        backward = module.chunk_dhu
        monkeypatch.setattr(module, "chunk_dhu", lambda *a, _b=backward, **kw:
                            calls.append("bwd" if a[5] is None else "dhu") or _b(*a, **kw))
    monkeypatch.setattr(kernel_choice, "_chosen", kernel_choice.GdnKernels.named("fused"))
    qk_heads = test_gdn_gpu.HEADS // 2 if gva else test_gdn_gpu.HEADS
    test_gdn_gpu.test_fla_gdn_matches_torch_backend(None, seq_len, keep_states, True, False, qk_heads)
    assert "fwd" in calls and "bwd" in calls and "dhu" not in calls, calls
