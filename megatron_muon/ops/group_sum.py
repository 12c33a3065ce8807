"""Sum of per-value-head gradients over each query/key head's group (GVA), plus an optional addend, in one pass.

With more value heads than query/key heads, the chunk backward's kernels write dq and dk per value head, and the
key-side gradient is their sum over the heads of a group (value head h reads query/key head h // group). torch's
`x.view(B, T, H, G, K).sum(3)` reduces over a middle dimension and then `dk.add_(dk_wy)` reads the result again; this
kernel reads each group's G·K contiguous elements once, accumulates in fp32, adds the addend and rounds once.
"""

from __future__ import annotations

import torch

from megatron_muon.kernels.triton_math import INTERPRETING

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch sequence serves every call
    triton = None

TILE = 4096  # elements per program and value head: rows of K, each the sum of G value heads' rows


def group_sum(x: torch.Tensor, heads: int, addend: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, HV, K] summed over the HV // heads value heads of each query/key head: [B, T, heads, K] in x's
    dtype, plus `addend` (same shape as the result) when given. fp32 accumulation, one rounding."""
    batch, seq_len, value_heads, key_dim = x.shape
    assert value_heads % heads == 0, (value_heads, heads)
    group = value_heads // heads
    if addend is not None:
        assert addend.shape == (batch, seq_len, heads, key_dim), (addend.shape, x.shape, heads)
    on_triton = triton is not None and (x.is_cuda or (INTERPRETING and x.device.type == "cpu"))
    if not on_triton or not x.is_contiguous() or (addend is not None and not addend.is_contiguous()):
        summed = x.view(batch, seq_len, heads, group, key_dim).float().sum(3)
        return (summed if addend is None else summed + addend.float()).to(x.dtype)
    out = x.new_empty(batch, seq_len, heads, key_dim)
    rows = batch * seq_len * heads
    if rows == 0:
        return out
    block_k = triton.next_power_of_2(key_dim)
    tile_rows = max(1, TILE // block_k)
    _group_sum_kernel[(triton.cdiv(rows, tile_rows),)](
        x, out, out if addend is None else addend, rows, G=group, K=key_dim, BK=block_k, ROWS=tile_rows,
        HAS_ADDEND=addend is not None, num_warps=4,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _group_sum_kernel(x, out, addend, N, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                          ROWS: tl.constexpr, HAS_ADDEND: tl.constexpr):
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, BK)
        mask = (rows < N)[:, None] & (cols < K)[None, :]
        acc = tl.zeros([ROWS, BK], dtype=tl.float32)
        for g in tl.static_range(G):
            acc += tl.load(x + (rows * G + g)[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_ADDEND:
            acc += tl.load(addend + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out + rows[:, None] * K + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)
