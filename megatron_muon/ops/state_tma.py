"""GDN's two chunk-state recurrences (FLA's `chunk_gated_delta_rule_fwd_h` and `..._bwd_dhu`) with their key-side
tiles streamed by TMA.

States are value-first ([V, K] per head) as FLA stores them; g is FLA's chunk-local cumulative log2 gate.
Forward, chunk by chunk: h_t (stored) = h; v_new_t = u_t − w_t·hᵀ;
    h ← 2^g_last·h + (diag(2^(g_last − g))·v_new_t)ᵀ·k_t.
Backward, from the last chunk: dh_t (stored) = dh; dv2_t = dv_t + diag(2^(g_last − g))·k_t·dhᵀ;
    dh ← 2^g_last·dh + scale·(diag(2^g)·do_t)ᵀ·q_t − dv2_tᵀ·w_t.
Each program owns one (head, value block) and reads the chunk's whole key-side tiles ([BT, K]: k and w forward,
q, k and w backward) for every chunk. FLA's kernels load them into registers 64 key columns at a time, so each chunk
waits on L2 (benchmarks/results/fla_state_kernels.md). Here TMA descriptors stream them into shared memory and the
chunk loop is software-pipelined, so the next chunk's tiles arrive while this one computes. Every product takes the
[BV, ·] register tile as its left operand and a shared-memory tile as its right one (v_new and dv2 are computed
transposed), so the state never goes through shared memory and 64-row value blocks run on wgmma.

Rounding differs from FLA's in one place: the backward's gate 2^g multiplies do (a [BT, BV] tile) instead of q, and
that product runs in the input dtype rather than tf32. Dense equal-length batches with one value head per key head;
everything else stays on FLA (`qualifies`). Opt-in until measured faster: MEGATRON_MUON_GDN_STATE=tma.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps FLA's kernels
    triton = None

_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
CHUNK = 64
ENV_VAR = "MEGATRON_MUON_GDN_STATE"
CHOICES = ("fla", "tma")


def enabled() -> bool:
    """Whether GDN's chunk ops use these kernels where they qualify (`MEGATRON_MUON_GDN_STATE=tma`; default `fla`)."""
    choice = os.environ.get(ENV_VAR, "fla")
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}; valid choices: {CHOICES}")
    return choice == "tma"


def qualifies(key_side: list, value_side: list, g, cu_seqlens, chunk_size: int) -> bool:
    """Dense [B, T, H, K] key-side and [B, T, H, V] value-side bf16/fp16 tensors on an sm90+ GPU (or the
    interpreter), one value head per key head, contiguous (TMA-able)."""
    first = key_side[0]
    on_device = first.is_cuda and torch.cuda.get_device_capability(first.device)[0] >= 9
    if triton is None or not (on_device or (_INTERPRETING and first.device.type == "cpu")):
        return False
    if cu_seqlens is not None or chunk_size != CHUNK or g is None or first.dim() != 4:
        return False
    value_dim = value_side[0].shape[-1]
    tensors = key_side + value_side
    return (
        all(t.shape == first.shape for t in key_side)
        and all(t.shape == (*first.shape[:3], value_dim) for t in value_side)
        and all(t.dtype == first.dtype for t in tensors)
        and first.dtype in (torch.bfloat16, torch.float16)
        and first.shape[-1] in (64, 128, 256)
        and value_dim % 16 == 0
        and all(t.is_contiguous() for t in tensors)
    )


