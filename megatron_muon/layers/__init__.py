"""Megatron modules for the hybrid: the Gated DeltaNet mixer, cuDNN-pinned core attention, the SwiGLU MLP."""

from megatron_muon.layers.attention import (
    AttentionKernelReport,
    SDPADotProductAttention,
    TEFusedDotProductAttention,
    attention_kernels_that_ran,
    classify_attention_events,
)
from megatron_muon.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSubmodules, GatedRMSNorm
from megatron_muon.layers.gdn_config import GatedDeltaNetShape, gdn_shape_from_config
from megatron_muon.layers.linear import CompilableRowParallelLinear
from megatron_muon.layers.mlp import PiecewiseSwiGLUMLP, swiglu_in_pieces

__all__ = [
    "AttentionKernelReport",
    "CompilableRowParallelLinear",
    "GatedDeltaNet",
    "GatedDeltaNetShape",
    "GatedDeltaNetSubmodules",
    "GatedRMSNorm",
    "PiecewiseSwiGLUMLP",
    "SDPADotProductAttention",
    "TEFusedDotProductAttention",
    "attention_kernels_that_ran",
    "classify_attention_events",
    "gdn_shape_from_config",
    "swiglu_in_pieces",
]
