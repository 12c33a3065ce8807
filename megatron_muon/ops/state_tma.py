"""GDN's two chunk-state recurrences (FLA's `chunk_gated_delta_rule_fwd_h` and `..._bwd_dhu`) with their key-side
tiles streamed by TMA.

States are value-first ([V, K] per head) as FLA stores them; g is FLA's chunk-local cumulative log2 gate.
Forward, chunk by chunk: h_t (stored) = h; v_new_t = u_t − w_t·hᵀ;
    h ← 2^g_last·h + (diag(2^(g_last − g))·v_new_t)ᵀ·k_t.
Backward, from the last chunk: dh_t (stored) = dh; dv2_t = dv_t + diag(2^(g_last − g))·k_t·dhᵀ;
    dh ← 2^g_last·dh + scale·(diag(2^g)·do_t)ᵀ·q_t − dv2_tᵀ·w_t.
Each program owns one (head, value block) and reads the chunk's whole key-side tiles ([BT, K]: k and w forward,
q, k and w backward) for every chunk (benchmarks/results/fla_state_kernels.md: at 16-column value blocks that
traffic is what limits FLA's kernels; at 32 and wider the chain of dependent products inside each chunk does). Here
TMA descriptors stream the tiles into shared memory and the chunk loop is software-pipelined. Every product takes
the [BV, ·] register tile as its left operand and a shared-memory tile as its right one (v_new and dv2 are computed
transposed), so the state never goes through shared memory; the state is kept in 64-column key slices, as in FLA's
kernels, so that no product's operands overflow the registers. On an H200 at the hybrid-1.5B shape the backward is
faster than FLA's autotuned kernel and the forward takes the same time (docs/design/gdn_kernels.md).

Rounding differs from FLA's in one place: the backward's gate 2^g multiplies do (a [BT, BV] tile) instead of q, and
that product runs in the input dtype rather than tf32. Dense equal-length batches; with more value heads than key
heads (GVA) value head h reads key head h // (HV // H) of k and q (w is per value head); everything else stays on FLA
(`qualifies`). Where Triton has Gluon, the warp-specialized kernels of `state_ws.py` take these calls on sm90
(docs/components.md); `ops/kernel_choice` picks between them and FLA's. Both kernels can also compute the chunks'
own output terms (the forward's output, the backward's local value gradient): the "fused" kernel choice.
"""

from __future__ import annotations

import torch

from megatron_muon.kernels.triton_math import INTERPRETING as _INTERPRETING

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps FLA's kernels
    triton = None

CHUNK = 64
KEY_SLICE = 64  # the kernels keep the state in [BV, 64] key slices (key dims 64, 128 or 256)


