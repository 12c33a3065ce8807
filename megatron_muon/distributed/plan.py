"""Owner plan: which rank orthogonalizes which matrix, balanced by cost rather than by element count.

Pure Python + numpy/scipy (no torch.distributed), so every rank can compute it and tests can check it alone.
Matrices of one shape form a bucket that the owner orthogonalizes as one batch; the cost of a batch is affine in
its size (a launch cost per bucket plus a per-matrix cost), which is what lets the MILP trade balance against
batching. The MILP (scipy HiGHS) works on counts per (shape, holder set) class instead of per-matrix binaries, which
keeps even a 64-layer model on 8 ranks to a few dozen integer variables.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np

from megatron_muon.distributed.cost import (  # noqa: F401  (re-exported: the plan's public vocabulary)
    AnalyticCost,
    CostModel,
    MeasuredCost,
    Shape,
    CachedCost,
    newton_schulz_flops,
)

# The MILP stops at this many branch-and-bound nodes or at its time limit, whichever comes first. Near-optimal plans
# are found at the root; the tree mostly tightens the bound. A time limit makes the answer depend on machine speed,
# which is why the owner layout broadcasts the first rank's plan to every rank of its stage.
MILP_NODE_LIMIT = 500
# The greedy runs once per batch granularity (fractions of the lower bound; 0 = one matrix per batch) and keeps
# the best: coarse batches save launches, fine ones balance better, and which wins depends on the shape mix.
LPT_BATCH_FRACTIONS = (1.0, 0.5, 0.25, 0.0)


@dataclass(frozen=True)
class MatrixSpec:
    """One matrix to orthogonalize: its full (unsharded) shape and the ranks allowed to own it."""

    name: str
    shape: Shape
    holders: tuple[int, ...]

    def __post_init__(self):
        if len(self.shape) != 2 or min(self.shape) < 1:
            raise ValueError(f"{self.name}: shape must be two positive ints (rows, cols), got {self.shape}")
        if not self.holders:
            raise ValueError(f"{self.name}: no rank holds this matrix; give at least one rank in `holders`")
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))
        object.__setattr__(self, "holders", tuple(sorted(set(int(r) for r in self.holders))))


@dataclass(frozen=True)
class OwnerPlan:
    """The assignment plus what it is predicted to cost; identical on every rank for identical inputs."""

    matrices: tuple[MatrixSpec, ...]
    owners: tuple[int, ...]  # owners[i] owns matrices[i]
    loads: dict[int, float]
    makespan: float
    lower_bound: float
    method: str

    def owner_of(self, name: str) -> int:
        return self.owners[self._index[name]]

    @cached_property
    def _index(self) -> dict[str, int]:
        return {m.name: i for i, m in enumerate(self.matrices)}

    def buckets(self, rank: int) -> dict[Shape, list[str]]:
        """Shape -> names that `rank` orthogonalizes as one batch (input order kept)."""
        out: dict[Shape, list[str]] = defaultdict(list)
        for spec, owner in zip(self.matrices, self.owners):
            if owner == rank:
                out[spec.shape].append(spec.name)
        return dict(out)

    @property
    def hash(self) -> int:
        """63-bit digest of inputs and assignment: cheap to all-reduce (min == max) to prove ranks agree."""
        return plan_hash(self.matrices, self.owners)


def plan_hash(matrices: Sequence[MatrixSpec], owners: Sequence[int] | None = None) -> int:
    payload = [[m.name, list(m.shape), list(m.holders)] for m in matrices]
    blob = json.dumps([payload, list(owners) if owners is not None else None], separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:8], "big") >> 1


def rank_loads(matrices: Sequence[MatrixSpec], owners: Sequence[int], cost: CostModel) -> dict[int, float]:
    """Predicted time per rank: one launch per (rank, shape) bucket plus the per-matrix costs."""
    ranks = sorted({r for m in matrices for r in m.holders})
    loads = {r: 0.0 for r in ranks}
    seen: set[tuple[int, Shape]] = set()
    for spec, owner in zip(matrices, owners):
        if (owner, spec.shape) not in seen:
            seen.add((owner, spec.shape))
            loads[owner] += cost.launch_cost(spec.shape)
        loads[owner] += cost.matrix_cost(spec.shape)
    return loads


def _min_batches(count: int, launch: float, work: float, makespan: float) -> int:
    """Fewest batches `count` matrices can be split into when no rank may exceed `makespan`."""
    per_rank = count if work <= 0 else max(1, int(np.floor((makespan * (1 + 1e-12) - launch) / work)))
    return -(-count // per_rank)


def lower_bound(matrices: Sequence[MatrixSpec], cost: CostModel) -> float:
    """No assignment beats this: the largest single matrix (with its launch), and for every holder set the work
    that must land inside it spread evenly, plus the launches it needs: a makespan T allows at most
    (T - launch) / work matrices of a shape per rank, so a shape needs that many batches (iterated to a fixed
    point from below, which keeps the bound valid)."""
    if not matrices:
        return 0.0
    best = max(cost.launch_cost(m.shape) + cost.matrix_cost(m.shape) for m in matrices)
    holder_sets = {m.holders for m in matrices} | {tuple(sorted({r for m in matrices for r in m.holders}))}
    for ranks in sorted(holder_sets):
        inside = [m for m in matrices if set(m.holders) <= set(ranks)]
        counts: dict[Shape, int] = defaultdict(int)
        for m in inside:
            counts[m.shape] += 1
        work = sum(n * cost.matrix_cost(shape) for shape, n in counts.items())
        bound = max(best, (work + sum(cost.launch_cost(shape) for shape in counts)) / len(ranks))
        for _ in range(64):
            launches = sum(cost.launch_cost(shape) * min(len(ranks), _min_batches(
                n, cost.launch_cost(shape), cost.matrix_cost(shape), bound)) for shape, n in counts.items())
            tighter = (work + launches) / len(ranks)
            if tighter <= bound * (1 + 1e-12):
                break
            bound = tighter
        best = max(best, bound, _pigeonhole_bound(inside, cost, len(ranks)))
    return best


def _pigeonhole_bound(matrices: Sequence[MatrixSpec], cost: CostModel, num_ranks: int) -> float:
    """Among the k·R + 1 costliest matrices some rank gets k + 1, so its load is at least the k + 1 cheapest of
    those plus one launch (what makes 10 equal big matrices on 8 ranks cost two matrices, not 1.25)."""
    costs = sorted((cost.matrix_cost(m.shape) for m in matrices), reverse=True)
    launches = min((cost.launch_cost(m.shape) for m in matrices), default=0.0)
    best, k = 0.0, 1
    while k * num_ranks < len(costs):
        best = max(best, sum(costs[k * num_ranks - k : k * num_ranks + 1]) + launches)
        k += 1
    return best


def plan_lpt(matrices: Sequence[MatrixSpec], cost: CostModel, batch_fraction: float = 1.0) -> tuple[int, ...]:
    """Longest-processing-time greedy, batch-aware.

    Each (shape, holders) class is cut into contiguous batches no longer than `batch_fraction` × the lower
    bound (0: every matrix its own batch). Batches go, biggest first, to the holder whose load grows least
    (a rank that already runs the shape pays no second launch)."""
    target = lower_bound(matrices, cost) * batch_fraction
    classes: dict[tuple[Shape, tuple[int, ...]], list[int]] = {}
    for i, m in enumerate(matrices):
        classes.setdefault((m.shape, m.holders), []).append(i)
    batches = []
    for (shape, holders), members in classes.items():
        launch, work = cost.launch_cost(shape), cost.matrix_cost(shape)
        count = len(members)
        if target > launch + work:
            count = min(count, _min_batches(len(members), launch, work, target))
        for chunk in np.array_split(np.array(members), count):
            batches.append((launch + len(chunk) * work, int(chunk[0]), shape, holders, chunk.tolist()))
    batches.sort(key=lambda b: (-b[0], b[1]))
    loads: dict[int, float] = defaultdict(float)
    shapes_on: dict[int, set[Shape]] = defaultdict(set)
    owners = [-1] * len(matrices)
    for _, _, shape, holders, members in batches:
        work = len(members) * cost.matrix_cost(shape)

        def finish(rank: int) -> tuple[float, float, int]:
            launch = 0.0 if shape in shapes_on[rank] else cost.launch_cost(shape)
            return (loads[rank] + launch + work, loads[rank], rank)

        rank = min(holders, key=finish)
        loads[rank] = finish(rank)[0]
        shapes_on[rank].add(shape)
        for i in members:
            owners[i] = rank
    return tuple(owners)


def plan_milp(
    matrices: Sequence[MatrixSpec], cost: CostModel, time_limit_s: float = 1.0, upper_bound: float | None = None
) -> tuple[tuple[int, ...], float] | None:
    """Min-makespan MILP over per-class counts n[c, r] and launch indicators y[shape, r]; None if no solution.

    `upper_bound` (a known makespan, e.g. LPT's) caps how many matrices of a shape fit on one rank, which
    tightens the LP relaxation a lot. Returns (owners, dual bound). Members of a class go to ranks in input
    order, so each owner receives a contiguous run of layers of that shape."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    classes: dict[tuple[Shape, tuple[int, ...]], list[int]] = {}
    for i, m in enumerate(matrices):
        classes.setdefault((m.shape, m.holders), []).append(i)
    class_keys = list(classes)
    ranks = sorted({r for m in matrices for r in m.holders})
    scale = lower_bound(matrices, cost) or 1.0
    n_index = {(c, r): k for k, (c, r) in enumerate((c, r) for c in range(len(class_keys)) for r in class_keys[c][1])}
    shape_ranks = sorted({(class_keys[c][0], r) for c, r in n_index})
    y_index = {sr: len(n_index) + k for k, sr in enumerate(shape_ranks)}
    t_var = len(n_index) + len(y_index)
    num_vars = t_var + 1

    rows_count = len(class_keys) + len(n_index) + len(ranks)
    a = lil_matrix((rows_count, num_vars))
    lo, hi = np.zeros(rows_count), np.zeros(rows_count)
    row = 0
    for c, (_, holders) in enumerate(class_keys):  # every member placed exactly once
        for r in holders:
            a[row, n_index[(c, r)]] = 1.0
        lo[row] = hi[row] = len(classes[class_keys[c]])
        row += 1
    def fits(c: int) -> float:  # most members of class c one rank can take within the upper bound
        count = len(classes[class_keys[c]])
        if upper_bound is None:
            return float(count)
        shape = class_keys[c][0]
        room = (upper_bound * (1 + 1e-9) - cost.launch_cost(shape)) / max(cost.matrix_cost(shape), 1e-30)
        return float(max(1, min(count, int(np.floor(room)))))

    for (c, r), k in n_index.items():  # a rank that gets any of a shape pays its launch
        a[row, k] = 1.0
        a[row, y_index[(class_keys[c][0], r)]] = -fits(c)
        lo[row], hi[row] = -np.inf, 0.0
        row += 1
    for r in ranks:  # load(r) <= T
        for (c, rr), k in n_index.items():
            if rr == r:
                a[row, k] = cost.matrix_cost(class_keys[c][0]) / scale
        for (shape, rr), k in y_index.items():
            if rr == r:
                a[row, k] = cost.launch_cost(shape) / scale
        a[row, t_var] = -1.0
        lo[row], hi[row] = -np.inf, 0.0
        row += 1

    objective = np.zeros(num_vars)
    objective[t_var] = 1.0
    for (shape, _), k in y_index.items():  # tie-break: among equal makespans prefer fewer, larger batches
        objective[k] = 1e-4 * cost.launch_cost(shape) / scale / max(len(y_index), 1)
    upper = np.full(num_vars, np.inf)
    for (c, r), k in n_index.items():
        upper[k] = fits(c)
    if upper_bound is not None:
        upper[t_var] = upper_bound * (1 + 1e-9) / scale
    for k in y_index.values():
        upper[k] = 1.0
    integrality = np.ones(num_vars)
    integrality[t_var] = 0
    result = milp(
        objective,
        integrality=integrality,
        bounds=Bounds(np.zeros(num_vars), upper),
        constraints=LinearConstraint(a.tocsr(), lo, hi),
        options={"time_limit": float(time_limit_s), "mip_rel_gap": 2e-3, "presolve": True,
                 "node_limit": MILP_NODE_LIMIT},
    )
    if result.x is None:
        return None
    owners = [-1] * len(matrices)
    for c, key in enumerate(class_keys):
        members = iter(classes[key])
        for r in key[1]:
            for _ in range(int(round(result.x[n_index[(c, r)]]))):
                owners[next(members)] = r
    assert all(o >= 0 for o in owners), "MILP counts do not cover every matrix"
    dual = getattr(result, "mip_dual_bound", None)
    if dual is None or not np.isfinite(dual):
        return tuple(owners), 0.0
    tie_break_max = float(sum(objective[k] for k in y_index.values()))
    return tuple(owners), max(0.0, (float(dual) - tie_break_max) * scale)


def improve_owners(
    matrices: Sequence[MatrixSpec], owners: Sequence[int], cost: CostModel, max_rounds: int | None = None
) -> tuple[int, ...]:
    """Deterministic local search on the most loaded rank: the best single move of one of its matrices, else
    the best swap with a matrix of another shape elsewhere, while that lowers the pair's max load.

    Repairs what greedy orders and time-limited solvers leave behind (a stray launch, an unlucky big item)."""
    owners = list(owners)
    work = {m.shape: cost.matrix_cost(m.shape) for m in matrices}
    launch = {m.shape: cost.launch_cost(m.shape) for m in matrices}
    loads = rank_loads(matrices, owners, cost)
    on_rank: dict[int, dict[tuple, list[int]]] = defaultdict(lambda: defaultdict(list))  # rank -> class -> members
    for i, (spec, owner) in enumerate(zip(matrices, owners)):
        on_rank[owner][(spec.shape, spec.holders)].append(i)
    count: dict[tuple[int, Shape], int] = defaultdict(int)
    for spec, owner in zip(matrices, owners):
        count[(owner, spec.shape)] += 1

    def removed(rank: int, shape: Shape) -> float:
        return loads[rank] - work[shape] - (launch[shape] if count[(rank, shape)] == 1 else 0.0)

    def added(load: float, rank: int, shape: Shape) -> float:
        return load + work[shape] + (0.0 if count[(rank, shape)] else launch[shape])

    for _ in range(max_rounds if max_rounds is not None else 4 * len(matrices)):
        src = max(sorted(loads), key=lambda r: loads[r])
        last = {r: {key: members[-1] for key, members in classes.items() if members} for r, classes in on_rank.items()}
        best = None  # (new pair max, dst, i, j or -1)
        for (shape, holders), i in sorted(last[src].items()):
            for dst in holders:
                if dst == src:
                    continue
                pair = max(removed(src, shape), added(loads[dst], dst, shape))
                if pair < loads[src] * (1 - 1e-12) and (best is None or (pair, dst, i, -1) < best):
                    best = (pair, dst, i, -1)
        if best is None:
            for (shape, holders), i in sorted(last[src].items()):
                for dst in holders:
                    for (other, other_holders), j in sorted(last.get(dst, {}).items()) if dst != src else ():
                        if other == shape or src not in other_holders:
                            continue
                        new_src = added(removed(src, shape), src, other)
                        new_dst = added(removed(dst, other), dst, shape)
                        pair = max(new_src, new_dst)
                        if pair < loads[src] * (1 - 1e-12) and (best is None or (pair, dst, i, j) < best):
                            best = (pair, dst, i, j)
        if best is None:
            break
        _, dst, i, j = best
        moves = [(i, src, dst)] + ([(j, dst, src)] if j >= 0 else [])
        for index, old, new in moves:
            spec = matrices[index]
            loads[old] = removed(old, spec.shape)
            loads[new] = added(loads[new], new, spec.shape)
            count[(old, spec.shape)] -= 1
            count[(new, spec.shape)] += 1
            on_rank[old][(spec.shape, spec.holders)].remove(index)
            on_rank[new][(spec.shape, spec.holders)].append(index)
            owners[index] = new
    return tuple(owners)


def plan_owners(
    matrices: Iterable[MatrixSpec],
    cost: CostModel | None = None,
    method: str = "auto",
    time_limit_s: float = 1.0,
    max_milp_vars: int = 20000,
) -> OwnerPlan:
    """Assign every matrix an owner among its holders, minimizing the most loaded rank's predicted time.

    method: "milp", "lpt", or "auto" (MILP when small enough and scipy is installed, else LPT; the better of the
    two is kept)."""
    matrices = tuple(matrices)
    cost = CachedCost(cost or AnalyticCost())
    if method not in ("auto", "milp", "lpt"):
        raise ValueError(f"method must be 'auto', 'milp' or 'lpt', got {method!r}")
    names = [m.name for m in matrices]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"matrix names must be unique; repeated: {dupes[:5]}")
    bound = lower_bound(matrices, cost)
    if not matrices:
        return OwnerPlan((), (), {}, 0.0, 0.0, "empty")

    greedy = [improve_owners(matrices, plan_lpt(matrices, cost, fraction), cost) for fraction in LPT_BATCH_FRACTIONS]
    lpt = min(greedy, key=lambda owners: max(rank_loads(matrices, owners, cost).values()))
    candidates = [("lpt", lpt)]
    num_vars = len({(m.shape, m.holders, r) for m in matrices for r in m.holders}) * 2 + 1
    if method == "auto" and importlib.util.find_spec("scipy") is None:  # pragma: no cover - scipy is a dependency
        method = "lpt"
    if method == "milp" or (method == "auto" and num_vars <= max_milp_vars):
        upper = max(rank_loads(matrices, lpt, cost).values())
        solved = plan_milp(matrices, cost, time_limit_s, upper_bound=upper)
        if solved is not None:
            candidates.insert(0, ("milp", improve_owners(matrices, solved[0], cost)))  # first: wins ties
            bound = max(bound, solved[1])
    scored = [(max(rank_loads(matrices, o, cost).values()), k, name, o) for k, (name, o) in enumerate(candidates)]
    makespan, _, chosen, owners = min(scored)
    return OwnerPlan(matrices, owners, rank_loads(matrices, owners, cost), makespan, min(bound, makespan), chosen)
