"""GDN's chunk-parallel backward in one Triton kernel: the chunk output gradients (`ops/dqkwg.py`), FLA's WY
backward (`prepare_wy_repr_bwd`) and the chunk-local reverse cumulative sum of the gate gradient.

After the state-gradient recurrence, everything left of the backward is chunk-parallel: per chunk and value head,
dqkwg turns (h, dh, v_new, du) into dq, dk, dw and dg, and the WY backward turns (dw, du) into the rest of dk, dv,
dβ and dg through the chunk's inverse A. Run as two kernels, dw and both dk and dg parts go through HBM and k, g
and du are read twice. Here one program per (chunk, value head) keeps dw in registers and passes it straight to the
WY products, adds both dk and dg parts before writing them, and sums dg backwards within the chunk; with more value
heads than query/key heads, dq and dk stay per value head for `group_sum`, as in `ops/dqkwg.py`.

Per chunk (g the chunk-local cumulative log2 gate, A the inverse (I + strictly-lower(β·kkᵀ ⊙ 2^(g_i − g_j)))⁻¹):
    ds = causal(do·v_newᵀ ⊙ 2^(g_i − g_j))·scale,  dq = scale·2^g ⊙ (do·h) + ds·k,
    dk = 2^(g_last − g) ⊙ (v_new·dh) + dsᵀ·q + Aᵀ·dw ⊙ β·2^g + (the inverse's gradient through k),  dw = −du·h,
    dv = β ⊙ Aᵀ·du,  dA = dw·(β·2^g ⊙ k)ᵀ + du·(β ⊙ v)ᵀ, taken through the inverse as FLA's kernel does.
The expressions of each part are those of the two kernels it replaces, except for transposes: Triton 3.4 to 3.7.0
miscompile the transpose of a product's result on Hopper (FLA issue #640), so dsᵀ is its own product (as in
`ops/dqkwg.py`) and the WY part reads dAᵀ back from a scratch tile where FLA's kernel transposes products. Reference:
`ops/reference.chunk_output_grads_reference` and the autograd of `ops/reference.chunk_wy_reference`.
"""

from __future__ import annotations

import torch

from megatron_muon.kernels.triton_math import INTERPRETING as _INTERPRETING
from megatron_muon.ops.group_sum import group_sum

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps the two-kernel path
    triton = None

CHUNK = 64
# (key block, value block, warps, stages); the autotuner picks one on the first call per shape. Compiled for sm90
# (Triton's ptxas), the first two spill nothing at either reference shape
# (`benchmarks/results/gdn_chunk_parallel_resources.md`).
CONFIGS = [(64, 32, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 1)]
_INTERPRETER_CONFIG = (64, 32, 4, 1)
KEY_DIMS = (64, 128, 256)
VALUE_DIM_MULTIPLE = 64  # the widest value block in CONFIGS


def dense_chunks_here(q, v, cu_seqlens, chunk_size: int) -> bool:
    """What the one-kernel backwards (this one and `ops/chunk_bwd_onepass.py`) need before their shapes: Triton, an
    sm90 GPU (or the interpreter for CPU tensors), dense equal-length [B, T, heads, dim] batches, 64-token chunks."""
    on_device = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
    if triton is None or not (on_device or (_INTERPRETING and q.device.type == "cpu")):
        return False
    return cu_seqlens is None and chunk_size == CHUNK and q.dim() == 4 and v.dim() == 4


