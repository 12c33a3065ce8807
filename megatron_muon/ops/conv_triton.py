"""The causal depthwise conv's backward (no activation, dense batches) as one Triton pass over dy and x.

y[t] = sum_w x[t - (W-1) + w] * weight[:, w] (+ bias), so
dx[s] = sum_j dy[s + j] * weight[:, W-1-j] and dweight[:, W-1-j] = sum_s dy[s + j] * x[s].
Each program owns a [BT tokens, BD channels] tile, reads x and the W shifted dy tiles (the overlap comes from
cache), writes dx, and writes its column sums of dy·x as a per-tile partial that one reduction sums, so the result
is deterministic. Few warps per tile keep those sums in registers: on the H200 at the hybrid-1.5B's GDN shape the
1- and 2-warp tiles are the fastest, and the whole backward is faster than FLA's kernel. The forward stays with FLA
(a one-pass forward of the same design was not faster), as do packed sequences and fused activations. Measured:
docs/design/gdn_kernels.md.
"""

from __future__ import annotations

import torch

from megatron_muon.kernels.triton_math import INTERPRETING as _INTERPRETING

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps FLA's kernel
    triton = None

_INTERPRETER_TILE = {"BT": 16, "BD": 16}


def qualifies(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, activation, cu_seqlens) -> bool:
    """The shapes and layouts this kernel covers: dense [B, T, D] with unit channel stride, no activation."""
    on_device = x.is_cuda or (_INTERPRETING and x.device.type == "cpu")
    return (
        triton is not None
        and on_device
        and activation is None
        and cu_seqlens is None
        and x.dim() == 3
        and x.stride(-1) == 1
        and dy.shape == x.shape
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def conv_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dy: torch.Tensor):
    """(dx, dweight, dbias or None) for y = causal_conv1d(x, weight, bias) without activation."""
    batch, seq, channels = x.shape
    width = weight.shape[1]
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    weight = weight.contiguous()
    dx = torch.empty((batch, seq, channels), dtype=x.dtype, device=x.device)
    kernel, tile = (_conv_bwd_kernel, _INTERPRETER_TILE) if _INTERPRETING else (_conv_bwd_tuned, None)
    # the partials are sized for the smallest token tile any config uses; a config with bigger tiles fills fewer
    tiles_t = triton.cdiv(seq, tile["BT"] if tile else _SMALLEST_BT)
    dweight_parts = torch.empty((batch * tiles_t, channels, width), dtype=torch.float32, device=x.device)
    dbias_parts = torch.empty((batch * tiles_t, channels), dtype=torch.float32, device=x.device) if bias is not None \
        else None
    used = {}

    def grid(meta):
        used["tiles_t"] = triton.cdiv(seq, meta["BT"])
        return triton.cdiv(channels, meta["BD"]), used["tiles_t"], batch

    kernel[grid](
        x, dy, weight, dx, dweight_parts, dbias_parts, seq, channels,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1),
        W=width, HAS_BIAS=bias is not None, **(tile or {}),
    )
    parts = batch * used["tiles_t"]
    dweight = dweight_parts[:parts].sum(0).to(weight.dtype)
    dbias = dbias_parts[:parts].sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


if triton is not None:
    _SMALLEST_BT = 32

    @triton.jit
    def _conv_bwd_kernel(
        X, DY, Weight, DX, DWeightParts, DBiasParts, T, D,
        stride_xb, stride_xt, stride_dyb, stride_dyt, stride_dxb, stride_dxt,
        W: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    ):
        i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        part = i_b * tl.num_programs(1) + i_t
        tokens = i_t.to(tl.int64) * BT + tl.arange(0, BT)
        channels = i_d * BD + tl.arange(0, BD)
        in_d = channels < D
        batch = i_b.to(tl.int64)
        in_tile = (tokens < T)[:, None] & in_d[None, :]
        x = tl.load(X + batch * stride_xb + tokens[:, None] * stride_xt + channels[None, :], mask=in_tile, other=0.0)
        x = x.to(tl.float32)
        dx = tl.zeros((BT, BD), dtype=tl.float32)
        for j in tl.static_range(W):
            later = tokens + j  # dy[s + j] meets x[s] through tap W-1-j
            dy = tl.load(
                DY + batch * stride_dyb + later[:, None] * stride_dyt + channels[None, :],
                mask=(later < T)[:, None] & in_d[None, :], other=0.0,
            ).to(tl.float32)
            tap = tl.load(Weight + channels * W + (W - 1 - j), mask=in_d, other=0.0).to(tl.float32)
            dx += dy * tap[None, :]
            tl.store(DWeightParts + part.to(tl.int64) * D * W + channels * W + (W - 1 - j), tl.sum(dy * x, 0),
                     mask=in_d)
            if HAS_BIAS and j == 0:
                tl.store(DBiasParts + part.to(tl.int64) * D + channels, tl.sum(dy, 0), mask=in_d)
        tl.store(DX + batch * stride_dxb + tokens[:, None] * stride_dxt + channels[None, :],
                 dx.to(DX.dtype.element_ty), mask=in_tile)

    # (BT, BD, warps): the H200 sweep's fastest backward tiles, all with few warps, and no tile large enough to spill
    _TILES = ((_SMALLEST_BT, 64, 1), (_SMALLEST_BT, 64, 2), (_SMALLEST_BT, 128, 2), (64, 64, 2), (128, 32, 4))
    _CONFIGS = [triton.Config({"BT": bt, "BD": bd}, num_warps=warps) for bt, bd, warps in _TILES]
    _conv_bwd_tuned = triton.autotune(configs=_CONFIGS, key=["D", "W", "HAS_BIAS"])(_conv_bwd_kernel)
