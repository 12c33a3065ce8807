"""Moving matrix shards between the ranks of one pipeline stage and the owners that orthogonalize them.

A stage's ranks form a grid: a data-parallel index d and a tensor-parallel index t, slot = d·tp + t. A matrix
owned by slot (d_o, t_o) is assembled from the TP shards of row d_o only (its gradient is only needed there:
`grad_reduce` reduce-scatters gradients so that only the owner's row holds them reduced), and its update travels
back the same way: one all-to-all inside the owner's TP row, then one all-gather across rows. The update goes back
in rounds (one per owner bucket), each a flat buffer, so the message count grows with the number of buckets an
owner holds, not with the number of matrices, and a round travels while the owner computes the next one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


@dataclass(frozen=True)
class UnitShard:
    """One matrix as this rank sees it: its full shape and along which dim (if any) TP splits it evenly."""

    full_shape: tuple[int, int]
    partition_dim: int | None  # None: every TP rank holds the whole matrix

    def local_shape(self, tp_size: int) -> tuple[int, int]:
        if self.partition_dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.partition_dim] //= tp_size
        return shape[0], shape[1]


class CommCounter:
    """Elements and calls handed to each kind of collective on this rank (tests and benchmarks read it).

    Kinds: grad_reduce_scatter (Muon gradients to their owner row), grad_all_reduce (what stays all-reduced in a
    bucket we took over: non-Muon gradients, or everything when megatron forces an all-reduce), grad_all_to_all
    (TP shards to the owner), update_all_to_all / update_all_gather (orthogonalized updates back to every rank).
    """

    def __init__(self):
        self.numel: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, kind: str, numel: int, element_size: int) -> None:
        self.numel[kind] += int(numel)
        self.bytes[kind] += int(numel) * int(element_size)
        self.calls[kind] += 1

    def reset(self) -> None:
        self.numel.clear()
        self.bytes.clear()
        self.calls.clear()


class StageGrid:
    """The DP×TP ranks of one pipeline stage, addressed by slot = dp_index·tp_size + tp_index."""

    def __init__(self, tp_group=None, dp_group=None, device: torch.device | None = None):
        self.tp_group, self.dp_group = tp_group, dp_group
        self.device = device or torch.device("cpu")  # where small control tensors live (NCCL needs the GPU)
        self.tp_size, self.tp_index = _size(tp_group), _rank(tp_group)
        self.dp_size, self.dp_index = _size(dp_group), _rank(dp_group)

    @property
    def num_slots(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def slot(self) -> int:
        return self.dp_index * self.tp_size + self.tp_index

    def row_of(self, slot: int) -> int:
        return slot // self.tp_size

    def column_of(self, slot: int) -> int:
        return slot % self.tp_size

    def all_equal(self, value: int) -> bool:
        """True when every rank of the stage passed the same int64 (min == max over TP, then DP)."""
        lo = torch.tensor([value], dtype=torch.int64, device=self.device)
        hi = lo.clone()
        for group in (self.tp_group, self.dp_group):
            if _size(group) > 1:
                dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
                dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        return int(lo) == int(hi)

    def max_over_stage(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        for group in (self.tp_group, self.dp_group):
            if _size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag)

    def broadcast_from_first_slot(self, values: torch.Tensor) -> torch.Tensor:
        """Slot 0's `values` on every rank (TP row 0 first, then down each DP column)."""
        values = values.to(self.device, copy=True)
        if self.tp_size > 1:
            dist.broadcast(values, dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        if self.dp_size > 1:
            dist.broadcast(values, dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        return values.cpu()


def _all_to_all(send: list[torch.Tensor], recv_numels: list[int], group, like: torch.Tensor) -> list[torch.Tensor]:
    """send[i] (flat) goes to group rank i; returns the flat pieces each group rank sent here."""
    send_numels = [s.numel() for s in send]
    flat_in = torch.cat(send) if send else like.new_empty(0)
    flat_out = like.new_empty(sum(recv_numels))
    dist.all_to_all_single(flat_out, flat_in, recv_numels, send_numels, group=group)
    return list(flat_out.split(recv_numels))


def _all_gather_flat(flat: torch.Tensor, numels: list[int], group) -> list[torch.Tensor]:
    """Every rank's flat buffer (sizes known in advance) through one all-gather of equal, padded buffers
    (gloo rejects unequal sizes; the padding is at most the imbalance between rows)."""
    width = max(numels)
    if width == 0:
        return [flat.new_empty(0) for _ in numels]
    padded = flat.new_zeros(width)
    padded[: flat.numel()] = flat
    parts = [flat.new_empty(width) for _ in numels]
    dist.all_gather(parts, padded, group=group)
    return [part[:n] for part, n in zip(parts, numels)]


def gather_to_owners(
    grid: StageGrid, units: Sequence[UnitShard], owners: Sequence[int], local: Sequence[torch.Tensor],
    counter: CommCounter | None = None,
) -> dict[int, torch.Tensor]:
    """Full matrices of the units this rank owns, from every rank's local [rows, cols] shards.

    `local[u]` is this rank's shard of unit u (all units, same order on every rank). Returns {u: full matrix}
    for the units whose owner is this rank's slot."""
    me, row, tp = grid.slot, grid.dp_index, grid.tp_size
    mine = [u for u, o in enumerate(owners) if o == me]
    if tp == 1:
        return {u: local[u] for u in mine}
    like = local[0] if local else torch.empty(0)
    sharded_to = [[] for _ in range(tp)]  # per TP peer: units it owns that TP splits
    for u, owner in enumerate(owners):
        if grid.row_of(owner) == row and units[u].partition_dim is not None:
            sharded_to[grid.column_of(owner)].append(u)
    send = [torch.cat([local[u].reshape(-1).to(like.dtype) for u in us]) if us else like.new_empty(0)
            for us in sharded_to]
    mine_sharded = sharded_to[grid.tp_index]
    per_peer = sum(local[u].numel() for u in mine_sharded)
    received = _all_to_all(send, [per_peer] * tp, grid.tp_group, like)
    if counter is not None:
        counter.record("grad_all_to_all", sum(s.numel() for s in send), like.element_size())
    full = {u: local[u] for u in mine if units[u].partition_dim is None}
    offsets = [0] * tp
    for u in mine_sharded:
        shape, numel = local[u].shape, local[u].numel()
        shards = []
        for peer in range(tp):
            shards.append(received[peer][offsets[peer] : offsets[peer] + numel].view(shape))
            offsets[peer] += numel
        full[u] = torch.cat(shards, dim=units[u].partition_dim)
    return full


class UpdateDelivery:
    """Owners' full results (orthogonalized updates, momentum) back to every rank as local shards, in rounds.

    Round k carries the units passed to the k-th `launch`; every rank of the stage must launch the same rounds
    with the same unit lists (the plan makes them known everywhere). Inside the owner's TP row the shards move by
    one all-to-all; across rows by one all-gather that is asynchronous, so an owner can orthogonalize its next
    bucket while the previous one travels. `arrived` hands back the rounds that are done, so that a caller can apply
    and free them while later rounds travel (holding every round at once costs a full fp32 copy of all updates);
    `finish` waits for every round and returns each unit's local shard.
    """

    def __init__(self, grid: StageGrid, units: Sequence[UnitShard], owners: Sequence[int], like: torch.Tensor,
                 counter: CommCounter | None = None):
        self.grid, self.units, self.owners, self.like = grid, units, owners, like
        self.counter = counter
        self.local_shapes = [unit.local_shape(grid.tp_size) for unit in units]
        self._pending: list[tuple] = []  # per launched round: (handle, gathered, row_units, width, direct parts)
        self._delivered = [False] * len(units)

    def _numel(self, u: int) -> int:
        rows, cols = self.local_shapes[u]
        return rows * cols

    def _row_exchange(self, round_units: Sequence[int], owned: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """This TP row's local shards of the round's units owned in this row (one all-to-all inside the row)."""
        grid, like, tp = self.grid, self.like, self.grid.tp_size
        me, row = grid.slot, grid.dp_index
        if tp == 1:
            return {u: owned[u].to(like.dtype) for u in round_units if self.owners[u] == me}
        from_peer = [[u for u in round_units if self.owners[u] == row * tp + peer] for peer in range(tp)]
        if not any(from_peer):
            return {}
        send = []
        for peer in range(tp):
            pieces = [(owned[u] if self.units[u].partition_dim is None
                       else owned[u].chunk(tp, dim=self.units[u].partition_dim)[peer]).reshape(-1).to(like.dtype)
                      for u in from_peer[grid.tp_index]]
            send.append(torch.cat(pieces) if pieces else like.new_empty(0))
        numels = [sum(self._numel(u) for u in us) for us in from_peer]
        received = _all_to_all(send, numels, grid.tp_group, like)
        if self.counter is not None:
            self.counter.record("update_all_to_all", sum(numels), like.element_size())
        row_parts = {}
        for peer, us in enumerate(from_peer):
            offset = 0
            for u in us:
                n = self._numel(u)
                row_parts[u] = received[peer][offset : offset + n].view(self.local_shapes[u])
                offset += n
        return row_parts

    def launch(self, round_units: Sequence[int], owned: dict[int, torch.Tensor]) -> None:
        """Start delivering `round_units` (this rank passes the full results of those it owns in `owned`)."""
        grid = self.grid
        row_parts = self._row_exchange(round_units, owned)
        if grid.dp_size == 1:
            self._pending.append((None, None, [], 0, row_parts))
            return
        row_units = [[u for u in round_units if grid.row_of(self.owners[u]) == r] for r in range(grid.dp_size)]
        numels = [sum(self._numel(u) for u in us) for us in row_units]
        width = max(numels)
        if width == 0:
            return
        padded = self.like.new_empty(width)  # the padding is sent but never read
        mine = [row_parts[u].reshape(-1) for u in row_units[grid.dp_index]]
        if mine:
            torch.cat(mine, out=padded[: numels[grid.dp_index]])
        gathered = self.like.new_empty(width * grid.dp_size)
        handle = dist.all_gather_into_tensor(gathered, padded, group=grid.dp_group, async_op=True)
        if self.counter is not None:
            self.counter.record("update_all_gather", gathered.numel(), gathered.element_size())
        self._pending.append((handle, gathered, row_units, width, {}))

    def arrived(self, keep: int = 0) -> dict[int, torch.Tensor]:
        """{unit: local shard} of every launched round but the newest `keep` (which may still travel); each round
        is handed back once. The current stream waits for them; the CPU does not."""
        split = max(len(self._pending) - keep, 0)
        done, self._pending = self._pending[:split], self._pending[split:]
        parts: dict[int, torch.Tensor] = {}
        for handle, gathered, row_units, width, direct in done:
            parts.update(direct)
            if handle is not None:
                handle.wait()
            for r, us in enumerate(row_units):
                offset = r * width
                for u in us:
                    n = self._numel(u)
                    parts[u] = gathered[offset : offset + n].view(self.local_shapes[u])
                    offset += n
        for u in parts:
            assert not self._delivered[u], f"unit {u} was delivered twice"
            self._delivered[u] = True
        return parts

    def finish(self) -> list[torch.Tensor]:
        """Every unit's local shard, once all launched rounds have arrived (none may have been taken by `arrived`)."""
        parts = self.arrived()
        missing = [u for u in range(len(self.units)) if u not in parts]
        assert not missing, f"units {missing[:5]} were never launched or were already handed back"
        return [parts[u] for u in range(len(self.units))]

    def undelivered(self) -> list[int]:
        return [u for u, done in enumerate(self._delivered) if not done]


def scatter_from_owners(
    grid: StageGrid, units: Sequence[UnitShard], owners: Sequence[int], owned: dict[int, torch.Tensor],
    like: torch.Tensor, counter: CommCounter | None = None,
) -> list[torch.Tensor]:
    """Inverse of `gather_to_owners`: every rank's local [rows, cols] shard of every unit, from the owners' full
    matrices `owned` ({u: full}); dtype of `like`. One round of `UpdateDelivery`."""
    delivery = UpdateDelivery(grid, units, owners, like, counter)
    delivery.launch(range(len(units)), owned)
    return delivery.finish()
