"""Triton helpers the package's elementwise kernels share: torch's roundings, products never contracted into a
later add, and the interpreter switch (TRITON_INTERPRET=1 runs the kernels on CPU tensors, where the CPU tests
compare them with torch bit for bit)."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # every caller has a torch path
    triton = None

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def supported(device: torch.device) -> bool:
    """The Triton passes run here: CUDA tensors with Triton, or CPU tensors under TRITON_INTERPRET=1."""
    if triton is None:
        return False
    return device.type == "cpu" if INTERPRETING else device.type == "cuda"


if triton is not None:

    @triton.jit
    def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
        """fp32 `x` rounded to nearest-even in DTYPE (the interpreter's own fp32→bf16 cast truncates)."""
        if EMULATE and DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            nearest = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(x == x, nearest, (bits >> 16) | 0x40)
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x.to(DTYPE)

    @triton.jit
    def through(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
        """fp32 `x` as torch sees it after storing it in DTYPE and reading it back."""
        if DTYPE == tl.float32:
            return x
        return round_to(x, DTYPE, EMULATE).to(tl.float32)

    @triton.jit
    def fma(a, b, c, EMULATE: tl.constexpr):
        """a·b + c with one rounding (the interpreter multiplies and adds in fp32; fp64 holds a·b exactly)."""
        if EMULATE:
            return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
        return tl.fma(a, b, c)

    @triton.jit
    def product(a, b, EMULATE: tl.constexpr):
        """a·b rounded by itself, as a separate multiply kernel stores it: never contracted into a later add."""
        if EMULATE:
            return a * b
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, tl.broadcast_to(b, a.shape)],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def fp32_scalar(x, EMULATE: tl.constexpr):
        """A float kernel argument in fp32 (the interpreter passes Python floats, which would compute in fp64)."""
        if EMULATE:
            return tl.full([1, 1], x, tl.float32)
        return x
