"""FLOPs per token, MFU and all-SDPA-equivalent MFU; standalone (imports neither megatron nor the rest)."""

from megatron_muon.metrics.flops import (
    ModelShape,
    all_attention_flops_per_token,
    attention_flops_per_token,
    flops_breakdown_per_token,
    gdn_flops_per_token,
    gdn_recurrence_flops_per_token,
    mlp_flops_per_token,
    training_flops_per_token,
)
from megatron_muon.metrics.mfu import PEAK_TFLOPS, MfuCalculator, mfu, peak_tflops

__all__ = [
    "ModelShape",
    "MfuCalculator",
    "PEAK_TFLOPS",
    "all_attention_flops_per_token",
    "attention_flops_per_token",
    "flops_breakdown_per_token",
    "gdn_flops_per_token",
    "gdn_recurrence_flops_per_token",
    "mfu",
    "mlp_flops_per_token",
    "peak_tflops",
    "training_flops_per_token",
]
