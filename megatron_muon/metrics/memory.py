"""What each rank holds for training: optimizer state, parameters, gradient buffers, and the device peak.

`measured_memory` reads the real tensors of a built model and optimizer (every distinct storage counted once);
`predicted_memory` derives the same figures from megatron's parameter layout alone, so a 7B model can be accounted
on the meta device. Both count optimizer state as fp32 masters (where the parameters are 16-bit), momentum and
Adam moments.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class RankMemory:
    optimizer_state_bytes: int
    param_bytes: int
    grad_bytes: int
    peak_bytes: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device.type, tensor.untyped_storage().data_ptr())


def _leaves(optimizer) -> list:
    children = getattr(optimizer, "chained_optimizers", None)
    return [leaf for child in children for leaf in _leaves(child)] if children is not None else [optimizer]


def _optimizer_tensors(leaf) -> list[torch.Tensor]:
    """State tensors and fp32 master copies a megatron optimizer leaf holds (views into model buffers included;
    the caller drops those)."""
    tensors = []
    inner = getattr(leaf, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
        for group in getattr(leaf, name, None) or []:
            tensors += [t for t in group if isinstance(t, torch.Tensor)]
    return tensors


def _model_storages(model_chunks) -> tuple[dict, dict]:
    """{storage: bytes} of the parameters (DDP's param buffers where they exist) and of the gradient buffers."""
    params, grads = {}, {}
    for chunk in model_chunks:
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            if getattr(buffer, "param_data", None) is not None:
                params[_storage_key(buffer.param_data)] = buffer.param_data.untyped_storage().nbytes()
            grads[_storage_key(buffer.grad_data)] = buffer.grad_data.untyped_storage().nbytes()
        for param in chunk.parameters():
            key = _storage_key(param)
            if key not in params and key not in grads:
                params[key] = param.untyped_storage().nbytes()
    return params, grads


def measured_memory(model_chunks, optimizer) -> RankMemory:
    """This rank's bytes, from the tensors themselves."""
    params, grads = _model_storages(model_chunks)
    state = {}
    for leaf in _leaves(optimizer):
        for tensor in _optimizer_tensors(leaf):
            key = _storage_key(tensor)
            if key not in params and key not in grads:
                state[key] = tensor.untyped_storage().nbytes()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and _on_cuda(model_chunks) else None
    return RankMemory(sum(state.values()), sum(params.values()), sum(grads.values()), peak)


def _on_cuda(model_chunks) -> bool:
    return any(p.is_cuda for chunk in model_chunks for p in chunk.parameters())


def memory_record(model_chunks, optimizer) -> dict:
    """{"optimizer_state_bytes": [...], "param_bytes": [...], "grad_bytes": [...], "peak_bytes": [...]}: one entry
    per rank of the world (collective)."""
    mine = measured_memory(model_chunks, optimizer).as_dict()
    everyone = [mine]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
    return {key: [rank[key] for rank in everyone] for key in mine}


def busiest_rank(record: dict) -> int:
    """The rank holding the most (optimizer state + parameters + gradients)."""
    totals = [sum(record[k][r] for k in ("optimizer_state_bytes", "param_bytes", "grad_bytes"))
              for r in range(len(record["param_bytes"]))]
    return max(range(len(totals)), key=totals.__getitem__)


def predicted_memory(full_param_layout, dp_rank: int, dp: int, param_bytes: int = 2, grad_bytes: int = 4,
                     master_bytes: int = 4, muon_state_bytes: int = 4, adam_state_bytes: int = 8) -> RankMemory:
    """The bytes one data-parallel rank holds with this layout: every rank keeps the whole 16-bit parameter and fp32
    gradient buffers; owners keep a Muon matrix's master and momentum; a distributed-optimizer shard keeps the
    master and Adam moments of the elements in it. `param_bytes`: 2 for bf16, 4 for fp32 (then no masters)."""
    masters = master_bytes if param_bytes < 4 else 0
    buffer_numel = state = 0
    for key, layout in full_param_layout.layouts.items():
        total = layout.bucket_indices[-1][1] if layout.bucket_indices else 0
        buffer_numel += total
        for start, end in layout.bucket_indices:
            shard = (end - start) // dp
            lo, hi = start + dp_rank * shard, start + (dp_rank + 1) * shard
            inside = sum(max(0, min(e, hi) - max(s, lo)) for s, e, b in layout.param_index_map.values()
                         if layout.bucket_indices[b] == (start, end))
            per_element = masters + (muon_state_bytes if key.is_managed_by_layer_wise_optimizer else adam_state_bytes)
            state += inside * per_element
    return RankMemory(state, buffer_numel * param_bytes, buffer_numel * grad_bytes)
