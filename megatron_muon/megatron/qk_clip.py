"""QK-clip (MuonClip) after the optimizer step, for the plugin's models and optimizers.

megatron-core's `optimizer.qk_clip.clip_qk` walks `model_chunk.module.module.decoder.layers`: DDP over a
Float16Module over a GPT. An fp32 run has no Float16Module, so that walk fails there; `clip_qk` below walks every
megatron `Attention` of the chunks instead (GPTModel and HybridModel alike; GDN mixers are not `Attention`s) with
megatron's semantics otherwise: the recorded maxima all-reduced (MAX) over the data-parallel x context-parallel
group, then each layer's own `clip_qk()` (megatron's `SelfAttention.clip_qk`: per query group
eta = min(threshold / max logit, 1), W_q *= eta^alpha, W_k *= eta^(1-alpha), on the weight and `weight.main_param`).

Where the fp32 masters are:
- fp32 runs: the parameters are their own masters (megatron's DistributedOptimizer steps views of them).
- megatron's Float16 wrapper (muon, or adam without the distributed optimizer) sets `weight.main_param` to the whole
  master, which megatron's clip scales.
- The owner engine (muon + distributed optimizer) wraps only the matrices a rank owns, so the owner's weight has
  `main_param` and is scaled with it; the other ranks scale their 16-bit copy the same way, and the next all-gather
  (after the step, or in the next forward with overlap_param_gather) brings the owner's copy, which holds the same
  values. Nothing more is needed there.
- megatron's DistributedOptimizer (adam + distributed optimizer, 16-bit) keeps a flat slice of the master
  (`main_param_sharded`; None on ranks that hold none of it), which megatron's clip cannot reshape: those slices are
  scaled here, by the row multipliers megatron's clip applies, and megatron's clip sees only the 16-bit weight.
"""

from __future__ import annotations

import math

import torch

METRIC = "max_attention_logit"  # the log's key, as Megatron-LM names it in TensorBoard


def attention_layers(model_chunks) -> list:
    """Every megatron `Attention` module of the chunks, in module order."""
    from megatron.core.transformer.attention import Attention

    return [module for chunk in model_chunks for module in chunk.modules() if isinstance(module, Attention)]


def check_qk_clip(model_chunks, config) -> None:
    """Raise ValueError, naming the fix, where QK-clip's settings or the model's core attention cannot work."""
    if not (config.qk_clip or config.log_max_attention_logit):
        return
    if config.qk_clip and not config.qk_clip_threshold > 0:
        raise ValueError(f"qk_clip_threshold must be > 0, got {config.qk_clip_threshold}; megatron's default is 100.")
    if config.qk_clip and not 0.0 < config.qk_clip_alpha < 1.0:
        raise ValueError(f"qk_clip_alpha must lie strictly between 0 and 1 (the share of the clip on queries), got "
                         f"{config.qk_clip_alpha}; megatron's default is 0.5.")
    silent = sorted({type(layer.core_attention).__name__ for layer in attention_layers(model_chunks)
                     if not hasattr(layer.core_attention, "current_max_attn_logits")})
    if silent:
        raise ValueError(
            f"qk_clip and log_max_attention_logit need a core attention that records its max logits, and "
            f"{', '.join(silent)} does not: use the plugin's local spec (SDPADotProductAttention; a hybrid with "
            f"layer pattern '*' is all attention) or a Transformer Engine spec (TE >= 2.9 returns them).")


