"""GDN's chunk forward as one kernel: the state recurrence and the output, with the state never leaving registers.

The split forward runs the state recurrence (`state_tma.chunk_fwd_h`: per-chunk states h and v_new written to HBM)
and then FLA's `chunk_fwd_o` (which reads q, k, v_new and h back). Here each program owns one (value head, value
block), walks the chunks in order and, at each chunk, with the state S [BV, K] (value-first) held in registers:
    v_newᵀ = uᵀ − S·wᵀ,
    oᵀ = scale·((S·qᵀ) ⊙ 2^g_i + v_newᵀ·Mᵀ),  M_ij = q_i·k_j·2^(g_i − g_j) for j ≤ i (zero above the diagonal),
    S ← 2^g_last·S + (v_newᵀ ⊙ 2^(g_last − g))·k.
g is FLA's chunk-local cumulative log2 gate. The intra-chunk scores M are recomputed by every value block of a head
(as FLA's `chunk_fwd_o` does); h and v_new are written only when the backward is to reuse them (`store_states`).
This is FlashQLA's forward design (docs/design/gdn_kernels.md) in Triton, where the Triton interpreter checks it on
a CPU; rounding follows the split path's (the state and v_new enter the products in the input dtype).
"""

from __future__ import annotations

import torch

from megatron_muon.ops import state_tma
from megatron_muon.ops.state_tma import CHUNK, KEY_SLICE

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps the split forward
    triton = None


def qualifies(q, k, w, u, g, cu_seqlens, chunk_size: int) -> bool:
    """Where the state kernels qualify (`state_tma.qualifies`), with q shaped like k."""
    return q.shape == k.shape and state_tma.qualifies([q, k, w], [u], g, cu_seqlens, chunk_size)


if triton is not None:
    from megatron_muon.ops.state_tma import _chunk_gates, _load_slices, _state_slice, _store_rows, _store_slices

    @triton.jit
    def _slice_products(b_s, q_desc, k_desc, w_desc, key_where, where, BT: tl.constexpr, KS: tl.constexpr):
        """One 64-column key slice's share of (−S·wᵀ, S·qᵀ, k·qᵀ), with S's slice `b_s` in the input dtype."""
        b_q = q_desc.load(key_where).reshape(BT, KS)
        b_k = k_desc.load(key_where).reshape(BT, KS)
        b_w = w_desc.load(where).reshape(BT, KS)
        return -tl.dot(b_s, tl.trans(b_w)), tl.dot(b_s, tl.trans(b_q)), tl.dot(b_k, tl.trans(b_q))

    @triton.jit
    def _store_state_slice(h, b_s, i_b, i_t, NT, state, j: tl.constexpr, STORE: tl.constexpr, H: tl.constexpr,
                           V: tl.constexpr, K: tl.constexpr, KS: tl.constexpr):
        if STORE:
            tl.store(_state_slice(h, i_b, i_t, NT, state, j, H, V, K, KS), b_s)

    @triton.jit
    def _chunk_fwd_fused_kernel(
        q_desc, k_desc, w_desc, u_desc, g, h0, h, v_new, o, ht, scale, T, NT,
        H: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
        BV: tl.constexpr, STAGES: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
        STORE_STATES: tl.constexpr,
    ):  # fmt: skip
        """The state in key slices of 64 columns, as in `state_tma`'s kernels; H counts value heads."""
        KS: tl.constexpr = 64
        i_v = tl.program_id(0)
        i_bh = tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        o_v = i_v * BV + tl.arange(0, BV)
        state = (i_bh * V + o_v[:, None]) * K + tl.arange(0, KS)[None, :]  # slice 0 of a [B, H, V, K] state
        b_h0, b_h1, b_h2, b_h3 = _load_slices(h0, state, USE_INITIAL_STATE, K, BV, KS)
        column = (i_h * K).to(tl.int32)  # w's head
        key_column = (i_h // GROUP * K).to(tl.int32)  # q's and k's head
        rows = tl.arange(0, BT)
        causal = rows[:, None] <= rows[None, :]  # [j, i]: token j at or before token i
        for i_t in tl.range(0, NT, num_stages=STAGES):
            t0 = i_t * BT
            batch = i_b.to(tl.int32)
            dtype = w_desc.dtype
            b_s = b_h0.to(dtype)
            _store_state_slice(h, b_s, i_b, i_t, NT, state, 0, STORE_STATES, H, V, K, KS)
            b_vt, b_ot, b_kq = _slice_products(b_s, q_desc, k_desc, w_desc, [batch, t0, key_column],
                                               [batch, t0, column], BT, KS)
            if K > 64:
                b_s = b_h1.to(dtype)
                _store_state_slice(h, b_s, i_b, i_t, NT, state, 1, STORE_STATES, H, V, K, KS)
                d_vt, d_ot, d_kq = _slice_products(b_s, q_desc, k_desc, w_desc, [batch, t0, key_column + KS],
                                                   [batch, t0, column + KS], BT, KS)
                b_vt, b_ot, b_kq = b_vt + d_vt, b_ot + d_ot, b_kq + d_kq
            if K > 128:
                b_s = b_h2.to(dtype)
                _store_state_slice(h, b_s, i_b, i_t, NT, state, 2, STORE_STATES, H, V, K, KS)
                d_vt, d_ot, d_kq = _slice_products(b_s, q_desc, k_desc, w_desc, [batch, t0, key_column + 2 * KS],
                                                   [batch, t0, column + 2 * KS], BT, KS)
                b_vt, b_ot, b_kq = b_vt + d_vt, b_ot + d_ot, b_kq + d_kq
                b_s = b_h3.to(dtype)
                _store_state_slice(h, b_s, i_b, i_t, NT, state, 3, STORE_STATES, H, V, K, KS)
                d_vt, d_ot, d_kq = _slice_products(b_s, q_desc, k_desc, w_desc, [batch, t0, key_column + 3 * KS],
                                                   [batch, t0, column + 3 * KS], BT, KS)
                b_vt, b_ot, b_kq = b_vt + d_vt, b_ot + d_ot, b_kq + d_kq
            b_u = u_desc.load([batch, t0, (i_h * V + i_v * BV).to(tl.int32)]).reshape(BT, BV)
            b_vt += tl.trans(b_u).to(tl.float32)  # v_newᵀ [BV, BT]
            if STORE_STATES:
                _store_rows(v_new, b_vt.to(b_u.dtype), i_b, i_h, t0, T, o_v, H, V, BT)
            b_g, b_g_last, inside = _chunk_gates(g, i_b, i_h, t0, T, H, BT)
            gaps = tl.where(causal, b_g[None, :] - b_g[:, None], 0.0)  # [j, i]: g_i − g_j ≤ 0 on and below
            b_mt = tl.where(causal, b_kq * tl.exp2(gaps), 0.0).to(dtype)  # Mᵀ [BT, BT]
            b_vt_in = b_vt.to(dtype)
            b_ot = b_ot * tl.exp2(b_g)[None, :] + tl.dot(b_vt_in, b_mt)
            _store_rows(o, (b_ot * scale).to(b_u.dtype), i_b, i_h, t0, T, o_v, H, V, BT)
            b_vt = (b_vt * tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)[None, :]).to(dtype)
            decay = tl.exp2(b_g_last)
            b_h0 = b_h0 * decay + tl.dot(b_vt, k_desc.load([batch, t0, key_column]).reshape(BT, KS))
            if K > 64:
                b_h1 = b_h1 * decay + tl.dot(b_vt, k_desc.load([batch, t0, key_column + KS]).reshape(BT, KS))
            if K > 128:
                b_h2 = b_h2 * decay + tl.dot(b_vt, k_desc.load([batch, t0, key_column + 2 * KS]).reshape(BT, KS))
                b_h3 = b_h3 * decay + tl.dot(b_vt, k_desc.load([batch, t0, key_column + 3 * KS]).reshape(BT, KS))
        if STORE_FINAL_STATE:
            _store_slices(ht, state, b_h0, b_h1, b_h2, b_h3, K, KS)


