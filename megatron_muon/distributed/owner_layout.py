"""Owner-ordered gradient buckets: which data-parallel rank owns each Muon matrix, and where it sits in DDP's buffer.

megatron's DDP reduce-scatters each bucket in `dp` equal shards. If every matrix lies whole inside the shard of its
owner, the reduce-scatter itself delivers each owner its reduced gradients (no packing copy) and the parameter
all-gather brings every owner's updated 16-bit matrices back (megatron's layer-wise layout has this property too;
it balances element counts per bucket). Here the owners balance the predicted Newton–Schulz time instead, knowing
the order in which buckets finish in the backward: work of an early bucket can run while the backward goes on, so
the plan minimizes the latest finish time over ranks with each bucket released when its gradients arrive.

Pure Python + scipy (no torch.distributed), identical on every rank for identical inputs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

PARAM_ALIGNMENT = 64  # megatron's parameter start alignment inside a buffer (`pad_param_start`)
MAX_PADDING = 0.03  # a bucket grows until whole matrices fill its dp shards to within this share
MILP_NODE_LIMIT = 400


@dataclass(frozen=True)
class LayoutItem:
    """One parameter of a Muon buffer, in the buffer's (forward) order.

    `kind` groups parameters that cost the same and batch together (e.g. their matrix shapes); `cost` is its
    Newton–Schulz time on the owner, `launch` the extra cost of the first parameter of its kind in a bucket."""

    name: str
    numel: int
    kind: tuple
    cost: float
    launch: float = 0.0


@dataclass(frozen=True)
class OwnerLayout:
    """Buckets (item indices, first finished first), each item's owner and [start, end) in the buffer."""

    buckets: tuple[tuple[int, ...], ...]
    owners: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    bucket_ranges: tuple[tuple[int, int], ...]
    finish_s: dict[int, float]  # predicted time each rank finishes its Newton–Schulz work (release times included)
    method: str
    work_s: dict[int, float] | None = None  # each rank's predicted Newton–Schulz time, releases left out

    @property
    def makespan_s(self) -> float:
        return max(self.finish_s.values(), default=0.0)

    def bucket_of(self) -> list[int]:
        where = [0] * len(self.owners)
        for b, members in enumerate(self.buckets):
            for i in members:
                where[i] = b
        return where

    def padding(self) -> int:
        """Elements of the buffer that hold no parameter."""
        used = sum(end - start for start, end in self.ranges)
        return (self.bucket_ranges[-1][1] if self.bucket_ranges else 0) - used


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def packed_shard_size(sizes: list[int], dp: int) -> int:
    """Largest shard when `sizes` go, largest first, to the emptiest of dp shards (a feasible packing)."""
    shards = [0] * dp
    for size in sorted(sizes, reverse=True):
        shards[shards.index(min(shards))] += size
    return max(shards)


