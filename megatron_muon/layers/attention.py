"""Core attention for the hybrid's softmax layers, pinned to cuDNN, and a report of which kernel really ran.

Two implementations share megatron's core-attention interface ([s, b, heads, dim] in, [s, b, heads*dim] out):
- `TEFusedDotProductAttention`: Transformer Engine's `TEDotProductAttention` restricted to TE's fused (cuDNN)
  backend, for the TE spec.
- `SDPADotProductAttention`: torch SDPA restricted to the cuDNN backend on GPU (the math backend on CPU), for the
  local spec. A restricted backend that cannot run the shape raises instead of silently falling back.
Which kernel a backend setting *requests* and which one *runs* can differ, so `attention_kernels_that_ran`
profiles a call and classifies the kernels it saw.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_muon.layers.max_logit import max_attention_logits, running_max

TE_FUSED_ATTENTION_ENV = {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"}
TE_INSTALL_HINT = (
    "Transformer Engine is not installed, so the TE spec cannot be built; install it with "
    "`pip install --no-build-isolation transformer-engine[pytorch]` or use backend='local' (SDPA on cuDNN)."
)
_CUDNN_ONLY = [SDPBackend.CUDNN_ATTENTION]
_MATH_ONLY = [SDPBackend.MATH]
_FULL_PRECISION_GPU = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(query: torch.Tensor) -> list:
    """cuDNN for 16-bit inputs on the GPU (the fast path, pinned so that no slower kernel is picked silently);
    cuDNN has no fp32/fp64 attention, so those take the memory-efficient kernel (fp32) or the math one."""
    if not query.is_cuda:
        return _MATH_ONLY
    if query.dtype in (torch.float16, torch.bfloat16):
        return _CUDNN_ONLY
    return _FULL_PRECISION_GPU


def require_te_fused_attention(config) -> None:
    """Check that TE's DotProductAttention can only pick its fused (cuDNN) backend; TE reads NVTE_*_ATTN per call.

    Megatron's model exports those variables from `config.attention_backend` before it builds its layers
    (`build_hybrid_model` turns `auto` into `fused` for the TE spec first), so a fused config finds them set; the
    plugin itself writes none.
    """
    if config.attention_backend != AttnBackend.fused:
        raise ValueError(
            f"The TE hybrid spec pins attention to TE's fused (cuDNN) backend, but attention_backend is "
            f"{config.attention_backend.name}; pass `--attention-backend fused` (build_hybrid_model chooses it for "
            f"auto), or use the local spec."
        )
    conflicts = {name: os.environ.get(name, "unset") for name, value in TE_FUSED_ATTENTION_ENV.items()
                 if os.environ.get(name) != value}
    if conflicts:
        required = " ".join(f"{name}={value}" for name, value in TE_FUSED_ATTENTION_ENV.items())
        raise ValueError(
            f"attention_backend is fused but the environment says {conflicts}; megatron's model exports "
            f"{required} for attention_backend=fused when it is built: unset NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and "
            f"NVTE_UNFUSED_ATTN and build the core attention inside the model (or export those values yourself)."
        )


if HAVE_TE:

    class TEFusedDotProductAttention(TEDotProductAttention):  # pragma: no cover - needs Transformer Engine
        """`TEDotProductAttention` that can only run TE's fused (cuDNN) attention backend."""

        required_environment = TE_FUSED_ATTENTION_ENV

        def __init__(self, config, *args, **kwargs):
            require_te_fused_attention(config)
            super().__init__(config, *args, **kwargs)

else:

    class TEFusedDotProductAttention:
        """Stand-in with the same name when Transformer Engine is absent: specs can name it, building it raises."""

        required_environment = TE_FUSED_ATTENTION_ENV

        def __init__(self, *args, **kwargs):
            raise ImportError(TE_INSTALL_HINT)