# (BV, warps, stages); the first entry is the default. Every entry fits an sm90 block's shared memory at both reference
# shapes and only (32, 4, 2) spills, a little, at key dim 256 (`benchmarks/state_kernel_sass.py --fused`; 64-column
# value blocks spilled hundreds of bytes and are left out); which is fastest is measured by `gdn.py --chunk-op`.
FUSED_CONFIGS = [(32, 8, 2), (32, 4, 2), (16, 4, 2), (16, 8, 2)]


def chunk_fwd_fused(q, k, w, u, g, scale: float, initial_state=None, output_final_state: bool = False,
                    store_states: bool = False, config=None):
    """(o like u, final state [B, HV, V, K] fp32 or None, h [B, NT, HV, V, K] or None, v_new like u or None) for
    q, k [B, T, H, K], w [B, T, HV, K], u [B, T, HV, V] and g [B, T, HV] (chunk-local cumulative log2 gates);
    `store_states` also returns the per-chunk states and v_new (as `state_tma.chunk_fwd_h` does);
    `config` = (BV, warps, stages) pins a tile."""
    batch, seq_len, heads, key_dim = w.shape
    value_dim = u.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    block_v, warps, stages = state_tma._tile(value_dim, config, FUSED_CONFIGS)
    o = torch.empty_like(u)
    h = k.new_empty(batch, chunks, heads, value_dim, key_dim) if store_states else None
    v_new = torch.empty_like(u) if store_states else None
    final = k.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if output_final_state else None
    h0 = None if initial_state is None else initial_state.contiguous()
    _chunk_fwd_fused_kernel[(value_dim // block_v, batch * heads)](
        state_tma._descriptor(q, KEY_SLICE), state_tma._descriptor(k, KEY_SLICE), state_tma._descriptor(w, KEY_SLICE),
        state_tma._descriptor(u, block_v), g.contiguous(), h0, h, v_new, o, final, float(scale), seq_len, chunks,
        H=heads, GROUP=heads // k.shape[2], K=key_dim, V=value_dim, BT=CHUNK, BV=block_v, STAGES=stages,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state, STORE_STATES=store_states,
        num_warps=warps,
    )
    return o, final, h, v_new
