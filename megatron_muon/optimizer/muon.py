"""Muon as a `torch.optim.Optimizer`, updating parameters grouped by matrix shape ("MegaBatch").

Each step, per shape bucket (matrices of equal shape from any layer, expert or fused part): the momentum EMA and
Nesterov blend written straight into one stacked bf16 NS input, one batched Newton–Schulz returning its fp16
result, and in-place parameter updates (weight decay included) with the shape's scale folded into the step size.
On CUDA the elementwise work is one Triton pass per bucket (`fused_pieces`; per piece where layouts differ:
`fused_elementwise`); elsewhere the EMA and the decay run foreach per param group first. No fp32 copy of the
updates is materialized between those passes. The bucket plan is built lazily in `step()` and rebuilt whenever the
set of parameters with gradients changes, because Megatron narrows param groups and swaps in fp32 master copies
after construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.profiler import record_function

from megatron_muon.kernels.coefficients import DEFAULT_COEFFICIENTS, warn_if_unsafe
from megatron_muon.kernels.newton_schulz import work_dtype
from megatron_muon.kernels.settings import Orthogonalizer
from megatron_muon.optimizer import fused_elementwise as fused_passes
from megatron_muon.optimizer import fused_pieces
from megatron_muon.optimizer import muon_math
from megatron_muon.optimizer.routing import (
    MatrixLayout,
    assert_pieces_cover_params,
    describe,
    matrix_layout,
    piece_matrix_count,
    piece_matrix_shape,
    piece_views,
)
from megatron_muon.optimizer.step_graphs import StepGraphs
from megatron_muon.optimizer.tensor_parallel import TP_MODES, gather_tp_shards, local_tp_shard

NS_KEYS = ("ns_steps", "coefficients", "method", "eps")
STACK_KEYS = (*NS_KEYS, "momentum", "nesterov", "weight_decay_mode")  # the settings stacks + Newton–Schulz read


def freeze_setting(value):
    """Hashable form of a group setting (coefficient schedules are lists of lists after a state_dict round trip)."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze_setting(v) for v in value)
    return value


@dataclass
class Bucket:
    """Matrices of one local shape that share NS settings and TP gathering: one batched orthogonalize."""

    shape: tuple[int, int]
    group_index: int
    tp_group: object = None
    partition_dim: int | None = None
    items: list[tuple[int, int]] = field(default_factory=list)  # (param index in the plan, piece index)
    wave: int = 0  # buckets of one wave can be orthogonalized together ahead of the step (`WaveMuon`)


class _Source(NamedTuple):
    """A parameter's gradient (after l2) and momentum buffer; `ema_pending`: the fused pass still owes the EMA."""

    grad: torch.Tensor
    buffer: torch.Tensor
    ema_pending: bool


@dataclass
class Plan:
    params: list[torch.Tensor]
    group_of: list[int]
    layouts: list[MatrixLayout]
    buckets: list[Bucket]