def form_buckets(numels: list[int], bucket_size: int | None, dp: int, max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Contiguous runs of item indices in backward order (last item first). A bucket closes once it holds
    `bucket_size` elements and its whole items pack into dp shards with at most `max_padding` of it left empty
    (megatron's layer-wise rule closes at dp × 0.9 × its largest item, which leaves more of a bucket empty:
    docs/design/distributed.md)."""
    buckets, chunk, sizes = [], [], []
    for index in reversed(range(len(numels))):
        chunk.append(index)
        sizes.append(_pad(numels[index], PARAM_ALIGNMENT))
        if bucket_size is not None and sum(sizes) >= bucket_size \
                and dp * packed_shard_size(sizes, dp) <= (1 + max_padding) * sum(sizes):
            buckets.append(chunk)
            chunk, sizes = [], []
    if chunk and buckets and dp * packed_shard_size(sizes, dp) > (1 + max_padding) * sum(sizes):
        buckets[-1].extend(chunk)  # a remainder that packs badly joins the bucket before it
    elif chunk:
        buckets.append(chunk)
    return buckets


def _capacities(items, buckets, dp) -> list[int]:
    """Room per shard of each bucket: the even share plus MAX_PADDING, never below a feasible packing."""
    caps = []
    for members in buckets:
        sizes = [_pad(items[i].numel, PARAM_ALIGNMENT) for i in members]
        caps.append(max(packed_shard_size(sizes, dp), math.ceil((1 + MAX_PADDING) * sum(sizes) / dp)))
    return caps


def finish_times(items, buckets, owners, dp, release_s) -> dict[int, float]:
    """Each rank runs its buckets in arrival order, a bucket no earlier than its release; one launch per kind
    per bucket."""
    finish = {r: 0.0 for r in range(dp)}
    for b, members in enumerate(buckets):
        load = defaultdict(float)
        seen = set()
        for i in members:
            r = owners[i]
            load[r] += items[i].cost + (items[i].launch if (r, items[i].kind) not in seen else 0.0)
            seen.add((r, items[i].kind))
        for r, work in load.items():
            finish[r] = max(finish[r], release_s[b]) + work
    return finish


def _greedy(items, buckets, dp, caps, release_s) -> list[int]:
    """Per bucket in arrival order, largest first: the rank that finishes earliest with it among those with room
    (else the emptiest)."""
    owners = [-1] * len(items)
    finish = [0.0] * dp
    for b, members in enumerate(buckets):
        used, kinds = [0] * dp, [set() for _ in range(dp)]
        start = [max(f, release_s[b]) for f in finish]
        for i in sorted(members, key=lambda i: (-items[i].numel, -items[i].cost, i)):
            size = _pad(items[i].numel, PARAM_ALIGNMENT)

            def after(r):
                return start[r] + items[i].cost + (0.0 if items[i].kind in kinds[r] else items[i].launch)

            fitting = [r for r in range(dp) if used[r] + size <= caps[b]]
            r = min(fitting, key=lambda r: (after(r), used[r], r)) if fitting else min(range(dp), key=lambda r: (used[r], r))
            start[r] = after(r)
            used[r] += size
            kinds[r].add(items[i].kind)
            owners[i] = r
        finish = [max(f, s) for f, s in zip(finish, start)]
    return owners


def _improve(items, buckets, owners, dp, caps, release_s, max_rounds: int = 200) -> list[int]:
    """Deterministic local search: the best single move or same-bucket swap of a matrix of the latest-finishing
    rank that lowers the latest finish time and keeps every shard within its room."""
    owners = list(owners)
    bucket_of = [0] * len(items)
    for b, members in enumerate(buckets):
        for i in members:
            bucket_of[i] = b
    used = defaultdict(int)
    for i, r in enumerate(owners):
        used[(bucket_of[i], r)] += _pad(items[i].numel, PARAM_ALIGNMENT)

    def makespan(candidate):
        return max(finish_times(items, buckets, candidate, dp, release_s).values())

    best = makespan(owners)
    for _ in range(max_rounds):
        finish = finish_times(items, buckets, owners, dp, release_s)
        worst = max(range(dp), key=lambda r: (finish[r], r))
        found = None
        for i in (i for i in range(len(items)) if owners[i] == worst):
            b, size = bucket_of[i], _pad(items[i].numel, PARAM_ALIGNMENT)
            for r in range(dp):
                if r == worst:
                    continue
                moves = [(None, size)] + [(j, size - _pad(items[j].numel, PARAM_ALIGNMENT))
                                         for j in buckets[b] if owners[j] == r]
                for j, growth in moves:
                    if used[(b, r)] + growth > caps[b] or used[(b, worst)] - growth > caps[b]:
                        continue
                    trial = list(owners)
                    trial[i] = r
                    if j is not None:
                        trial[j] = worst
                    value = makespan(trial)
                    if value < best * (1 - 1e-9) and (found is None or value < found[0]):
                        found = (value, i, r, j, growth)
        if found is None:
            break
        best, i, r, j, growth = found
        owners[i] = r
        if j is not None:
            owners[j] = worst
        used[(bucket_of[i], r)] += growth
        used[(bucket_of[i], worst)] -= growth
    return owners


def _milp(items, buckets, dp, caps, release_s, upper_bound: float, time_limit_s: float) -> list[int] | None:
    """Min latest finish over per-(bucket, kind) counts per rank, with per-(bucket, rank) room and launch indicators."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    classes: dict[tuple[int, tuple], list[int]] = {}
    for b, members in enumerate(buckets):
        for i in sorted(members):
            classes.setdefault((b, items[i].kind), []).append(i)
    keys = list(classes)
    nc = len(keys)
    x = lambda c, r: c * dp + r  # noqa: E731
    y = lambda c, r: nc * dp + c * dp + r  # noqa: E731
    t_var = 2 * nc * dp
    scale = max(upper_bound, 1e-12)
    rows = []  # (coefficients {var: value}, lo, hi)
    for c, key in enumerate(keys):
        count = len(classes[key])
        rows.append(({x(c, r): 1.0 for r in range(dp)}, count, count))
        for r in range(dp):
            rows.append(({x(c, r): 1.0, y(c, r): -float(count)}, -np.inf, 0.0))
    for b in range(len(buckets)):
        in_bucket = [c for c, key in enumerate(keys) if key[0] == b]
        later = [c for c, key in enumerate(keys) if key[0] >= b]
        for r in range(dp):
            rows.append(({x(c, r): float(_pad(items[classes[keys[c]][0]].numel, PARAM_ALIGNMENT)) for c in in_bucket},
                         -np.inf, float(caps[b])))
            finish = {t_var: -1.0}
            for c in later:
                item = items[classes[keys[c]][0]]
                finish[x(c, r)] = item.cost / scale
                finish[y(c, r)] = item.launch / scale
            rows.append((finish, -np.inf, -release_s[b] / scale))
    a = lil_matrix((len(rows), t_var + 1))
    lo, hi = np.empty(len(rows)), np.empty(len(rows))
    for k, (coefficients, low, high) in enumerate(rows):
        for var, value in coefficients.items():
            a[k, var] = value
        lo[k], hi[k] = low, high
    objective = np.zeros(t_var + 1)
    objective[t_var] = 1.0
    objective[nc * dp: t_var] = 1e-6  # tie-break: fewer batches
    upper = np.zeros(t_var + 1)
    for c, key in enumerate(keys):
        for r in range(dp):
            upper[x(c, r)] = len(classes[key])
            upper[y(c, r)] = 1.0
    upper[t_var] = upper_bound * (1 + 1e-9) / scale
    integrality = np.ones(t_var + 1)
    integrality[t_var] = 0
    result = milp(objective, integrality=integrality, bounds=Bounds(np.zeros(t_var + 1), upper),
                  constraints=LinearConstraint(a.tocsr(), lo, hi),
                  options={"time_limit": float(time_limit_s), "node_limit": MILP_NODE_LIMIT, "mip_rel_gap": 1e-3})
    if result.x is None:
        return None
    owners = [-1] * len(items)
    for c, key in enumerate(keys):
        members = iter(classes[key])
        for r in range(dp):
            for _ in range(int(round(result.x[x(c, r)]))):
                owners[next(members)] = r
    return owners if all(o >= 0 for o in owners) else None


def _place(items, buckets, owners, dp, shard_divisor) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Offsets: each bucket is dp equal shards; shard r holds its owner's items in backward order, 64-aligned."""
    ranges: list[tuple[int, int] | None] = [None] * len(items)
    bucket_ranges = []
    cursor = 0
    for members in buckets:
        per_rank = [[i for i in members if owners[i] == r] for r in range(dp)]
        offsets, sizes = {}, []
        for r, mine in enumerate(per_rank):
            at = 0
            for i in mine:
                at = _pad(at, PARAM_ALIGNMENT)
                offsets[i] = at
                at += items[i].numel
            sizes.append(at)
        shard = _pad(max(max(sizes), 1), shard_divisor)
        for r, mine in enumerate(per_rank):
            for i in mine:
                start = cursor + r * shard + offsets[i]
                ranges[i] = (start, start + items[i].numel)
        bucket_ranges.append((cursor, cursor + dp * shard))
        cursor += dp * shard
    return ranges, bucket_ranges


def plan_owner_layout(items: list[LayoutItem], dp: int, bucket_size: int | None, shard_divisor: int,
                      backward_s_per_element: float = 0.0, method: str = "auto", time_limit_s: float = 2.0,
                      owners: list[int] | None = None) -> OwnerLayout:
    """Buckets, owners and offsets for one Muon buffer of `items` (forward order) over `dp` ranks.

    `backward_s_per_element`: backward time per parameter element, which releases bucket b when the elements of
    the buckets before it are done (0: all at once, which balances total work). `method`: "auto" (the better of the greedy and the MILP), "milp" or "greedy". `owners`: place
    this assignment instead of planning one (a plan computed elsewhere, e.g. broadcast from another rank)."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if method not in ("auto", "milp", "greedy"):
        raise ValueError(f"owner layout method must be 'auto', 'milp' or 'greedy', got {method!r}")
    if shard_divisor % PARAM_ALIGNMENT:
        raise ValueError(f"shard_divisor must be a multiple of {PARAM_ALIGNMENT}, got {shard_divisor}")
    buckets = form_buckets([item.numel for item in items], bucket_size, dp)
    if backward_s_per_element < 0:
        raise ValueError(f"backward_s_per_element must be >= 0, got {backward_s_per_element}")
    done = np.cumsum([0] + [sum(items[i].numel for i in members) for members in buckets[:-1]])
    release = [float(d) * backward_s_per_element for d in done]
    caps = _capacities(items, buckets, dp) if items else []
    if owners is not None:
        if len(owners) != len(items) or any(not 0 <= o < dp for o in owners):
            raise ValueError(f"owners must give each of the {len(items)} items a rank in [0, {dp})")
        owners, chosen = list(owners), "given"
    else:
        owners, chosen = _greedy(items, buckets, dp, caps, release), "greedy"
        if dp > 1 and items:
            owners = _improve(items, buckets, owners, dp, caps, release)
    if chosen == "greedy" and dp > 1 and items and method != "greedy":
        best = max(finish_times(items, buckets, owners, dp, release).values())
        solved = _milp(items, buckets, dp, caps, release, best, time_limit_s)
        if solved is not None and max(finish_times(items, buckets, solved, dp, release).values()) <= best:
            owners, chosen = solved, "milp"
    ranges, bucket_ranges = _place(items, buckets, owners, dp, shard_divisor)
    return OwnerLayout(tuple(map(tuple, buckets)), tuple(owners), tuple(ranges), tuple(bucket_ranges),
                       finish_times(items, buckets, owners, dp, release), chosen,
                       finish_times(items, buckets, owners, dp, [0.0] * len(buckets)))
