"""Muon gradients reduced straight to the data-parallel row that owns each matrix: a reduce-scatter, not an all-reduce.

Why: `OwnerMuon` reads a matrix's gradient only on its owner's DP row (`comm.gather_to_owners` takes the TP shards
from that row), so all-reducing Muon gradients over data parallelism delivers every byte to every rank for nothing.

Bytes per step and rank, for this rank's Muon gradient shards of N bytes, DP size p, ring collectives:
  all-reduce path:   all-reduce of the gradients 2(p-1)/p·N, then the update all-gather (p-1)/p·N    = 3(p-1)/p·N
  owner path (here): reduce-scatter of the gradients (p-1)/p·N', then the same update all-gather      = 2(p-1)/p·N'
with N' = p·max_r N_r ≥ N the padded owner-ordered buffer (N_r: bytes of the units owned by row r). The padding is
the owner plan's row imbalance within one DDP bucket group; `CommCounter` records the real buffer sizes.

Layout of the buffer: [row 0's units | pad | row 1's units | pad | ...], each unit this rank's TP shard in plan
order. Every rank of a DP group holds the same units with the same local shapes, so the buffer is identical in
layout across the group and the collective is `reduce_scatter_tensor` as is (NCCL; gloo implements it too).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_muon.distributed.comm import CommCounter


class OwnerReduceScatter:
    """Reduce a fixed set of gradient views (one per unit) to the DP row owning each unit.

    After `finish`, the views of units owned by this rank's row hold the reduced gradient; the views of units
    owned elsewhere hold zeros, so gradient norms and zero counts summed over the DP group see every matrix once.
    """

    def __init__(self, views: Sequence[torch.Tensor], owner_rows: Sequence[int], dp_group, counter: CommCounter):
        if len(views) != len(owner_rows):
            raise ValueError(f"{len(views)} gradient views but {len(owner_rows)} owner rows; pass one row per view")
        self.views, self.dp_group, self.counter = list(views), dp_group, counter
        self.dp_size, self.dp_index = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        bad = sorted({r for r in owner_rows if not 0 <= r < self.dp_size})
        if bad:
            raise ValueError(f"owner rows {bad} are outside the data-parallel group of size {self.dp_size}")
        self.rows = [[i for i, r in enumerate(owner_rows) if r == row] for row in range(self.dp_size)]
        self.row_numels = [sum(self.views[i].numel() for i in members) for members in self.rows]
        self.width = max(self.row_numels, default=0)
        self._pending: tuple | None = None

    @property
    def padding(self) -> int:
        """Elements of padding in the buffer (the owner plan's row imbalance for these units)."""
        return self.width * self.dp_size - sum(self.row_numels)

    def _pack(self) -> torch.Tensor:
        flat = self.views[0].new_zeros(self.width * self.dp_size)
        for row, members in enumerate(self.rows):
            if members:
                start = row * self.width
                torch.cat([self.views[i].reshape(-1) for i in members],
                          out=flat[start : start + self.row_numels[row]])
        return flat

    def launch(self, op=dist.ReduceOp.SUM, async_op: bool = False, everywhere: bool = False) -> None:
        """Start the collective. `everywhere=True` all-reduces instead (every rank then holds every reduced
        gradient), for callers that force an all-reduce."""
        assert self._pending is None, "launch called twice without finish"
        if self.width == 0:
            self._pending = (None, None, None, everywhere)
            return
        flat = self._pack()
        if everywhere:
            handle = dist.all_reduce(flat, op=op, group=self.dp_group, async_op=async_op)
            self.counter.record("grad_all_reduce", flat.numel(), flat.element_size())
            self._pending = (handle, flat, None, everywhere)
            return
        mine = flat.new_empty(self.width)
        handle = dist.reduce_scatter_tensor(mine, flat, op=op, group=self.dp_group, async_op=async_op)
        self.counter.record("grad_reduce_scatter", flat.numel(), flat.element_size())
        self._pending = (handle, flat, mine, everywhere)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def finish(self) -> None:
        """Wait, then write the reduced gradients into the owned views and zero the others."""
        assert self._pending is not None, "finish called without launch"
        handle, flat, mine, everywhere = self._pending
        self._pending = None
        if handle is not None:
            handle.wait()
        if flat is None:
            return
        for row, members in enumerate(self.rows):
            if everywhere or row == self.dp_index:
                source = flat[row * self.width :] if everywhere else mine
                offset = 0
                for i in members:
                    view = self.views[i]
                    view.copy_(source[offset : offset + view.numel()].view(view.shape))
                    offset += view.numel()
            else:
                for i in members:
                    self.views[i].zero_()