class SDPADotProductAttention(MegatronModule):
    """Megatron core attention on torch SDPA: cuDNN only on GPU, math on CPU; causal or unmasked, no packing.

    With `config.qk_clip` or `config.log_max_attention_logit` it keeps `current_max_attn_logits` as TE's core
    attention does (per head of this partition, running max over micro-batches until QK-clip resets it), so
    megatron's `SelfAttention.clip_qk` works on the local spec too; SDPA returns no logits, so they are recomputed
    (`max_logit.py`). None when both options are off.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        **unused_kwargs,
    ):
        super().__init__(config=config)
        del cp_comm_type, attention_type, unused_kwargs
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(
                f"SDPADotProductAttention supports causal or no_mask attention, got {attn_mask_type.name}; use the "
                f"TE spec for padding or arbitrary masks."
            )
        for name, value, allowed in (
            ("context_parallel_size", config.context_parallel_size, 1),
            ("softmax_type", config.softmax_type, "vanilla"),
            ("window_size", config.window_size, None),
            ("apply_query_key_layer_scaling", config.apply_query_key_layer_scaling, False),
        ):
            if value != allowed:
                raise ValueError(f"SDPADotProductAttention needs {name}={allowed!r}, got {value!r}; use the TE spec.")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        if config.num_attention_heads % tp_size or config.num_query_groups % tp_size:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) and num_query_groups "
                f"({config.num_query_groups}) must be divisible by the tensor-parallel size ({tp_size})."
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.records_max_logits = bool(config.qk_clip or config.log_max_attention_logit)
        self.current_max_attn_logits: Optional[torch.Tensor] = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        del attention_mask  # causality comes from the mask type, as in TE
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPADotProductAttention takes no packed sequences or attention bias; use the TE spec.")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if self.records_max_logits:  # before the GQA expansion: the per-group key heads suffice
            scale = self.softmax_scale if self.softmax_scale is not None else query.shape[-1] ** -0.5
            step_max = max_attention_logits(query, key, scale, causal=mask_type == AttnMaskType.causal)
            self.current_max_attn_logits = running_max(self.current_max_attn_logits, step_max)
        if self.heads_per_group > 1:  # cuDNN SDPA has no native GQA: give every query head its key/value head
            key = key.repeat_interleave(self.heads_per_group, dim=2)
            value = value.repeat_interleave(self.heads_per_group, dim=2)
        seq, batch = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        dropout_p = self.dropout_p if self.training else 0.0
        # Like megatron's DotProductAttention: dropout on TP-split heads draws from the model-parallel RNG stream.
        rng = get_cuda_rng_tracker().fork() if dropout_p > 0 and not self.config.sequence_parallel else nullcontext()
        with rng, sdpa_kernel(sdpa_backends(q)):
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=mask_type == AttnMaskType.causal, scale=self.softmax_scale
            )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


ATTENTION_KERNEL_PATTERNS = (  # (backend, substrings of profiler event names), most specific first
    ("cudnn", ("cudnn_attention", "cudnn_generated_fort_native_sdpa", "fused_attn", "fusedattn")),
    ("flash", ("_scaled_dot_product_flash_attention", "flash_fwd", "flash_bwd", "flash_attn", "flashattention")),
    ("efficient", ("_efficient_attention", "fmha_cutlass", "mem_efficient")),
    ("math", ("_scaled_dot_product_attention_math",)),
    ("te_unfused", ("scaled_upper_triang_masked_softmax", "scaled_masked_softmax", "unfuseddotproductattention")),
)


@dataclass(frozen=True)
class AttentionKernelReport:
    """Attention backends seen in a profiled call, with the event names that prove each one."""

    backends: tuple[str, ...]
    evidence: dict

    @property
    def only(self) -> str:
        """The single backend that ran; raises if none or several ran (a mixed run is worth looking at)."""
        if len(self.backends) != 1:
            raise ValueError(f"expected exactly one attention backend, saw {self.backends or 'none'}: {self.evidence}")
        return self.backends[0]


def classify_attention_events(event_names) -> AttentionKernelReport:
    """Map profiler event names (aten ops and device kernels) to attention backends."""
    evidence: dict[str, list[str]] = {}
    for name in sorted(set(event_names)):
        lowered = name.lower()
        if lowered.endswith("_for_cpu") and "_scaled_dot_product_flash_attention" in lowered:
            evidence.setdefault("flash_cpu", []).append(name)
            continue
        for backend, needles in ATTENTION_KERNEL_PATTERNS:
            if any(needle in lowered for needle in needles):
                evidence.setdefault(backend, []).append(name)
                break
    return AttentionKernelReport(backends=tuple(sorted(evidence)), evidence=evidence)


def attention_kernels_that_ran(fn: Callable, *args, **kwargs) -> AttentionKernelReport:
    """Run `fn(*args, **kwargs)` under the torch profiler and report which attention kernels executed."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        fn(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return classify_attention_events(event.name for event in profile.events())
