"""Gradient accumulation into megatron's fp32 `main_grad` buffers in one vectorized pass.

Megatron's DDP backward hook adds each bf16 weight gradient into its fp32 `main_grad` with `Tensor.add_`. Mixed
dtypes send that through TensorIterator's non-vectorized path: 6.45 ms per step on the H200 for the hybrid-1.5B,
against a ~3.4 ms memory floor (benchmarks/results/e2e_profile_rung4.md). Autograd runs a parameter's
post-accumulate-grad hooks before the hooks on its gradient accumulator, where megatron's sits, so a hook installed
here adds first, with a Triton kernel, and sets `grad_added_to_main_grad`: the flag megatron already honours for
kernels that accumulate into `main_grad` themselves (Transformer Engine's wgrad fusion). Megatron's hook then skips
its add and still drops `param.grad` and signals the bucket; `zero_grad_buffer()` clears the flag every step.
"""

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
    def add_kernel(dst, src, numel, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        total = tl.load(dst + offsets, mask=inside) + tl.load(src + offsets, mask=inside).to(tl.float32)
        tl.store(dst + offsets, total, mask=inside)

    return add_kernel


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """main_grad += grad; one vectorized Triton pass for contiguous fp32 += bf16/fp16 on a GPU, torch elsewhere."""
    fast = (
        main_grad.is_cuda and main_grad.dtype == torch.float32 and grad.dtype in _HALF_DTYPES
        and main_grad.shape == grad.shape and main_grad.is_contiguous() and grad.is_contiguous()
    )
    if not fast:
        main_grad.add_(grad)
        return
    numel = main_grad.numel()
    _triton_add()[(-(-numel // _BLOCK),)](main_grad, grad, numel, BLOCK=_BLOCK, num_warps=8)


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    if param.grad is None or getattr(param, "zero_out_wgrad", False):
        return  # nothing to add, or megatron's hook must overwrite: leave both to it
    accumulate(param.main_grad, param.grad)
    param.grad_added_to_main_grad = True


_HOOKED = "_megatron_muon_main_grad_add"


def install_main_grad_add(ddp_model) -> int:
    """Hook every parameter megatron's DDP accumulates into a `main_grad`; returns how many were newly hooked
    (a second call hooks nothing: two hooks would add every gradient twice)."""
    hooked = 0
    for param in getattr(ddp_model, "params_with_grad", []):
        if getattr(param, _HOOKED, False):
            continue
        if param in ddp_model.param_to_bucket_group and getattr(param, "main_grad", None) is not None:
            param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            setattr(param, _HOOKED, True)
            hooked += 1
    return hooked