def qualifies(q, k, v, v_new, beta, g, a_inverse, h, do, dh, du, cu_seqlens, chunk_size: int) -> bool:
    """Dense equal-length bf16/fp16 inputs (q, k [B, T, H, K]; v, v_new, do, du [B, T, HV, V]; beta, g [B, T, HV];
    A [B, T, HV, 64]; h, dh [B, NT, HV, V, K]) on an sm90 GPU (or the interpreter), contiguous, with key dim 64, 128
    or 256 and a value dim that the value blocks divide."""
    if not dense_chunks_here(q, v, cu_seqlens, chunk_size):
        return False
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    value_side = (v, v_new, do, du)
    states = (batch, -(-seq_len // CHUNK), value_heads, value_dim, key_dim)
    return (
        k.shape == q.shape
        and value_heads % heads == 0
        and all(t.shape == (batch, seq_len, value_heads, value_dim) for t in value_side)
        and beta.shape == g.shape == (batch, seq_len, value_heads)
        and a_inverse.shape == (batch, seq_len, value_heads, CHUNK)
        and h.shape == dh.shape == states
        and all(t.dtype == q.dtype for t in (k, *value_side, h, dh, a_inverse))
        and q.dtype in (torch.bfloat16, torch.float16)
        and key_dim in KEY_DIMS
        and value_dim % VALUE_DIM_MULTIPLE == 0
        and all(t.is_contiguous() for t in (q, k, *value_side, beta, g, a_inverse, h, dh))
    )


if triton is not None:

    @triton.jit
    def _value_tile(x, value_base, t0, v0, T, HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    BV: tl.constexpr):
        """Block pointer to the [BT, BV] tile at (t0, v0) of one value head of x [B, T, HV, V]."""
        return tl.make_block_ptr(x + value_base * V, (T, V), (HV * V, 1), (t0, v0), (BT, BV), (1, 0))

    @triton.jit
    def _key_tile(x, value_base, t0, k0, T, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr):
        """Block pointer to the [BT, BK] tile at (t0, k0) of one value head of x [B, T, HV, K]."""
        return tl.make_block_ptr(x + value_base * K, (T, K), (HV * K, 1), (t0, k0), (BT, BK), (1, 0))

    @triton.jit
    def inverse_gradient(b_dA, b_A, b_g, o_t, inside):
        """dA taken through the WY inverse, as FLA's WY kernel takes it (b_A the Aᵀ tile, o_t the chunk's rows,
        inside: real tokens): the strictly-lower part's −A·dA·A products, times the gate gaps, in A's dtype."""
        strictly_lower = (o_t[:, None] > o_t[None, :]) & (inside[:, None] & inside[None, :])
        b_dA = tl.where(strictly_lower, b_dA, 0)
        b_dA = tl.dot(b_dA.to(b_A.dtype), b_A)
        b_dA = tl.dot(b_A, b_dA.to(b_A.dtype))
        b_dA *= tl.exp2(tl.where(strictly_lower, b_g[:, None] - b_g[None, :], 0.0))
        return tl.where(strictly_lower, -b_dA, 0).to(b_A.dtype)

    @triton.jit
    def _chunk_bwd_fused_kernel(
        q, k, v, v_new, beta, g, A, h, do, dh, du, dq, dk, dv, dbeta, dg, dA_scratch, scale, T, NT,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
        BV: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        i_t = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_b, i_h = i_bh // HV, i_bh % HV  # a value head; it reads query/key head i_h // (HV // H)
        t0 = i_t * BT
        o_t = t0 + tl.arange(0, BT)
        inside = o_t < T
        rows = ((i_b * T + o_t) * HV + i_h).to(tl.int64)  # row offsets in [B, T, HV] units
        value_base = (i_b * T * HV + i_h).to(tl.int64)  # first row of this value head; tiles by block pointers
        qk_base = (i_b * T * H + i_h // (HV // H)).to(tl.int64) * K
        state = ((i_b * NT + i_t) * HV + i_h).to(tl.int64) * V * K
        last_t = tl.minimum(t0 + BT, T) - 1
        b_g = tl.load(g + rows, mask=inside, other=0.0).to(tl.float32)
        b_g_last = tl.load(g + (i_b * T + last_t) * HV + i_h).to(tl.float32)
        b_b = tl.load(beta + rows, mask=inside, other=0.0)
        b_g_exp = tl.exp2(b_g)
        # Aᵀ: element [a, t] is row t's entry a, as FLA's WY kernel loads it
        p_A = tl.make_block_ptr(A + value_base * BT, (BT, T), (1, HV * BT), (0, t0), (BT, BT), (0, 1))
        b_A = tl.load(p_A, boundary_check=(1,), padding_option="zero")

        # value side: the scores' gradients and the WY backward's value part
        b_ds = tl.zeros([BT, BT], dtype=tl.float32)
        b_ds_t = tl.zeros([BT, BT], dtype=tl.float32)
        b_dA = tl.zeros([BT, BT], dtype=tl.float32)
        b_db = tl.zeros([BT], dtype=tl.float32)
        for v0 in tl.range(0, V, BV, num_stages=STAGES):
            b_do = tl.load(_value_tile(do, value_base, t0, v0, T, HV, V, BT, BV), boundary_check=(0,),
                           padding_option="zero")
            b_vn = tl.load(_value_tile(v_new, value_base, t0, v0, T, HV, V, BT, BV), boundary_check=(0,),
                           padding_option="zero")
            b_v = tl.load(_value_tile(v, value_base, t0, v0, T, HV, V, BT, BV), boundary_check=(0,),
                          padding_option="zero")
            b_du = tl.load(_value_tile(du, value_base, t0, v0, T, HV, V, BT, BV), boundary_check=(0,),
                           padding_option="zero")
            b_ds = tl.dot(b_do, tl.trans(b_vn), b_ds)
            b_ds_t = tl.dot(b_vn, tl.trans(b_do), b_ds_t)
            b_vb = (b_v * b_b[:, None]).to(b_v.dtype)
            b_dA = tl.dot(b_du, tl.trans(b_vb), b_dA)
            b_dvb = tl.dot(b_A, b_du)
            tl.store(_value_tile(dv, value_base, t0, v0, T, HV, V, BT, BV),
                     (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), boundary_check=(0,))
            b_db += tl.sum(b_dvb * b_v, 1)
        # row i at or after column j, both real tokens (a padding row's gate gap could overflow exp2)
        later = (o_t[:, None] >= o_t[None, :]) & inside[:, None]
        b_ds = tl.where(later, b_ds * tl.exp2(tl.where(later, b_g[:, None] - b_g[None, :], 0.0)), 0.0) * scale
        earlier = (o_t[:, None] <= o_t[None, :]) & inside[None, :]  # b_ds_t[j, i] = ds[i, j]
        b_ds_t = tl.where(earlier, b_ds_t * tl.exp2(tl.where(earlier, b_g[None, :] - b_g[:, None], 0.0)), 0.0)
        # kept as the products' operands through the key blocks (half the registers of fp32)
        b_ds = b_ds.to(k.dtype.element_ty)
        b_ds_t = (b_ds_t * scale).to(k.dtype.element_ty)

        # key side, first pass: dq, the output part of dk, dw (kept here) and its WY part of dk
        b_dg = tl.zeros([BT], dtype=tl.float32)
        b_dg_last = tl.zeros([1], dtype=tl.float32)
        for k0 in range(0, K, BK):
            b_dq = tl.zeros([BT, BK], dtype=tl.float32)
            b_dk = tl.zeros([BT, BK], dtype=tl.float32)
            b_dw = tl.zeros([BT, BK], dtype=tl.float32)
            b_state_dot = tl.zeros([BV, BK], dtype=tl.float32)
            for v0 in tl.range(0, V, BV, num_stages=STAGES):
                b_do = tl.load(_value_tile(do, value_base, t0, v0, T, HV, V, BT, BV), boundary_check=(0,),
                               padding_option="zero")
                b_vn = tl.load(_value_tile(v_new, value_base, t0, v0, T, HV, V, BT, BV), boundary_check=(0,),
                               padding_option="zero")
                b_du = tl.load(_value_tile(du, value_base, t0, v0, T, HV, V, BT, BV), boundary_check=(0,),
                               padding_option="zero")
                b_h = tl.load(tl.make_block_ptr(h + state, (V, K), (K, 1), (v0, k0), (BV, BK), (1, 0)))
                b_dh = tl.load(tl.make_block_ptr(dh + state, (V, K), (K, 1), (v0, k0), (BV, BK), (1, 0)))
                b_state_dot += b_h.to(tl.float32) * b_dh.to(tl.float32)
                b_dq = tl.dot(b_do, b_h, b_dq)
                b_dk = tl.dot(b_vn, b_dh, b_dk)
                b_dw = tl.dot(b_du, b_h, b_dw)
            p_q = tl.make_block_ptr(q + qk_base, (T, K), (H * K, 1), (t0, k0), (BT, BK), (1, 0))
            p_k = tl.make_block_ptr(k + qk_base, (T, K), (H * K, 1), (t0, k0), (BT, BK), (1, 0))
            b_q = tl.load(p_q, boundary_check=(0,), padding_option="zero")
            b_k = tl.load(p_k, boundary_check=(0,), padding_option="zero")
            b_dq = b_dq * (b_g_exp * scale)[:, None]
            b_dk = b_dk * tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)[:, None]
            b_dg_last += tl.sum(b_state_dot) * tl.exp2(b_g_last) + tl.sum(b_dk * b_k.to(tl.float32))
            b_dq = tl.dot(b_ds, b_k, b_dq)
            b_dk = tl.dot(b_ds_t, b_q, b_dk)
            b_dg += tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
            tl.store(_key_tile(dq, value_base, t0, k0, T, HV, K, BT, BK), b_dq.to(dq.dtype.element_ty),
                     boundary_check=(0,))
            # the WY backward's key part, with dw = −du·h from registers
            b_dw = (-b_dw).to(b_k.dtype)
            b_kbg = b_k * (b_b * b_g_exp)[:, None]
            b_dA = tl.dot(b_dw, tl.trans(b_kbg).to(b_dw.dtype), b_dA)
            b_dkbg = tl.dot(b_A, b_dw)
            b_dk += b_dkbg * (b_g_exp * b_b)[:, None]
            b_db += tl.sum(b_dkbg * b_k * b_g_exp[:, None], 1)
            b_dg += tl.sum(b_dkbg * b_kbg, 1)
            tl.store(_key_tile(dk, value_base, t0, k0, T, HV, K, BT, BK), b_dk.to(dk.dtype.element_ty),
                     boundary_check=(0,))

        b_dA = inverse_gradient(b_dA, b_A, b_g, o_t, inside)
        # dAᵀ through a scratch tile: a transpose of a product's result miscompiles on Hopper with Triton 3.4 to
        # 3.7.0 (the tensor-core layout transposed; FLA issue #640), a loaded tile's does not
        p_dA = tl.make_block_ptr(dA_scratch + (i_bh * NT + i_t).to(tl.int64) * BT * BT, (BT, BT), (BT, 1), (0, 0),
                                 (BT, BT), (1, 0))
        tl.store(p_dA, b_dA)
        tl.debug_barrier()
        p_dA_t = tl.make_block_ptr(dA_scratch + (i_bh * NT + i_t).to(tl.int64) * BT * BT, (BT, BT), (1, BT), (0, 0),
                                   (BT, BT), (0, 1))
        b_dA_t = tl.load(p_dA_t)

        # key side, second pass: the inverse's part of dk and dβ
        b_kk = tl.zeros([BT, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            p_k = tl.make_block_ptr(k + qk_base, (T, K), (H * K, 1), (t0, k0), (BT, BK), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0,), padding_option="zero")
            b_kb = b_k * b_b[:, None]
            b_kk = tl.dot(b_k, tl.trans(b_k), b_kk)
            b_dkb = tl.dot(b_dA, b_k)
            b_db += tl.sum(b_dkb * b_k, 1)
            b_dk = b_dkb * b_b[:, None] + tl.dot(b_dA_t, b_kb.to(b_dA_t.dtype))
            p_dk = _key_tile(dk, value_base, t0, k0, T, HV, K, BT, BK)
            b_dk += tl.load(p_dk, boundary_check=(0,), padding_option="zero")
            tl.store(p_dk, b_dk.to(dk.dtype.element_ty), boundary_check=(0,))
        tl.store(dbeta + rows, b_db.to(dbeta.dtype.element_ty), mask=inside)

        b_AdA = b_dA * (b_kk * b_b[:, None])
        b_dg += tl.sum(b_AdA, axis=1) - tl.sum(b_AdA, axis=0)
        b_dg = tl.where(o_t == last_t, b_dg + tl.sum(b_dg_last), b_dg)
        b_dg = tl.cumsum(tl.where(inside, b_dg, 0.0), axis=0, reverse=True)  # FLA's chunk-local reverse cumsum
        tl.store(dg + rows, b_dg, mask=inside)

    _tuned = triton.autotune(
        configs=[triton.Config({"BK": bk, "BV": bv, "STAGES": stages}, num_warps=warps)
                 for bk, bv, warps, stages in CONFIGS],
        key=["H", "HV", "K", "V"],
    )(_chunk_bwd_fused_kernel)


def gradient_outputs(q, v, beta):
    """The one-kernel backwards' outputs, uninitialized: dq, dk per value head [B, T, HV, K] (`group_sum` folds them
    under GVA), dv like v, dβ like beta, dg [B, T, HV] fp32."""
    batch, seq_len, value_heads = v.shape[:3]
    per_value_head = (batch, seq_len, value_heads, q.shape[-1])
    dg = torch.empty(batch, seq_len, value_heads, dtype=torch.float32, device=q.device)
    return q.new_empty(per_value_head), q.new_empty(per_value_head), torch.empty_like(v), torch.empty_like(beta), dg


def chunk_bwd_fused(q, k, v, v_new, beta, g, a_inverse, h, do, dh, du, scale: float, config=None):
    """(dq, dk like q; dv like v; dβ like beta; dg [B, T, HV] fp32, already summed backwards within each chunk), as
    ours `chunk_dqkwg` followed by FLA's `prepare_wy_repr_bwd`, the dk and dg adds and `chunk_local_cumsum(dg,
    reverse=True)`; `config` = (key block, value block, warps, stages) pins a tile instead of autotuning."""
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    dq, dk, dv, dbeta, dg = gradient_outputs(q, v, beta)
    scratch = q.new_empty(batch * value_heads * chunks * CHUNK * CHUNK)  # one [64, 64] tile per program
    args = (q, k, v, v_new, beta, g, a_inverse, h, do, dh, du, dq, dk, dv, dbeta, dg, scratch, float(scale), seq_len,
            chunks)
    constants = dict(H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=CHUNK)
    grid = (chunks, batch * value_heads)
    config = config or (_INTERPRETER_CONFIG if _INTERPRETING else None)
    if config is None:
        _tuned[grid](*args, **constants)
    else:
        block_k, block_v, warps, stages = config
        if key_dim % block_k or value_dim % block_v:
            raise ValueError(f"tile {config} does not divide key dim {key_dim} and value dim {value_dim}; pick key "
                             "and value blocks that do (chunk_bwd_fused.CONFIGS lists the tiles)")
        _chunk_bwd_fused_kernel[grid](*args, **constants, BK=block_k, BV=block_v, STAGES=stages, num_warps=warps)
    if value_heads != heads:
        dq, dk = group_sum(dq, heads), group_sum(dk, heads)
    return dq, dk, dv, dbeta, dg