if triton is not None:

    @triton.jit
    def _chunk_gates(g, i_b, i_h, t0, T, H: tl.constexpr, BT: tl.constexpr):
        """(g of the chunk's rows [BT] (0 past T), g of its last row, which rows are inside the sequence)."""
        o_t = t0 + tl.arange(0, BT)
        inside = o_t < T
        b_g = tl.load(g + (i_b * T + o_t) * H + i_h, mask=inside, other=0.0).to(tl.float32)
        b_g_last = tl.load(g + (i_b * T + tl.minimum(t0 + BT, T) - 1) * H + i_h).to(tl.float32)
        return b_g, b_g_last, inside

    @triton.jit
    def _store_rows(out, tile_t, i_b, i_h, t0, T, o_v, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
        """Store a transposed [BV, BT] tile into a [B, T, H, V] tensor, rows past T left out."""
        o_t = t0 + tl.arange(0, BT)
        rows = (i_b * T + o_t).to(tl.int64)
        tl.store(out + (rows[:, None] * H + i_h) * V + o_v[None, :], tl.trans(tile_t), mask=(o_t < T)[:, None])

    @triton.jit
    def _fwd_h_kernel(
        k_desc, w_desc, u_desc, g, h0, h, v_new, ht, T, NT,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
        STAGES: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    ):  # fmt: skip
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        o_v = i_v * BV + tl.arange(0, BV)
        state = (i_bh * V + o_v[:, None]) * K + tl.arange(0, K)[None, :]  # [BV, K] in a [B, H, V, K] state
        b_h = tl.zeros([BV, K], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_h += tl.load(h0 + state).to(tl.float32)
        for i_t in tl.range(0, NT, num_stages=STAGES):
            t0 = i_t * BT
            tl.store(h + (i_b * NT + i_t) * H * V * K + state - i_b * H * V * K, b_h.to(h.dtype.element_ty))
            where = [i_b.to(tl.int32), t0, (i_h * K).to(tl.int32)]
            b_k = k_desc.load(where).reshape(BT, K)
            b_w = w_desc.load(where).reshape(BT, K)
            b_u = u_desc.load([i_b.to(tl.int32), t0, (i_h * V + i_v * BV).to(tl.int32)]).reshape(BT, BV)
            b_g, b_g_last, inside = _chunk_gates(g, i_b, i_h, t0, T, H, BT)
            b_vt = tl.trans(b_u).to(tl.float32) - tl.dot(b_h.to(b_w.dtype), tl.trans(b_w))  # v_newᵀ [BV, BT]
            _store_rows(v_new, b_vt.to(b_u.dtype), i_b, i_h, t0, T, o_v, H, V, BT)
            b_vt = (b_vt * tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)[None, :]).to(b_k.dtype)
            b_h = b_h * tl.exp2(b_g_last) + tl.dot(b_vt, b_k)
        if STORE_FINAL_STATE:
            tl.store(ht + state, b_h)

    @triton.jit
    def _dhu_kernel(
        q_desc, k_desc, w_desc, do_desc, dv_desc, g, dht, dh, dv2, dh0, scale, T, NT,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
        STAGES: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    ):  # fmt: skip
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        o_v = i_v * BV + tl.arange(0, BV)
        state = (i_bh * V + o_v[:, None]) * K + tl.arange(0, K)[None, :]  # [BV, K] in a [B, H, V, K] state
        b_dh = tl.zeros([BV, K], dtype=tl.float32)
        if USE_FINAL_STATE_GRADIENT:
            b_dh += tl.load(dht + state).to(tl.float32)
        for i in tl.range(0, NT, num_stages=STAGES):
            i_t = NT - 1 - i
            t0 = i_t * BT
            # dh[b, t, h]: the gradient entering chunk t from the chunks after it
            tl.store(dh + (i_b * NT + i_t) * H * V * K + state - i_b * H * V * K, b_dh.to(dh.dtype.element_ty))
            where = [i_b.to(tl.int32), t0, (i_h * K).to(tl.int32)]
            b_k = k_desc.load(where).reshape(BT, K)
            b_q = q_desc.load(where).reshape(BT, K)
            b_w = w_desc.load(where).reshape(BT, K)
            value_where = [i_b.to(tl.int32), t0, (i_h * V + i_v * BV).to(tl.int32)]
            b_do = do_desc.load(value_where).reshape(BT, BV)
            b_dv = dv_desc.load(value_where).reshape(BT, BV)
            b_g, b_g_last, inside = _chunk_gates(g, i_b, i_h, t0, T, H, BT)
            b_dv2t = tl.dot(b_dh.to(b_k.dtype), tl.trans(b_k))  # dv2ᵀ [BV, BT]
            b_dv2t = b_dv2t * tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)[None, :] + tl.trans(b_dv).to(tl.float32)
            b_dv2t = b_dv2t.to(b_dv.dtype)
            _store_rows(dv2, b_dv2t, i_b, i_h, t0, T, o_v, H, V, BT)
            b_do_gated_t = (tl.trans(b_do).to(tl.float32) * tl.exp2(b_g)[None, :]).to(b_q.dtype)  # [BV, BT]
            b_dh = b_dh * tl.exp2(b_g_last)
            b_dh += tl.dot(b_do_gated_t, b_q) * scale
            b_dh -= tl.dot(b_dv2t, b_w)
        if USE_INITIAL_STATE:
            tl.store(dh0 + state, b_dh)