def master_slices(optimizer) -> dict[int, tuple[torch.Tensor, int]]:
    """id(model param) -> (its flat fp32 master slice, the slice's offset in the flattened param), for the
    parameters megatron's DistributedOptimizer holds in 16 bits on this rank."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    slices, stack = {}, [optimizer]
    while stack:
        item = stack.pop()
        stack.extend(getattr(item, "chained_optimizers", []))
        if isinstance(item, DistributedOptimizer):
            for param in item.model_param_gbuf_map:
                main = getattr(param, "main_param", None)
                if main is not None and getattr(param, "main_param_sharded", False):
                    slices[id(param)] = (main, item._get_model_param_range_map(param)["param"].start)
    return slices


def qkv_row_scales(attention) -> torch.Tensor | None:
    """(rows of this partition's linear_qkv,): the multipliers megatron's `clip_qk` applies, eta^alpha on a query
    group's query rows, eta^(1-alpha) on its key rows, 1 on its value rows (same fp32 arithmetic); None where no
    group exceeds the threshold (megatron's clip then changes nothing)."""
    config, groups = attention.config, attention.num_query_groups_per_partition
    grouped = attention.core_attention.current_max_attn_logits.view(groups, -1).amax(dim=1)
    if not bool((grouped > config.qk_clip_threshold).any()):
        return None
    eta = torch.clamp(config.qk_clip_threshold / grouped, max=1.0)[:, None]
    q_rows = attention.query_projection_size // groups
    kv_rows = attention.kv_projection_size // groups
    return torch.cat([torch.pow(eta, config.qk_clip_alpha).expand(groups, q_rows),
                      torch.pow(eta, 1 - config.qk_clip_alpha).expand(groups, kv_rows),
                      torch.ones_like(eta).expand(groups, kv_rows)], dim=1).reshape(-1)


def _scale_master_slice(weight, scales: torch.Tensor, main: torch.Tensor, offset: int) -> None:
    rows = torch.arange(offset, offset + main.numel(), device=main.device) // weight.shape[-1]
    main.view(-1).mul_(scales.to(main.device)[rows])


def _clip_layer(layer, slices: dict) -> None:
    """megatron's `clip_qk()` on one layer; a sharded master is hidden from it and scaled here instead."""
    weight = layer.linear_qkv.weight
    sharded = getattr(weight, "main_param_sharded", False) and hasattr(weight, "main_param")
    scales = qkv_row_scales(layer) if id(weight) in slices else None  # before clip_qk resets the maxima
    hidden = weight.main_param if sharded else None
    if sharded:  # megatron's clip_qk scales `main_param` whenever the attribute exists
        del weight.main_param
    try:
        layer.clip_qk()
    finally:
        if sharded:
            weight.main_param = hidden
    if scales is not None:
        _scale_master_slice(weight, scales, *slices[id(weight)])


def _recorded(model_chunks) -> list:
    return [layer for layer in attention_layers(model_chunks)
            if getattr(layer.core_attention, "current_max_attn_logits", None) is not None]


@torch.no_grad()
def clip_qk(model_chunks, log_max_only: bool = False, slices: dict | None = None, group=None) -> torch.Tensor | None:
    """megatron's `clip_qk(model, log_max_only)` over every attention layer of the chunks: one MAX all-reduce over
    `group` (default: data parallel x context parallel) for all layers, then each layer clipped, or only reset when
    `log_max_only`. `slices`: `master_slices(optimizer)`. Returns this rank's largest logit (after the all-reduce)
    as a 0-d fp32 tensor, left on the device for the log to read, or None when no layer recorded one."""
    from megatron.core import parallel_state

    layers = _recorded(model_chunks)
    if not layers:
        return None
    maxima = [layer.core_attention.current_max_attn_logits for layer in layers]
    flat = torch.cat([m.float() for m in maxima])
    if group is None:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
    for layer, reduced in zip(layers, flat.split([m.numel() for m in maxima])):
        if log_max_only:  # as megatron does: no clip_qk() runs to reset them
            layer.core_attention.current_max_attn_logits = None
        else:
            # A negative group maximum would make megatron's eta negative and its root NaN; at 0 eta is 1.
            layer.core_attention.current_max_attn_logits = reduced.clamp(min=0.0)
            _clip_layer(layer, slices or {})
    return flat.max()


@torch.no_grad()
def reset_max_logits(model_chunks) -> torch.Tensor | None:
    """Forget the recorded maxima without clipping (a skipped step changes no weight); returns this rank's largest."""
    layers = _recorded(model_chunks)
    if not layers:
        return None
    largest = torch.stack([layer.core_attention.current_max_attn_logits.float().max() for layer in layers]).max()
    for layer in layers:
        layer.core_attention.current_max_attn_logits = None
    return largest


class QkClipAfterStep:
    """The loop's QK-clip: after every optimizer step clip (or, with only `log_max_attention_logit`, record), and
    keep the largest logit until the log reads it. Build it with `for_config`, which returns None when both options
    are off."""

    def __init__(self, model_chunks, optimizer, config):
        check_qk_clip(model_chunks, config)
        self.model_chunks, self.optimizer, self.clip = list(model_chunks), optimizer, bool(config.qk_clip)
        self._largest: torch.Tensor | None = None

    @classmethod
    def for_config(cls, config, model_chunks, optimizer) -> "QkClipAfterStep | None":
        if not (config.qk_clip or config.log_max_attention_logit):
            return None
        return cls(model_chunks, optimizer, config)

    def after_step(self, update_ok: bool) -> None:
        """`update_ok`: the optimizer's first result; a skipped step is not clipped, its maxima are forgotten."""
        if update_ok:
            slices = master_slices(self.optimizer) if self.clip else {}  # each step: a checkpoint load may replace them
            largest = clip_qk(self.model_chunks, log_max_only=not self.clip, slices=slices)
        else:
            largest = reset_max_logits(self.model_chunks)
        if largest is not None:
            self._largest = largest if self._largest is None else torch.maximum(self._largest, largest)

    def read(self) -> float | None:
        """The largest logit over every rank since the last read (a collective: every rank calls it); None when no
        rank recorded one."""
        value = self._largest
        if value is None:
            nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            value = torch.tensor(float("-inf"), device=device)
        value = value.clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        self._largest = None
        result = float(value)
        return None if result == -math.inf else result

    def record(self) -> dict:
        """The log record's entry (collective, like `read`)."""
        return {METRIC: self.read()}
