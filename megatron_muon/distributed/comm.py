"""The data- × tensor-parallel ranks of one pipeline stage, for the few small collectives owner planning needs."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


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
