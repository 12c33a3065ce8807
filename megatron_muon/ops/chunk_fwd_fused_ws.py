"""The fused chunk forward (`chunk_fwd_fused.py`: state recurrence and output in one kernel) as a warp-specialized
Hopper kernel in Gluon, on the skeleton of `state_ws`'s forward.

The producer warp streams k, w and q slices and the u tile into the two-stage ring by TMA; the consumer warpgroup
keeps the state key-major in registers and writes it to shared memory once per chunk (the B operand of its
products), as `state_ws` does, and adds the output: oᵀ's rows o = scale·(2^g ⊙ (q·S) + M·v_new) with
M = causal(q·kᵀ ⊙ 2^(g_i − g_j)), three more wgmma products (q·S, q·kᵀ, M·v_new) that do not depend on the state
update. h and v_new go to HBM only when the backward keeps them. The q, k and w rings take 48 KiB per key slice,
so the kernel takes key dims up to 128 (Qwen3-Next's heads); wider keys stay on the Triton kernel.
"""

from __future__ import annotations

import torch

from megatron_muon.ops import state_ws
from megatron_muon.kernels.gluon_support import KernelSwitch
from megatron_muon.ops.state_ws import BLOCK_V, CHUNK, KEY_SLICE, gl, gluon

MAX_KEY_DIM = 128
SWITCH = KernelSwitch("warp-specialized Hopper GDN fused chunk forward")


def ready(q, k, w, u) -> bool:
    """On top of `chunk_fwd_fused.qualifies` (which the caller checked): what `state_ws.ready` asks, K ≤ 128, and
    no earlier compile failure of this kernel."""
    return q.shape[-1] <= MAX_KEY_DIM and SWITCH.available() and state_ws.ready([q, k, w], [u])


