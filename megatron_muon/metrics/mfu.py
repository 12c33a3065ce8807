"""Model FLOPs utilisation against a per-GPU peak table, and the all-SDPA-equivalent MFU.

The all-SDPA-equivalent MFU uses the measured tokens/s but the FLOPs the same model would have with every mixer
softmax attention: it says what the hybrid's cheaper mixers buy, in the units people compare dense models in.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_muon.metrics.flops import ModelShape, all_attention_flops_per_token, training_flops_per_token

# Dense (no sparsity) datasheet peaks in TFLOP/s. Checked in order: the first name fragment found in the device
# name wins, so the specific variants come before the family.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
    "A100": {"bf16": 312.0, "fp16": 312.0},
}
PRECISIONS = ("bf16", "fp16", "fp8")


def peak_tflops(device_name: str, precision: str = "bf16") -> float | None:
    """Datasheet dense peak for a device name such as 'NVIDIA H200', or None when the device is not in the table."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
    for fragment, by_precision in PEAK_TFLOPS.items():
        if fragment.lower() in device_name.lower():
            return by_precision.get(precision)
    return None


def mfu(flops_per_token: float, tokens_per_second: float, peak_tflops_per_gpu: float, num_gpus: int = 1) -> float:
    """Fraction of the peak used: FLOPs/token x tokens/s / (peak x GPUs)."""
    if peak_tflops_per_gpu <= 0 or num_gpus <= 0:
        raise ValueError("peak_tflops_per_gpu and num_gpus must be positive.")
    return flops_per_token * tokens_per_second / (peak_tflops_per_gpu * 1e12 * num_gpus)


@dataclass(frozen=True)
class MfuCalculator:
    """Turns a measured throughput into MFU and all-SDPA-equivalent MFU for one model and one peak."""

    flops_per_token: float
    all_attention_flops_per_token: float
    peak_tflops_per_gpu: float | None
    num_gpus: int = 1

    @classmethod
    def for_model(cls, shape: ModelShape, peak_tflops_per_gpu: float | None, num_gpus: int = 1) -> "MfuCalculator":
        return cls(training_flops_per_token(shape), all_attention_flops_per_token(shape), peak_tflops_per_gpu, num_gpus)

    def __call__(self, tokens_per_second: float) -> dict[str, float | None]:
        """{'mfu': ..., 'mfu_all_sdpa': ...}; both None when the peak is unknown (e.g. on CPU)."""
        if not self.peak_tflops_per_gpu:
            return {"mfu": None, "mfu_all_sdpa": None}
        return {
            "mfu": mfu(self.flops_per_token, tokens_per_second, self.peak_tflops_per_gpu, self.num_gpus),
            "mfu_all_sdpa": mfu(
                self.all_attention_flops_per_token, tokens_per_second, self.peak_tflops_per_gpu, self.num_gpus
            ),
        }
