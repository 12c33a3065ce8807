"""GDN's whole chunk backward as one Triton program per value head that walks the chunks backwards with the state
gradient in registers: the state-gradient recurrence with the chunks' own value gradient (FLA's
`chunk_gated_delta_rule_bwd_dhu` and `chunk_bwd_dv_local`), the chunk output gradients (`ops/dqkwg.py`), FLA's WY
backward and the gate gradient's chunk-local reverse cumulative sum.

This is FlashQLA's backward structure (docs/design/gdn_kernels.md): the per-chunk state gradients dh never go to HBM
(the split path writes them in one kernel and reads them back in the next), and each chunk's tiles are read once.
A program holds a head's whole dh [V, K] in fp32, so it takes K and V up to 128 (Qwen3-Next's heads); at wider heads
dh does not fit one SM and the key-side gradients would need summing across programs. Where one program per value
head would leave SMs idle, each sequence is cut into segments of whole chunks that run side by side, each from the
exact state gradient at its end (`segment_ends`, from the state-gradient recurrence's per-chunk dh).

Per chunk, from the last (g the chunk-local cumulative log2 gate, dh the gradient of the state after the chunk, h the
state entering it, A the WY inverse; `ops/chunk_bwd_fused.py` gives the rest of the expressions):
    du = scale·Mᵀ·do + 2^(g_last − g) ⊙ (k·dhᵀ),  M = causal(q·kᵀ ⊙ 2^(g_i − g_j)),
    dq, dk, dw, dg from (h, dh, v_new, du) as in `ops/dqkwg.py`, then the WY backward from (dw, du),
    dh ← 2^g_last·dh + scale·(2^g ⊙ do)ᵀ·q − duᵀ·w.
du is computed transposed (its own products) for the state update and read back untransposed from a scratch tile, as
is dAᵀ: Triton 3.4 to 3.7.0 miscompile the transpose of a product's result on Hopper (FLA issue #640).
References: `ops/reference.chunk_local_dv_reference`, `chunk_state_backward_reference`,
`chunk_output_grads_reference` and the autograd of `chunk_wy_reference`.
"""

from __future__ import annotations

import torch

from megatron_muon.kernels.triton_math import INTERPRETING as _INTERPRETING
from megatron_muon.ops.chunk_bwd_fused import dense_chunks_here, gradient_outputs
from megatron_muon.ops.group_sum import group_sum

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps the split path
    triton = None

CHUNK = 64
DIMS = (64, 128)  # key and value dims a program's fp32 dh [V, K] holds
WARPS = (4, 8)  # the autotuner picks one per shape


