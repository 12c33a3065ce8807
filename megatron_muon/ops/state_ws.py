"""GDN's two chunk-state recurrences as warp-specialized Hopper kernels in Gluon (same contract as `state_tma`).

The Triton kernels (`state_tma.py`) keep the state value-major in registers and run Ampere-style MMAs, since a
32-row value block is too short for wgmma's 64-row tiles. Here the state is kept key-major, [K, BV] in four
64 × 32 slices, so every product of a chunk is a wgmma with a 64-row operand from shared memory:
    forward:  v_new = u − w·S,  S ← 2^g_last·S + kᵀ·(2^(g_last − g)·v_new),    with S = hᵀ
    backward: dv2 = dv + 2^(g_last − g)·k·dS,  M ← 2^g_last·M + wᵀ·dv2 + qᵀ·(−scale·2^g·do),  with M = −dS = −dhᵀ
(the backward keeps M = −dhᵀ so both products accumulate). One producer warp streams the chunk's key-side tiles
into a two-stage ring by TMA (all shared memory allows); the consumer warpgroup writes each chunk's state to shared
memory once, as the B operand of the first product and the source of the state's TMA store, and prefetches the
next chunk's gates (and do, dv) into registers. On the H200 at the hybrid-1.5B layer shape both recurrences are
faster than the Triton kernels and FLA's (docs/design/gdn_kernels.md).

Rounding differs from the Triton kernels in one place: the backward's −scale·2^g multiplies do before its bf16
cast (exact when scale is a power of two, as for key dim 64 or 256). Needs Triton's Gluon (`gluon_support`); a
batch of more than one sequence needs T to be a multiple of the chunk (the descriptors run over [B·T, ·] rows).
"""

from __future__ import annotations

import functools

import torch

from megatron_muon.kernels.gluon_support import (FRONTEND_ERRORS, KernelSwitch, TensorDescriptor,  # noqa: F401
                                                 fence_async_shared, gl, gluon, is_hopper, mbarrier, tma,
                                                 warpgroup_mma, warpgroup_mma_wait)

CHUNK = 64
KEY_SLICE = 64
BLOCK_V = 32  # the value block the GDN ops run; the launchers take others (16, 64, 128) for measurements
BLOCK_V_CHOICES = (16, 32, 64, 128)
STAGES = 2  # two stages of q, k, w slices (3 × 32 KB each) fill the backward's shared memory
SWITCH = KernelSwitch("warp-specialized Hopper GDN state kernel")


def ready(key_side: list, value_side: list) -> bool:
    """On top of `state_tma.qualifies` (which the caller checked): Gluon, an sm90 GPU, value blocks of 32, and one
    sequence or whole chunks."""
    first = key_side[0]
    batch, seq_len = first.shape[:2]
    return (SWITCH.available() and first.is_cuda and is_hopper(first.device.index or 0)
            and value_side[0].shape[-1] % BLOCK_V == 0 and (batch == 1 or seq_len % CHUNK == 0))