if gluon is not None:
    from megatron_muon.ops.state_ws import (_add_transposed, _causal_scores, _chunk_rows, _key_loader,
                                            _ring_barriers, _state_io, _store_state, _times_state,
                                            fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    @gluon.jit
    def _fused_forward_consumer(q_bufs, k_bufs, w_bufs, u_bufs, ready_bars, empty_bars, sb0, sb1, sb2, sb3, v_bufs,
                                vg_buf, m_buf, o_bufs, h_desc, v_desc, o_desc, g, h0, ht, scale, T, NT, row0, v_col,
                                i_b, i_h, i_v, i_bh, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                                BV: gl.constexpr, USE_INITIAL_STATE: gl.constexpr, STORE_FINAL_STATE: gl.constexpr,
                                STORE_STATES: gl.constexpr):
        NS: gl.constexpr = K // 64
        STORES: gl.constexpr = 1 + (NS + 1 if STORE_STATES else 0)  # TMA stores issued per chunk
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BV, 16])
        rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        dtype: gl.constexpr = v_desc.dtype
        o_v = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, acc_layout))
        s0 = gl.zeros([64, BV], gl.float32, acc_layout)
        s1, s2, s3 = s0, s0, s0
        if USE_INITIAL_STATE:
            s0, s1, s2, s3 = _state_io(h0, i_bh, i_v, s0, s1, s2, s3, True, 1.0, V, K)
        o_t = gl.arange(0, 64, layout=rows_layout)
        b_g, b_g_last, _, _ = _chunk_rows(g, g, g, row0, 0, T, o_t, o_v, i_h, H, V, False)
        for i_t in range(NT):
            t0 = i_t * 64
            slot = i_t % 2
            cur = i_t % 2
            g_next, g_last_next, _, _ = _chunk_rows(g, g, g, row0, t0 + 64, T, o_t, o_v, i_h, H, V, False)
            tma.store_wait(STORES)  # chunk i_t − 2's stores out of this buffer pair have completed
            c0, c1, c2, c3 = sb0.index(cur), sb1.index(cur), sb2.index(cur), sb3.index(cur)
            _store_state(c0, c1, c2, c3, s0, s1, s2, s3, h_desc, ((i_b * NT + i_t) * H + i_h) * V + i_v * BV,
                         NS, 1.0, STORE_STATES)
            mbarrier.wait(ready_bars.index(slot), (i_t // 2) & 1)
            acc = _times_state(w_bufs, slot * NS, c0, c1, c2, c3, gl.zeros([64, BV], gl.float32, acc_layout),
                               NS)
            v_new = u_bufs.index(slot).load(acc_layout).to(gl.float32) - acc
            v_bufs.index(cur).store(v_new.to(dtype))
            gate = gl.where(t0 + o_t < T, gl.exp2(b_g_last - b_g), 0.0)
            vg_buf.store((v_new * gate[:, None]).to(dtype))
            m_buf.store(_causal_scores(q_bufs, k_bufs, slot * NS, b_g, NS, True).to(dtype))
            fence_async_shared()
            if STORE_STATES:
                tma.async_copy_shared_to_global(v_desc, [row0 + t0, v_col], v_bufs.index(cur))
            out = _times_state(q_bufs, slot * NS, c0, c1, c2, c3, gl.zeros([64, BV], gl.float32, acc_layout), NS)
            out = warpgroup_mma(m_buf, v_bufs.index(cur), out * gl.exp2(b_g)[:, None], is_async=True)
            out = warpgroup_mma_wait(0, deps=(out, ))
            o_bufs.index(cur).store((out * scale).to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [row0 + t0, v_col], o_bufs.index(cur))
            decay = gl.exp2(b_g_last)
            s0, s1, s2, s3 = _add_transposed(k_bufs, slot * NS, vg_buf, s0 * decay, s1 * decay, s2 * decay,
                                             s3 * decay, NS)
            s0, s1, s2, s3 = warpgroup_mma_wait(0, deps=(s0, s1, s2, s3))
            mbarrier.arrive(empty_bars.index(slot), count=1)
            b_g, b_g_last = g_next, g_last_next
        tma.store_wait(0)
        if STORE_FINAL_STATE:
            _state_io(ht, i_bh, i_v, s0, s1, s2, s3, False, 1.0, V, K)

    @gluon.jit
    def _chunk_fwd_fused_ws_kernel(q_desc, k_desc, w_desc, u_desc, h_desc, v_desc, o_desc, g, h0, ht, scale, T, NT,
                                   H: gl.constexpr, GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                                   BV: gl.constexpr, USE_INITIAL_STATE: gl.constexpr,
                                   STORE_FINAL_STATE: gl.constexpr, STORE_STATES: gl.constexpr):
        """H counts value heads; q and k are read at key head i_h // GROUP, w at value head i_h."""
        NS: gl.constexpr = K // 64
        dtype: gl.constexpr = k_desc.dtype
        i_v, i_bh = gl.program_id(0), gl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        q_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], k_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], w_desc.layout)
        u_bufs = gl.allocate_shared_memory(dtype, [2, 64, BV], u_desc.layout)
        sb0 = gl.allocate_shared_memory(dtype, [2, BV, 64], h_desc.layout)
        sb1 = gl.allocate_shared_memory(dtype, [2, BV, 64], h_desc.layout)
        sb2 = gl.allocate_shared_memory(dtype, [2, BV, 64], h_desc.layout)
        sb3 = gl.allocate_shared_memory(dtype, [2, BV, 64], h_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [2, 64, BV], v_desc.layout)
        vg_buf = gl.allocate_shared_memory(dtype, [64, BV], v_desc.layout)
        m_buf = gl.allocate_shared_memory(dtype, [64, 64], k_desc.layout)
        o_bufs = gl.allocate_shared_memory(dtype, [2, 64, BV], o_desc.layout)
        ready_bars, empty_bars = _ring_barriers()
        row0 = i_b * T
        v_col = i_h * V + i_v * BV
        gl.warp_specialize([
            (_fused_forward_consumer, (q_bufs, k_bufs, w_bufs, u_bufs, ready_bars, empty_bars, sb0, sb1, sb2, sb3,
                                       v_bufs, vg_buf, m_buf, o_bufs, h_desc, v_desc, o_desc, g, h0, ht, scale, T,
                                       NT, row0, v_col, i_b, i_h, i_v, i_bh, H, K, V, BV, USE_INITIAL_STATE,
                                       STORE_FINAL_STATE, STORE_STATES)),
            (_key_loader, (k_desc, w_desc, q_desc, k_bufs, w_bufs, q_bufs, u_desc, u_bufs, ready_bars, empty_bars,
                           row0, i_h // GROUP * K, i_h * K, i_h // GROUP * K, v_col, NT, NS, True, True, False)),
        ], [1], [40])


def chunk_fwd_fused(q, k, w, u, g, scale: float, initial_state=None, output_final_state: bool = False,
                    store_states: bool = False):
    """`chunk_fwd_fused.chunk_fwd_fused` on the warp-specialized kernel (where `ready`)."""
    batch, seq_len, heads, key_dim = w.shape
    value_dim = u.shape[-1]
    chunks = -(-seq_len // CHUNK)
    key, state, value = state_ws._layouts(k.dtype)
    o = torch.empty_like(u)
    # without kept states the kernel stores no h or v_new: its descriptors then only lend their layouts
    h = k.new_empty(batch, chunks if store_states else 1, heads, value_dim, key_dim)
    v_new = torch.empty_like(u) if store_states else o
    final = k.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if output_final_state else None
    h0 = None if initial_state is None else initial_state.contiguous()
    _chunk_fwd_fused_ws_kernel[(value_dim // BLOCK_V, batch * heads)](
        state_ws._rows(q, [CHUNK, KEY_SLICE], key), state_ws._rows(k, [CHUNK, KEY_SLICE], key),
        state_ws._rows(w, [CHUNK, KEY_SLICE], key), state_ws._rows(u, [CHUNK, BLOCK_V], value),
        state_ws._rows(h, [BLOCK_V, KEY_SLICE], state), state_ws._rows(v_new, [CHUNK, BLOCK_V], value),
        state_ws._rows(o, [CHUNK, BLOCK_V], value), g.contiguous(), h if h0 is None else h0,
        h if final is None else final, float(scale), seq_len, chunks, heads, heads // k.shape[2], key_dim, value_dim,
        BLOCK_V, h0 is not None, output_final_state, store_states, num_warps=4,
    )
    return o, final, (h if store_states else None), (v_new if store_states else None)


__all__ = ["MAX_KEY_DIM", "SWITCH", "chunk_fwd_fused", "ready"]
