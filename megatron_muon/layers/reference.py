"""Plain-torch fp32 reference of the GatedDeltaNet layer (the oracle for layer tests), built from the ops' naive
references: dense projections, F.conv1d, token-by-token delta rule, explicit gated RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_muon.layers.gdn_config import GatedDeltaNetShape
from megatron_muon.ops.reference import (
    causal_conv1d_reference,
    gated_rms_norm_reference,
    naive_recurrent_gated_delta_rule,
)

REFERENCE_PARAMETERS = ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight", "out_proj.weight")


def full_layer_weights(layer) -> dict[str, torch.Tensor]:
    """fp32 leaf copies (requiring grad) of a tp=1 local-backend layer's parameters, keyed like its state dict."""
    if layer.tp_size != 1:
        raise ValueError("full_layer_weights reads a tp=1 layer; at tp>1 gather or load a tp=1 copy first.")
    params = dict(layer.named_parameters())
    unsupported = sorted(set(params) - set(REFERENCE_PARAMETERS))
    if unsupported:
        raise ValueError(f"the reference covers {REFERENCE_PARAMETERS}; this layer also has {unsupported}.")
    return {name: params[name].detach().float().clone().requires_grad_(True) for name in REFERENCE_PARAMETERS}


def gated_deltanet_reference(
    weights: dict[str, torch.Tensor], shape: GatedDeltaNetShape, hidden_states: torch.Tensor, eps: float,
    use_qk_l2norm: bool = True, zero_centered_gamma: bool = False,
) -> torch.Tensor:
    """[s, b, hidden] -> [s, b, hidden] from full (tp=1) weights, in fp32."""
    x = hidden_states.float().transpose(0, 1)  # [b, s, hidden]
    batch, seq = x.shape[:2]
    projected = x @ weights["in_proj.weight"].T
    q, k, v, z, beta_logits, alpha = torch.split(projected, list(shape.in_proj_sections), dim=-1)
    conv_out = causal_conv1d_reference(torch.cat([q, k, v], -1), weights["conv1d.weight"].squeeze(1), None, "silu")
    q, k, v = torch.split(conv_out, list(shape.conv_sections), dim=-1)
    q = q.reshape(batch, seq, shape.num_key_heads, shape.key_head_dim)
    k = k.reshape(batch, seq, shape.num_key_heads, shape.key_head_dim)
    v = v.reshape(batch, seq, shape.num_value_heads, shape.value_head_dim)
    g = -weights["A_log"].exp() * F.softplus(alpha + weights["dt_bias"])
    core, _ = naive_recurrent_gated_delta_rule(
        q, k, v, g, beta_logits.sigmoid(), use_qk_l2norm_in_kernel=use_qk_l2norm
    )
    norm_weight = weights["out_norm.weight"] + 1 if zero_centered_gamma else weights["out_norm.weight"]
    z = z.reshape(batch, seq, shape.num_value_heads, shape.value_head_dim)
    normed = gated_rms_norm_reference(core, z, norm_weight, eps).reshape(batch, seq, shape.v_dim)
    return (normed @ weights["out_proj.weight"].T).transpose(0, 1)