def qualifies(q, k, v, v_new, w, beta, g, a_inverse, h, do, cu_seqlens, chunk_size: int) -> bool:
    """Dense equal-length bf16/fp16 inputs (q, k [B, T, H, K]; v, v_new, do [B, T, HV, V]; w [B, T, HV, K]; beta, g
    [B, T, HV]; A [B, T, HV, 64]; h [B, NT, HV, V, K], the kept chunk states) on an sm90 GPU (or the interpreter),
    contiguous, with key and value dims of 64 or 128."""
    if not dense_chunks_here(q, v, cu_seqlens, chunk_size):
        return False
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    value_side = (v, v_new, do)
    return (
        k.shape == q.shape
        and value_heads % heads == 0
        and all(t.shape == (batch, seq_len, value_heads, value_dim) for t in value_side)
        and w.shape == (batch, seq_len, value_heads, key_dim)
        and beta.shape == g.shape == (batch, seq_len, value_heads)
        and a_inverse.shape == (batch, seq_len, value_heads, CHUNK)
        and h.shape == (batch, -(-seq_len // CHUNK), value_heads, value_dim, key_dim)
        and all(t.dtype == q.dtype for t in (k, *value_side, w, h, a_inverse))
        and q.dtype in (torch.bfloat16, torch.float16)
        and key_dim in DIMS and value_dim in DIMS
        and all(t.is_contiguous() for t in (q, k, *value_side, w, beta, g, a_inverse, h))
    )


if triton is not None:
    from megatron_muon.ops.chunk_bwd_fused import inverse_gradient

    @triton.jit
    def _rows_tile(x, base, t0, T, HEADS: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
        """Block pointer to the [BT, D] tile at row t0 of one head of x [B, T, HEADS, D] (base: that head's first
        element)."""
        return tl.make_block_ptr(x + base, (T, D), (HEADS * D, 1), (t0, 0), (BT, D), (1, 0))

    @triton.jit
    def _chunk_bwd_onepass_kernel(
        q, k, v, v_new, w, beta, g, A, h, do, dht, dq, dk, dv, dbeta, dg, dh0, scratch, scale, T, NT,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
        USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    ):  # fmt: skip
        i_bh = tl.program_id(0)
        i_b, i_h = i_bh // HV, i_bh % HV  # a value head; it reads query/key head i_h // (HV // H)
        o_c = tl.arange(0, BT)
        o_k = tl.arange(0, K)
        o_v = tl.arange(0, V)
        value_base = (i_b * T * HV + i_h).to(tl.int64)
        qk_base = (i_b * T * H + i_h // (HV // H)).to(tl.int64) * K
        head_state = i_bh.to(tl.int64) * V * K  # dht, dh0 [B, HV, V, K]
        # per program: duᵀ [V, BT], then dA [BT, BT]
        du_scratch = scratch + i_bh.to(tl.int64) * (V * BT + BT * BT)
        dA_scratch = du_scratch + V * BT
        b_dh = tl.zeros([V, K], dtype=tl.float32)  # the gradient of the state after the current chunk
        if USE_DHT:
            b_dh += tl.load(dht + head_state + o_v[:, None] * K + o_k[None, :])
        for i in range(NT):
            i_t = NT - 1 - i
            t0 = i_t * BT
            o_t = t0 + o_c
            inside = o_t < T
            rows = ((i_b * T + o_t) * HV + i_h).to(tl.int64)
            last_t = tl.minimum(t0 + BT, T) - 1
            b_g = tl.load(g + rows, mask=inside, other=0.0).to(tl.float32)
            b_g_last = tl.load(g + (i_b * T + last_t) * HV + i_h).to(tl.float32)
            b_b = tl.load(beta + rows, mask=inside, other=0.0)
            b_g_exp = tl.exp2(b_g)
            b_q = tl.load(_rows_tile(q, qk_base, t0, T, H, K, BT), boundary_check=(0,), padding_option="zero")
            b_k = tl.load(_rows_tile(k, qk_base, t0, T, H, K, BT), boundary_check=(0,), padding_option="zero")
            b_vn = tl.load(_rows_tile(v_new, value_base * V, t0, T, HV, V, BT), boundary_check=(0,),
                           padding_option="zero")
            b_do = tl.load(_rows_tile(do, value_base * V, t0, T, HV, V, BT), boundary_check=(0,),
                           padding_option="zero")
            # row i at or after column j, both real tokens (a padding row's gate gap could overflow exp2)
            later = (o_c[:, None] >= o_c[None, :]) & inside[:, None]
            gaps = tl.exp2(tl.where(later, b_g[:, None] - b_g[None, :], 0.0))
            decay = tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)

            # everything that reads dh first, so that the [V, K] tiles die early (registers are short):
            # the gradient of v_new, transposed: duᵀ = (dh·kᵀ) ⊙ 2^(g_last − g) + scale·doᵀ·M
            b_dh_low = b_dh.to(b_k.dtype)  # the products' operand, rounded as the split path stores dh
            b_m = tl.where(later, tl.dot(b_q, tl.trans(b_k)) * gaps, 0.0) * scale
            b_du_t = tl.dot(b_dh_low, tl.trans(b_k)) * decay[None, :]
            b_du_t = tl.dot(tl.trans(b_do), b_m.to(b_do.dtype), b_du_t).to(b_k.dtype)
            tl.debug_barrier()  # the previous chunk's reads of the scratch tiles are done
            tl.store(du_scratch + o_v[:, None] * BT + o_c[None, :], b_du_t)
            # the output gradients' parts that read v_new and the old dh (ops/dqkwg.py): dk's state part, the
            # last row's gate gradient through it, and the scores' gradient ds (and dsᵀ, its own product)
            b_dk = tl.dot(b_vn, b_dh_low) * decay[:, None]
            b_dg_last = tl.sum(b_dk * b_k.to(tl.float32))
            b_ds = tl.dot(b_do, tl.trans(b_vn))
            b_ds = (tl.where(later, b_ds * gaps, 0.0) * scale).to(b_k.dtype)
            earlier = (o_c[:, None] <= o_c[None, :]) & inside[None, :]  # b_ds_t[j, i] = ds[i, j]
            b_ds_t = tl.dot(b_vn, tl.trans(b_do))
            b_ds_t = tl.where(earlier, b_ds_t * tl.exp2(tl.where(earlier, b_g[None, :] - b_g[:, None], 0.0)), 0.0)
            b_ds_t = (b_ds_t * scale).to(b_k.dtype)
            p_h = tl.make_block_ptr(h + ((i_b * NT + i_t) * HV + i_h).to(tl.int64) * V * K, (V, K), (K, 1), (0, 0),
                                    (V, K), (1, 0))
            b_h = tl.load(p_h)
            b_dg_last += tl.sum(b_h.to(tl.float32) * b_dh) * tl.exp2(b_g_last)
            # the state gradient before this chunk: dh ← 2^g_last·dh + scale·(2^g ⊙ do)ᵀ·q − duᵀ·w
            b_w = tl.load(_rows_tile(w, value_base * K, t0, T, HV, K, BT), boundary_check=(0,),
                          padding_option="zero")
            b_dog = (b_do * (b_g_exp * scale)[:, None]).to(b_q.dtype)
            b_dh = tl.dot(tl.trans(b_dog), b_q, b_dh * tl.exp2(b_g_last))  # accumulated in place: one [V, K] live
            b_dh = tl.dot(-b_du_t, b_w, b_dh)
            tl.debug_barrier()
            b_du = tl.load(du_scratch + o_c[:, None] + o_v[None, :] * BT)  # [BT, V]
            # the rest of the output gradients
            b_dq = tl.dot(b_do, b_h) * (b_g_exp * scale)[:, None]
            b_dw = (-tl.dot(b_du, b_h)).to(b_k.dtype)
            b_dq = tl.dot(b_ds, b_k, b_dq)
            b_dk = tl.dot(b_ds_t, b_q, b_dk)
            b_dg = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
            tl.store(_rows_tile(dq, value_base * K, t0, T, HV, K, BT), b_dq.to(dq.dtype.element_ty),
                     boundary_check=(0,))

            # the WY backward (FLA's prepare_wy_repr_bwd), with dw and du from registers
            b_v = tl.load(_rows_tile(v, value_base * V, t0, T, HV, V, BT), boundary_check=(0,),
                          padding_option="zero")
            # Aᵀ: element [a, t] is row t's entry a, as FLA's WY kernel loads it
            p_A = tl.make_block_ptr(A + value_base * BT, (BT, T), (1, HV * BT), (0, t0), (BT, BT), (0, 1))
            b_A = tl.load(p_A, boundary_check=(1,), padding_option="zero")
            b_vb = (b_v * b_b[:, None]).to(b_v.dtype)
            b_dA = tl.dot(b_du, tl.trans(b_vb))
            b_dvb = tl.dot(b_A, b_du)
            tl.store(_rows_tile(dv, value_base * V, t0, T, HV, V, BT), (b_dvb * b_b[:, None]).to(dv.dtype.element_ty),
                     boundary_check=(0,))
            b_db = tl.sum(b_dvb * b_v, 1)
            b_kbg = b_k * (b_b * b_g_exp)[:, None]
            b_dA = tl.dot(b_dw, tl.trans(b_kbg).to(b_dw.dtype), b_dA)
            b_dkbg = tl.dot(b_A, b_dw)
            b_dk += b_dkbg * (b_g_exp * b_b)[:, None]
            b_db += tl.sum(b_dkbg * b_k * b_g_exp[:, None], 1)
            b_dg += tl.sum(b_dkbg * b_kbg, 1)
            b_dA = inverse_gradient(b_dA, b_A, b_g, o_c, inside)
            tl.store(dA_scratch + o_c[:, None] * BT + o_c[None, :], b_dA)
            tl.debug_barrier()
            b_dA_t = tl.load(dA_scratch + o_c[:, None] + o_c[None, :] * BT)
            b_kb = b_k * b_b[:, None]
            b_kk = tl.dot(b_k, tl.trans(b_k))
            b_dkb = tl.dot(b_dA, b_k)
            b_db += tl.sum(b_dkb * b_k, 1)
            b_dk += b_dkb * b_b[:, None] + tl.dot(b_dA_t, b_kb.to(b_dA_t.dtype))
            tl.store(_rows_tile(dk, value_base * K, t0, T, HV, K, BT), b_dk.to(dk.dtype.element_ty),
                     boundary_check=(0,))
            tl.store(dbeta + rows, b_db.to(dbeta.dtype.element_ty), mask=inside)
            b_AdA = b_dA * (b_kk * b_b[:, None])
            b_dg += tl.sum(b_AdA, axis=1) - tl.sum(b_AdA, axis=0)
            b_dg = tl.where(o_t == last_t, b_dg + b_dg_last, b_dg)
            b_dg = tl.cumsum(tl.where(inside, b_dg, 0.0), axis=0, reverse=True)  # FLA's chunk-local reverse cumsum
            tl.store(dg + rows, b_dg, mask=inside)
        if STORE_DH0:
            tl.store(dh0 + head_state + o_v[:, None] * K + o_k[None, :], b_dh)

    _tuned = triton.autotune(configs=[triton.Config({}, num_warps=warps) for warps in WARPS],
                             key=["H", "HV", "K", "V"])(_chunk_bwd_onepass_kernel)


MIN_SEGMENT_CHUNKS = 4


def segments_for(q, v) -> int:
    """How many segments to cut each sequence into so that the programs fill the GPU: a power of two, at most one
    program per SM, each segment at least MIN_SEGMENT_CHUNKS chunks, dividing whole chunks (1 where T is not a
    multiple of the chunk, or off CUDA)."""
    batch, seq_len, value_heads = v.shape[:3]
    if not q.is_cuda or seq_len % CHUNK:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    chunks, segments = seq_len // CHUNK, 1
    while (2 * segments * batch * value_heads <= sms and chunks % (2 * segments) == 0
           and chunks // (2 * segments) >= MIN_SEGMENT_CHUNKS):
        segments *= 2
    return segments


def segment_ends(dh, dht, segments: int):
    """[B, S, HV, V, K] fp32: the state gradient after each segment's last chunk, from the per-chunk state gradients
    dh [B, NT, HV, V, K] of the recurrence (the last segment's is dht itself, zeros without one)."""
    batch, chunks = dh.shape[:2]
    ends = dh.view(batch, segments, chunks // segments, *dh.shape[2:])[:, :, -1].float()
    ends[:, -1] = 0.0 if dht is None else dht
    return ends


def chunk_bwd_onepass(q, k, v, v_new, w, beta, g, a_inverse, h, do, scale: float, dht=None, want_dh0: bool = False,
                      num_warps: int | None = None, ends=None):
    """(dq, dk like q; dv like v; dβ like beta; dg [B, T, HV] fp32, summed backwards within each chunk; dh0 [B, HV,
    V, K] fp32 or None), as the state-gradient kernel with the local dv, `chunk_dqkwg`, FLA's WY backward, the adds
    and the reverse cumsum together; dht [B, HV, V, K] is the final state's gradient; `num_warps` pins the warps.
    `ends` ([B, S, HV, V, K], `segment_ends`) cuts each sequence into S segments of whole chunks that run side by
    side, each from its end's state gradient (dht is then not read)."""
    if ends is not None:
        return _on_segments(q, k, v, v_new, w, beta, g, a_inverse, h, do, scale, want_dh0, num_warps, ends)
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    dq, dk, dv, dbeta, dg = gradient_outputs(q, v, beta)
    dh0 = (torch.empty(batch, value_heads, value_dim, key_dim, dtype=torch.float32, device=q.device) if want_dh0
           else None)
    scratch = q.new_empty(batch * value_heads * (value_dim * CHUNK + CHUNK * CHUNK))
    dht = None if dht is None else dht.float().contiguous()
    args = (q, k, v, v_new, w, beta, g, a_inverse, h, do, dq if dht is None else dht, dq, dk, dv, dbeta, dg,
            dq if dh0 is None else dh0, scratch, float(scale), seq_len, chunks)
    constants = dict(H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=CHUNK, USE_DHT=dht is not None,
                     STORE_DH0=want_dh0)
    grid = (batch * value_heads,)
    num_warps = num_warps or (WARPS[0] if _INTERPRETING else None)
    if num_warps is None:
        _tuned[grid](*args, **constants)
    else:
        _chunk_bwd_onepass_kernel[grid](*args, **constants, num_warps=num_warps)
    if value_heads != heads:
        dq, dk = group_sum(dq, heads), group_sum(dk, heads)
    return dq, dk, dv, dbeta, dg, dh0


def _on_segments(q, k, v, v_new, w, beta, g, a_inverse, h, do, scale, want_dh0, num_warps, ends):
    """The segments as rows of a batch: [B, T, ...] viewed as [B·S, T/S, ...] (T a multiple of S chunks)."""
    batch, seq_len = q.shape[:2]
    segments = ends.shape[1]
    assert seq_len % (segments * CHUNK) == 0 and h.shape[1] % segments == 0, (seq_len, segments, h.shape)

    def rows(x):
        return x.view(batch * segments, x.shape[1] // segments, *x.shape[2:])

    dq, dk, dv, dbeta, dg, dh0 = chunk_bwd_onepass(
        *(rows(t) for t in (q, k, v, v_new, w, beta, g, a_inverse, h, do)), scale,
        dht=ends.reshape(batch * segments, *ends.shape[2:]), want_dh0=want_dh0, num_warps=num_warps)
    grads = tuple(t.view(batch, seq_len, *t.shape[2:]) for t in (dq, dk, dv, dbeta, dg))
    return (*grads, None if dh0 is None else dh0.view(batch, segments, *dh0.shape[1:])[:, 0].contiguous())
