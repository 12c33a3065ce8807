"""`fused_elementwise`'s passes over many same-geometry pieces in ONE launch each.

A Muon step runs the momentum pass and the decay+update pass once per matrix piece: about 400 Triton launches for
the hybrid-1.5B, each costing the CPU more than the GPU needs to run it, so the GPU waits
(docs/design/optimizer_passes.md). Pieces of one shape bucket share their geometry, so one launch can walk them on a
third grid axis: each piece's grad, buffer or target is found by an element offset from the first piece's (a small
int64 table on the device, built once per layout and cached), and its slot or update, which are evenly spaced in the
stacked NS input or result, by a fixed stride.

Same kernels, same rounding as the per-piece passes. Returns False without touching anything when the pieces do not
qualify (other geometry, strides or dtypes, not consecutive, no Triton); callers then go piece by piece.
"""

from __future__ import annotations

import functools

import torch

from megatron_muon.optimizer import fused_elementwise as single

_TABLE_CACHE_SIZE = 256
_MAX_PIECES = 65535  # CUDA's limit on the grid's third axis, which walks the pieces


@functools.lru_cache(maxsize=_TABLE_CACHE_SIZE)
def _device_table(device: torch.device, values: tuple[int, ...]) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, built once per distinct tuple (the key is the values themselves,
    so a hit is always right)."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def _offset_table(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Element offsets of each tensor from the first, as an int64 device tensor (cached); None when an offset is
    not a whole number of elements."""
    base, size = tensors[0].data_ptr(), tensors[0].element_size()
    if any((t.data_ptr() - base) % size for t in tensors):
        return None
    return _device_table(tensors[0].device, tuple((t.data_ptr() - base) // size for t in tensors))


def _same_layout(tensors: list[torch.Tensor]) -> bool:
    first = tensors[0]
    return all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype for t in tensors)


def _even_spacing(tensors: list[torch.Tensor]) -> int | None:
    """Elements from each tensor's start to the next one's, when that is one constant (slices of one stacked
    tensor, in order); else None."""
    size, base = tensors[0].element_size(), tensors[0].data_ptr()
    step = (tensors[1].data_ptr() - base) // size
    if step <= 0 or any(t.data_ptr() != base + i * step * size for i, t in enumerate(tensors)):
        return None
    return step


def _qualify(varied: list[list[torch.Tensor]], stacked: list[torch.Tensor]):
    """(geometry, strides per role, offset tables of the `varied` roles, spacing of `stacked`) when one launch can
    cover the pieces, else None."""
    first = varied[0][0]
    if single.triton is None or not 2 <= len(stacked) <= _MAX_PIECES or first.numel() == 0 \
            or not single.supported(first.device):
        return None
    if not all(_same_layout(role) for role in (*varied, stacked)):
        return None
    geometry = single._blocks_rows_cols(first)
    strides = [single._strides(role[0]) for role in (*varied, stacked)]
    spacing = _even_spacing(stacked)
    if geometry is None or spacing is None or any(s is None for s in strides):
        return None
    tables = [_offset_table(role) for role in varied]
    return None if any(t is None for t in tables) else (geometry, strides, tables, spacing)


def momentum_into_slots_(grads, buffers, slots, *, momentum: float, nesterov: bool, grad_factor=None,
                         store_buffer: bool = True, norm_partials=None) -> bool:
    """`fused_elementwise.momentum_into_slot_` on every (grad, buffer, slot) triple in one launch; `slots` must
    be evenly spaced slices of one stacked tensor. False (nothing done) when the pieces do not qualify.
    `norm_partials`: the pieces' partial sums of squares one after another (`norm_programs` per piece)."""
    qualified = _qualify([list(grads), list(buffers)], list(slots))
    if qualified is None:
        return False
    (blocks, rows, cols), strides, (grad_offsets, buffer_offsets), slot_spacing = qualified
    grid, tile = single._launch(blocks * rows, cols)
    single._check_partials(norm_partials, grid[0] * grid[1] * len(grads))
    ema_weight, blend_weight = 1.0 - momentum, float(momentum)
    single._momentum_kernel[(*grid, len(grads))](
        grads[0], buffers[0], slots[0], blocks * rows, rows, cols, *strides[0], *strides[1], *strides[2],
        ema_weight, blend_weight, grad_offsets, buffer_offsets, slot_spacing,
        grads[0] if grad_factor is None else grad_factor, slots[0] if norm_partials is None else norm_partials,
        EMA_SMALL=single._lerp_weight_small(ema_weight), BLEND_SMALL=single._lerp_weight_small(blend_weight),
        NESTEROV=bool(nesterov), EMULATE=single.INTERPRETING, PIECES=True, HAS_FACTOR=grad_factor is not None,
        STORE_BUFFER=bool(store_buffer), NORM=norm_partials is not None, **tile,
    )  # fmt: skip
    return True


def decay_and_update_pieces_(targets, updates, *, decay: float, alpha: float, models=None) -> bool:
    """`fused_elementwise.decay_and_update_` on every (target, update[, model]) in one launch; `updates` must be
    evenly spaced slices of one tensor (the NS result). False (nothing done) when the pieces do not qualify."""
    varied = [list(targets)] if models is None else [list(targets), list(models)]
    qualified = _qualify(varied, list(updates))
    if qualified is None:
        return False
    (blocks, rows, cols), strides, tables, update_spacing = qualified
    model_strides, model_offsets = (strides[1], tables[1]) if models is not None else ((0, 0), tables[0])
    grid, tile = single._launch(blocks * rows, cols)
    single._decay_update_kernel[(*grid, len(targets))](
        targets[0], updates[0], blocks * rows, rows, cols, *strides[0], *strides[-1], float(decay), float(alpha),
        tables[0], update_spacing, targets[0] if models is None else models[0], *model_strides, model_offsets,
        EMULATE=single.INTERPRETING, PIECES=True, HAS_MODEL=models is not None, **tile,
    )  # fmt: skip
    return True


def decay_and_update_all_(targets, updates, models, *, decay: float, alpha: float) -> None:
    """`decay_and_update_pieces_` where the pieces qualify (and all or none of them have a model copy; None: none),
    else `fused_elementwise.decay_and_update_` piece by piece."""
    copies = sum(model is not None for model in models)
    if copies in (0, len(models)) and decay_and_update_pieces_(targets, updates, decay=decay, alpha=alpha,
                                                               models=models if copies else None):
        return
    for target, update, model in zip(targets, updates, models):
        single.decay_and_update_(target, update, decay=decay, alpha=alpha, model=model)


def runs_by_group(items: list[tuple]) -> list[tuple[int, list[tuple]]]:
    """(group, [fields...]) items as runs of consecutive items of one group: (group, [fields, ...]) each."""
    runs: list[tuple[int, list[tuple]]] = []
    for group, *fields in items:
        if not runs or runs[-1][0] != group:
            runs.append((group, []))
        runs[-1][1].append(tuple(fields))
    return runs
