"""Gated DeltaNet mixer as a Megatron module: TP-split heads, sequence-parallel aware, reshardable checkpoints.

The math runs through `megatron_muon.ops` (torch.library custom ops), so `torch.compile` sees one graph per layer
with no breaks; nothing in `forward` reads per-layer Python state, so every GDN layer reuses the same graph.

Layout follows megatron-core's `GatedDeltaNet` (parameter names, the fused in_proj order q|k|v|z|beta|alpha per TP
rank, the depthwise conv over q|k|v, per-head `A_log`/`dt_bias`, an RMSNorm weight over the value head dim), and
the checkpoint splits in_proj and conv into named sections the same way, so TP can change between save and load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from megatron_muon.layers.gdn_config import GatedDeltaNetShape, gdn_shape_from_config
from megatron_muon.layers.gradient_pieces import MIN_GRADIENT_PIECES, piece_sizes
from megatron_muon.ops.conv import causal_conv1d
from megatron_muon.ops.gdn import chunk_gated_delta_rule
from megatron_muon.ops.norm import gated_rms_norm

IN_PROJ_SECTION_NAMES = ("query", "key", "value", "z", "beta", "alpha")
CONV_SECTION_NAMES = ("query", "key", "value")
GEMM_ROW_ALIGNMENT = 64  # output features per row: 128 bytes in bf16


class RowAlignedColumnParallelLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear, multiplying by a copy of its weight zero-padded to a multiple of 64 rows.

    The GDN in_proj has 2 * (qk + v) + 2 * heads rows (9228 for hybrid-1.5B): output rows that are not 16-byte
    aligned push cuBLAS onto slow non-TMA kernels for the forward and both backward GEMMs on Hopper. Padding the
    rows (a 0.5% larger, aligned GEMM) keeps the parameter, its checkpoint layout and the math unchanged. The output
    keeps its zero pad columns (callers split them off with the sections), so the output gradient is assembled
    once, aligned, instead of as a cat followed by a separate zero-padding pass. The padded copy has no
    ``main_grad``, so the weight gradient goes through ``param.grad`` (megatron's DDP hook accumulates it) instead
    of megatron's fused accumulation.
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        rows = weight.shape[0]
        pad = -rows % GEMM_ROW_ALIGNMENT
        if pad == 0:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if kwargs.get("bias") is not None:
            kwargs["bias"] = F.pad(kwargs["bias"], (0, pad))
        if "gradient_accumulation_fusion" in kwargs:
            kwargs["gradient_accumulation_fusion"] = False
        return super()._forward_impl(input, F.pad(weight, (0, 0, 0, pad)), *args, **kwargs)


@dataclass
class GatedDeltaNetSubmodules:
    """The projections come from the spec (local or Transformer Engine); the rest is fixed by the GDN math."""

    in_proj: Union[ModuleSpec, type] = IdentityOp
    out_proj: Union[ModuleSpec, type] = IdentityOp


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over the value head dim, gated by SiLU(z), with one weight shared by every head.

    Each TP rank normalizes only its own heads, so the weight's gradient is a partial sum per rank; routing the
    weight through megatron's copy-to-TP-region op all-reduces that gradient, keeping the replicas identical with
    or without sequence parallelism.
    """

    def __init__(self, dim: int, eps: float, zero_centered_gamma: bool, tp_group=None, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.tp_group = tp_group
        self.reduce_grad_over_tp = tp_group is not None and tp_group.size() > 1
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(dim, device=device, dtype=dtype))

    def effective_weight(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = self.effective_weight()
        if self.reduce_grad_over_tp:
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        return gated_rms_norm(x, gate, weight, self.eps)


class DepthwiseConvParameters(torch.nn.Module):
    """The causal conv's parameters under megatron's names and shapes (weight [D, 1, W], bias [D]).

    Not an nn.Conv1d: the custom op does the compute, and nn.Conv1d's own init would draw per-rank-sized random
    numbers, making the rest of the initialization depend on the TP size.
    """

    def __init__(self, channels: int, kernel: int, bias: bool, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(channels, 1, kernel, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(channels, device=device, dtype=dtype)) if bias else None


def _rank_slice_of_sections(full: torch.Tensor, sections: tuple[int, ...], tp_rank: int, tp_size: int):
    """This rank's rows of a tensor made of concatenated sections, each split evenly across TP."""
    parts = torch.split(full, list(sections), dim=0)
    return torch.cat([part.chunk(tp_size, dim=0)[tp_rank] for part in parts], dim=0)


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet token mixer for a TransformerLayer (drop-in for megatron-core's `GatedDeltaNet`).

    Input and output are [s, b, h] (s is this rank's shard under sequence parallelism); returns (output, bias)
    like every Megatron mixer. Heads are split across tensor parallel ranks; packed (thd) sequences are supported
    with micro-batch size 1; context parallelism and inference caching are not supported and raise.
    ``keep_chunk_states`` keeps the GDN chunk states from the forward for the backward instead of recomputing them
    (faster; about 0.55 GB per layer at 16k tokens with hybrid-1.5B sizes; see ``chunk_gated_delta_rule``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int = 1,
        bias: bool = False,
        conv_bias: bool = False,
        use_qk_l2norm: bool = True,
        keep_chunk_states: bool = True,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        pg_collection: Optional[ProcessGroupCollection] = None,
        cp_comm_type: Optional[str] = None,
        name: Optional[str] = None,
        **unused_layer_kwargs,
    ):
        super().__init__(config)
        del cp_comm_type, unused_layer_kwargs  # accepted for TransformerLayer compatibility
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_size = pg_collection.tp.size()
        self.tp_rank = pg_collection.tp.rank()
        cp_size = pg_collection.cp.size() if getattr(pg_collection, "cp", None) is not None else 1
        self.shape: GatedDeltaNetShape = gdn_shape_from_config(config, self.tp_size, cp_size)
        if not (0 < A_init_range[0] <= A_init_range[1]):
            raise ValueError(f"A_init_range must satisfy 0 < low <= high, got {A_init_range}")
        self.layer_number = layer_number
        self.use_qk_l2norm = use_qk_l2norm
        self.keep_chunk_states = keep_chunk_states
        self.A_init_range = A_init_range
        shape = self.shape

        in_proj = submodules.in_proj
        if in_proj is ColumnParallelLinear:  # the local spec: same module, aligned GEMM
            in_proj = RowAlignedColumnParallelLinear
        self.in_proj = build_module(
            in_proj,
            config.hidden_size,
            shape.in_proj_dim,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=pg_collection.tp,
            name=f"{name}.in_proj" if name else None,
        )
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.conv1d = DepthwiseConvParameters(
            shape.conv_dim // self.tp_size, shape.conv_kernel, conv_bias, device=device, dtype=config.params_dtype
        )
        heads_local = shape.num_value_heads // self.tp_size
        self.dt_bias = torch.nn.Parameter(torch.empty(heads_local, device=device, dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(torch.empty(heads_local, device=device, dtype=config.params_dtype))
        for param in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log):
            if param is not None:
                param.tensor_model_parallel = True
                param.partition_dim = 0
                param.partition_stride = 1
        self.out_norm = GatedRMSNorm(
            shape.value_head_dim, config.layernorm_epsilon, config.layernorm_zero_centered_gamma,
            tp_group=pg_collection.tp, device=device, dtype=config.params_dtype,
        )
        self.out_proj = build_module(
            submodules.out_proj,
            shape.num_value_heads * shape.value_head_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=pg_collection.tp,
            name=f"{name}.out_proj" if name else None,
        )
        if config.perform_initialization:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize conv, A_log and dt_bias from full-size tensors, then keep this rank's slice.

        Drawing the full tensor on every rank makes the layer identical for every TP size from the same seed. With
        `use_cpu_initialization` the in_proj is redrawn the same way: megatron's CPU init splits its master weight
        into contiguous row blocks, which mixes the q|k|v|z|beta|alpha sections differently for each TP size.
        """
        shape, conv, rank, tp = self.shape, self.conv1d, self.tp_rank, self.tp_size
        if self.config.use_cpu_initialization:
            full_in_proj = torch.empty(shape.in_proj_dim, self.config.hidden_size)  # fp32, like megatron's CPU init
            self.config.init_method(full_in_proj)
            self.in_proj.weight.copy_(_rank_slice_of_sections(full_in_proj, shape.in_proj_sections, rank, tp))
        full_weight = torch.empty(shape.conv_dim, 1, shape.conv_kernel)
        bound = 1.0 / math.sqrt(shape.conv_kernel)  # nn.Conv1d's default for a depthwise conv (fan_in = kernel)
        full_weight.uniform_(-bound, bound)
        conv.weight.copy_(_rank_slice_of_sections(full_weight, shape.conv_sections, rank, tp))
        if conv.bias is not None:
            full_bias = torch.empty(shape.conv_dim).uniform_(-bound, bound)
            conv.bias.copy_(_rank_slice_of_sections(full_bias, shape.conv_sections, rank, tp))
        full_A = torch.empty(shape.num_value_heads).uniform_(*self.A_init_range)
        self.A_log.copy_(full_A.log().chunk(tp)[rank])
        self.dt_bias.fill_(1.0)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
        **unused_attention_kwargs,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        del attention_mask, sequence_len_offset, unused_attention_kwargs  # causal by construction
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("megatron_muon's GatedDeltaNet has no inference cache; it is train-only for now.")
        cu_seqlens = self._packed_cu_seqlens(packed_seq_params, hidden_states)
        s, tp = self.shape, self.tp_size
        qk_local, v_local = s.qk_dim // tp, s.v_dim // tp
        k_heads, v_heads = s.num_key_heads // tp, s.num_value_heads // tp

        projected, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim / tp (+ alignment pad)], full sequence
        projected = projected.transpose(0, 1)  # [b, s, ·]
        batch, seq = projected.shape[0], projected.shape[1]
        pad = projected.shape[-1] - (2 * qk_local + 2 * v_local + 2 * v_heads)
        other_pieces = 3 + (pad > 0)  # qkv, beta, alpha (and the pad) are one piece each
        z_sizes = piece_sizes(v_local, MIN_GRADIENT_PIECES - other_pieces)
        parts = torch.split(projected, [2 * qk_local + v_local, *z_sizes, v_heads, v_heads, pad], -1)
        qkv, beta_logits, alpha = parts[0], parts[-3], parts[-2]
        z = torch.stack(parts[1:-3], dim=-2).reshape(batch, seq, v_heads, s.value_head_dim)
        qkv = causal_conv1d(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, None, cu_seqlens)
        # SiLU per piece, stacked per section: each result is a fresh contiguous tensor, which the kernels below need
        # (a split view of the conv output would be copied by each of them); compiled, one fused pass per section.
        wanted = -(-MIN_GRADIENT_PIECES // 3)
        sizes = [piece_sizes(qk_local, wanted), piece_sizes(qk_local, wanted), piece_sizes(v_local, wanted)]
        parts = iter(torch.split(qkv, [size for group in sizes for size in group], dim=-1))
        q, k, v = (torch.stack([F.silu(next(parts)) for _ in group], dim=-2) for group in sizes)
        q = q.reshape(batch, seq, k_heads, s.key_head_dim)  # the op maps value head h to key head h // (Hv / Hk)
        k = k.reshape(batch, seq, k_heads, s.key_head_dim)
        v = v.reshape(batch, seq, v_heads, s.value_head_dim)
        decay_dtype = torch.promote_types(alpha.dtype, torch.float32)  # fp32 (fp64 in an fp64 model)
        g = -self.A_log.to(decay_dtype).exp() * F.softplus(alpha.to(decay_dtype) + self.dt_bias.to(decay_dtype))
        beta = beta_logits.sigmoid()
        core, _ = chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=self.use_qk_l2norm, cu_seqlens=cu_seqlens,
            keep_states_for_backward=self.keep_chunk_states,
        )
        normed = self.out_norm(core, z)
        normed = normed.reshape(batch, seq, v_heads * s.value_head_dim).transpose(0, 1).contiguous()
        return self.out_proj(normed)

    def _packed_cu_seqlens(self, packed_seq_params, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        """Sequence boundaries of a packed (thd) batch, or None for ordinary [s, b, h] batches."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return None
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        if hidden_states.shape[1] != 1:
            raise ValueError(f"packed (thd) sequences need micro-batch size 1, got {hidden_states.shape[1]}.")
        if not torch.compiler.is_compiling():
            total = hidden_states.shape[0] * (self.tp_size if self.config.sequence_parallel else 1)
            end = int(cu_seqlens[-1])
            if end != total:
                raise ValueError(f"cu_seqlens ends at {end} but the packed sequence has {total} tokens.")
        return cu_seqlens

    def in_proj_sections(self) -> tuple[int, ...]:
        """Sizes of q|k|v|z|beta|alpha in this rank's in_proj output (rows of its weight)."""
        s, tp = self.shape, self.tp_size
        return tuple(size // tp for size in s.in_proj_sections)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """TP-sharded checkpoint entries, with in_proj and conv split into named sections.

        A rank's in_proj rows are [q_r|k_r|v_r|z_r|beta_r|alpha_r], so the concatenation over ranks is not the
        tp=1 layout; storing each section as its own TP-sharded tensor makes any save/load TP pair agree.
        """
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = tp_group if tp_group is not None else self.pg_collection.tp
        dp_cp_group = metadata["dp_cp_group"]
        own_params = {}
        self._save_to_state_dict(own_params, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(
            own_params, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets, tp_group=tp_group,
            dp_cp_group=dp_cp_group,
        )
        for child_name, child in self.named_children():
            child_prefix = f"{prefix}{child_name}."
            if child_name == "conv1d":
                sharded.update(make_sharded_tensors_for_checkpoint(
                    child.state_dict(prefix="", keep_vars=True), child_prefix, {"weight": 0, "bias": 0},
                    sharded_offsets, tp_group=tp_group, dp_cp_group=dp_cp_group,
                ))
            else:
                sharded.update(sharded_state_dict_default(child, child_prefix, sharded_offsets, metadata, tp_group))
        in_proj_sections = list(self.in_proj_sections())
        conv_sections = [size // self.tp_size for size in self.shape.conv_sections]
        for key, sections, names in (
            ("in_proj.weight", in_proj_sections, IN_PROJ_SECTION_NAMES),
            ("in_proj.bias", in_proj_sections, IN_PROJ_SECTION_NAMES),
            ("conv1d.weight", conv_sections, CONV_SECTION_NAMES),
            ("conv1d.bias", conv_sections, CONV_SECTION_NAMES),
        ):
            full_key = f"{prefix}{key}"
            if full_key in sharded:
                sharded[full_key] = _split_tensor_factory(sharded[full_key], sections, list(names), 0)
        return sharded

    def backward_dw(self) -> None:
        """Weight-gradient pass for schedules that delay it (megatron's fine-grained overlap)."""
        self.in_proj.backward_dw()
        self.out_proj.backward_dw()