if gluon is not None:

    @gluon.jit
    def _ring_barriers():
        """The two-stage ring's barriers: "ready" (the producer's TMA loads landed), "empty" (the consumer is done)."""
        ready_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ready_bars.index(i), count=1)
            mbarrier.init(empty_bars.index(i), count=1)
        return ready_bars, empty_bars

    @gluon.jit
    def _load_chunk(descs, bufs, bar, row, col, NS: gl.constexpr, slot):
        for j in gl.static_range(NS):
            tma.async_copy_global_to_shared(descs, [row, col + j * 64], bar, bufs.index(slot * NS + j))

    @gluon.jit
    def _key_loader(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, u_desc, u_bufs, ready_bars, empty_bars,
                    row0, a_col, b_col, c_col, v_col, NT, NS: gl.constexpr, THREE: gl.constexpr, WITH_U: gl.constexpr,
                    REVERSE: gl.constexpr):
        """Producer warp: each chunk's key-side slices (two or three tensors, each at its own head's columns) and
        optionally its u tile."""
        nbytes: gl.constexpr = ((3 if THREE else 2) * NS * a_desc.block_type.nbytes
                                + (u_desc.block_type.nbytes if WITH_U else 0))
        for i in range(NT):
            slot = i % 2
            mbarrier.wait(empty_bars.index(slot), ((i // 2) & 1) ^ 1)
            bar = ready_bars.index(slot)
            mbarrier.expect(bar, nbytes)
            row = row0 + ((NT - 1 - i) if REVERSE else i) * 64
            _load_chunk(a_desc, a_bufs, bar, row, a_col, NS, slot)
            _load_chunk(b_desc, b_bufs, bar, row, b_col, NS, slot)
            if THREE:
                _load_chunk(c_desc, c_bufs, bar, row, c_col, NS, slot)
            if WITH_U:
                tma.async_copy_global_to_shared(u_desc, [row, v_col], bar, u_bufs.index(slot))

    @gluon.jit
    def _store_state(sb0, sb1, sb2, sb3, s0, s1, s2, s3, desc, row, NS: gl.constexpr, SIGN: gl.constexpr,
                     TO_GLOBAL: gl.constexpr = True):
        """SIGN·state (bf16) into the four slice buffers (as [BV, 64] value-major tiles), then TMA-stored (unless
        not TO_GLOBAL)."""
        dtype: gl.constexpr = desc.dtype
        sb0.permute((1, 0)).store((s0 * SIGN).to(dtype))
        if NS > 1:
            sb1.permute((1, 0)).store((s1 * SIGN).to(dtype))
        if NS > 2:
            sb2.permute((1, 0)).store((s2 * SIGN).to(dtype))
            sb3.permute((1, 0)).store((s3 * SIGN).to(dtype))
        fence_async_shared()
        if TO_GLOBAL:
            tma.async_copy_shared_to_global(desc, [row, 0], sb0)
            if NS > 1:
                tma.async_copy_shared_to_global(desc, [row, 64], sb1)
            if NS > 2:
                tma.async_copy_shared_to_global(desc, [row, 128], sb2)
                tma.async_copy_shared_to_global(desc, [row, 192], sb3)

    @gluon.jit
    def _times_state(bufs, base, sb0, sb1, sb2, sb3, acc, NS: gl.constexpr):
        """acc = Σ_j tile_j · state_j: a [64, BV] product over the key slices."""
        acc = warpgroup_mma(bufs.index(base), sb0.permute((1, 0)), acc, is_async=True)
        if NS > 1:
            acc = warpgroup_mma(bufs.index(base + 1), sb1.permute((1, 0)), acc, is_async=True)
        if NS > 2:
            acc = warpgroup_mma(bufs.index(base + 2), sb2.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(bufs.index(base + 3), sb3.permute((1, 0)), acc, is_async=True)
        return warpgroup_mma_wait(0, deps=(acc, ))

    @gluon.jit
    def _causal_scores(a_bufs, b_bufs, base, b_g, NS: gl.constexpr, LOWER: gl.constexpr):
        """[64, 64] fp32: a·bᵀ over the key slices, times 2^(g_r − g_c) on and below the diagonal (LOWER; a = q,
        b = k: the forward's scores M) or 2^(g_c − g_r) on and above it (a = k, b = q: Mᵀ), zero elsewhere."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 64, 16])
        acc = warpgroup_mma(a_bufs.index(base), b_bufs.index(base).permute((1, 0)),
                            gl.zeros([64, 64], gl.float32, layout), is_async=True)
        if NS > 1:
            acc = warpgroup_mma(a_bufs.index(base + 1), b_bufs.index(base + 1).permute((1, 0)), acc, is_async=True)
        if NS > 2:
            acc = warpgroup_mma(a_bufs.index(base + 2), b_bufs.index(base + 2).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a_bufs.index(base + 3), b_bufs.index(base + 3).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        g_rows = gl.convert_layout(b_g, gl.SliceLayout(1, layout))
        g_cols = gl.convert_layout(b_g, gl.SliceLayout(0, layout))
        if LOWER:
            kept = rows[:, None] >= cols[None, :]
            gaps = gl.where(kept, g_rows[:, None] - g_cols[None, :], 0.0)
        else:
            kept = rows[:, None] <= cols[None, :]
            gaps = gl.where(kept, g_cols[None, :] - g_rows[:, None], 0.0)
        return gl.where(kept, acc * gl.exp2(gaps), 0.0)

    @gluon.jit
    def _add_transposed(bufs, base, values, s0, s1, s2, s3, NS: gl.constexpr):
        """state_j += tile_jᵀ · values, issued asynchronously (the caller waits)."""
        s0 = warpgroup_mma(bufs.index(base).permute((1, 0)), values, s0, is_async=True)
        if NS > 1:
            s1 = warpgroup_mma(bufs.index(base + 1).permute((1, 0)), values, s1, is_async=True)
        if NS > 2:
            s2 = warpgroup_mma(bufs.index(base + 2).permute((1, 0)), values, s2, is_async=True)
            s3 = warpgroup_mma(bufs.index(base + 3).permute((1, 0)), values, s3, is_async=True)
        return s0, s1, s2, s3

    @gluon.jit
    def _state_io(ptr, i_bh, i_v, s0, s1, s2, s3, LOAD: gl.constexpr, SIGN: gl.constexpr, V: gl.constexpr,
                  K: gl.constexpr):
        """Load SIGN·(a [V, K] fp32 state's key slices) from `ptr` (LOAD) or store SIGN·slices there. The
        offsets are built here, not kept across the chunk loop, where registers are short."""
        NS: gl.constexpr = K // 64
        layout: gl.constexpr = s0.type.layout
        BV: gl.constexpr = s0.shape[1]
        o_k = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        o_v = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
        state = (i_bh * V + o_v[None, :]).to(gl.int64) * K + o_k[:, None]  # slice 0, key-major
        if LOAD:
            s0 += gl.load(ptr + state) * SIGN
            if NS > 1:
                s1 += gl.load(ptr + state + 64) * SIGN
            if NS > 2:
                s2 += gl.load(ptr + state + 128) * SIGN
                s3 += gl.load(ptr + state + 192) * SIGN
        else:
            gl.store(ptr + state, s0 * SIGN)
            if NS > 1:
                gl.store(ptr + state + 64, s1 * SIGN)
            if NS > 2:
                gl.store(ptr + state + 128, s2 * SIGN)
                gl.store(ptr + state + 192, s3 * SIGN)
        return s0, s1, s2, s3

    @gluon.jit
    def _chunk_rows(do, dv, g, row0, t0, T, o_t, value_cols, i_h, H: gl.constexpr, V: gl.constexpr,
                    WITH_VALUES: gl.constexpr):
        """The chunk at t0's gates, last gate, and (WITH_VALUES) do and dv tiles; zeros outside [0, T)."""
        inside = (t0 + o_t < T) & (t0 >= 0)
        rows = (row0 + t0 + o_t).to(gl.int64)
        b_g = gl.load(g + rows * H + i_h, mask=inside, other=0.0)
        b_g_last = gl.load(g + (row0 + gl.maximum(gl.minimum(t0 + 64, T) - 1, 0)) * H + i_h)
        b_do = b_g
        b_dv = b_g
        if WITH_VALUES:
            where = rows[:, None] * (H * V) + value_cols[None, :]
            b_do = gl.load(do + where, mask=inside[:, None], other=0.0)
            b_dv = gl.load(dv + where, mask=inside[:, None], other=0.0)
        return b_g, b_g_last, b_do, b_dv

    @gluon.jit
    def _forward_consumer(q_bufs, k_bufs, w_bufs, u_bufs, ready_bars, empty_bars, sb0, sb1, sb2, sb3, v_bufs, vg_buf,
                          m_buf, o_bufs, h_desc, v_desc, o_desc, g, h0, ht, scale, T, NT, row0, v_col, i_b, i_h, i_v,
                          i_bh, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                          USE_INITIAL_STATE: gl.constexpr, STORE_FINAL_STATE: gl.constexpr,
                          STORE_STATES: gl.constexpr, WITH_OUTPUT: gl.constexpr):
        """STORE_STATES: each chunk's state and v_new go to HBM. WITH_OUTPUT: the output too,
        o = scale·(2^g ⊙ (q·S) + M·v_new) with M = causal(q·kᵀ ⊙ 2^(g_i − g_j)) (`ops/chunk_fwd_fused_ws.py`)."""
        NS: gl.constexpr = K // 64
        STORES: gl.constexpr = (NS + 1 if STORE_STATES else 0) + (1 if WITH_OUTPUT else 0)  # TMA stores a chunk
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
            if WITH_OUTPUT:
                m_buf.store(_causal_scores(q_bufs, k_bufs, slot * NS, b_g, NS, True).to(dtype))
            fence_async_shared()
            if STORE_STATES:
                tma.async_copy_shared_to_global(v_desc, [row0 + t0, v_col], v_bufs.index(cur))
            if WITH_OUTPUT:
                out = _times_state(q_bufs, slot * NS, c0, c1, c2, c3, gl.zeros([64, BV], gl.float32, acc_layout),
                                   NS)
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
    def _chunk_state_fwd_ws_kernel(q_desc, k_desc, w_desc, u_desc, h_desc, v_desc, o_desc, g, h0, ht, scale, T, NT,
                                   H: gl.constexpr, GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                                   BV: gl.constexpr, USE_INITIAL_STATE: gl.constexpr,
                                   STORE_FINAL_STATE: gl.constexpr, STORE_STATES: gl.constexpr,
                                   WITH_OUTPUT: gl.constexpr):
        """H counts value heads; q and k are read at key head i_h // GROUP, w at value head i_h; q_desc, o_desc and
        scale are unused without WITH_OUTPUT."""
        NS: gl.constexpr = K // 64
        dtype: gl.constexpr = k_desc.dtype
        i_v, i_bh = gl.program_id(0), gl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        k_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], k_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], w_desc.layout)
        u_bufs = gl.allocate_shared_memory(dtype, [2, 64, BV], u_desc.layout)
        # the state's key slices, one allocation each (one buffer would order their stores by block barriers)
        sb0 = gl.allocate_shared_memory(dtype, [2, BV, 64], h_desc.layout)
        sb1 = gl.allocate_shared_memory(dtype, [2, BV, 64], h_desc.layout)
        sb2 = gl.allocate_shared_memory(dtype, [2, BV, 64], h_desc.layout)
        sb3 = gl.allocate_shared_memory(dtype, [2, BV, 64], h_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [2, 64, BV], v_desc.layout)
        vg_buf = gl.allocate_shared_memory(dtype, [64, BV], v_desc.layout)
        if WITH_OUTPUT:
            q_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], q_desc.layout)
            m_buf = gl.allocate_shared_memory(dtype, [64, 64], k_desc.layout)
            o_bufs = gl.allocate_shared_memory(dtype, [2, 64, BV], o_desc.layout)
        else:  # not read
            q_bufs, m_buf, o_bufs = k_bufs, vg_buf, v_bufs
        ready_bars, empty_bars = _ring_barriers()
        row0 = i_b * T
        v_col = i_h * V + i_v * BV
        gl.warp_specialize([
            (_forward_consumer, (q_bufs, k_bufs, w_bufs, u_bufs, ready_bars, empty_bars, sb0, sb1, sb2, sb3, v_bufs,
                                 vg_buf, m_buf, o_bufs, h_desc, v_desc, o_desc, g, h0, ht, scale, T, NT, row0, v_col,
                                 i_b, i_h, i_v, i_bh, H, K, V, BV, USE_INITIAL_STATE, STORE_FINAL_STATE,
                                 STORE_STATES, WITH_OUTPUT)),
            (_key_loader, (k_desc, w_desc, q_desc, k_bufs, w_bufs, q_bufs, u_desc, u_bufs, ready_bars, empty_bars,
                           row0, i_h // GROUP * K, i_h * K, i_h // GROUP * K, v_col, NT, NS, WITH_OUTPUT, True,
                           False)),
        ], [1], [40])

    @gluon.jit
    def _backward_consumer(q_bufs, k_bufs, w_bufs, ready_bars, empty_bars, sb0, sb1, sb2, sb3, dv2_buf, dog_buf,
                           m_buf, dh_desc,
                           dv2_desc, do, dv, g, dht, dh0, scale, T, NT, row0, i_b, i_h, i_v, i_bh, H: gl.constexpr,
                           K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                           USE_FINAL_STATE_GRADIENT: gl.constexpr, USE_INITIAL_STATE: gl.constexpr,
                           LOCAL_DV: gl.constexpr):
        """With LOCAL_DV the chunk's own value gradient, scale·Mᵀ·do, is computed here (dog_buf first holds
        scale·do as its operand) instead of read from dv."""
        NS: gl.constexpr = K // 64
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BV, 16])
        rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        dtype: gl.constexpr = dv2_desc.dtype
        o_v = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, acc_layout))
        m0 = gl.zeros([64, BV], gl.float32, acc_layout)  # M = −dhᵀ, key-major slices
        m1, m2, m3 = m0, m0, m0
        if USE_FINAL_STATE_GRADIENT:
            m0, m1, m2, m3 = _state_io(dht, i_bh, i_v, m0, m1, m2, m3, True, -1.0, V, K)
        o_t = gl.arange(0, 64, layout=rows_layout)
        value_cols = i_h * V + o_v
        b_g, b_g_last, b_do, b_dv = _chunk_rows(do, dv, g, row0, (NT - 1) * 64, T, o_t, value_cols, i_h, H, V, True)
        for i in range(NT):
            i_t = NT - 1 - i
            t0 = i_t * 64
            slot = i % 2
            upcoming = _chunk_rows(do, dv, g, row0, t0 - 64, T, o_t, value_cols, i_h, H, V, True)
            tma.store_wait(0)  # the previous chunk's dh and dv2 stores have read their buffers
            _store_state(sb0, sb1, sb2, sb3, m0, m1, m2, m3, dh_desc, ((i_b * NT + i_t) * H + i_h) * V + i_v * BV,
                         NS, -1.0)
            mbarrier.wait(ready_bars.index(slot), (i // 2) & 1)
            acc = _times_state(k_bufs, slot * NS, sb0, sb1, sb2, sb3, gl.zeros([64, BV], gl.float32, acc_layout),
                               NS)
            gate = gl.where(t0 + o_t < T, gl.exp2(b_g_last - b_g), 0.0)
            if LOCAL_DV:
                dog_buf.store((b_do.to(gl.float32) * scale).to(dtype))
                m_buf.store(_causal_scores(k_bufs, q_bufs, slot * NS, b_g, NS, False).to(dtype))
                fence_async_shared()
                own = warpgroup_mma(m_buf, dog_buf, gl.zeros([64, BV], gl.float32, acc_layout), is_async=True)
                own = warpgroup_mma_wait(0, deps=(own, ))
            else:
                own = b_dv.to(gl.float32)
            dv2_buf.store((acc * gate[:, None] + own).to(dtype))
            dog_buf.store((b_do.to(gl.float32) * (gl.exp2(b_g) * -scale)[:, None]).to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dv2_desc, [row0 + t0, i_h * V + i_v * BV], dv2_buf)
            decay = gl.exp2(b_g_last)
            m0, m1, m2, m3 = _add_transposed(w_bufs, slot * NS, dv2_buf, m0 * decay, m1 * decay, m2 * decay,
                                             m3 * decay, NS)
            m0, m1, m2, m3 = _add_transposed(q_bufs, slot * NS, dog_buf, m0, m1, m2, m3, NS)
            m0, m1, m2, m3 = warpgroup_mma_wait(0, deps=(m0, m1, m2, m3))
            mbarrier.arrive(empty_bars.index(slot), count=1)
            b_g, b_g_last, b_do, b_dv = upcoming
        tma.store_wait(0)
        if USE_INITIAL_STATE:
            _state_io(dh0, i_bh, i_v, m0, m1, m2, m3, False, -1.0, V, K)

    @gluon.jit
    def _chunk_state_bwd_ws_kernel(q_desc, k_desc, w_desc, dh_desc, dv2_desc, do, dv, g, dht, dh0, scale, T, NT,
                                   H: gl.constexpr, GROUP: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                                   BV: gl.constexpr, USE_FINAL_STATE_GRADIENT: gl.constexpr,
                                   USE_INITIAL_STATE: gl.constexpr, LOCAL_DV: gl.constexpr):
        """H counts value heads; q and k are read at key head i_h // GROUP, w at value head i_h. LOCAL_DV: the
        chunks' own value gradient is computed here, dv is not read."""
        NS: gl.constexpr = K // 64
        dtype: gl.constexpr = k_desc.dtype
        i_v, i_bh = gl.program_id(0), gl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        q_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], k_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [2 * NS, 64, 64], w_desc.layout)
        sb0 = gl.allocate_shared_memory(dtype, [BV, 64], dh_desc.layout)
        sb1 = gl.allocate_shared_memory(dtype, [BV, 64], dh_desc.layout)
        sb2 = gl.allocate_shared_memory(dtype, [BV, 64], dh_desc.layout)
        sb3 = gl.allocate_shared_memory(dtype, [BV, 64], dh_desc.layout)
        dv2_buf = gl.allocate_shared_memory(dtype, [64, BV], dv2_desc.layout)
        dog_buf = gl.allocate_shared_memory(dtype, [64, BV], dv2_desc.layout)
        if LOCAL_DV:
            m_buf = gl.allocate_shared_memory(dtype, [64, 64], q_desc.layout)
        else:
            m_buf = dog_buf  # not read
        ready_bars, empty_bars = _ring_barriers()
        row0 = i_b * T
        gl.warp_specialize([
            (_backward_consumer, (q_bufs, k_bufs, w_bufs, ready_bars, empty_bars, sb0, sb1, sb2, sb3, dv2_buf,
                                  dog_buf, m_buf, dh_desc,
                                  dv2_desc, do, dv, g, dht, dh0, scale, T, NT, row0, i_b, i_h, i_v, i_bh, H, K, V,
                                  BV, USE_FINAL_STATE_GRADIENT, USE_INITIAL_STATE, LOCAL_DV)),
            (_key_loader, (k_desc, w_desc, q_desc, k_bufs, w_bufs, q_bufs, dv2_desc, dog_buf, ready_bars,
                           empty_bars, row0, i_h // GROUP * K, i_h * K, i_h // GROUP * K, 0, NT, NS, True, False,
                           True)),
        ], [1], [40])


