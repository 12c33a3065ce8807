"""Our hybrid spec on Transformer Engine's modules against the same spec on local modules, TP=1, bf16 on the GPU:
the TE model takes the local model's weights by checkpoint key (the local spec maps its separate pre-norms onto TE's
fused `layer_norm_` names), then the loss and every parameter's gradient agree within bf16 tolerance, and TE's
attention runs cuDNN's fused kernels."""

import pytest
import torch

from megatron_muon.training.te_cudnn import transformer_engine_usable
from tests.ops.helpers import error_ratio


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not transformer_engine_usable(),
                                 reason="needs Transformer Engine (pip install megatron-muon[te])")]

VOCAB, SEQ = 512, 256  # four 64-token GDN chunks
# bf16 through 4 layers with different fusions (TE's fused norm + GEMM, its attention against SDPA's cuDNN call):
# the GDN layer's own GPU bound is 0.01-0.02 (tests/layers/test_gated_deltanet_gpu.py); a model is looser
MAX_ERROR_RATIO = 0.03


def _config():
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=4, num_query_groups=2,
        kv_channels=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, normalization="RMSNorm", layernorm_epsilon=1e-6,
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False,
    )


def _model(backend: str, monkeypatch):
    from megatron_muon.specs import build_hybrid_model

    # megatron's build exports its attention backend to TE's NVTE_*_ATTN for the process (TE reads them per call)
    # and asserts on values another build left: each model is built from none, the TE one last
    for key in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(key, raising=False)
    torch.manual_seed(0)
    return build_hybrid_model(_config(), "GGG*", vocab_size=VOCAB, max_seq_len=SEQ, backend=backend).cuda()


def _params_by_key(model) -> dict:
    """Checkpoint key -> the model's parameter (TP=1: each sharded tensor, or factory of a sectioned one such as
    GDN's in_proj, holds a whole parameter)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    by_address = {param.data_ptr(): param for param in model.parameters()}
    out = {}
    for key, sharded in model.sharded_state_dict().items():
        if isinstance(sharded, (ShardedTensor, ShardedTensorFactory)) and sharded.data.data_ptr() in by_address:
            out[sharded.key] = by_address[sharded.data.data_ptr()]
    return out


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    positions = torch.arange(SEQ, device="cuda").expand(tokens.size(0), -1)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    return loss.detach(), {key: param.grad for key, param in _params_by_key(model).items()}


def test_te_spec_loss_and_every_gradient_equal_the_local_specs(single_gpu_model_parallel, monkeypatch):
    from megatron_muon.layers.attention import attention_kernels_that_ran

    local, te = _model("local", monkeypatch), _model("te", monkeypatch)
    local_params, te_params = _params_by_key(local), _params_by_key(te)
    assert set(local_params) == set(te_params), set(local_params) ^ set(te_params)
    assert len(te_params) == sum(1 for _ in te.parameters()), "every TE parameter has a checkpoint key"
    with torch.no_grad():
        for key, param in local_params.items():
            param.add_(0.02 * torch.randn_like(param))  # off the init values (unit norms, zero biases)
            te_params[key].copy_(param)

    tokens = torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    local_loss, local_grads = _loss_and_grads(local, tokens)
    te_loss, te_grads = _loss_and_grads(te, tokens)
    assert te_loss == pytest.approx(float(local_loss), rel=1e-2)
    ratios = {key: error_ratio(local_grads[key].float(), te_grads[key].float()) for key in local_grads}
    print("TE vs local gradient error ratios:", {k: f"{v:.2e}" for k, v in sorted(ratios.items())})
    for key, ratio in ratios.items():
        assert torch.isfinite(te_grads[key]).all(), f"{key}: non-finite gradient"
        assert ratio < MAX_ERROR_RATIO, f"{key}: error ratio {ratio:.2e} >= {MAX_ERROR_RATIO}"

    with torch.no_grad():
        report = attention_kernels_that_ran(te, tokens, torch.arange(SEQ, device="cuda").expand(2, -1), None)
    assert report.only == "cudnn", report.evidence
