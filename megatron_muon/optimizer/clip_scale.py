"""Gradient clipping's in-place scale in one Triton launch that skips the work when nothing is clipped.

Megatron clips by multiplying every gradient by min(1, max_norm / norm), kept on the device (`tensor_fallbacks`,
as Transformer Engine does). Most steps of a healthy run are not clipped and x·1 = x exactly, yet the multiply reads
and writes every fp32 gradient (docs/design/optimizer_passes.md). This kernel reads the factor on the device and does
nothing when it is 1; otherwise it computes the same fp32 product as `torch._foreach_mul_` (bit-identical).

The gradients are views into megatron's contiguous grad buffers, so one launch per buffer walks them: blocks are
addressed by element offsets from the lowest gradient in that buffer (a small table, built once per layout and
cached on the device).
"""

from __future__ import annotations

import functools

import torch

from megatron_muon.kernels.triton_math import supported

try:
    import triton
    import triton.language as tl
except ImportError:  # `scale_in_place` declines and the caller keeps torch's foreach multiply
    triton = None

BLOCK = 4096
_PROGRAMS_PER_SM = 64  # the measured best (docs/design/optimizer_passes.md)
_TABLE_CACHE_SIZE = 16


def _block_table(tensors: list[torch.Tensor], base: torch.Tensor) -> torch.Tensor | None:
    """[2, blocks] int64 on the device: each block's first element and its tensor's end, as offsets from `base`;
    None when two tensors overlap (concurrent programs would scale the shared elements in a race)."""
    size = base.element_size()
    offsets = tuple((t.data_ptr() - base.data_ptr()) // size for t in tensors)
    return _cached_block_table(base.device, offsets, tuple(t.numel() for t in tensors))


@functools.lru_cache(maxsize=_TABLE_CACHE_SIZE)
def _cached_block_table(device: torch.device, offsets: tuple[int, ...], numels: tuple[int, ...]):
    spans = sorted(zip(offsets, numels))
    if any(start + numel > next_start for (start, numel), (next_start, _) in zip(spans, spans[1:])):
        return None
    starts = torch.cat([torch.arange(o, o + n, BLOCK, dtype=torch.int64) for o, n in zip(offsets, numels)])
    ends = torch.cat([torch.full((-(-n // BLOCK),), o + n, dtype=torch.int64) for o, n in zip(offsets, numels)])
    return torch.stack([starts, ends]).to(device)


def _programs(device: torch.device, blocks: int) -> int:
    if device.type != "cuda":
        return min(blocks, 4)
    return min(blocks, _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count)


def scale_in_place(tensors: list[torch.Tensor], factor: torch.Tensor) -> bool:
    """tensors *= factor (a one-element fp32 tensor on their device), skipped on the device when factor is 1.

    Returns False without touching anything when the call does not qualify (no Triton, not contiguous fp32
    tensors on a supported device, overlapping tensors, another factor dtype or device); the caller then
    multiplies with torch.
    """
    if not tensors:
        return True
    device = tensors[0].device
    qualifies = (
        triton is not None
        and supported(device)
        and factor.numel() == 1
        and factor.dtype == torch.float32
        and factor.device == device
        and all(t.dtype == torch.float32 and t.device == device and t.is_contiguous() for t in tensors)
    )
    if not qualifies:
        return False
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    groups = [(min(group, key=torch.Tensor.data_ptr), group) for group in by_storage.values()]
    tables = [_block_table(group, base) for base, group in groups]
    if any(table is None for table in tables):
        return False
    factor = factor.reshape(1)
    for (base, _), table in zip(groups, tables):
        blocks = table.size(1)
        _scale_blocks_kernel[(_programs(device, blocks),)](base, factor, table[0], table[1], blocks, BLOCK=BLOCK)
    return True


if triton is not None:

    @triton.jit
    def _scale_blocks_kernel(Base, Factor, Starts, Ends, blocks, BLOCK: tl.constexpr):
        factor = tl.load(Factor)
        if factor != 1.0:  # every program reads the factor first: an unclipped step moves no gradient bytes
            for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
                start = tl.load(Starts + block)
                end = tl.load(Ends + block)
                index = start + tl.arange(0, BLOCK).to(tl.int64)
                inside = index < end
                values = tl.load(Base + index, mask=inside)
                tl.store(Base + index, values * factor, mask=inside)