@functools.cache
def _layouts(dtype: torch.dtype, block_v: int = BLOCK_V):
    """Shared layouts of (a [64, 64] key-side slice, a [BV, 64] state slice, a [64, BV] value tile)."""
    element = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return tuple(gl.NVMMASharedLayout.get_default_for(shape, element)
                 for shape in ([CHUNK, KEY_SLICE], [block_v, KEY_SLICE], [CHUNK, block_v]))


def _check_block_v(block_v: int, value_dim: int) -> None:
    if block_v not in BLOCK_V_CHOICES or value_dim % block_v:
        raise ValueError(f"value block {block_v} for value dim {value_dim}: pick one of {BLOCK_V_CHOICES} that "
                         "divides the value dim")


def _rows(t: torch.Tensor, block: list, layout):
    """A 2-D TMA descriptor over a contiguous [B, T, heads, dim] (or [..., dim]) tensor's [rows, heads·dim] view."""
    flat = t.view(-1, t.shape[-1]) if t.dim() != 4 else t.view(t.shape[0] * t.shape[1], -1)
    return TensorDescriptor.from_tensor(flat, block, layout)


def _outputs(key: torch.Tensor, value: torch.Tensor, want_boundary: bool, block_v: int = BLOCK_V):
    """(per-chunk states [B, NT, H, V, K], a tensor like `value`, a [B, H, V, K] fp32 boundary state or None) and
    the launch grid (value blocks, batch·heads), for a key-side tensor `key` with the value heads (w)."""
    batch, seq_len, heads, key_dim = key.shape
    value_dim = value.shape[-1]
    states = key.new_empty(batch, -(-seq_len // CHUNK), heads, value_dim, key_dim)
    boundary = key.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if want_boundary else None
    return (states, torch.empty_like(value), boundary), (value_dim // block_v, batch * heads)


def _lengths_and_dims(states: torch.Tensor, seq_len: int, key_heads: int) -> tuple:
    """The kernels' (T, NT, H, GROUP, K, V) arguments, from the [B, NT, H, V, K] per-chunk states."""
    _, chunks, heads, value_dim, key_dim = states.shape
    return seq_len, chunks, heads, heads // key_heads, key_dim, value_dim


def chunk_fwd_h(k, w, u, g, initial_state=None, output_final_state: bool = False, block_v: int = BLOCK_V):
    """`state_tma.chunk_fwd_h` on the warp-specialized kernel (where `ready`)."""
    h, v_new, _, final = chunk_forward(k, w, u, g, initial_state, output_final_state, block_v=block_v)
    return h, v_new, final


def chunk_forward(k, w, u, g, initial_state=None, output_final_state: bool = False, *, q=None, scale: float = 1.0,
                  store_states: bool = True, block_v: int = BLOCK_V):
    """The forward kernel's launcher: (h, v_new, o, final state), each None where not asked for; with q the kernel
    also computes the output (`ops/chunk_fwd_fused_ws.py`). Without `store_states` h and v_new stay in shared
    memory; their descriptors then only lend their layouts."""
    batch, seq_len, heads, key_dim = w.shape
    value_dim = u.shape[-1]
    _check_block_v(block_v, value_dim)
    key, state, value = _layouts(k.dtype, block_v)
    h = k.new_empty(batch, -(-seq_len // CHUNK) if store_states else 1, heads, value_dim, key_dim)
    o = None if q is None else torch.empty_like(u)
    v_new = torch.empty_like(u) if store_states or o is None else o  # never written then: o's memory lends it
    final = k.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if output_final_state else None
    h0 = None if initial_state is None else initial_state.contiguous()
    k_tiles, v_tiles = _rows(k, [CHUNK, KEY_SLICE], key), _rows(v_new, [CHUNK, block_v], value)
    _chunk_state_fwd_ws_kernel[(value_dim // block_v, batch * heads)](
        k_tiles if q is None else _rows(q, [CHUNK, KEY_SLICE], key), k_tiles, _rows(w, [CHUNK, KEY_SLICE], key),
        _rows(u, [CHUNK, block_v], value), _rows(h, [block_v, KEY_SLICE], state), v_tiles,
        v_tiles if o is None else _rows(o, [CHUNK, block_v], value), g.contiguous(), h if h0 is None else h0,
        h if final is None else final, float(scale), seq_len, -(-seq_len // CHUNK), heads, heads // k.shape[2],
        key_dim, value_dim, block_v, h0 is not None, output_final_state, store_states, q is not None, num_warps=4,
    )
    return (h, v_new, o, final) if store_states else (None, None, o, final)


def chunk_dhu(q, k, w, g, do, dv, scale: float, dht=None, want_dh0: bool = False, block_v: int = BLOCK_V):
    """`state_tma.chunk_dhu` on the warp-specialized kernel (where `ready`); dv None: the chunks' own value
    gradient is computed in the kernel."""
    _check_block_v(block_v, do.shape[-1])
    (dh, dv2, dh0), grid = _outputs(w, do, want_dh0, block_v)
    key, state, value = _layouts(q.dtype, block_v)
    dht = None if dht is None else dht.contiguous()
    do = do.contiguous()
    _chunk_state_bwd_ws_kernel[grid](
        _rows(q, [CHUNK, KEY_SLICE], key), _rows(k, [CHUNK, KEY_SLICE], key), _rows(w, [CHUNK, KEY_SLICE], key),
        _rows(dh, [block_v, KEY_SLICE], state), _rows(dv2, [CHUNK, block_v], value), do,
        do if dv is None else dv.contiguous(), g.contiguous(), dh if dht is None else dht, dh if dh0 is None else dh0,
        float(scale), *_lengths_and_dims(dh, q.shape[1], q.shape[2]), block_v, dht is not None, want_dh0,
        dv is None, num_warps=4,
    )
    return dh, dh0, dv2