def qualifies(key_side: list, value_side: list, g, cu_seqlens, chunk_size: int) -> bool:
    """Dense [B, T, H, K] key-side and [B, T, HV, V] value-side bf16/fp16 tensors on an sm90 GPU (or the
    interpreter), q and k with key heads that divide the value heads (w, and the value side, per value head),
    contiguous (TMA-able), with V a multiple of the default tiles' value blocks."""
    first = key_side[0]
    on_device = first.is_cuda and torch.cuda.get_device_capability(first.device)[0] == 9
    if triton is None or not (on_device or (_INTERPRETING and first.device.type == "cpu")):
        return False
    if cu_seqlens is not None or chunk_size != CHUNK or g is None or first.dim() != 4:
        return False
    value_dim = value_side[0].shape[-1]
    value_shape = (*value_side[0].shape[:3], value_dim)
    tensors = key_side + value_side
    return (
        all(t.dim() == 4 and t.shape[:2] == first.shape[:2] and t.shape[3] == first.shape[3] for t in key_side)
        and len({t.shape[2] for t in key_side} - {value_shape[2]}) <= 1  # key heads, value heads or both
        and all(value_shape[2] % t.shape[2] == 0 for t in key_side)
        and all(t.shape == value_shape for t in value_side)
        and g.shape == value_shape[:3]
        and all(t.dtype == first.dtype for t in tensors)
        and first.dtype in (torch.bfloat16, torch.float16)
        and first.shape[-1] in (64, 128, 256)
        and value_dim % _default_value_block() == 0
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
    def _state_slice(base, i_b, i_t, NT, state, j, H: tl.constexpr, V: tl.constexpr, K: tl.constexpr,
                     KS: tl.constexpr):
        """Pointers to key slice j ([BV, KS]) of chunk i_t's state in a [B, NT, H, V, K] tensor."""
        return base + (i_b * NT + i_t) * H * V * K - i_b * H * V * K + state + j * KS

    @triton.jit
    def _load_slices(src, state, LOAD: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr):
        """The four [BV, KS] fp32 key slices of a [V, K] state at `src + state` (zeros past K, or all zeros
        unless LOAD)."""
        s0 = tl.zeros([BV, KS], dtype=tl.float32)
        s1 = tl.zeros([BV, KS], dtype=tl.float32)
        s2 = tl.zeros([BV, KS], dtype=tl.float32)
        s3 = tl.zeros([BV, KS], dtype=tl.float32)
        if LOAD:
            s0 += tl.load(src + state).to(tl.float32)
            if K > 64:
                s1 += tl.load(src + state + KS).to(tl.float32)
            if K > 128:
                s2 += tl.load(src + state + 2 * KS).to(tl.float32)
                s3 += tl.load(src + state + 3 * KS).to(tl.float32)
        return s0, s1, s2, s3

    @triton.jit
    def _store_slices(dst, state, s0, s1, s2, s3, K: tl.constexpr, KS: tl.constexpr):
        """Store the key slices that K covers, as `_load_slices` reads them."""
        tl.store(dst + state, s0)
        if K > 64:
            tl.store(dst + state + KS, s1)
        if K > 128:
            tl.store(dst + state + 2 * KS, s2)
            tl.store(dst + state + 3 * KS, s3)

    @triton.jit
    def _state_slice_products(b_h, b_sw, b_ot, b_kq, h, q_desc, k_desc, w_desc, i_b, i_t, NT, state, batch, t0,
                              key_column, column, j: tl.constexpr, H: tl.constexpr, V: tl.constexpr,
                              K: tl.constexpr, BT: tl.constexpr, KS: tl.constexpr, STORE_STATES: tl.constexpr,
                              WITH_OUTPUT: tl.constexpr):
        """Key slice j's share of the chunk's products with the state entering it (stored to h first when
        STORE_STATES), accumulated: S·wᵀ into b_sw and, with WITH_OUTPUT, S·qᵀ into b_ot and k·qᵀ into b_kq."""
        b_s = b_h.to(w_desc.dtype)
        if STORE_STATES:
            tl.store(_state_slice(h, i_b, i_t, NT, state, j, H, V, K, KS), b_s)
        b_sw = tl.dot(b_s, tl.trans(w_desc.load([batch, t0, column + j * KS]).reshape(BT, KS)), b_sw)
        if WITH_OUTPUT:
            b_q = q_desc.load([batch, t0, key_column + j * KS]).reshape(BT, KS)
            b_ot = tl.dot(b_s, tl.trans(b_q), b_ot)
            b_kq = tl.dot(k_desc.load([batch, t0, key_column + j * KS]).reshape(BT, KS), tl.trans(b_q), b_kq)
        return b_sw, b_ot, b_kq

    @triton.jit
    def _chunk_state_fwd_kernel(
        q_desc, k_desc, w_desc, u_desc, g, h0, h, v_new, o, ht, skip, scale, T, NT,
        H: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
        STAGES: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
        STORE_STATES: tl.constexpr, WITH_OUTPUT: tl.constexpr, SKIP: tl.constexpr,
    ):  # fmt: skip
        """The state in key slices of 64 columns (as FLA keeps it): each product's operands stay small enough for
        the registers; the slices' tiles still come through TMA. STORE_STATES writes h and v_new; WITH_OUTPUT also
        computes the output (`ops/chunk_fwd_fused.py`; q_desc, o and scale are unused without it). With SKIP the
        program starts at chunk skip[b, h], its state there the initial one (`ops/state_segments.py`'s windows)."""
        KS: tl.constexpr = 64
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        o_v = i_v * BV + tl.arange(0, BV)
        state = (i_bh * V + o_v[:, None]) * K + tl.arange(0, KS)[None, :]  # slice 0 of a [B, H, V, K] state
        b_h0, b_h1, b_h2, b_h3 = _load_slices(h0, state, USE_INITIAL_STATE, K, BV, KS)
        column = (i_h * K).to(tl.int32)  # w's head
        key_column = (i_h // GROUP * K).to(tl.int32)  # k's (and q's) head
        rows = tl.arange(0, BT)
        causal = rows[:, None] <= rows[None, :]  # [j, i]: token j at or before token i
        first = tl.load(skip + i_bh) if SKIP else 0
        for i_t in tl.range(first, NT, num_stages=STAGES):
            t0 = i_t * BT
            batch = i_b.to(tl.int32)
            b_vt = tl.zeros([BV, BT], dtype=tl.float32)  # S·wᵀ, then v_newᵀ
            b_ot = tl.zeros([BV, BT], dtype=tl.float32)
            b_kq = tl.zeros([BT, BT], dtype=tl.float32)
            for j in tl.static_range(K // KS):
                b_h = b_h0 if j == 0 else (b_h1 if j == 1 else (b_h2 if j == 2 else b_h3))
                b_vt, b_ot, b_kq = _state_slice_products(b_h, b_vt, b_ot, b_kq, h, q_desc, k_desc, w_desc, i_b, i_t,
                                                         NT, state, batch, t0, key_column, column, j, H, V, K, BT,
                                                         KS, STORE_STATES, WITH_OUTPUT)
            b_u = u_desc.load([batch, t0, (i_h * V + i_v * BV).to(tl.int32)]).reshape(BT, BV)
            b_vt = tl.trans(b_u).to(tl.float32) - b_vt  # v_newᵀ [BV, BT]
            if STORE_STATES:
                _store_rows(v_new, b_vt.to(b_u.dtype), i_b, i_h, t0, T, o_v, H, V, BT)
            b_g, b_g_last, inside = _chunk_gates(g, i_b, i_h, t0, T, H, BT)
            if WITH_OUTPUT:  # oᵀ = scale·((S·qᵀ) ⊙ 2^g_i + v_newᵀ·Mᵀ), Mᵀ_ji = q_i·k_j·2^(g_i − g_j) for j ≤ i
                gaps = tl.where(causal, b_g[None, :] - b_g[:, None], 0.0)
                b_mt = tl.where(causal, b_kq * tl.exp2(gaps), 0.0).to(w_desc.dtype)
                b_ot = b_ot * tl.exp2(b_g)[None, :] + tl.dot(b_vt.to(w_desc.dtype), b_mt)
                _store_rows(o, (b_ot * scale).to(b_u.dtype), i_b, i_h, t0, T, o_v, H, V, BT)
            b_vt = (b_vt * tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)[None, :]).to(w_desc.dtype)
            decay = tl.exp2(b_g_last)
            b_h0 = b_h0 * decay + tl.dot(b_vt, k_desc.load([batch, t0, key_column]).reshape(BT, KS))
            if K > 64:
                b_h1 = b_h1 * decay + tl.dot(b_vt, k_desc.load([batch, t0, key_column + KS]).reshape(BT, KS))
            if K > 128:
                b_h2 = b_h2 * decay + tl.dot(b_vt, k_desc.load([batch, t0, key_column + 2 * KS]).reshape(BT, KS))
                b_h3 = b_h3 * decay + tl.dot(b_vt, k_desc.load([batch, t0, key_column + 3 * KS]).reshape(BT, KS))
        if STORE_FINAL_STATE:
            _store_slices(ht, state, b_h0, b_h1, b_h2, b_h3, K, KS)

    @triton.jit
    def _dh_slice_update(b_dh, q_desc, w_desc, key_where, where, b_do_gated_t, b_dv2t, decay, scale,
                         BT: tl.constexpr, KS: tl.constexpr):
        """One key slice of dh ← 2^g_last·dh + scale·(gated do)ᵀ·q − dv2ᵀ·w (q at `key_where`, w at
        `where`)."""
        b_q = q_desc.load(key_where).reshape(BT, KS)
        b_w = w_desc.load(where).reshape(BT, KS)
        return b_dh * decay + tl.dot(b_do_gated_t, b_q) * scale - tl.dot(b_dv2t, b_w)

    @triton.jit
    def _local_dv_t(q_desc, k_desc, b_do, b_g, batch, t0, key_column, scale, K: tl.constexpr, BT: tl.constexpr,
                    KS: tl.constexpr):
        """dvᵀ [BV, BT] of the chunk's own output (FLA's `chunk_bwd_dv_local`): scale·doᵀ·M with
        M_ij = q_i·k_j·2^(g_i − g_j) for j ≤ i, zero above the diagonal."""
        b_qk = tl.dot(q_desc.load([batch, t0, key_column]).reshape(BT, KS),
                      tl.trans(k_desc.load([batch, t0, key_column]).reshape(BT, KS)))
        if K > 64:
            b_qk += tl.dot(q_desc.load([batch, t0, key_column + KS]).reshape(BT, KS),
                           tl.trans(k_desc.load([batch, t0, key_column + KS]).reshape(BT, KS)))
        if K > 128:
            b_qk += tl.dot(q_desc.load([batch, t0, key_column + 2 * KS]).reshape(BT, KS),
                           tl.trans(k_desc.load([batch, t0, key_column + 2 * KS]).reshape(BT, KS)))
            b_qk += tl.dot(q_desc.load([batch, t0, key_column + 3 * KS]).reshape(BT, KS),
                           tl.trans(k_desc.load([batch, t0, key_column + 3 * KS]).reshape(BT, KS)))
        rows = tl.arange(0, BT)
        causal = rows[:, None] >= rows[None, :]  # [i, j]: token j at or before token i
        b_m = tl.where(causal, b_qk * tl.exp2(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
        return tl.dot(tl.trans(b_do), b_m.to(b_do.dtype)) * scale

    @triton.jit
    def _chunk_state_bwd_kernel(
        q_desc, k_desc, w_desc, do_desc, dv_desc, g, dht, dh, dv2, dh0, skip, scale, T, NT,
        H: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
        STAGES: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
        LOCAL_DV: tl.constexpr, SKIP: tl.constexpr,
    ):  # fmt: skip
        """The state gradient in key slices of 64 columns, as in the forward. With LOCAL_DV the chunk's own value
        gradient is computed here (`_local_dv_t`) instead of read from dv. With SKIP the program leaves out the
        last skip[b, h] chunks, its gradient entering the chunk before them the given final one."""
        KS: tl.constexpr = 64
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        o_v = i_v * BV + tl.arange(0, BV)
        state = (i_bh * V + o_v[:, None]) * K + tl.arange(0, KS)[None, :]  # slice 0 of a [B, H, V, K] state
        b_dh0, b_dh1, b_dh2, b_dh3 = _load_slices(dht, state, USE_FINAL_STATE_GRADIENT, K, BV, KS)
        column = (i_h * K).to(tl.int32)  # w's head
        key_column = (i_h // GROUP * K).to(tl.int32)  # q's and k's head
        first = tl.load(skip + i_bh) if SKIP else 0
        for i in tl.range(first, NT, num_stages=STAGES):
            i_t = NT - 1 - i
            t0 = i_t * BT
            batch = i_b.to(tl.int32)
            dtype = dh.dtype.element_ty
            # dh[b, t, h]: the gradient entering chunk t from the chunks after it
            tl.store(_state_slice(dh, i_b, i_t, NT, state, 0, H, V, K, KS), b_dh0.to(dtype))
            b_dv2t = tl.dot(b_dh0.to(k_desc.dtype), tl.trans(k_desc.load([batch, t0, key_column]).reshape(BT, KS)))
            if K > 64:
                tl.store(_state_slice(dh, i_b, i_t, NT, state, 1, H, V, K, KS), b_dh1.to(dtype))
                b_k = k_desc.load([batch, t0, key_column + KS]).reshape(BT, KS)
                b_dv2t += tl.dot(b_dh1.to(k_desc.dtype), tl.trans(b_k))
            if K > 128:
                tl.store(_state_slice(dh, i_b, i_t, NT, state, 2, H, V, K, KS), b_dh2.to(dtype))
                tl.store(_state_slice(dh, i_b, i_t, NT, state, 3, H, V, K, KS), b_dh3.to(dtype))
                b_k = k_desc.load([batch, t0, key_column + 2 * KS]).reshape(BT, KS)
                b_dv2t += tl.dot(b_dh2.to(k_desc.dtype), tl.trans(b_k))
                b_k = k_desc.load([batch, t0, key_column + 3 * KS]).reshape(BT, KS)
                b_dv2t += tl.dot(b_dh3.to(k_desc.dtype), tl.trans(b_k))
            value_where = [batch, t0, (i_h * V + i_v * BV).to(tl.int32)]
            b_do = do_desc.load(value_where).reshape(BT, BV)
            b_g, b_g_last, inside = _chunk_gates(g, i_b, i_h, t0, T, H, BT)
            if LOCAL_DV:
                b_dvt = _local_dv_t(q_desc, k_desc, b_do, b_g, batch, t0, key_column, scale, K, BT, KS)
            else:
                b_dvt = tl.trans(dv_desc.load(value_where).reshape(BT, BV)).to(tl.float32)
            b_dv2t = b_dv2t * tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)[None, :] + b_dvt
            b_dv2t = b_dv2t.to(b_do.dtype)  # dv2ᵀ [BV, BT]
            _store_rows(dv2, b_dv2t, i_b, i_h, t0, T, o_v, H, V, BT)
            b_do_gated_t = (tl.trans(b_do).to(tl.float32) * tl.exp2(b_g)[None, :]).to(b_do.dtype)  # [BV, BT]
            decay = tl.exp2(b_g_last)
            b_dh0 = _dh_slice_update(b_dh0, q_desc, w_desc, [batch, t0, key_column], [batch, t0, column],
                                     b_do_gated_t, b_dv2t, decay, scale, BT, KS)
            if K > 64:
                b_dh1 = _dh_slice_update(b_dh1, q_desc, w_desc, [batch, t0, key_column + KS], [batch, t0, column + KS],
                                         b_do_gated_t, b_dv2t, decay, scale, BT, KS)
            if K > 128:
                b_dh2 = _dh_slice_update(b_dh2, q_desc, w_desc, [batch, t0, key_column + 2 * KS],
                                         [batch, t0, column + 2 * KS], b_do_gated_t, b_dv2t, decay, scale, BT, KS)
                b_dh3 = _dh_slice_update(b_dh3, q_desc, w_desc, [batch, t0, key_column + 3 * KS],
                                         [batch, t0, column + 3 * KS], b_do_gated_t, b_dv2t, decay, scale, BT, KS)
        if USE_INITIAL_STATE:
            _store_slices(dh0, state, b_dh0, b_dh1, b_dh2, b_dh3, K, KS)


# (BV, warps, stages): every entry compiles for sm90 within the H200's 227 KiB of shared memory per block at key dim
# 256. Checked with Triton's own ptxas on a CPU machine (pointers and lengths specialized as divisible by 16, as at
# run time): no forward tile spills registers and the backward tiles spill little (the 64-column key slices keep
# operands small; whole 256-column tiles spilled in every config). The first entry is the default: on the H200 it
# is the fastest forward tile, and close to the fastest backward one, which moves twice the key-side tiles through
# L2 (docs/design/gdn_kernels.md).
FORWARD_CONFIGS = [(32, 4, 3), (32, 8, 3), (32, 8, 2), (32, 4, 4), (16, 4, 3), (16, 4, 2), (64, 8, 2)]
BACKWARD_CONFIGS = [(32, 8, 2), (32, 8, 3), (16, 4, 2), (16, 4, 3), (16, 8, 2), (32, 4, 2), (64, 8, 1)]
# With the local value gradient computed in the backward kernel (dv None) the tile also streams q·kᵀ's tiles: the
# 3-stage tiles exceed the block's shared memory at key dim 256 (`benchmarks/state_kernel_sass.py --fused`).
LOCAL_DV_CONFIGS = [config for config in BACKWARD_CONFIGS if config[2] < 3]
_INTERPRETER_CONFIG = (16, 4, 1)


def _default_value_block() -> int:
    """The widest value block among the tiles the kernels use unless pinned (each table's first entry)."""
    return _INTERPRETER_CONFIG[0] if _INTERPRETING else max(FORWARD_CONFIGS[0][0], BACKWARD_CONFIGS[0][0])


def _descriptor(t: torch.Tensor, block_cols: int):
    """A 3-D [B, T, heads·dim] TMA view of a contiguous [B, T, heads, dim] tensor; edges load zeros per batch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = t.view(t.shape[0], t.shape[1], -1)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, CHUNK, block_cols])


def _skips(skip_chunks, batch: int, heads: int):
    """The kernels' per-(row, head) chunk skips, int32 [B·HV] (None: none)."""
    if skip_chunks is None:
        return None
    assert skip_chunks.shape == (batch, heads), f"skip_chunks {tuple(skip_chunks.shape)} != {(batch, heads)}"
    return skip_chunks.to(torch.int32).contiguous()


def _tile(value_dim: int, config, table):
    block_v, warps, stages = config or (_INTERPRETER_CONFIG if _INTERPRETING else table[0])
    if value_dim % block_v:
        raise ValueError(f"value dim {value_dim} is not a multiple of the value block {block_v}")
    return block_v, warps, stages


def chunk_fwd_h(k, w, u, g, initial_state=None, output_final_state: bool = False, config=None, skip_chunks=None):
    """(h [B, NT, HV, V, K], v_new like u, final state [B, HV, V, K] fp32 or None) as FLA's value-first
    `chunk_gated_delta_rule_fwd_h`, with k [B, T, H, K] and w [B, T, HV, K]; `config` = (BV, warps, stages) pins a
    tile; `skip_chunks` (int32 [B, HV]): each (row, head) starts that many chunks in, from the initial state (the
    states of the chunks it leaves out are not written)."""
    h, v_new, _, final = chunk_forward(k, w, u, g, initial_state, output_final_state, config, skip_chunks=skip_chunks)
    return h, v_new, final


def chunk_forward(k, w, u, g, initial_state=None, output_final_state: bool = False, config=None, *, q=None,
                  scale: float = 1.0, store_states: bool = True, configs=FORWARD_CONFIGS, skip_chunks=None):
    """The forward state kernel's launcher: (h, v_new, o, final state), each None where not asked for. With q the
    kernel also computes the output o = scale·(...) (`ops/chunk_fwd_fused.py`); `store_states` writes h and v_new;
    `configs` is the tile table whose first entry is the default."""
    batch, seq_len, heads, key_dim = w.shape
    value_dim = u.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    block_v, warps, stages = _tile(value_dim, config, configs)
    h = k.new_empty(batch, chunks, heads, value_dim, key_dim) if store_states else None
    v_new = torch.empty_like(u) if store_states else None
    o = None if q is None else torch.empty_like(u)
    final = k.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if output_final_state else None
    h0 = None if initial_state is None else initial_state.contiguous()
    k_tiles = _descriptor(k, KEY_SLICE)
    _chunk_state_fwd_kernel[(value_dim // block_v, batch * heads)](
        k_tiles if q is None else _descriptor(q, KEY_SLICE), k_tiles, _descriptor(w, KEY_SLICE),
        _descriptor(u, block_v), g.contiguous(), h0, h, v_new, o, final, _skips(skip_chunks, batch, heads),
        float(scale), seq_len, chunks, H=heads, GROUP=heads // k.shape[2], K=key_dim, V=value_dim, BT=CHUNK,
        BV=block_v, STAGES=stages, USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state,
        STORE_STATES=store_states, WITH_OUTPUT=q is not None, SKIP=skip_chunks is not None, num_warps=warps,
    )
    return h, v_new, o, final


def chunk_dhu(q, k, w, g, do, dv, scale: float, dht=None, want_dh0: bool = False, config=None, skip_chunks=None):
    """(dh [B, NT, HV, V, K], dh0 [B, HV, V, K] fp32 or None, dv2 like do) as FLA's value-first
    `chunk_gated_delta_rule_bwd_dhu`, with q, k [B, T, H, K] and w [B, T, HV, K]; `config` = (BV, warps, stages)
    pins a tile. dv None: the kernel computes the chunks' own value gradient (FLA's `chunk_bwd_dv_local`) itself.
    `skip_chunks` (int32 [B, HV]): each (row, head) leaves out that many chunks at the end, `dht` entering the chunk
    before them (dh and dv2 of the chunks left out are not written)."""
    batch, seq_len, heads, key_dim = w.shape
    value_dim = do.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    block_v, warps, stages = _tile(value_dim, config, BACKWARD_CONFIGS if dv is not None else LOCAL_DV_CONFIGS)
    dh = q.new_empty(batch, chunks, heads, value_dim, key_dim)
    dv2 = torch.empty_like(do)
    dh0 = q.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if want_dh0 else None
    dht = None if dht is None else dht.contiguous()
    _chunk_state_bwd_kernel[(value_dim // block_v, batch * heads)](
        _descriptor(q, KEY_SLICE), _descriptor(k, KEY_SLICE), _descriptor(w, KEY_SLICE), _descriptor(do, block_v),
        _descriptor(do if dv is None else dv, block_v), g.contiguous(), dht, dh, dv2, dh0,
        _skips(skip_chunks, batch, heads), float(scale), seq_len, chunks,
        H=heads, GROUP=heads // q.shape[2], K=key_dim, V=value_dim, BT=CHUNK, BV=block_v, STAGES=stages,
        USE_FINAL_STATE_GRADIENT=dht is not None, USE_INITIAL_STATE=want_dh0, LOCAL_DV=dv is None,
        SKIP=skip_chunks is not None, num_warps=warps,
    )
    return dh, dh0, dv2
