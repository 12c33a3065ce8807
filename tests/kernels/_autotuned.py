"""Two autotuned Triton kernels for the autotune-table tests: one plain, one under heuristics (FLA's pattern)."""

import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps) for block, warps in ((16, 1), (32, 2), (64, 4))]


@triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def double(x, y, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    tl.store(y + offsets, tl.load(x + offsets, mask=inside) * 2, mask=inside)


@triton.heuristics({"EVEN": lambda args: args["N"] % 16 == 0})
@triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def triple(x, y, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    tl.store(y + offsets, tl.load(x + offsets, mask=inside) * 3, mask=inside)
