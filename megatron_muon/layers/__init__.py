"""Megatron modules for the hybrid: the Gated DeltaNet mixer and cuDNN-pinned core attention."""

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

__all__ = [
    "AttentionKernelReport",
    "CompilableRowParallelLinear",
    "GatedDeltaNet",
    "GatedDeltaNetShape",
    "GatedDeltaNetSubmodules",
    "GatedRMSNorm",
    "SDPADotProductAttention",
    "TEFusedDotProductAttention",
    "attention_kernels_that_ran",
    "classify_attention_events",
    "gdn_shape_from_config",
]
