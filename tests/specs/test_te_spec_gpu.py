"""Our hybrid spec on Transformer Engine's modules against the same spec on local modules, TP=1, on the GPU: the TE
model takes the local model's weights by checkpoint key (the local spec maps its separate pre-norms onto TE's fused
`layer_norm_` names). Both run bf16 and are measured against the local spec in fp32 (torch GDN backend) with the same
weights: TE's loss and every parameter's gradient are as close to that reference as the local bf16 model's are, and
TE's attention runs cuDNN's fused kernels. (Measured directly against each other, the two bf16 models differ about
as much as the local model differs from itself on another GDN backend: a random 4-layer model amplifies bf16
rounding, so only a common fp32 reference separates precision from a wrong result.)"""

import pytest
import torch

from megatron_muon.training.te_cudnn import transformer_engine_usable
from tests.ops.helpers import error_ratio


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not transformer_engine_usable(),
                                 reason="needs Transformer Engine (pip install megatron-muon[te])")]

VOCAB, SEQ = 512, 256  # four 64-token GDN chunks
# TE's error against the fp32 reference may exceed the local bf16 model's by this factor plus the floor (different
# fusions round differently: TE's fused norm + GEMM, its attention against SDPA's cuDNN call; the GDN gate
# parameters' errors differ most between the two)
MAX_ERROR_FACTOR = 2.0
ERROR_FLOOR = 0.005


def _config(dtype=torch.bfloat16):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=4, num_query_groups=2,
        kv_channels=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, normalization="RMSNorm", layernorm_epsilon=1e-6,
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False, bf16=dtype == torch.bfloat16,
        params_dtype=dtype, pipeline_dtype=dtype, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False,
    )


def _model(backend: str, monkeypatch, dtype=torch.bfloat16):
    from megatron_muon.specs import build_hybrid_model

    # megatron's build exports its attention backend to TE's NVTE_*_ATTN for the process (TE reads them per call)
    # and asserts on values another build left: each model is built from none, the TE one last
    for key in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(key, raising=False)
    torch.manual_seed(0)
    return build_hybrid_model(_config(dtype), "GGG*", vocab_size=VOCAB, max_seq_len=SEQ, backend=backend).cuda()


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


def test_te_spec_loss_and_every_gradient_as_close_to_fp32_as_the_local_specs(single_gpu_model_parallel, monkeypatch):
    from megatron_muon.layers.attention import attention_kernels_that_ran
    from megatron_muon.ops import backend

    local, reference = _model("local", monkeypatch), _model("local", monkeypatch, dtype=torch.float32)
    te = _model("te", monkeypatch)  # last: see _model
    local_params, te_params, reference_params = _params_by_key(local), _params_by_key(te), _params_by_key(reference)
    assert set(local_params) == set(te_params) == set(reference_params), \
        (set(local_params) ^ set(te_params)) | (set(local_params) ^ set(reference_params))
    assert len(te_params) == sum(1 for _ in te.parameters()), "every TE parameter has a checkpoint key"
    with torch.no_grad():
        for key, param in local_params.items():
            # off the init values (unit norms, zero biases), then bf16 values: the local norms keep fp32 weights and
            # TE's are bf16, so all three models hold the same numbers
            param.add_(0.02 * torch.randn_like(param)).copy_(param.to(torch.bfloat16))
            te_params[key].copy_(param)
            reference_params[key].copy_(param)

    tokens = torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    local_loss, local_grads = _loss_and_grads(local, tokens)
    te_loss, te_grads = _loss_and_grads(te, tokens)
    try:
        backend.set_backend("torch")  # the GDN reference in fp32
        reference_loss, reference_grads = _loss_and_grads(reference, tokens)
    finally:
        backend.set_backend(None)
    local_loss_error = abs(float(local_loss) - float(reference_loss))
    te_loss_error = abs(float(te_loss) - float(reference_loss))
    assert te_loss_error <= MAX_ERROR_FACTOR * local_loss_error + 1e-3 * float(reference_loss), \
        (float(reference_loss), float(local_loss), float(te_loss))
    errors = {key: (error_ratio(expected, local_grads[key]), error_ratio(expected, te_grads[key]))
              for key, expected in reference_grads.items()}
    print("gradient error ratios against fp32 (local bf16, TE bf16):",
          {k: f"{a:.2e} {b:.2e}" for k, (a, b) in sorted(errors.items())})
    for key, (local_error, te_error) in errors.items():
        assert torch.isfinite(te_grads[key]).all(), f"{key}: non-finite gradient"
        bound = MAX_ERROR_FACTOR * local_error + ERROR_FLOOR
        assert te_error < bound, f"{key}: TE's error {te_error:.2e} >= {bound:.2e} (local bf16's {local_error:.2e})"

    with torch.no_grad():
        report = attention_kernels_that_ran(te, tokens, torch.arange(SEQ, device="cuda").expand(2, -1), None)
    assert report.only == "cudnn", report.evidence
