"""One-pass Triton versions of Muon's elementwise work on a matrix piece, with the torch sequence as fallback.

`momentum_into_slot_` replaces the momentum EMA, the cast to the gradient dtype and the Nesterov lerp into the
stacked Newton–Schulz input (three to five passes over memory) by one read of gradient and buffer and one write of
buffer and slot. `decay_and_update_` replaces the weight-decay multiply and the in-place add of the NS result by
one read-modify-write of the parameter. The torch sequence in `muon_math` is the reference and the fallback: on CPU,
without Triton, or for a dtype or layout the kernels do not cover.

Rounding follows the torch sequence: math in fp32, each value rounded to a tensor's dtype where torch stores it,
lerps and adds as one fma (what torch's CUDA and CPU kernels compute), so fp32 momentum buffers and fp32 parameters
come out bit-identical. Under TRITON_INTERPRET=1 (CPU tests) the interpreter's fma and fp32→bf16 cast are not
the GPU's (two roundings; truncation), so the kernels emulate both exactly there.

Inputs are views [rows, cols], [blocks, rows, cols] or routing's pieces [experts, groups, rows, cols] with unit
column stride and any row/block strides (a 4-D view also needs experts and groups to merge into one block dim,
as they do for a contiguous parameter; anything else takes the fallback); offsets are int64.
"""

from __future__ import annotations

import struct

import torch

from megatron_muon.kernels.triton_math import INTERPRETING, supported
from megatron_muon.optimizer import muon_math

try:
    import triton
    import triton.language as tl

    from megatron_muon.kernels.triton_math import fma, fp32_scalar, product, round_to, through
except ImportError:  # the torch fallback serves every call
    triton = None

COVERED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SETTINGS = ("auto", True, False)


def use_fused(setting, device: torch.device) -> bool:
    """Resolve a `fused_elementwise` setting ("auto", True, False) for tensors on `device`."""
    if setting == "auto":
        return supported(device)
    if setting is True and not supported(device):
        raise ValueError(
            f"fused_elementwise=True needs Triton and CUDA tensors (or TRITON_INTERPRET=1 on CPU); got {device} "
            f"tensors{'' if triton is not None else ' and no Triton'}. Use fused_elementwise='auto' or False"
        )
    return bool(setting)


def check_setting(setting) -> None:
    if not (setting is True or setting is False or setting == "auto"):
        raise ValueError(f"fused_elementwise must be one of {SETTINGS}, got {setting!r}")


def _blocks_rows_cols(t: torch.Tensor) -> tuple[int, int, int] | None:
    """t read as [blocks, rows, cols] (experts and groups of a 4-D piece merged)."""
    if t.ndim == 2:
        return 1, t.shape[0], t.shape[1]
    if t.ndim == 3:
        return t.shape[0], t.shape[1], t.shape[2]
    if t.ndim == 4:
        return t.shape[0] * t.shape[1], t.shape[2], t.shape[3]
    return None


def _strides(t: torch.Tensor) -> tuple[int, int] | None:
    """(block stride, row stride) of t as [blocks, rows, cols], or None when unit column stride or a mergeable
    leading pair is missing, or the dtype is not covered."""
    if t.dtype not in COVERED_DTYPES or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    if t.ndim == 2:
        return 0, t.stride(0)
    if t.ndim == 3:
        return t.stride(0), t.stride(1)
    experts, groups = t.shape[0], t.shape[1]
    if groups == 1:
        return t.stride(0), t.stride(2)
    if experts == 1 or t.stride(0) == groups * t.stride(1):
        return t.stride(1), t.stride(2)
    return None


def _lerp_weight_small(weight: float) -> bool:
    """torch.lerp's formula choice, made on the weight as its kernels see it (fp32)."""
    return abs(struct.unpack("f", struct.pack("f", weight))[0]) < 0.5