# (BV, warps, stages) that fit the H200's 227 KiB of shared memory per block at key dim 256, compiled for sm90 (the
# backward streams three key-side tiles per chunk, the forward two: 64/4/2 takes 217 KiB backward, 64/4/3 takes
# 217 KiB forward). 64- and 128-row value blocks run on wgmma, 16 and 32 on mma.sync. Which is fastest is for the
# GPU to say (benchmarks/fla_state_kernels.py); the first entry is the default.
FORWARD_CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 4, 2), (32, 4, 3), (32, 4, 4), (16, 4, 2)]
BACKWARD_CONFIGS = [(64, 4, 2), (32, 4, 2), (32, 8, 2), (16, 4, 2), (64, 8, 1), (128, 8, 1)]
_INTERPRETER_CONFIG = (16, 4, 1)


def _descriptor(t: torch.Tensor, block_cols: int):
    """A 3-D [B, T, heads·dim] TMA view of a contiguous [B, T, heads, dim] tensor; edges load zeros per batch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = t.view(t.shape[0], t.shape[1], -1)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, CHUNK, block_cols])


def _tile(value_dim: int, config, table):
    block_v, warps, stages = config or (_INTERPRETER_CONFIG if _INTERPRETING else table[0])
    if value_dim % block_v:
        raise ValueError(f"value dim {value_dim} is not a multiple of the value block {block_v}")
    return block_v, warps, stages


def chunk_fwd_h(k, w, u, g, initial_state=None, output_final_state: bool = False, config=None):
    """(h [B, NT, H, V, K], v_new like u, final state [B, H, V, K] fp32 or None) as FLA's value-first
    `chunk_gated_delta_rule_fwd_h`; `config` = (BV, warps, stages) pins a tile."""
    batch, seq_len, heads, key_dim = k.shape
    value_dim = u.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    block_v, warps, stages = _tile(value_dim, config, FORWARD_CONFIGS)
    h = k.new_empty(batch, chunks, heads, value_dim, key_dim)
    v_new = torch.empty_like(u)
    final = k.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if output_final_state else None
    h0 = None if initial_state is None else initial_state.contiguous()
    _fwd_h_kernel[(value_dim // block_v, batch * heads)](
        _descriptor(k, key_dim), _descriptor(w, key_dim), _descriptor(u, block_v), g.contiguous(), h0, h, v_new,
        final, seq_len, chunks, H=heads, K=key_dim, V=value_dim, BT=CHUNK, BV=block_v, STAGES=stages,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state, num_warps=warps,
    )
    return h, v_new, final


def chunk_dhu(q, k, w, g, do, dv, scale: float, dht=None, want_dh0: bool = False, config=None):
    """(dh [B, NT, H, V, K], dh0 [B, H, V, K] fp32 or None, dv2 like dv) as FLA's value-first
    `chunk_gated_delta_rule_bwd_dhu`; `config` = (BV, warps, stages) pins a tile."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = do.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    block_v, warps, stages = _tile(value_dim, config, BACKWARD_CONFIGS)
    dh = q.new_empty(batch, chunks, heads, value_dim, key_dim)
    dv2 = torch.empty_like(dv)
    dh0 = q.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if want_dh0 else None
    dht = None if dht is None else dht.contiguous()
    _dhu_kernel[(value_dim // block_v, batch * heads)](
        _descriptor(q, key_dim), _descriptor(k, key_dim), _descriptor(w, key_dim), _descriptor(do, block_v),
        _descriptor(dv, block_v), g.contiguous(), dht, dh, dv2, dh0, float(scale), seq_len, chunks,
        H=heads, K=key_dim, V=value_dim, BT=CHUNK, BV=block_v, STAGES=stages,
        USE_FINAL_STATE_GRADIENT=dht is not None, USE_INITIAL_STATE=want_dh0, num_warps=warps,
    )
    return dh, dh0, dv2
