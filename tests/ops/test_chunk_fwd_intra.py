"""The one-kernel chunk-parallel forward (`ops/chunk_fwd_intra.py`): the fp64 references on CPU through the
interpreter, its tiles compiled for sm90 on any machine, and on the GPU against FLA's kernels."""

import sys
from pathlib import Path

import pytest
import torch

from megatron_muon.ops import chunk_fwd_intra, kernel_choice
from tests.interpreter import run_under_interpreter
from tests.ops.helpers import assert_op_on_kernels_matches_torch_backend

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SM90_SHARED_MEMORY_PER_BLOCK = 227 * 1024
# (key heads, value heads, key dim, value dim): Qwen3-Next's GDN heads and the hybrid-1.5B's
GPU_SHAPES = {"qwen3-next": (16, 32, 128, 128), "hybrid-1.5b": (6, 6, 256, 512)}


def test_kernel_under_triton_interpreter():
    run_under_interpreter(Path(__file__).with_name("_chunk_fwd_intra_interpret_check.py"))


def test_cpu_tensors_do_not_qualify_without_the_interpreter():
    k, v = torch.zeros(1, 64, 1, 64, dtype=torch.float16), torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    gates = torch.zeros(1, 64, 2)
    assert chunk_fwd_intra.qualifies(k, v, gates, gates, None, 64) == chunk_fwd_intra._INTERPRETING


def test_the_kernel_choice_names_it():
    assert kernel_choice.GdnKernels(intra="ours").intra == "ours"
    assert kernel_choice.GdnKernels().intra == "fla"  # the measured default until ours measures faster
    with pytest.raises(ValueError, match="GDN intra-chunk forward kernels 'one'; valid choices"):
        kernel_choice.GdnKernels(intra="one")


@pytest.mark.skipif(chunk_fwd_intra.triton is None, reason="needs Triton")
def test_only_tiles_that_divide_the_dims_run():
    """A 64-wide block at key dim 96 would read and write past the head's columns (the kernels check only T)."""
    assert chunk_fwd_intra._tuned.early_config_prune is chunk_fwd_intra._dividing_tiles
    configs = chunk_fwd_intra._tuned.configs
    assert chunk_fwd_intra._dividing_tiles(configs, {}, K=128, V=128) == configs
    kept = chunk_fwd_intra._dividing_tiles(configs, {}, K=96, V=128)
    assert kept and all(c.kwargs["BK"] == 32 for c in kept)
    assert chunk_fwd_intra._first_dividing_tile(96, 64) == (32, 32, 4)
    assert chunk_fwd_intra._first_dividing_tile(128, 128) == chunk_fwd_intra.CONFIGS[0]


def test_every_tile_compiles_for_sm90_without_spills():
    """Each tile, and the w/u kernel a backward without kept states launches, compiled for sm90 (Triton's ptxas, no
    GPU needed) at both reference shapes: within the block's shared memory, no spilled registers, no transpose of a
    tensor-core result (FLA issue #640's pattern)."""
    pytest.importorskip("triton", reason="ptxas comes with Triton")
    sys.path.insert(0, str(BENCHMARKS))
    import state_kernel_sass

    for shape in state_kernel_sass.FUSED_SHAPES:
        kernels = [state_kernel_sass.fused_intra(shape, *config) for config in chunk_fwd_intra.CONFIGS]
        kernels.append(state_kernel_sass.intra_recompute(shape, *chunk_fwd_intra.CONFIGS[0]))  # what it launches
        for index, kernel in enumerate(kernels):
            assert state_kernel_sass.transposed_products(kernel) == [], (shape, index)
            used = state_kernel_sass.resources(kernel)
            assert used["shared"] <= SM90_SHARED_MEMORY_PER_BLOCK and used["stack"] == 0, (shape, index, used)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("config", [None, *chunk_fwd_intra.CONFIGS], ids=str)
def test_kernel_equals_flas_kernels(shape, config):
    """bf16, every tile (None: the autotuned choice), 16k and 2k tokens: g_cumsum, w, u and A within 1e-2 of FLA's
    cumsum and fused kkt + solve + recompute_w_u; at 2k no further from the fp64 references than twice FLA's error."""
    pytest.importorskip("fla", reason="needs flash-linear-attention")
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    from megatron_muon.ops.reference import chunk_wy_inverse_reference, chunk_wy_reference
    from tests.ops._chunk_fwd_intra_interpret_check import chunk_local_log2_cumsum

    key_heads, heads, key_dim, value_dim = GPU_SHAPES[shape]
    for seq_len in (16384, 2048):
        torch.manual_seed(seq_len + heads)
        k = torch.nn.functional.normalize(torch.randn(1, seq_len, key_heads, key_dim, device="cuda"), dim=-1)
        k = k.bfloat16()
        v = torch.randn(1, seq_len, heads, value_dim, device="cuda", dtype=torch.bfloat16)
        g = -torch.rand(1, seq_len, heads, device="cuda") * 0.1
        beta = torch.rand(1, seq_len, heads, device="cuda")
        ours = chunk_fwd_intra.chunk_fwd_intra(k, v, g, beta, config=config)
        g_cumsum = chunk_local_cumsum(g, chunk_size=64, scale=chunk_fwd_intra.RCP_LN2)
        w, u, a_inverse = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cumsum, beta=beta, chunk_size=64)
        theirs = g_cumsum, w, u, a_inverse
        for name, got, want in zip(("g_cumsum", "w", "u", "A"), ours, theirs):
            assert got.shape == want.shape and _relative(got, want) < 1e-2, name
        if seq_len == 2048:
            cpu = [t.cpu().double() for t in (k, v, g, beta)]
            want_g = chunk_local_log2_cumsum(cpu[2])
            want_w, want_u = chunk_wy_reference(cpu[0], cpu[1], want_g, cpu[3])
            want_a = chunk_wy_inverse_reference(cpu[0], want_g, cpu[3], value_heads=heads)
            for name, got, their, want in zip(("g_cumsum", "w", "u", "A"), ours, theirs,
                                              (want_g, want_w, want_u, want_a)):
                assert _relative(got.cpu(), want) < 2 * _relative(their.cpu(), want) + 1e-3, name


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq_len, keep_states, gva", [(1008, True, False), (1008, False, False), (1008, True, True)],
                         ids=["kept-states", "recomputed-states", "gva"])
def test_gdn_op_on_our_intra_kernel_matches_the_torch_backend(monkeypatch, seq_len, keep_states, gva):
    """The GDN custom op with intra "ours": outputs and all gradients within FLA's tolerances of the torch backend,
    and the one kernel really ran."""
    kernels = kernel_choice.GdnKernels(intra="ours")
    assert_op_on_kernels_matches_torch_backend(monkeypatch, chunk_fwd_intra, "chunk_fwd_intra", kernels, seq_len,
                                               keep_states, gva)
