"""The TMA backward state kernel: the fp32 recurrence on CPU through the interpreter, FLA's kernel on the GPU."""

from pathlib import Path

import pytest
import torch

from megatron_muon.ops import dhu_triton
from tests.interpreter import run_under_interpreter


def test_kernel_under_triton_interpreter():
    """Partial last chunk, two batch elements and heads, with and without the final-state gradient."""
    pytest.importorskip("triton", reason="the interpreter comes with Triton")
    run_under_interpreter(Path(__file__).with_name("_dhu_interpret_check.py"))


def test_cpu_tensors_do_not_qualify_without_the_interpreter():
    q = torch.randn(1, 64, 1, 64).half()
    do = torch.randn(1, 64, 1, 16).half()
    assert dhu_triton.qualifies(q, q, q, do, do, torch.zeros(1, 64, 1), None, 64) == dhu_triton._INTERPRETING


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", dhu_triton._CONFIGS, ids=str)
def test_equals_flas_kernel_at_the_hybrid_shape(config):
    """bf16 at the hybrid-1.5B's GDN shape (16k tokens, 6 heads, key 256, value 512) for every tile in the table,
    against FLA's kernel and, on 2k tokens, against the fp32 recurrence (FLA's own error shown beside ours)."""
    pytest.importorskip("fla", reason="needs flash-linear-attention")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    torch.manual_seed(0)
    for seq_len in (16384, 2048):
        shape = (1, seq_len, 6, 256)
        q = torch.nn.functional.normalize(torch.randn(shape, device="cuda"), dim=-1).bfloat16()
        k = torch.nn.functional.normalize(torch.randn(shape, device="cuda"), dim=-1).bfloat16()
        w = (torch.randn(shape, device="cuda") * 0.05).bfloat16()
        do, dv = (torch.randn(1, seq_len, 6, 512, device="cuda").bfloat16() for _ in range(2))
        g = chunk_local_cumsum(-torch.rand(1, seq_len, 6, device="cuda") * 0.1, chunk_size=64, scale=RCP_LN2)
        dht = torch.randn(1, 6, 512, 256, device="cuda")
        ours = dhu_triton.chunk_dhu(q, k, w, g, do, dv, 256**-0.5, dht=dht, want_dh0=True, config=config)
        fla = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=torch.zeros_like(dht), dht=dht, do=do, dv=dv,
                                             scale=256**-0.5, state_v_first=True, chunk_size=64)
        for got, want in zip(ours, fla):
            assert _relative(got, want) < 1e-2
        if seq_len == 2048:
            reference = dhu_triton.reference_dhu(*(t.cpu() for t in (q, k, w, g, do, dv)), 256**-0.5, dht=dht.cpu())
            for got, theirs, want in zip(ours, fla, reference):
                assert _relative(got.cpu(), want) < 2 * _relative(theirs.cpu(), want) + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq_len, keep_states, with_state",
                         [(1008, True, True), (1008, False, True), (496, True, False)],
                         ids=["kept-states", "recomputed-states", "no-initial-state"])
def test_gdn_op_on_the_tma_kernel_matches_the_torch_backend(monkeypatch, seq_len, keep_states, with_state):
    """The GDN custom op with MEGATRON_MUON_GDN_DHU=tma: every output and gradient within FLA's tolerances of the
    torch backend, and the kernel really ran."""
    from tests.ops import test_gdn_gpu

    calls = []
    kernel = dhu_triton.chunk_dhu
    monkeypatch.setattr(dhu_triton, "chunk_dhu", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.setenv(dhu_triton.ENV_VAR, "tma")
    test_gdn_gpu.test_fla_gdn_matches_torch_backend(None, seq_len, keep_states, with_state, False)
    assert calls


def test_an_unknown_kernel_choice_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv(dhu_triton.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="valid choices"):
        dhu_triton.enabled()
