"""Core attention: SDPA path equals megatron's own DotProductAttention; the kernel report says what really ran; the
TE path is pinned to the fused backend (environment and config) and fails clearly without Transformer Engine."""

import os
from types import SimpleNamespace

import pytest
import torch
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.transformer.enums import AttnBackend

from megatron_muon.layers.attention import (
    TE_FUSED_ATTENTION_ENV,
    TEFusedDotProductAttention,
    classify_attention_events,
    require_te_fused_attention,
)

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 24, 2, 4, 2, 16


def _attention_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator)
    v = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator)
    return [t.requires_grad_(True) for t in (q, k, v)]


def _sdpa_vs_megatron(rank, world_size):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_muon.layers.attention import SDPADotProductAttention, attention_kernels_that_ran
    from megatron_muon.testing.models import tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    config = tiny_transformer_config(num_attention_heads=HEADS, num_query_groups=GROUPS)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                  pg_collection=groups)
    ours, theirs = SDPADotProductAttention(**kwargs), DotProductAttention(**kwargs)
    grad_out = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(3))
    results = {}
    for name, module in (("ours", ours), ("megatron", theirs)):
        q, k, v = _attention_inputs(seed=1)
        out = module(q, k, v, None)
        out.backward(grad_out)
        results[name] = (out.detach(), q.grad, k.grad, v.grad)
    q, k, v = _attention_inputs(seed=1)
    with torch.no_grad():
        ours_report = attention_kernels_that_ran(ours, q, k, v, None)
        plain = [t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))]
        default_report = attention_kernels_that_ran(torch.nn.functional.scaled_dot_product_attention, *plain,
                                                    is_causal=True)
    return results, ours_report, default_report


def test_sdpa_attention_equals_megatron_local_and_reports_math_on_cpu(rank_pool_1):
    results, ours_report, default_report = rank_pool_1.run(_sdpa_vs_megatron)[0]
    for what, mine, reference in zip(("output", "dq", "dk", "dv"), results["ours"], results["megatron"]):
        assert reference.abs().max() > 0
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    assert ours_report.only == "math", ours_report
    # Unpinned SDPA on CPU picks another kernel: the report follows what ran, not a fixed answer.
    assert default_report.backends and default_report.backends != ("math",), default_report


@pytest.mark.parametrize(
    "names,expected",
    [
        (["aten::_scaled_dot_product_cudnn_attention",
          "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0"], "cudnn"),
        (["aten::_scaled_dot_product_flash_attention", "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>"],
         "flash"),
        (["aten::_scaled_dot_product_efficient_attention", "fmha_cutlassF_bf16_aligned_64x128_rf_sm80"], "efficient"),
        (["aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::softmax"], "math"),
        (["aten::_scaled_dot_product_flash_attention_for_cpu"], "flash_cpu"),
        (["FusedAttnFunc", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_1"], "cudnn"),
        (["FlashAttention", "flash_fwd_kernel"], "flash"),
        (["UnfusedDotProductAttention", "scaled_upper_triang_masked_softmax_warp_forward"], "te_unfused"),
    ],
    ids=["cudnn", "flash", "efficient", "math", "flash-cpu", "te-fused", "te-flash", "te-unfused"],
)
def test_classify_attention_events(names, expected):
    report = classify_attention_events(names + ["aten::linear", "ampere_sgemm_128x64_tn"])
    assert report.only == expected, report


def test_mixed_or_missing_attention_is_not_reported_as_one_backend():
    with pytest.raises(ValueError, match="exactly one"):
        classify_attention_events(["aten::mm"]).only
    with pytest.raises(ValueError, match="exactly one"):
        classify_attention_events(["flash_fwd_kernel", "fmha_cutlassF_f16"]).only


def _clear_te_attention_environment(monkeypatch):
    for name in TE_FUSED_ATTENTION_ENV:
        monkeypatch.setenv(name, "")  # recorded, so whatever megatron exports below is undone after the test
        monkeypatch.delenv(name)


def test_te_fused_attention_accepts_what_megatron_exports_for_fused(monkeypatch):
    """Megatron's model exports NVTE_*_ATTN from attention_backend before it builds layers; fused passes the check
    and the check itself writes nothing."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _clear_te_attention_environment(monkeypatch)
    config = SimpleNamespace(attention_backend=AttnBackend.fused, flash_attention_version=None)
    LanguageModule._set_attention_backend(SimpleNamespace(config=config))
    before = dict(os.environ)
    require_te_fused_attention(config)
    assert dict(os.environ) == before
    assert {name: os.environ[name] for name in TE_FUSED_ATTENTION_ENV} == TE_FUSED_ATTENTION_ENV


def test_te_fused_attention_refuses_auto_and_contradictions(monkeypatch):
    _clear_te_attention_environment(monkeypatch)
    for backend in (AttnBackend.auto, AttnBackend.flash):
        with pytest.raises(ValueError, match="--attention-backend fused"):
            require_te_fused_attention(SimpleNamespace(attention_backend=backend))
    with pytest.raises(ValueError, match="'NVTE_FUSED_ATTN': 'unset'"):  # built outside a megatron model
        require_te_fused_attention(SimpleNamespace(attention_backend=AttnBackend.fused))
    for name, value in TE_FUSED_ATTENTION_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    with pytest.raises(ValueError, match="NVTE_FUSED_ATTN"):
        require_te_fused_attention(SimpleNamespace(attention_backend=AttnBackend.fused))


@pytest.mark.skipif(HAVE_TE, reason="checks the message shown when Transformer Engine is missing")
def test_te_attention_without_te_says_what_to_install():
    with pytest.raises(ImportError, match="pip install"):
        TEFusedDotProductAttention(config=None, layer_number=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sdpa_attention_runs_cudnn_on_gpu():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_muon.layers.attention import SDPADotProductAttention, attention_kernels_that_ran

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, attention_dropout=0.0)
    single_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    module = SDPADotProductAttention(config, 1, AttnMaskType.causal, pg_collection=single_rank)
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_(True) for t in _attention_inputs(seed=2))
    report = attention_kernels_that_ran(lambda: module(q, k, v, None).float().square().sum().backward())
    assert report.only == "cudnn", report
    with torch.no_grad():
        exact = module(*(t.detach().float().cpu() for t in (q, k, v)), None)
        fast = module(q, k, v, None).float().cpu()
    torch.testing.assert_close(fast, exact, rtol=2e-2, atol=2e-2)


def test_sdpa_backends_pin_cudnn_for_16_bit_gpu_inputs_only():
    from torch.nn.attention import SDPBackend

    from megatron_muon.layers.attention import sdpa_backends

    class FakeCuda:  # dtype and device are all the choice reads
        is_cuda = True

        def __init__(self, dtype):
            self.dtype = dtype

    assert sdpa_backends(FakeCuda(torch.bfloat16)) == [SDPBackend.CUDNN_ATTENTION]
    assert sdpa_backends(FakeCuda(torch.float16)) == [SDPBackend.CUDNN_ATTENTION]
    for dtype in (torch.float32, torch.float64):  # cuDNN has no full-precision attention: no kernel would run
        assert SDPBackend.CUDNN_ATTENTION not in sdpa_backends(FakeCuda(dtype))
        assert SDPBackend.MATH in sdpa_backends(FakeCuda(dtype))
    assert sdpa_backends(torch.zeros(1, dtype=torch.bfloat16)) == [SDPBackend.MATH]
