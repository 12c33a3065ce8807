"""Muon whose Newton–Schulz runs ahead of the step, one wave of parameters at a time, while the backward goes on.

A wave is a set of parameters whose gradients are final before the step (in data-parallel training: the matrices
of one DDP bucket once its reduce-scatter has landed). `speculate(wave, grad_of)` computes the wave's orthogonalized
momentum updates exactly as the coming `step()` would if nothing changes those gradients first, without touching
any state. The caller then says whether that held (`speculation_valid`: no gradient clipping happened, in
megatron's terms the clip factor was >= 1); `step()` uses the results only then, and otherwise computes every
bucket afresh, so a discarded speculation costs time, never correctness. A step with nothing speculated to reuse
batches each shape across all waves, as `Muon` does (fewer, larger Newton–Schulz calls).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import record_function

from megatron_muon.kernels.newton_schulz import work_dtype
from megatron_muon.optimizer import fused_elementwise as fused_passes
from megatron_muon.optimizer import fused_pieces, muon_math
from megatron_muon.optimizer.muon import STACK_KEYS, Bucket, Muon, Plan, freeze_setting
from megatron_muon.optimizer.routing import piece_matrix_count, piece_views
from megatron_muon.optimizer.speculation_graphs import SpeculationGraphs


class WaveMuon(Muon):
    """`Muon` plus `speculate`; `wave_of[id(param)]` assigns parameters to waves (default 0)."""

    def __init__(self, params, *args, **kwargs):
        self.wave_of: dict[int, int] = {}
        self.speculation_valid = False  # set by the caller between the backward and step()
        self._prepared: dict[int, tuple] = {}  # plan bucket index -> (ortho, full shape, grad data pointers)
        self.speculated_buckets = 0  # counters the tests and benchmarks read
        self.speculation_used = 0
        self.speculation_discarded = 0
        self._by_wave = False  # buckets split by wave while speculating; a step without speculation batches as Muon
        self._plans: dict[tuple, Plan] = {}
        self.graphs = SpeculationGraphs()
        super().__init__(params, *args, **kwargs)

    def _wave(self, param: torch.Tensor) -> int:
        return self.wave_of.get(id(param), 0) if self._by_wave else 0

    def _plan(self, params: list[torch.Tensor], group_of: list[int]) -> Plan:
        key = (tuple(zip(map(id, params), group_of)), self._by_wave)
        if key not in self._plans:
            if len(self._plans) >= 4:  # the parameter set changed (megatron swapped in masters): start over
                self._plans.clear()
            self._plans[key] = self._build_plan(params, group_of)
        self._plan_cache = (key[0], self._plans[key])  # what Muon's own readers of the plan look at
        return self._plans[key]

    def _all_params(self) -> tuple[list[torch.Tensor], list[int]]:
        params, group_of = [], []
        for index, group in enumerate(self.param_groups):
            params += group["params"]
            group_of += [index] * len(group["params"])
        return params, group_of

    @torch.no_grad()
    def speculate(self, wave: int | None, grad_of: Callable[[torch.Tensor], torch.Tensor],
                  graphed: bool = False, grad_factor: torch.Tensor | None = None) -> int:
        """Orthogonalize the momentum updates of `wave` from the gradients `grad_of(param)`; returns the number of
        buckets prepared. `wave=None` takes every parameter at once, one batch per shape (all gradients final).
        Reads the momentum buffers and parameters, writes nothing. `graphed` replays the wave from a CUDA graph when
        its inputs are the tensors of an earlier call (`SpeculationGraphs`); same results. `grad_factor` (a
        one-element fp32 tensor: the step's clip factor, known before megatron applies it) multiplies each
        gradient as megatron's clip will, so the speculation holds for a clipped step too."""
        params, group_of = self._all_params()
        if not params:
            return 0
        if self._prepared and self._by_wave != (wave is not None):
            raise ValueError("speculate(None) batches every wave and cannot mix with per-wave speculation of the "
                             "same gradients: call discard_speculation() first, or use one kind per step")
        self._by_wave = wave is not None
        plan = self._plan(params, group_of)
        buckets = [(index, bucket) for index, bucket in enumerate(plan.buckets) if wave is None or bucket.wave == wave]
        grads = {index: grad_of(params[index]) for _, bucket in buckets for index, _ in bucket.items}

        def eager():
            before = self.orthogonalized_matrices
            prepared = {}
            for bucket_index, bucket in buckets:
                with record_function(f"muon.speculate {bucket.shape}"):
                    stacked = self._speculative_stack(bucket, plan, grads, grad_factor)
                    ortho, full_shape = self._orthogonalize_bucket(bucket, stacked,
                                                                   narrow_result=self._narrow(bucket, plan))
                pointers = tuple(sorted((index, grads[index].data_ptr()) for index, _ in bucket.items))
                prepared[bucket_index] = (ortho, full_shape, pointers)
            matrices, self.orthogonalized_matrices = self.orthogonalized_matrices - before, before
            return prepared, matrices  # counted once per call below, replayed or not

        if graphed and buckets and self.graphs.disabled is None and self._graphable(plan, buckets, grads):
            key = (self._graph_key(plan, buckets, grads), None if grad_factor is None else grad_factor.data_ptr())
            prepared, matrices = self.graphs.run(-1 if wave is None else wave, key, eager)
        else:
            prepared, matrices = eager()
        self.orthogonalized_matrices += matrices
        self._prepared.update(prepared)
        self.speculated_buckets += len(prepared)
        return len(prepared)

    def _graphable(self, plan: Plan, buckets, grads) -> bool:
        """CUDA tensors only, and no tensor-parallel bucket (their all-to-alls run on the TP group's own terms)."""
        return all(bucket.tp_group is None for _, bucket in buckets) and all(g.is_cuda for g in grads.values())

    def _graph_key(self, plan: Plan, buckets, grads) -> tuple:
        """What a captured wave depends on: the tensors it reads (by address) and every setting it bakes in."""
        groups = sorted({plan.group_of[index] for _, bucket in buckets for index, _ in bucket.items})
        settings = tuple((g, *(freeze_setting(self.param_groups[g][k]) for k in STACK_KEYS),
                          self.param_groups[g]["weight_decay"] if self.param_groups[g]["weight_decay_mode"] == "l2"
                          else None) for g in groups)  # not lr: the schedule changes it every step
        tensors = tuple((index, grads[index].data_ptr(), plan.params[index].data_ptr(),
                         self._momentum_buffer(plan.params[index]).data_ptr())
                        for _, bucket in buckets for index, _ in bucket.items)
        shape = tuple((bucket_index, bucket.shape, tuple(bucket.items)) for bucket_index, bucket in buckets)
        return shape, tensors, settings, self.compute_dtype

    def _speculative_stack(self, bucket: Bucket, plan: Plan, grads: dict[int, torch.Tensor],
                           grad_factor: torch.Tensor | None = None) -> torch.Tensor:
        """`_stack_updates` with the momentum EMA kept out of the buffers: the same rounding as the step's EMA
        (buffer.lerp_(grad, 1 - β)) followed by its Nesterov blend, on the gradient times `grad_factor` (rounded to
        its dtype, as megatron's in-place clip stores it) where one is given. On the GPU one pass per run of pieces
        reads gradient and buffer and writes only the slot; elsewhere the EMA goes to a temporary."""
        factor = None if grad_factor is None else grad_factor.reshape(())
        pieces = []
        for index, piece_index in bucket.items:
            group_index = plan.group_of[index]
            group = self.param_groups[group_index]
            grad = grads[index]
            if group["weight_decay_mode"] == "l2":  # as megatron: clipped before l2 is added
                clipped = grad if factor is None else grad * factor
                grad = muon_math.l2_regularized([clipped], [plan.params[index]], group["weight_decay"])[0]
            layout = plan.layouts[index]
            buffer = self._momentum_buffer(plan.params[index])
            grad_piece = piece_views(grad, layout)[piece_index]
            pieces.append((group_index, grad_piece, piece_views(buffer, layout)[piece_index],
                           piece_matrix_count(grad_piece, layout.piece_head_rows(piece_index))))
        stacked, slots = self._stacked_slots(bucket, [(piece[1], piece[-1]) for piece in pieces])
        slotted = [(group_index, grad, buffer, slot) for (group_index, grad, buffer, _), slot in zip(pieces, slots)]

        def unclipped(group_index: int) -> bool:  # the factor is in the gradient already, or there is none
            return factor is None or self.param_groups[group_index]["weight_decay_mode"] == "l2"

        if fused_passes.use_fused(self.fused_elementwise, stacked.device):
            for group_index, run in fused_pieces.runs_by_group(slotted):
                options = {key: self.param_groups[group_index][key] for key in ("momentum", "nesterov")}
                options["grad_factor"] = None if unclipped(group_index) else grad_factor
                if not fused_pieces.momentum_into_slots_(*zip(*run), **options, store_buffer=False):
                    for grad, buffer, slot in run:
                        fused_passes.momentum_into_slot_(grad, buffer, slot, **options, store_buffer=False)
            return stacked
        for group_index, grad, buffer, slot in slotted:
            group = self.param_groups[group_index]
            if not unclipped(group_index):
                grad = grad * factor
            ema = torch.lerp(buffer, grad.to(buffer.dtype), 1.0 - group["momentum"])
            muon_math.nesterov_into_(grad, ema, slot, group["momentum"], group["nesterov"])
        return stacked

    def discard_speculation(self) -> None:
        """Forget what was speculated for the current gradients (a step that will not run on them)."""
        self.speculation_discarded += len(self._prepared)
        self._prepared = {}

    def _usable(self, plan: Plan) -> dict[int, tuple]:
        """Prepared buckets whose gradients are still the ones speculated on (same tensors, no clip since)."""
        usable = {}
        for bucket_index, (ortho, full_shape, pointers) in self._prepared.items():
            if bucket_index < len(plan.buckets) and all(
                    plan.params[index].grad is not None and plan.params[index].grad.data_ptr() == pointer
                    for index, pointer in pointers):
                usable[bucket_index] = (ortho, full_shape)
        return usable

    @torch.no_grad()
    def step(self, closure=None):
        valid, self.speculation_valid = self.speculation_valid and self.pending_grad_factor is None, False
        prepared, self._prepared = self._prepared, {}
        if prepared and not valid:
            self.speculation_discarded += len(prepared)
        params, group_of = self._all_params()
        if not (prepared and valid) or any(param.grad is None for param in params):
            if prepared and valid:  # some parameter has no gradient: the step's plan is not the speculated one
                self.speculation_discarded += len(prepared)
            self._by_wave = False  # nothing speculated to reuse: one batch per shape, as Muon
            return super().step(closure)
        self._prepared = prepared  # _by_wave stays as the speculation left it: the step reuses its plan
        plan = self._plan(params, group_of)
        self._for_step = self._usable(plan)
        self._for_step_params = {id(plan.params[index]) for b in self._for_step for index, _ in plan.buckets[b].items}
        self.speculation_used += len(self._for_step)
        self.speculation_discarded += len(prepared) - len(self._for_step)
        self._prepared = {}
        try:
            return super().step(closure)
        finally:
            self._for_step, self._for_step_params = {}, set()

    def _graph_step(self) -> bool:
        """A step that reuses speculated buckets computes only the rest: not the graph of a whole step."""
        return super()._graph_step() and not getattr(self, "_for_step", None)

    def _norm_partials(self, bucket: Bucket, pieces, slots) -> None:
        """No norms from the momentum passes: a speculated bucket must equal the step's bit for bit, and a step
        may stack a bucket whose parameters were partly speculated (eager EMA, no fused pass): NS reduces every
        stack itself, in one order."""
        return None

    def _ema_in_fused_pass(self, param: torch.Tensor) -> bool:
        """Prepared buckets skip the stacking pass, so their momentum EMA runs eagerly (same rounding)."""
        return id(param) not in getattr(self, "_for_step_params", ())

    def _orthogonalize_bucket(self, bucket: Bucket, stacked: torch.Tensor, narrow_result: bool = False,
                              frobenius_norm=None):
        """Tensor-parallel buckets: each matrix is assembled on one TP rank only (matrix j on rank j mod tp), which
        runs its Newton–Schulz; one all-to-all brings the shards in and one takes the results back, so the TP ranks
        share the work instead of repeating it. Same full matrices, same per-matrix result as gathering everywhere."""
        if bucket.tp_group is None:
            return super()._orthogonalize_bucket(bucket, stacked, narrow_result, frobenius_norm)
        assert frobenius_norm is None, "a shard's norm is not the matrix's"
        import torch.distributed as dist

        group, dim = bucket.tp_group, bucket.partition_dim + 1
        tp, me = dist.get_world_size(group), dist.get_rank(group)
        count = stacked.shape[0]
        mine = list(range(me, count, tp))
        order = [j for r in range(tp) for j in range(r, count, tp)]  # matrices grouped by the rank that runs them
        shard = stacked[0].numel()
        send = stacked[order].contiguous()
        received = torch.empty((len(mine) * tp, *stacked.shape[1:]), dtype=stacked.dtype, device=stacked.device)
        dist.all_to_all_single(received.view(-1), send.view(-1), [len(mine) * shard] * tp,
                               [len(range(r, count, tp)) * shard for r in range(tp)], group=group)
        full = torch.cat(list(received.view(tp, len(mine), *stacked.shape[1:]).unbind(0)), dim=dim)
        settings = self.param_groups[bucket.group_index]
        full_shape = self._full_shape(stacked.shape[-2:], bucket.partition_dim, tp)
        out_dtype = stacked.dtype  # known on every rank, also one that runs none of the bucket's matrices
        if narrow_result:
            out_dtype = work_dtype(torch.empty(full_shape, device="meta"), settings["method"], self.compute_dtype)
        ortho = muon_math.orthogonal_update(
            full, ns_steps=settings["ns_steps"], coefficients=settings["coefficients"], method=settings["method"],
            eps=settings["eps"], compute_dtype=self.compute_dtype, out_dtype=out_dtype,
        ) if mine else full.new_empty((0, *full.shape[1:]), dtype=out_dtype)
        self.orthogonalized_matrices += len(mine)
        back = torch.cat([part.contiguous() for part in ortho.chunk(tp, dim=dim)]) if mine else ortho.new_empty(0)
        result = torch.empty((count, *stacked.shape[1:]), dtype=ortho.dtype, device=stacked.device)
        arrived = torch.empty_like(result)
        dist.all_to_all_single(arrived.view(-1), back.reshape(-1).contiguous(),
                               [len(range(r, count, tp)) * shard for r in range(tp)], [len(mine) * shard] * tp,
                               group=group)
        result[order] = arrived
        return result, full_shape

    @staticmethod
    def _full_shape(local: torch.Size, partition_dim: int, tp: int) -> tuple[int, int]:
        shape = list(local)
        shape[partition_dim] *= tp
        return shape[0], shape[1]

    def _bucket_update(self, bucket_index: int, bucket: Bucket, plan: Plan, sources, factor):
        ready = getattr(self, "_for_step", {}).get(bucket_index)
        if ready is not None:
            return ready
        return super()._bucket_update(bucket_index, bucket, plan, sources, factor)
