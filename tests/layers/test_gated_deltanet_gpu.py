"""On a CUDA GPU: the whole GatedDeltaNet layer (row-aligned in_proj GEMM, FLA conv / chunk / norm kernels) against
the same layer on the torch backend, outputs and every gradient, in bf16 at the benchmark's sizes (shared autotune)
and at Qwen3-Next's GDN heads (16 q/k heads, 32 value heads of 128: GVA)."""

import pytest
import torch

from megatron_muon.ops import backend
from tests.ops.helpers import error_ratio

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ_LEN = 1008  # not a multiple of the 64-token chunk; a multiple of 16 like the benchmark's 16384
# bf16 end to end, so FLA's bf16 bounds (o/dq/dk/dv 0.005-0.008, dg/dbeta 0.02) with room for the projections
# around the core; the decay-gate parameters' gradients come from dg.
MAX_ERROR_RATIO = 0.01
GATE_MAX_ERROR_RATIO = 0.02


def _layer(key_heads, value_heads, key_dim, value_dim):
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from megatron_muon.specs import gdn_mixer_spec

    config = TransformerConfig(
        num_layers=1, hidden_size=2048, num_attention_heads=16, linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads, linear_key_head_dim=key_dim, linear_value_head_dim=value_dim,
        linear_conv_kernel_dim=4, normalization="RMSNorm",
        layernorm_epsilon=1e-6, activation_func=F.silu, add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    torch.manual_seed(0)
    layer = build_module(gdn_mixer_spec("local"), config=config, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    with torch.no_grad():  # off the init values, so the gate, norm and conv parameters all shape the output
        for param in layer.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return layer


def _fwd_bwd(layer, x, grad_out):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x)
    out.float().backward(grad_out)
    grads = {"input": x.grad}
    grads.update({name: param.grad for name, param in layer.named_parameters()})
    return out.detach(), grads


@pytest.mark.parametrize("key_heads, value_heads, key_dim, value_dim", [(6, 6, 256, 512), (16, 32, 128, 128)],
                         ids=["hybrid-1.5b", "qwen3-next-gva"])
def test_layer_on_fla_matches_torch_backend(single_gpu_model_parallel, key_heads, value_heads, key_dim, value_dim):
    layer = _layer(key_heads, value_heads, key_dim, value_dim)
    if key_heads == value_heads:
        assert layer.in_proj.weight.shape[0] % 64, "the case must exercise the row-padded in_proj GEMM"
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(SEQ_LEN, 1, 2048, device="cuda", dtype=torch.bfloat16, generator=generator)
    grad_out = torch.randn(SEQ_LEN, 1, 2048, device="cuda", generator=generator)
    try:
        backend.set_backend(None)
        fast_name = backend.selected_backend()
        fast = _fwd_bwd(layer, x, grad_out)
        backend.set_backend("torch")
        ref = _fwd_bwd(layer, x, grad_out)
    finally:
        backend.set_backend(None)
    pairs = {"output": (ref[0], fast[0])}
    pairs.update({f"{name} grad": (ref[1][name], fast[1][name]) for name in ref[1]})
    ratios = {name: error_ratio(expected, got) for name, (expected, got) in pairs.items()}
    print(f"layer {fast_name} vs torch error ratios:", {k: f"{v:.2e}" for k, v in ratios.items()})
    for name, ratio in ratios.items():
        bound = GATE_MAX_ERROR_RATIO if ("A_log" in name or "dt_bias" in name) else MAX_ERROR_RATIO
        assert torch.isfinite(pairs[name][1]).all(), f"{name}: non-finite values"
        assert ratio < bound, f"{name}: error ratio {ratio:.2e} >= {bound}"