class Muon(torch.optim.Optimizer):
    """Muon (momentum + Newton–Schulz orthogonalization) for 2-D weights, batched across equal shapes.

    Args:
        params: parameters or param groups (named parameters give better error messages). Route embeddings, the
            output layer, norms, biases and vectors to AdamW (see `split_params_for_muon`).
        lr, momentum, nesterov, weight_decay: as torch.optim.Muon; weight decay is decoupled by default.
        ns_steps, coefficients, method, eps: Newton–Schulz settings passed to `megatron_muon.kernels.orthogonalize`.
        scale_mode: `match_rms_adamw` (default: reuse AdamW's lr and weight decay), `original`, `spectral`,
            `shape_scaling`, `unit_rms_norm` or `none`; extra_scale multiplies it.
        weight_decay_mode: `decoupled`, `independent` or `l2`.
        momentum_dtype: dtype of the momentum buffers (default: the parameter's).
        split_fused: orthogonalize fused QKV / GDN in_proj sections separately (megatron's `is_qkv` tags).
        split_heads: with split_fused, orthogonalize each head of those sections on its own (q, k, v per head; GDN's
            beta and alpha stay whole). A head is never sharded by TP, so this needs no TP gather.
        batched: stack equal shapes into one orthogonalize call (False runs one call per matrix: the reference).
        compute_dtype: Newton–Schulz iteration dtype override (default: the kernel's choice per method).
        tp_mode, tp_group_fn: for tensor-parallel shards, `duplicated`/`distributed` gather each sharded matrix
            over `tp_group_fn(param)` before NS (TP-invariant); `blockwise` orthogonalizes local shards.
        layout_fn: `(param) -> MatrixLayout` override of the attribute-based layout.
        check_finite: raise naming the parameter on a NaN/Inf gradient, before any state changes.
        fused_elementwise: "auto" (Triton on CUDA), True or False: momentum + Nesterov blend, and weight decay +
            update, each as one pass per matrix piece instead of several torch passes (same rounding).
        graph_newton_schulz: replay the step's momentum stacks and Newton–Schulz from a CUDA graph once its tensors
            and settings repeat (`step_graphs`); bit-identical results, one launch instead of hundreds.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        *,
        ns_steps: int = 5,
        coefficients=DEFAULT_COEFFICIENTS,
        method: str = "auto",
        eps: float = 1e-7,
        scale_mode: str = "match_rms_adamw",
        extra_scale: float = 1.0,
        weight_decay_mode: str = "decoupled",
        momentum_dtype: torch.dtype | None = None,
        split_fused: bool = True,
        split_heads: bool = False,
        batched: bool = True,
        compute_dtype: torch.dtype | None = None,
        tp_mode: str = "duplicated",
        tp_group_fn: Callable[[torch.Tensor], object] | None = None,
        layout_fn: Callable[[torch.Tensor], MatrixLayout] | None = None,
        check_finite: bool = True,
        fused_elementwise="auto",
        graph_newton_schulz: bool = False,
    ):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"unknown tp_mode {tp_mode!r}; valid choices: {TP_MODES}")
        if split_heads and not split_fused:
            raise ValueError("split_heads cuts the fused sections per head: it needs split_fused=True "
                             "(megatron's muon_split_qkv)")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
            coefficients=coefficients, method=method, eps=eps, scale_mode=scale_mode, extra_scale=extra_scale,
            weight_decay_mode=weight_decay_mode,
        )
        self.momentum_dtype = momentum_dtype
        self.split_fused = split_fused
        self.split_heads = split_heads
        self.batched = batched
        self.compute_dtype = compute_dtype
        self.tp_mode = tp_mode
        self.tp_group_fn = tp_group_fn
        self.layout_fn = layout_fn
        self.check_finite = check_finite
        fused_passes.check_setting(fused_elementwise)
        self.fused_elementwise = fused_elementwise
        self.graph_newton_schulz = graph_newton_schulz
        self.step_graphs = StepGraphs(STACK_KEYS, freeze_setting)
        self._plan_cache: tuple[tuple, Plan] | None = None
        # megatron's deferred clip (`megatron.clip_deferral`): the next step multiplies each gradient by this
        # one-element fp32 tensor as it reads it, inside the fused momentum pass where it can
        self.pending_grad_factor: torch.Tensor | None = None
        # id(parameter) -> its 16-bit model copy (megatron's fp32 masters): each step writes the updated parameter
        # rounded into it, inside the fused update pass where it can (`megatron.muon_model_copy`)
        self.model_copies: dict[int, torch.Tensor] = {}
        self.orthogonalized_matrices = 0  # matrices this optimizer has run Newton–Schulz on (tests count these)
        super().__init__(params, defaults)

    # ---- setup and validation ----

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        Orthogonalizer(group["ns_steps"], group["coefficients"], group["method"], group["eps"])  # raises with the fix
        warn_if_unsafe(group["coefficients"])
        muon_math.check_scale_mode(group["scale_mode"])
        if group["weight_decay_mode"] not in muon_math.WEIGHT_DECAY_MODES:
            raise ValueError(
                f"unknown weight_decay_mode {group['weight_decay_mode']!r}; "
                f"valid choices: {muon_math.WEIGHT_DECAY_MODES}"
            )
        names = group.get("param_names") or [None] * len(group["params"])
        for param, name in zip(group["params"], names):
            self._layout(param, name)  # raises naming a parameter Muon cannot treat as matrices
        self._plan_cache = None

    def _layout(self, param: torch.Tensor, name: str | None = None) -> MatrixLayout:
        if getattr(self, "layout_fn", None) is not None:
            return self.layout_fn(param)
        return matrix_layout(param, split_fused=getattr(self, "split_fused", True),
                             split_heads=getattr(self, "split_heads", False), name=name)

    def _name(self, group_index: int, param: torch.Tensor) -> str:
        group = self.param_groups[group_index]
        for i, candidate in enumerate(group["params"]):
            if candidate is param:
                names = group.get("param_names")
                name = names[i] if names else f"param_groups[{group_index}]['params'][{i}]"
                return describe(param, name)
        return describe(param)

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        """Create momentum buffers (megatron's checkpoint init calls this with skip_non_grad_params=False)."""
        for param in group["params"]:
            if skip_non_grad_params and param.grad is None:
                continue
            self._momentum_buffer(param)

    def _momentum_buffer(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        if "momentum_buffer" not in state:
            dtype = self.momentum_dtype or param.dtype
            state["momentum_buffer"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded state to the parameter dtype; put momentum back into `momentum_dtype`."""
        super().load_state_dict(state_dict)
        if self.momentum_dtype is not None:
            for state in self.state.values():
                buffer = state.get("momentum_buffer")
                if buffer is not None and buffer.dtype != self.momentum_dtype:
                    state["momentum_buffer"] = buffer.to(self.momentum_dtype)
        self._plan_cache = None

    def _tp_key(self, param: torch.Tensor, layout: MatrixLayout) -> tuple[object, int | None]:
        if self.tp_mode == "blockwise" or layout.partition_dim is None or self.tp_group_fn is None:
            return None, None
        group = self.tp_group_fn(param)
        if group is None or torch.distributed.get_world_size(group) == 1:
            return None, None
        return group, layout.partition_dim

    def _wave(self, param: torch.Tensor) -> int:
        return 0

    def _build_plan(self, params: list[torch.Tensor], group_of: list[int]) -> Plan:
        layouts = [self._layout(p, None) for p in params]
        buckets: dict[tuple, Bucket] = {}
        singles: list[Bucket] = []
        for index, (param, layout) in enumerate(zip(params, layouts)):
            group = self.param_groups[group_of[index]]
            ns_key = tuple(freeze_setting(group[k]) for k in NS_KEYS)
            param_tp_key = self._tp_key(param, layout)
            wave = self._wave(param)
            for piece_index, piece in enumerate(piece_views(param, layout)):
                heads = layout.piece_head_rows(piece_index)
                shape = piece_matrix_shape(piece, heads)
                # TP shards rows by whole heads (megatron's column-parallel QKV / in_proj): a head is all local
                tp_group, partition_dim = (None, None) if heads and param_tp_key[1] == 0 else param_tp_key
                if not self.batched:
                    singles.append(Bucket(shape, group_of[index], tp_group, partition_dim, [(index, piece_index)],
                                           wave))
                    continue
                key = (wave, shape, ns_key, id(tp_group), partition_dim)
                bucket = buckets.setdefault(key, Bucket(shape, group_of[index], tp_group, partition_dim, wave=wave))
                bucket.items.append((index, piece_index))
        plan = Plan(params, group_of, layouts, list(buckets.values()) + singles)
        assert_pieces_cover_params([bucket.items for bucket in plan.buckets], plan.params, plan.layouts)
        return plan

    def _plan(self, params: list[torch.Tensor], group_of: list[int]) -> Plan:
        key = tuple(zip(map(id, params), group_of))
        if self._plan_cache is None or self._plan_cache[0] != key:
            self._plan_cache = (key, self._build_plan(params, group_of))
        return self._plan_cache[1]

    def _check_grads_finite(self, params: list[torch.Tensor], grads: list[torch.Tensor], group_of: list[int]):
        bad = muon_math.first_non_finite(grads)
        if bad is not None:
            raise ValueError(
                f"non-finite gradient (NaN or Inf) in {self._name(group_of[bad], params[bad])}; no optimizer state "
                "was changed. Skip this step (or lower the learning rate / enable loss scaling) and zero the gradients."
            )

    def _orthogonalize_bucket(
        self, bucket: Bucket, stacked: torch.Tensor, narrow_result: bool = False, frobenius_norm=None
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """Batched NS of one bucket; `narrow_result` keeps the iteration dtype for fp32 targets (no widened copy);
        `frobenius_norm`: the stack's norms where its momentum pass summed them (never for TP shards)."""
        group = self.param_groups[bucket.group_index]
        full = stacked
        if bucket.tp_group is not None:
            assert frobenius_norm is None, "a shard's norm is not the matrix's"
            full = gather_tp_shards(stacked, bucket.tp_group, bucket.partition_dim)
        ortho = muon_math.orthogonal_update(
            full, ns_steps=group["ns_steps"], coefficients=group["coefficients"], method=group["method"],
            eps=group["eps"], compute_dtype=self.compute_dtype,
            out_dtype=work_dtype(full, group["method"], self.compute_dtype) if narrow_result else None,
            frobenius_norm=frobenius_norm,
        )
        full_shape = tuple(full.shape[-2:])
        self.orthogonalized_matrices += full.shape[0] if full.dim() == 3 else 1
        if bucket.tp_group is not None:
            ortho = local_tp_shard(ortho, bucket.tp_group, bucket.partition_dim)
        return ortho, full_shape

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step; each bucket's phases are named ranges in profiler traces (GPU idle time maps to them)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        params, grads, group_of = [], [], []
        for group_index, group in enumerate(self.param_groups):
            for param in group["params"]:
                if param.grad is not None:
                    if param.grad.is_sparse:
                        raise ValueError(f"Muon does not support sparse gradients: {self._name(group_index, param)}")
                    params.append(param)
                    grads.append(param.grad)
                    group_of.append(group_index)
        if not params:
            return loss
        if self.check_finite:
            with record_function("muon.check_finite"):
                self._check_grads_finite(params, grads, group_of)
        plan = self._plan(params, group_of)
        fused = fused_passes.use_fused(self.fused_elementwise, params[0].device)
        factor, self.pending_grad_factor = self.pending_grad_factor, None
        with record_function("muon.momentum_sources"):
            sources = self._momentum_sources(params, grads, group_of, fused, factor)
        updates = self._bucket_updates(plan, sources, factor, fused)
        for bucket, (ortho, full_shape) in zip(plan.buckets, updates):
            by_group: dict[int, tuple[list, list, list]] = {}
            offset = 0
            for index, piece_index in bucket.items:
                target = piece_views(params[index], plan.layouts[index])[piece_index]
                model = self.model_copies.get(id(params[index]))
                count = piece_matrix_count(target, plan.layouts[index].piece_head_rows(piece_index))
                chunk = ortho[offset : offset + count].reshape(target.shape)
                offset += count
                targets, chunks, models = by_group.setdefault(group_of[index], ([], [], []))
                targets.append(target)
                chunks.append(chunk)
                models.append(None if model is None else piece_views(model, plan.layouts[index])[piece_index])
            for owner, (group_targets, chunks, models) in by_group.items():
                group = self.param_groups[owner]
                scale = muon_math.update_scale(full_shape, group["scale_mode"], group["extra_scale"])
                with record_function(f"muon.apply_updates {bucket.shape}"):
                    self._apply_updates(owner, group_targets, chunks, scale, fused, models)
        return loss

    def _bucket_updates(self, plan: Plan, sources, factor, fused: bool) -> list:
        """Every bucket's (orthogonalized updates, full shape), from one CUDA graph where `graph_newton_schulz`."""

        def compute(factor):
            before = self.orthogonalized_matrices
            results = [self._bucket_update(i, bucket, plan, sources, factor) for i, bucket in enumerate(plan.buckets)]
            matrices, self.orthogonalized_matrices = self.orthogonalized_matrices - before, before
            return results, matrices  # counted once per step below, replayed or not

        if self._graph_step() and self.step_graphs.graphable(self, plan, sources, fused):
            results, matrices = self.step_graphs.run(self, plan, sources, factor, compute)
        else:
            results, matrices = compute(factor)
        self.orthogonalized_matrices += matrices
        return results

    def _graph_step(self) -> bool:
        return self.graph_newton_schulz and self.step_graphs.graphs.disabled is None

    def _bucket_update(self, bucket_index: int, bucket: Bucket, plan: Plan, sources, factor):
        """The bucket's orthogonalized momentum updates (stacked) and its full matrix shape."""
        with record_function(f"muon.stack_momentum {bucket.shape}"):
            stacked, norms = self._stack_updates(bucket, plan, sources, factor)
        with record_function(f"muon.orthogonalize {bucket.shape}"):
            return self._orthogonalize_bucket(bucket, stacked, narrow_result=self._narrow(bucket, plan),
                                              frobenius_norm=norms)

    @staticmethod
    def _narrow(bucket: Bucket, plan: Plan) -> bool:
        """fp32 targets take the iteration-dtype result; 16-bit ones the stack dtype's (the owners' rounding)."""
        return all(plan.params[index].dtype == torch.float32 for index, _ in bucket.items)

    def _ema_in_fused_pass(self, param: torch.Tensor) -> bool:
        return True

    def _momentum_sources(self, params, grads, group_of, fused: bool, factor) -> list[_Source]:
        """Gradients (l2 applied) and buffers per parameter. Unfused, the momentum EMA and the weight decay run
        here, foreach per param group; fused, the per-piece passes do both (l2 groups keep the foreach EMA). A
        pending clip factor multiplies, in place and first, the gradients no fused momentum pass reads."""
        sources: list[_Source | None] = [None] * len(params)
        for group_index, group in enumerate(self.param_groups):
            members = [i for i, g in enumerate(group_of) if g == group_index]
            if not members:
                continue
            group_params = [params[i] for i in members]
            buffers = [self._momentum_buffer(p) for p in group_params]
            # Piece views alias only a contiguous buffer; any other takes the foreach EMA.
            pending = [fused and group["weight_decay_mode"] != "l2" and b.is_contiguous() and self._ema_in_fused_pass(p)
                       for p, b in zip(group_params, buffers)]
            eager = [k for k, p in enumerate(pending) if not p]
            if factor is not None and eager:  # as megatron: clipped before l2 is added
                torch._foreach_mul_([grads[members[k]] for k in eager], factor.reshape(()))
            group_grads = [grads[i] for i in members]
            if group["weight_decay_mode"] == "l2":
                group_grads = muon_math.l2_regularized(group_grads, group_params, group["weight_decay"])
            muon_math.momentum_buffers_update_([group_grads[k] for k in eager], [buffers[k] for k in eager],
                                               group["momentum"])
            for i, grad, buffer, ema_pending in zip(members, group_grads, buffers, pending):
                sources[i] = _Source(grad, buffer, ema_pending)
            if not fused:
                muon_math.apply_weight_decay_(
                    group_params, lr=group["lr"], weight_decay=group["weight_decay"], mode=group["weight_decay_mode"]
                )
        return sources

    def _apply_updates(self, group_index: int, targets, chunks, scale: float, fused: bool, models=None) -> None:
        """targets ← targets - lr·scale·chunks, and each model copy (None: none) ← its target rounded; fused, the
        group's weight decay and the copies are written in the same pass."""
        group = self.param_groups[group_index]
        models = [None] * len(targets) if models is None else models
        if not fused:
            muon_math.apply_updates_(targets, chunks, lr=group["lr"], scale=scale)
            pairs = [(model, target) for model, target in zip(models, targets) if model is not None]
            if pairs:
                torch._foreach_copy_(*map(list, zip(*pairs)))
            return
        decay = muon_math.weight_decay_factor(lr=group["lr"], weight_decay=group["weight_decay"],
                                              mode=group["weight_decay_mode"])
        fused_pieces.decay_and_update_all_(targets, chunks, models, decay=decay, alpha=-group["lr"] * scale)

    def _stack_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        return muon_math.stack_dtype(grad_dtype, self.compute_dtype)

    def _stacked_slots(self, bucket: Bucket, pieces: list[tuple[torch.Tensor, int]]):
        """One [matrices, rows, cols] NS input for the bucket and each piece's slot in it, a view shaped like the
        piece; `pieces` are (gradient piece, how many matrices it contributes)."""
        dtype = self._stack_dtype(pieces[0][0].dtype)
        stacked = torch.empty((sum(count for _, count in pieces), *bucket.shape), dtype=dtype,
                              device=pieces[0][0].device)
        slots, offset = [], 0
        for grad_piece, count in pieces:
            slots.append(stacked[offset : offset + count].view(grad_piece.shape))
            offset += count
        return stacked, slots

    def _stack_updates(self, bucket: Bucket, plan: Plan, sources, factor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket's momentum updates as one [b, rows, cols] NS input, each blended straight into its slot, and
        the stack's Frobenius norms where the fused momentum passes summed them (else None: NS computes them)."""
        pieces = []
        for index, piece_index in bucket.items:
            grad, buffer, ema_pending = sources[index]
            layout = plan.layouts[index]
            grad_piece = piece_views(grad, layout)[piece_index]
            pieces.append((index, grad_piece, piece_views(buffer, layout)[piece_index], ema_pending,
                           piece_matrix_count(grad_piece, layout.piece_head_rows(piece_index))))
        stacked, slots = self._stacked_slots(bucket, [(piece[1], piece[-1]) for piece in pieces])
        partials = self._norm_partials(bucket, pieces, slots)
        pending = []
        for position, ((index, grad_piece, buffer_piece, ema_pending, _), slot) in enumerate(zip(pieces, slots)):
            group_index = plan.group_of[index]
            group = self.param_groups[group_index]
            if ema_pending:  # each piece is in exactly one bucket: the EMA covers every buffer element once
                pending.append((group_index, grad_piece, buffer_piece, slot, position))
            else:
                muon_math.nesterov_into_(grad_piece, buffer_piece, slot, group["momentum"], group["nesterov"])
        summed = partials is not None
        for group_index, run in fused_pieces.runs_by_group(pending):
            options = {key: self.param_groups[group_index][key] for key in ("momentum", "nesterov")}
            options["grad_factor"] = factor
            run_grads, run_buffers, run_slots, positions = zip(*run)
            run_partials = partials[positions[0]:] if summed else None  # a run's slots are consecutive
            if not fused_pieces.momentum_into_slots_(run_grads, run_buffers, run_slots, **options,
                                                     norm_partials=run_partials):  # one launch for the whole run
                for grad_piece, buffer_piece, slot, position in run:
                    summed &= fused_passes.momentum_into_slot_(grad_piece, buffer_piece, slot, **options,
                                                               norm_partials=partials[position] if summed else None)
        return stacked, partials.sum(dim=1).sqrt() if summed else None

    def _norm_partials(self, bucket: Bucket, pieces, slots) -> torch.Tensor | None:
        """[matrices, programs] fp32 for the momentum passes' partial sums of squares, where every piece of the bucket
        is one whole matrix that a fused pass writes (an l2 group, a tensor-parallel shard or per-head pieces: None,
        and NS reduces the stack itself)."""
        if bucket.tp_group is not None or not all(ema_pending and count == 1 for *_, ema_pending, count in pieces):
            return None
        programs = fused_passes.norm_programs(slots[0])
        if programs is None or slots[0].dtype not in fused_passes.COVERED_DTYPES:
            return None
        return torch.empty((len(slots), programs), dtype=torch.float32, device=slots[0].device)

