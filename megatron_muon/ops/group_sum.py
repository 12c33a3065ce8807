"""Sum of per-value-head gradients over each query/key head's group (GVA), of one or two parts, in one pass.

With more value heads than query/key heads, the chunk backward's kernels write dq and dk per value head, and the
key-side gradient is their sum over the heads of a group (value head h reads query/key head h // group); dk has two
such parts (the output gradients' and the WY backward's). torch's `x.view(B, T, H, G, K).sum(3)` reduces over a
middle dimension, once per part, and an add joins the parts; this kernel reads each group's G·K contiguous elements
of each part once, accumulates in fp32 and rounds once.
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


def group_sum(x: torch.Tensor, heads: int, other: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, HV, K] (+ `other`, same shape) summed over the HV // heads value heads of each query/key head:
    [B, T, heads, K] in x's dtype. fp32 accumulation, one rounding."""
    batch, seq_len, value_heads, key_dim = x.shape
    assert value_heads % heads == 0, (value_heads, heads)
    assert other is None or other.shape == x.shape, (x.shape, None if other is None else other.shape)
    group = value_heads // heads
    on_triton = triton is not None and (x.is_cuda or (INTERPRETING and x.device.type == "cpu"))
    if not on_triton or not x.is_contiguous() or (other is not None and not other.is_contiguous()):
        both = x.float() if other is None else x.float() + other.float()
        return both.view(batch, seq_len, heads, group, key_dim).sum(3).to(x.dtype)
    out = x.new_empty(batch, seq_len, heads, key_dim)
    rows = batch * seq_len * heads
    if rows == 0:
        return out
    block_k = triton.next_power_of_2(key_dim)
    tile_rows = max(1, TILE // block_k)
    _group_sum_kernel[(triton.cdiv(rows, tile_rows),)](
        x, x if other is None else other, out, rows, G=group, K=key_dim, BK=block_k, ROWS=tile_rows,
        HAS_OTHER=other is not None, num_warps=4,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _group_sum_kernel(x, other, out, N, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                          ROWS: tl.constexpr, HAS_OTHER: tl.constexpr):
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, BK)
        mask = (rows < N)[:, None] & (cols < K)[None, :]
        acc = tl.zeros([ROWS, BK], dtype=tl.float32)
        for g in tl.static_range(G):
            offsets = (rows * G + g)[:, None] * K + cols[None, :]
            acc += tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_OTHER:
                acc += tl.load(other + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + rows[:, None] * K + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)
