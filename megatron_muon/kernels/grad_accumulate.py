"""`main_grad += grad` for megatron's fp32 gradient buffers in one vectorized Triton pass (mixed dtypes send
`Tensor.add_` through TensorIterator's non-vectorized path)."""

from __future__ import annotations

import functools

import torch

_BLOCK = 4096
_HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _triton_add():
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(dst, src, numel, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        total = tl.load(src + offsets, mask=inside).to(tl.float32)
        if ACCUMULATE:
            total += tl.load(dst + offsets, mask=inside)
        tl.store(dst + offsets, total, mask=inside)

    return add_kernel


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor, overwrite: bool = False) -> None:
    """main_grad += grad (main_grad = grad with `overwrite`); one vectorized Triton pass for contiguous fp32 and
    bf16/fp16 on a GPU, torch elsewhere."""
    fast = (
        main_grad.is_cuda and main_grad.dtype == torch.float32 and grad.dtype in _HALF_DTYPES
        and main_grad.shape == grad.shape and main_grad.is_contiguous() and grad.is_contiguous()
    )
    if not fast:
        main_grad.copy_(grad) if overwrite else main_grad.add_(grad)
        return
    numel = main_grad.numel()
    _triton_add()[(-(-numel // _BLOCK),)](main_grad, grad, numel, BLOCK=_BLOCK, ACCUMULATE=not overwrite,
                                          num_warps=8)
