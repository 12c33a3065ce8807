"""Tensor-parallel gather/scatter of stacked matrix shards, so Muon's update is the same at any TP size.

Newton–Schulz is not separable across shards: orthogonalizing each TP shard on its own ("blockwise", megatron's
default) gives a different update at every TP size. Gathering the shards of a whole bucket in one collective,
orthogonalizing the full matrices and keeping the local slice makes the result TP-invariant.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# megatron-core's `muon_tp_mode` values. `distributed` (NS with sharded matmuls) computes the same polar factor as
# `duplicated`; both gather here, so the two give identical updates.
TP_MODES = ("duplicated", "distributed", "blockwise")


def gather_tp_shards(stacked: torch.Tensor, group, partition_dim: int) -> torch.Tensor:
    """[b, m_local, n] or [b, m, n_local] shards → the full [b, m, n] stack, concatenated in rank order."""
    shards = [torch.empty_like(stacked) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, stacked.contiguous(), group=group)
    return torch.cat(shards, dim=partition_dim + 1)


def local_tp_shard(full: torch.Tensor, group, partition_dim: int) -> torch.Tensor:
    """This rank's slice of a full [b, m, n] stack along the matrix dim `partition_dim` (contiguous)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return full.chunk(world, dim=partition_dim + 1)[rank].contiguous()
