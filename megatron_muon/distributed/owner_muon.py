"""Owner-centric distributed Muon: every matrix is orthogonalized exactly once per step, by one owner rank.

Each rank of a pipeline stage holds TP shards of every matrix, replicated across data-parallel rows. Gradients
must be reduced over data parallelism at least on the owner's row: either all-reduced, or reduce-scattered to
owner rows by `grad_reduce.OwnerReduceScatter` (what `dist_muon` installs into megatron's DDP). Per step: shards go
to the matrix's owner (one all-to-all inside each TP row), the owner keeps the full momentum and runs one batched
Newton–Schulz per shape bucket, and each bucket's orthogonalized update starts back as soon as it is done
(`comm.UpdateDelivery`: all-to-all, then an asynchronous all-gather across rows) while the owner works on its next
bucket and every rank applies weight decay. The update is applied locally with the same foreach calls as the
single-process `Muon`, so the result matches it at any (tp, dp) layout. Owners come from `plan.plan_owners`
(cost-balanced, shape buckets kept together).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from megatron_muon.distributed.comm import (
    CommCounter,
    StageGrid,
    UnitShard,
    UpdateDelivery,
    gather_to_owners,
    scatter_from_owners,
)
from megatron_muon.distributed.plan import (
    AnalyticCost,
    CostModel,
    MatrixSpec,
    OwnerPlan,
    plan_hash,
    plan_owners,
    rank_loads,
)
from megatron_muon.distributed.profile import profiled_cost
from megatron_muon.kernels.coefficients import resolve_coefficients
from megatron_muon.kernels.newton_schulz import work_dtype
from megatron_muon.optimizer import fused_elementwise, muon_math
from megatron_muon.optimizer.muon import Muon, _freeze
from megatron_muon.optimizer.routing import piece_as_matrices, piece_matrix_shape, piece_views

_NS_KEYS = ("ns_steps", "coefficients", "method", "eps")


@dataclass(frozen=True)
class _Unit:
    """One orthogonalized matrix: expert `expert` of piece `piece` of the parameter at `param_index`."""

    param_index: int
    piece: int
    expert: int
    shard: UnitShard
    name: str


class OwnerMuon(Muon):
    """Muon whose matrices are split among the DP×TP ranks of a stage; same math and settings as `Muon`.

    Args (beyond `Muon`'s):
        tp_group, dp_group: this stage's tensor- and data-parallel groups (None = size 1). Gradients must already
            be summed/averaged over `dp_group` (megatron's DDP does it); parameters are replicated across it.
        expert_tp_group, expert_dp_group: used instead when every parameter is an expert weight (megatron marks
            them `allreduce = False`); megatron builds expert and dense parameters into separate optimizers.
        cost_model: per-shape cost for owner balancing: None (FLOPs), a `plan.CostModel` such as
            `plan.MeasuredCost`, or "profile" (time each shape once on this device at the first step).
        plan_method, plan_time_limit_s: forwarded to `plan.plan_owners`.
    """

    def __init__(self, params, *args, tp_group=None, dp_group=None, expert_tp_group=None, expert_dp_group=None,
                 cost_model: CostModel | None = None, plan_method: str = "auto", plan_time_limit_s: float = 1.0,
                 **kwargs):
        if kwargs.get("tp_mode", "duplicated") == "blockwise":
            raise ValueError("OwnerMuon always orthogonalizes whole matrices; tp_mode='blockwise' is not available "
                             "here (use megatron_muon.optimizer.Muon for blockwise)")
        self._groups = {"dense": (tp_group, dp_group), "expert": (expert_tp_group, expert_dp_group)}
        self.grid = StageGrid(tp_group, dp_group)
        if isinstance(cost_model, str) and cost_model != "profile":
            raise ValueError(f"cost_model must be a CostModel, 'profile' or None, got {cost_model!r}")
        self.cost_model = cost_model  # None: FLOPs of the group's Newton–Schulz settings (`_analytic_cost`)
        self.plan_method, self.plan_time_limit_s = plan_method, plan_time_limit_s
        self.owner_momentum: dict[int, torch.Tensor] = {}  # unit index -> full momentum, on its owner only
        self.orthogonalized_matrices = 0  # matrices this rank has run Newton–Schulz on (tests count these)
        self.comm_counter = CommCounter()  # what this engine (and a gradient reduction set up for it) sent
        self._plan_frozen = False  # gradients are routed by this plan outside the optimizer: it must not change
        self._units_key = None
        self._units: list[_Unit] = []
        self.owner_plan: OwnerPlan | None = None
        self._layouts: list = []
        self._loaded_momentum = False  # per-parameter shards in self.state came from a checkpoint: import them
        super().__init__(params, *args, **kwargs)

    # ---- units and the plan (built on the first step, after megatron has swapped in its master params) ----

    def _params_in_order(self) -> tuple[list[torch.Tensor], list[int], list[str]]:
        params, group_of, names = [], [], []
        for gi, group in enumerate(self.param_groups):
            group_names = group.get("param_names") or [None] * len(group["params"])
            for pi, (param, name) in enumerate(zip(group["params"], group_names)):
                params.append(param)
                group_of.append(gi)
                names.append(name or f"param_groups[{gi}][{pi}]")
        return params, group_of, names

    def _ensure_plan(self, params: list[torch.Tensor], group_of: list[int], names: list[str]) -> None:
        key = tuple(zip(map(id, params), group_of))
        if self._units_key == key:
            return
        if self._plan_frozen:
            raise ValueError("the Muon parameters changed after their gradient reduction was set up by owner; "
                             "rebuild the optimizer (and its dist_muon gradient reduction) for the new parameters")
        experts = [getattr(p, "allreduce", True) is False for p in params]
        if any(experts) and not all(experts):
            raise ValueError("OwnerMuon got expert weights (allreduce=False) and dense weights in one optimizer; "
                             "build one OwnerMuon per kind (megatron's factory does) so each uses its own groups")
        if all(experts):
            tp_group, dp_group = self._groups["expert"]
            if tp_group is None and dp_group is None:
                tp_group, dp_group = self._groups["dense"]
            self.grid = StageGrid(tp_group, dp_group)
        self.grid.device = params[0].device if params else self.grid.device
        tp = self.grid.tp_size
        units: list[_Unit] = []
        layouts = [self._layout(param, name) for param, name in zip(params, names)]
        for index, (param, name, layout) in enumerate(zip(params, names, layouts)):
            for piece_index, piece in enumerate(piece_views(param, layout)):
                rows, cols = piece_matrix_shape(piece)
                full = [rows, cols]
                if layout.partition_dim is not None:
                    full[layout.partition_dim] *= tp
                for expert in range(piece.shape[0]):
                    label = name + (f"[part {piece_index}]" if layout.split_sections else "")
                    label += f"[expert {expert}]" if piece.shape[0] > 1 else ""
                    units.append(_Unit(index, piece_index, expert, UnitShard((full[0], full[1]), layout.partition_dim),
                                       label))
        specs = [MatrixSpec(f"{u.name}#{i}", u.shard.full_shape, tuple(range(self.grid.num_slots)))
                 for i, u in enumerate(units)]
        if not self.grid.all_equal(plan_hash(specs)):
            raise ValueError(
                "ranks of this pipeline stage disagree on the matrices Muon manages (names/shapes/order differ); "
                "build the model and the optimizer identically on every TP and DP rank"
            )
        cost, group = self.cost_model or self._analytic_cost(), self.param_groups[0]
        if cost == "profile":  # only the first slot measures; every rank adopts its plan below
            cost = self._analytic_cost()
            if self.grid.slot == 0:
                cost = profiled_cost({spec.shape for spec in specs}, device=params[0].device,
                                     ns_steps=group["ns_steps"], coefficients=group["coefficients"],
                                     method=group["method"], compute_dtype=self.compute_dtype)
        method = self.plan_method if self.grid.slot == 0 else "lpt"  # the other ranks adopt slot 0's plan anyway
        plan = plan_owners(specs, cost, method, self.plan_time_limit_s)
        owners = tuple(self.grid.broadcast_from_first_slot(torch.tensor(plan.owners, dtype=torch.int64)).tolist())
        if owners != plan.owners:
            loads = rank_loads(specs, owners, cost)
            plan = OwnerPlan(plan.matrices, owners, loads, max(loads.values()), plan.lower_bound, "first slot's")
        if self.owner_momentum:
            raise ValueError("the set of Muon parameters changed after momentum exists; rebuild the optimizer, or "
                             "save and load a checkpoint to move the momentum to the new layout")
        self._units, self._units_key, self.owner_plan, self._layouts = units, key, plan, layouts

    @property
    def owners(self) -> tuple[int, ...]:
        assert self.owner_plan is not None
        return self.owner_plan.owners

    def managed_parameters(self) -> list[torch.Tensor]:
        """The parameters this optimizer updates, in the order units refer to them."""
        return self._params_in_order()[0]

    def freeze_plan(self) -> None:
        """Build the owner plan now (collective over the stage) and keep it: for callers that route gradients by
        owner before the first step. Afterwards the set of parameters must not change."""
        params, group_of, names = self._params_in_order()
        if params:
            self._ensure_plan(params, group_of, names)
        self._plan_frozen = True

    def unit_views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Writable views of every unit inside `tensors` (shaped like `managed_parameters()`, same order)."""
        return [piece_views(tensors[u.param_index], self._layouts[u.param_index])[u.piece][u.expert]
                for u in self._units]

    def unit_param_indices(self) -> list[int]:
        return [u.param_index for u in self._units]

    def owner_rows(self) -> list[int]:
        """The data-parallel row of every unit's owner."""
        return [self.grid.row_of(o) for o in self.owners]

    def _unit_shards(self, tensors: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's [rows, cols] block of every unit, read from tensors shaped like the parameters."""
        out = []
        for unit in self._units:
            piece = piece_views(tensors[unit.param_index], self._layouts[unit.param_index])[unit.piece]
            out.append(piece_as_matrices(piece)[unit.expert])
        return out

    # ---- checkpoint bridge: momentum as parameter-shaped shards, the layout every checkpoint format expects ----

    def _export_momentum_to_state(self) -> None:
        """Put each parameter's momentum shard into self.state (collective over the stage); owners stay the
        source of truth, so the next step simply drops these copies."""
        params, group_of, names = self._params_in_order()
        if self._loaded_momentum or not params:
            return
        self._ensure_plan(params, group_of, names)
        like = torch.empty(0, dtype=self.momentum_dtype or params[0].dtype, device=params[0].device)
        owned = {u: self.owner_momentum.get(u, torch.zeros(self._units[u].shard.full_shape, dtype=like.dtype,
                                                            device=like.device))
                 for u, o in enumerate(self.owners) if o == self.grid.slot}
        shards = scatter_from_owners(self.grid, [u.shard for u in self._units], self.owners, owned, like)
        for param in params:
            self.state[param]["momentum_buffer"] = torch.zeros_like(param, dtype=like.dtype)
        for unit, shard in zip(self._units, shards):
            param = params[unit.param_index]
            buffer = self.state[param]["momentum_buffer"]
            target = piece_views(buffer, self._layouts[unit.param_index])[unit.piece][unit.expert]
            target.copy_(shard.view(target.shape))

    def _import_momentum_from_state(self, params: list[torch.Tensor]) -> None:
        """Owners rebuild full momentum from the per-parameter shards in self.state (after a load or export)."""
        buffers = [self.state[p].get("momentum_buffer") for p in params]
        if any(b is None for b in buffers):
            raise ValueError("a checkpoint restored momentum for only some Muon parameters; load a checkpoint "
                             "written for the same model")
        self.owner_momentum = {
            u: m.clone() for u, m in gather_to_owners(
                self.grid, [u.shard for u in self._units], self.owners, self._unit_shards(buffers, params)).items()}
        self._loaded_momentum = False

    def _drop_state_copies(self, params: list[torch.Tensor]) -> None:
        for p in params:
            if p in self.state:
                self.state[p].pop("momentum_buffer", None)

    def state_dict(self) -> dict:
        self._export_momentum_to_state()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Loaded momentum shards (any layout megatron resharded them from) reach the owners on the next step."""
        super().load_state_dict(state_dict)
        self.owner_momentum = {}
        self._loaded_momentum = any("momentum_buffer" in s for s in self.state.values())

    # ---- the step ----

    def _check_finite_everywhere(self, grads: list[torch.Tensor], params, group_of, names) -> None:
        """Every rank checks its shards; one max-reduce tells all ranks the first bad parameter (or none)."""
        first_bad = 0
        if grads:
            max_abs = torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))])
            bad = (~torch.isfinite(max_abs)).nonzero()
            first_bad = len(grads) - int(bad[0]) if len(bad) else 0
        found = self.grid.max_over_stage(first_bad)
        if found:
            index = len(grads) - found
            raise ValueError(
                f"non-finite gradient (NaN or Inf) in {names[index]} (shape {tuple(params[index].shape)}); no "
                "optimizer state was changed. Skip this step (or lower the learning rate / enable loss scaling) "
                "and zero the gradients."
            )

    def _bucket_key(self, u: int, group_of_unit: list[int]) -> tuple:
        group = self.param_groups[group_of_unit[u]]
        return tuple(self._units[u].shard.full_shape), tuple(_freeze(group[k]) for k in _NS_KEYS)

    def _rounds(self, group_of_unit: list[int]) -> list[list[int]]:
        """Round k: the k-th (shape, NS settings) bucket of every owner, in unit order (the same on every rank)."""
        per_owner: dict[int, dict[tuple, list[int]]] = defaultdict(dict)
        for u, owner in enumerate(self.owners):
            per_owner[owner].setdefault(self._bucket_key(u, group_of_unit), []).append(u)
        rounds: list[list[int]] = []
        for buckets in per_owner.values():
            for k, members in enumerate(buckets.values()):
                if k == len(rounds):
                    rounds.append([])
                rounds[k].extend(members)
        return [sorted(members) for members in rounds]

    def _analytic_cost(self) -> AnalyticCost:
        """FLOP cost of this optimizer's Newton–Schulz: its steps, method and schedule (which sets the restarts)."""
        group = self.param_groups[0]
        schedule = tuple(map(tuple, resolve_coefficients(group["coefficients"], group["ns_steps"])))
        return AnalyticCost(steps=group["ns_steps"], method=group["method"], coefficients=schedule)

    def _orthogonalize_owned(self, updates: dict[int, torch.Tensor], group_of_unit: list[int],
                             param_dtypes: list[torch.dtype]) -> dict:
        """One batched Newton–Schulz per (shape, NS settings) bucket of the matrices this rank owns, with the
        single-process Muon's dtypes (stack in `stack_dtype`, fp32 targets take the iteration-dtype result), so
        both engines round identically."""
        buckets: dict[tuple, list[int]] = defaultdict(list)
        for u in sorted(updates):
            buckets[self._bucket_key(u, group_of_unit)].append(u)
        result = {}
        for (_, _), members in buckets.items():
            group = self.param_groups[group_of_unit[members[0]]]
            first = updates[members[0]]
            stacked = torch.stack([updates[u] for u in members]).to(
                muon_math.stack_dtype(first.dtype, self.compute_dtype))
            narrow = all(param_dtypes[self._units[u].param_index] == torch.float32 for u in members)
            ortho = muon_math.orthogonal_update(
                stacked, ns_steps=group["ns_steps"], coefficients=group["coefficients"], method=group["method"],
                eps=group["eps"], compute_dtype=self.compute_dtype,
                out_dtype=work_dtype(stacked, group["method"], self.compute_dtype) if narrow else None,
            )
            self.orthogonalized_matrices += len(members)
            result.update({u: ortho[i] for i, u in enumerate(members)})
        return result

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, group_of, names = self._params_in_order()
        if not params:
            return loss
        missing = [n for p, n in zip(params, names) if p.grad is None]
        if missing:
            raise ValueError(f"OwnerMuon needs a gradient for every parameter on every rank, but {missing[:3]} "
                             "have none; keep unused parameters out of the optimizer or zero their grads "
                             "(set_to_none=False)")
        grads = [p.grad for p in params]
        fused = fused_elementwise.use_fused(self.fused_elementwise, params[0].device)
        self._ensure_plan(params, group_of, names)
        if self.check_finite:
            self._check_finite_everywhere(grads, params, group_of, names)
        if self._loaded_momentum:
            self._import_momentum_from_state(params)
        self._drop_state_copies(params)

        for gi, group in enumerate(self.param_groups):  # l2 acts on the local shards, before anything moves
            if group["weight_decay_mode"] == "l2":
                members = [i for i, g in enumerate(group_of) if g == gi]
                regularized = muon_math.l2_regularized([grads[i] for i in members], [params[i] for i in members],
                                                       group["weight_decay"])
                for i, g in zip(members, regularized):
                    grads[i] = g

        shards = [u.shard for u in self._units]
        group_of_unit = [group_of[u.param_index] for u in self._units]
        full_grads = gather_to_owners(self.grid, shards, self.owners, self._unit_shards(grads, params),
                                      self.comm_counter)
        updates: dict[int, torch.Tensor] = {}
        for gi, group in enumerate(self.param_groups):
            members = [u for u in sorted(full_grads) if group_of_unit[u] == gi]
            if not members:
                continue
            dtype = self.momentum_dtype
            buffers = [self.owner_momentum.setdefault(
                u, torch.zeros_like(full_grads[u], dtype=dtype or params[self._units[u].param_index].dtype))
                for u in members]
            new = muon_math.momentum_update_([full_grads[u] for u in members], buffers, group["momentum"],
                                             group["nesterov"])
            updates.update(zip(members, new))
        for gi, group in enumerate(self.param_groups if not fused else ()):  # fused: decay is in the update pass
            members = [i for i, g in enumerate(group_of) if g == gi]  # before any update lands: decay, then step
            muon_math.apply_weight_decay_([params[i] for i in members], lr=group["lr"],
                                          weight_decay=group["weight_decay"], mode=group["weight_decay_mode"])
        like = self._delivery_like(grads[0] if grads else params[0], params, group_of_unit)
        param_dtypes = [p.dtype for p in params]
        delivery = UpdateDelivery(self.grid, shards, self.owners, like, self.comm_counter)
        for round_units in self._rounds(group_of_unit):  # each owner bucket leaves as soon as it is orthogonalized
            mine = {u: updates.pop(u) for u in round_units if u in updates}
            delivery.launch(round_units, self._orthogonalize_owned(mine, group_of_unit, param_dtypes) if mine else {})
            # the previous round has travelled while this one was orthogonalized: apply it and free its buffer
            self._apply_delivered(delivery.arrived(keep=1), params, group_of, fused)
        self._apply_delivered(delivery.arrived(), params, group_of, fused)
        assert not delivery.undelivered(), f"units {delivery.undelivered()[:5]} got no update"
        return loss

    def _delivery_like(self, like: torch.Tensor, params, group_of_unit: list[int]) -> torch.Tensor:
        """Updates travel in the owners' result dtype when that is one 16-bit dtype (fp32 targets get the iteration
        dtype, see `_orthogonalize_owned`): half the bytes of fp32, nothing lost. Else in the gradients' dtype."""
        if any(p.dtype != torch.float32 for p in params):
            return like
        pairs = {(u.shard.full_shape, self.param_groups[g]["method"]) for u, g in zip(self._units, group_of_unit)}
        dtypes = {work_dtype(torch.empty(shape, device="meta"), method, self.compute_dtype) for shape, method in pairs}
        dtype = dtypes.pop() if len(dtypes) == 1 else like.dtype
        return like.new_empty(0, dtype=dtype) if dtype.itemsize == 2 else like

    def _apply_delivered(self, parts: dict[int, torch.Tensor], params, group_of: list[int], fused: bool) -> None:
        """Apply the delivered local update shards {unit: shard}; units partition each parameter, so each part of
        a parameter is decayed (fused) and updated exactly once per step."""
        by_scale: dict[tuple[int, float], tuple[list, list]] = defaultdict(lambda: ([], []))
        for u, chunk in sorted(parts.items()):
            unit = self._units[u]
            group = self.param_groups[group_of[unit.param_index]]
            target = piece_views(params[unit.param_index], self._layouts[unit.param_index])[unit.piece][unit.expert]
            scale = muon_math.update_scale(unit.shard.full_shape, group["scale_mode"], group["extra_scale"])
            targets, chunks = by_scale[(group_of[unit.param_index], scale)]
            targets.append(target)
            chunks.append(chunk.view(target.shape))
        for (gi, scale), (targets, chunks) in by_scale.items():
            self._apply_updates(gi, targets, chunks, scale, fused)