def _launch(rows: int, cols: int) -> tuple[tuple[int, int], dict]:
    """Grid and tile: each program covers ROWS×BLOCK ≈ 2048 elements of up to ROWS rows (narrow matrices get
    several rows per program)."""
    block = min(2048, triton.next_power_of_2(cols))
    tile_rows = min(2048 // block, triton.next_power_of_2(rows))
    grid = (triton.cdiv(rows, tile_rows), triton.cdiv(cols, block))
    return grid, dict(ROWS=tile_rows, BLOCK=block, num_warps=max(1, min(8, tile_rows * block // 256)))


def momentum_into_slot_(grad, buffer, slot, *, momentum: float, nesterov: bool, grad_factor=None,
                        store_buffer: bool = True, norm_partials=None) -> bool:
    """buffer ← buffer + (1-β)(grad - buffer) in the buffer's dtype; slot ← the Nesterov blend
    grad + β(buffer - grad) (or the buffer) in the slot's dtype. One pass per piece on the GPU. `grad_factor` (a
    one-element fp32 tensor: megatron's deferred clip) multiplies the gradient as it is read; `grad` is not changed.
    `store_buffer=False` leaves the buffer as it was (a speculative slot: the step stores the EMA later).
    `norm_partials` (fp32, `norm_programs(slot)` elements): each program of the pass writes the sum of squares of
    the slot values it stored, so that Newton–Schulz needs no pass of its own for the slot's Frobenius norm.
    Returns whether the one-pass kernel ran (only then are the partial sums written).

    Equals `muon_math.momentum_buffers_update_` followed by `muon_math.nesterov_into_` on the same tensors (on
    grad·grad_factor, rounded to the gradient's dtype, when a factor is given).
    """
    assert grad.shape == buffer.shape == slot.shape, (grad.shape, buffer.shape, slot.shape)
    geometry = _blocks_rows_cols(grad)
    strides = [_strides(t) for t in (grad, buffer, slot)] if geometry is not None else [None]
    if triton is None or any(s is None for s in strides) or not supported(grad.device) or slot.numel() == 0:
        if grad_factor is not None:
            grad = grad * grad_factor.reshape(())
        if not store_buffer:
            buffer = buffer.clone()
        muon_math.momentum_buffers_update_([grad], [buffer], momentum)
        muon_math.nesterov_into_(grad, buffer, slot, momentum, nesterov)
        return False
    blocks, rows, cols = geometry
    grid, tile = _launch(blocks * rows, cols)
    _check_partials(norm_partials, grid[0] * grid[1])
    ema_weight, blend_weight = 1.0 - momentum, float(momentum)
    _momentum_kernel[grid](
        grad, buffer, slot, blocks * rows, rows, cols, *strides[0], *strides[1], *strides[2], ema_weight,
        blend_weight, grad, buffer, 0, grad if grad_factor is None else grad_factor,
        slot if norm_partials is None else norm_partials,
        EMA_SMALL=_lerp_weight_small(ema_weight), BLEND_SMALL=_lerp_weight_small(blend_weight),
        NESTEROV=bool(nesterov), EMULATE=INTERPRETING, PIECES=False, HAS_FACTOR=grad_factor is not None,
        STORE_BUFFER=bool(store_buffer), NORM=norm_partials is not None, **tile,
    )  # fmt: skip
    return True


def norm_programs(slot: torch.Tensor) -> int | None:
    """How many programs the momentum pass runs over one piece shaped like `slot` (the partial sums it writes);
    None where the pass does not take the piece."""
    geometry = _blocks_rows_cols(slot)
    if triton is None or geometry is None or slot.numel() == 0:
        return None
    grid, _ = _launch(geometry[0] * geometry[1], geometry[2])
    return grid[0] * grid[1]


def _check_partials(norm_partials, programs: int) -> None:
    if norm_partials is not None:
        assert norm_partials.dtype == torch.float32 and norm_partials.is_contiguous(), norm_partials
        assert norm_partials.numel() >= programs, (norm_partials.shape, programs)


def decay_and_update_(target, update, *, decay: float, alpha: float, model=None) -> None:
    """target ← target·decay + alpha·update, computed in fp32 and stored in the target's dtype; `update` (the NS
    result, often narrower) is read as it is; `model` (a 16-bit copy of the target, same shape) ← the new target
    rounded. One pass per piece on the GPU.

    Equals `target.mul_(decay)` followed by `muon_math.apply_updates_` (lr·scale = -alpha) and `model.copy_(target)`
    on the same tensors.
    """
    assert target.shape == update.shape and (model is None or model.shape == target.shape)
    geometry = _blocks_rows_cols(target)
    roles = (target, update) if model is None else (target, update, model)
    strides = [_strides(t) for t in roles] if geometry is not None else [None]
    if triton is None or any(s is None for s in strides) or not supported(target.device):
        if decay != 1.0:
            target.mul_(decay)
        muon_math.apply_updates_([target], [update], lr=-alpha, scale=1.0)
        if model is not None:
            model.copy_(target)
        return
    blocks, rows, cols = geometry
    if blocks * rows * cols == 0:
        return
    grid, tile = _launch(blocks * rows, cols)
    model_strides = strides[2] if model is not None else (0, 0)
    _decay_update_kernel[grid](
        target, update, blocks * rows, rows, cols, *strides[0], *strides[1], float(decay), float(alpha), target, 0,
        target if model is None else model, *model_strides, target, EMULATE=INTERPRETING, PIECES=False,
        HAS_MODEL=model is not None, **tile,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _tile(total_rows, rows, cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's rows as (block, row-in-block) int64 vectors, its columns, and the bounds mask."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = (row < total_rows)[:, None] & (col < cols)[None, :]
        return row // rows, row % rows, col[None, :], mask

    @triton.jit
    def _at(Base, block, row, col, block_stride, row_stride):
        return Base + (block * block_stride + row * row_stride)[:, None] + col

    @triton.jit
    def _lerp(start, end, weight, SMALL: tl.constexpr, EMULATE: tl.constexpr):
        """torch.lerp's two formulas: start + w(end - start) for |w| < 0.5, else end - (end - start)(1 - w)."""
        if SMALL:
            return fma(weight, end - start, start, EMULATE)
        return fma(weight - 1.0, end - start, end, EMULATE)

    @triton.jit
    def _momentum_kernel(
        Grad, Buffer, Slot, total_rows, rows, cols,
        grad_block_stride, grad_row_stride, buffer_block_stride, buffer_row_stride,
        slot_block_stride, slot_row_stride,
        ema_weight, blend_weight, GradOffsets, BufferOffsets, slot_piece_stride, GradFactor, NormPartials,
        EMA_SMALL: tl.constexpr, BLEND_SMALL: tl.constexpr, NESTEROV: tl.constexpr,
        EMULATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PIECES: tl.constexpr,
        HAS_FACTOR: tl.constexpr, STORE_BUFFER: tl.constexpr, NORM: tl.constexpr,
    ):  # fmt: skip
        if PIECES:  # grid axis 2 walks same-geometry pieces: element offsets from Grad / Buffer, slots stacked
            piece = tl.program_id(2)
            Grad += tl.load(GradOffsets + piece)
            Buffer += tl.load(BufferOffsets + piece)
            Slot += piece.to(tl.int64) * slot_piece_stride
        block, row, col, mask = _tile(total_rows, rows, cols, ROWS, BLOCK)
        grad_at = _at(Grad, block, row, col, grad_block_stride, grad_row_stride)
        buffer_at = _at(Buffer, block, row, col, buffer_block_stride, buffer_row_stride)
        grad = tl.load(grad_at, mask=mask).to(tl.float32)
        buffer = tl.load(buffer_at, mask=mask).to(tl.float32)
        ema_weight = fp32_scalar(ema_weight, EMULATE)
        blend_weight = fp32_scalar(blend_weight, EMULATE)
        buffer_dtype: tl.constexpr = Buffer.dtype.element_ty
        grad_dtype: tl.constexpr = Grad.dtype.element_ty
        if HAS_FACTOR:  # the clip megatron would have stored into the gradient: the product in its dtype
            grad = through(product(grad, tl.load(GradFactor), EMULATE), grad_dtype, EMULATE)
        if buffer_dtype != grad_dtype:  # torch lerps the gradient cast to the buffer's dtype
            new = _lerp(buffer, through(grad, buffer_dtype, EMULATE), ema_weight, EMA_SMALL, EMULATE)
        else:
            new = _lerp(buffer, grad, ema_weight, EMA_SMALL, EMULATE)
        stored = round_to(new, buffer_dtype, EMULATE)
        if STORE_BUFFER:
            tl.store(buffer_at, stored, mask=mask)
        new = stored.to(tl.float32)
        if buffer_dtype != grad_dtype:  # ... and blends the buffer cast to the gradient's dtype
            new = through(new, grad_dtype, EMULATE)
        if NESTEROV:  # torch.lerp(out=slot) rounds to the inputs' dtype before the slot's
            new = through(_lerp(grad, new, blend_weight, BLEND_SMALL, EMULATE), grad_dtype, EMULATE)
        slot_at = _at(Slot, block, row, col, slot_block_stride, slot_row_stride)
        slot_value = round_to(new, Slot.dtype.element_ty, EMULATE)
        tl.store(slot_at, slot_value, mask=mask)
        if NORM:  # the stored values' squares, summed per program (Newton–Schulz's Frobenius norm, in parts)
            program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if PIECES:  # each piece's partial sums follow the previous piece's
                program += tl.program_id(2).to(tl.int64) * tl.num_programs(0) * tl.num_programs(1)
            squares = slot_value.to(tl.float32) * slot_value.to(tl.float32)
            tl.store(NormPartials + program, tl.sum(tl.where(mask, squares, 0.0)))

    @triton.jit
    def _decay_update_kernel(
        Target, Update, total_rows, rows, cols,
        target_block_stride, target_row_stride, update_block_stride, update_row_stride,
        decay, alpha, TargetOffsets, update_piece_stride, Model, model_block_stride, model_row_stride, ModelOffsets,
        EMULATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PIECES: tl.constexpr,
        HAS_MODEL: tl.constexpr,
    ):  # fmt: skip
        if PIECES:  # grid axis 2 walks same-geometry pieces: element offsets from Target, updates stacked
            piece = tl.program_id(2)
            Target += tl.load(TargetOffsets + piece)
            Update += piece.to(tl.int64) * update_piece_stride
            if HAS_MODEL:
                Model += tl.load(ModelOffsets + piece)
        block, row, col, mask = _tile(total_rows, rows, cols, ROWS, BLOCK)
        target_at = _at(Target, block, row, col, target_block_stride, target_row_stride)
        update_at = _at(Update, block, row, col, update_block_stride, update_row_stride)
        target = tl.load(target_at, mask=mask).to(tl.float32)
        update = tl.load(update_at, mask=mask).to(tl.float32)
        target_dtype: tl.constexpr = Target.dtype.element_ty
        # torch stores the decayed parameter first, then adds alpha·update in one fma
        decayed = through(target * fp32_scalar(decay, EMULATE), target_dtype, EMULATE)
        new = fma(fp32_scalar(alpha, EMULATE), update, decayed, EMULATE)
        tl.store(target_at, round_to(new, target_dtype, EMULATE), mask=mask)
        if HAS_MODEL:  # the 16-bit model copy of an fp32 master: the stored value rounded, as torch's copy_
            model_at = _at(Model, block, row, col, model_block_stride, model_row_stride)
            tl.store(model_at, round_to(through(new, target_dtype, EMULATE), Model.dtype.element_ty, EMULATE),
                     mask=mask)
