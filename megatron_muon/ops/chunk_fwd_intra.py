"""GDN's chunk-parallel forward in one Triton kernel: the gate's chunk-local cumulative sum, the WY inverse and w, u.

Before the state recurrence everything of the forward is chunk-parallel: FLA runs it as its gate cumsum, a zero fill of
A, its fused kkt + triangular solve and `recompute_w_u`, four launches that write A and read it back with k and v.
Here one program per (chunk, value head) computes, with g the chunk-local cumulative log2 gate
(cumsum(g) / ln 2, as FLA's `chunk_local_cumsum(g, scale=RCP_LN2)`):
    N = strictly-lower(β_i·k_i·k_j·2^(g_i − g_j)),  A = (I + N)⁻¹,  w = A·(β·2^g ⊙ k),  u = A·(β ⊙ v).
The inverse goes by 16-row blocks as FLA's fused solve does: the ten blocks of k·kᵀ on or below the diagonal in fp32
registers, each diagonal block inverted by forward substitution, then the blocks below it by block forward
substitution, X_ij = −D_i·Σ_{j≤m<i} N_im·X_mj with X_jj = D_j = (I + N_jj)⁻¹. The gate's cumulative sum and A go
through their outputs (the program's own rows, L2-resident) to be read back as 16-row blocks and as one [64, 64]
tile, since Triton cannot slice a tile held in registers. Reference: `ops/reference.chunk_wy_reference` and
`chunk_wy_inverse_reference`.
"""

from __future__ import annotations

import math

import torch

from megatron_muon.kernels.triton_math import INTERPRETING as _INTERPRETING

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps FLA's kernels
    triton = None

CHUNK = 64
BLOCK = 16  # rows of the inverse's blocks
# (key block, value block, warps); the autotuner picks one on the first call per shape
CONFIGS = [(64, 64, 4), (64, 64, 8), (32, 32, 4), (64, 32, 2)]
_INTERPRETER_CONFIG = (32, 32, 4)
RCP_LN2 = 1.0 / math.log(2)


def qualifies(k, v, g, beta, cu_seqlens, chunk_size: int) -> bool:
    """Dense equal-length bf16/fp16 k [B, T, H, K] and v [B, T, HV, V] (HV a multiple of H), g and beta [B, T, HV],
    on an sm90 GPU (or the interpreter), contiguous, with key and value dims that are multiples of 32."""
    on_device = k.is_cuda and torch.cuda.get_device_capability(k.device)[0] == 9
    if triton is None or not (on_device or (_INTERPRETING and k.device.type == "cpu")):
        return False
    if cu_seqlens is not None or chunk_size != CHUNK or k.dim() != 4 or v.dim() != 4:
        return False
    return (
        v.shape[:2] == k.shape[:2]
        and v.shape[2] % k.shape[2] == 0
        and g.shape == beta.shape == v.shape[:3]
        and k.dtype == v.dtype
        and k.dtype in (torch.bfloat16, torch.float16)
        and k.shape[-1] % 32 == 0
        and v.shape[-1] % 32 == 0
        and all(t.is_contiguous() for t in (k, v, g, beta))
    )


if triton is not None:

    @triton.jit
    def _block_ptr(A, value_base, t0, i, j, T, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        """Block pointer to the [BC, BC] block (i, j) of this chunk's A in this value head's A [B, T, HV, BT]."""
        return tl.make_block_ptr(A + value_base * BT, (T, BT), (HV * BT, 1), (t0 + i * BC, j * BC), (BC, BC), (1, 0))

    @triton.jit
    def _store_block(A, value_base, t0, i, j, b_x, T, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        tl.store(_block_ptr(A, value_base, t0, i, j, T, HV, BT, BC), b_x.to(A.dtype.element_ty), boundary_check=(0,))

    @triton.jit
    def _rows(x, value_base, t0, i, T, HV: tl.constexpr, BC: tl.constexpr):
        """Rows t0 + i·BC ... of this value head's [B, T, HV] x (0 past the end), fp32."""
        o_r = t0 + i * BC + tl.arange(0, BC)
        return tl.load(x + value_base + o_r.to(tl.int64) * HV, mask=o_r < T, other=0.0).to(tl.float32)

    @triton.jit
    def _scaled(b_kk, g_cumsum, beta, value_base, t0, i, j, T, HV: tl.constexpr, BC: tl.constexpr):
        """Block (i, j) of N = β_i·k_i·k_j·2^(g_i − g_j), strictly lower on the diagonal, 0 past the end."""
        o_c = tl.arange(0, BC)
        b_gi = _rows(g_cumsum, value_base, t0, i, T, HV, BC)
        b_gj = _rows(g_cumsum, value_base, t0, j, T, HV, BC)
        keep = ((t0 + i * BC + o_c) < T)[:, None] & ((t0 + j * BC + o_c) < T)[None, :]
        if i == j:
            keep = keep & (o_c[:, None] > o_c[None, :])
        gaps = tl.where(keep, b_gi[:, None] - b_gj[None, :], 0.0)  # a padding row's gap could overflow exp2
        return tl.where(keep, b_kk * tl.exp2(gaps) * _rows(beta, value_base, t0, i, T, HV, BC)[:, None], 0.0)

    @triton.jit
    def _diagonal_inverse(b_n, BC: tl.constexpr):
        """(I + N_ii)⁻¹ of a strictly lower [BC, BC] block by forward substitution, as FLA's solve does."""
        o_c = tl.arange(0, BC)
        b_neg = -b_n
        b_x = b_neg  # rows from r on are −N's until row r is solved: x_r = −n_r − Σ_{j<r} n_rj·x_j
        for r in range(2, BC):
            b_row = tl.sum(tl.where(o_c[:, None] == r, b_neg, 0.0), 0)
            b_row = b_row + tl.sum(b_row[:, None] * b_x, 0)
            b_x = tl.where(o_c[:, None] == r, b_row[None, :], b_x)
        return b_x + (o_c[:, None] == o_c[None, :]).to(tl.float32)

    @triton.jit
    def _key_rows(k, k_base, t0, i, k0, T, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
        p = tl.make_block_ptr(k + k_base, (T, K), (H * K, 1), (t0 + i * BC, k0), (BC, BK), (1, 0))
        return tl.load(p, boundary_check=(0,), padding_option="zero")

    @triton.jit
    def _chunk_fwd_intra_kernel(
        k, v, g, beta, g_cumsum, A, w, u, T, scale_log2,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr,
    ):  # fmt: skip
        i_t = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_b, i_h = i_bh // HV, i_bh % HV  # a value head; it reads key head i_h // (HV // H)
        t0 = i_t * BT
        o_t = t0 + tl.arange(0, BT)
        inside = o_t < T
        rows = ((i_b * T + o_t) * HV + i_h).to(tl.int64)  # row offsets in [B, T, HV] units
        value_base = (i_b * T * HV + i_h).to(tl.int64)
        k_base = (i_b * T * H + i_h // (HV // H)).to(tl.int64) * K

        # the gate's chunk-local cumulative sum in log2 units (padding rows add 0), read back below by 16-row blocks
        b_g = tl.cumsum(tl.load(g + rows, mask=inside, other=0.0).to(tl.float32), axis=0) * scale_log2
        tl.store(g_cumsum + rows, b_g, mask=inside)
        b_b = tl.load(beta + rows, mask=inside, other=0.0)

        # the ten blocks of k·kᵀ on or below the diagonal, in fp32 registers
        b_kk00 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk10 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk11 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk20 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk21 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk22 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk30 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk31 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk32 = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk33 = tl.zeros([BC, BC], dtype=tl.float32)
        for k0 in range(0, K, BK):
            b_k0 = _key_rows(k, k_base, t0, 0, k0, T, H, K, BC, BK)
            b_k1 = _key_rows(k, k_base, t0, 1, k0, T, H, K, BC, BK)
            b_k2 = _key_rows(k, k_base, t0, 2, k0, T, H, K, BC, BK)
            b_k3 = _key_rows(k, k_base, t0, 3, k0, T, H, K, BC, BK)
            b_kk00 = tl.dot(b_k0, tl.trans(b_k0), b_kk00)
            b_kk10 = tl.dot(b_k1, tl.trans(b_k0), b_kk10)
            b_kk11 = tl.dot(b_k1, tl.trans(b_k1), b_kk11)
            b_kk20 = tl.dot(b_k2, tl.trans(b_k0), b_kk20)
            b_kk21 = tl.dot(b_k2, tl.trans(b_k1), b_kk21)
            b_kk22 = tl.dot(b_k2, tl.trans(b_k2), b_kk22)
            b_kk30 = tl.dot(b_k3, tl.trans(b_k0), b_kk30)
            b_kk31 = tl.dot(b_k3, tl.trans(b_k1), b_kk31)
            b_kk32 = tl.dot(b_k3, tl.trans(b_k2), b_kk32)
            b_kk33 = tl.dot(b_k3, tl.trans(b_k3), b_kk33)
        tl.debug_barrier()  # g_cumsum stored before its 16-row blocks are read back

        # A = (I + N)⁻¹ by 16-row blocks: the diagonal blocks, then the ones below them by block substitution
        b_x00 = _diagonal_inverse(_scaled(b_kk00, g_cumsum, beta, value_base, t0, 0, 0, T, HV, BC), BC)
        b_x11 = _diagonal_inverse(_scaled(b_kk11, g_cumsum, beta, value_base, t0, 1, 1, T, HV, BC), BC)
        b_x22 = _diagonal_inverse(_scaled(b_kk22, g_cumsum, beta, value_base, t0, 2, 2, T, HV, BC), BC)
        b_x33 = _diagonal_inverse(_scaled(b_kk33, g_cumsum, beta, value_base, t0, 3, 3, T, HV, BC), BC)
        b_n10 = _scaled(b_kk10, g_cumsum, beta, value_base, t0, 1, 0, T, HV, BC)
        b_n20 = _scaled(b_kk20, g_cumsum, beta, value_base, t0, 2, 0, T, HV, BC)
        b_n21 = _scaled(b_kk21, g_cumsum, beta, value_base, t0, 2, 1, T, HV, BC)
        b_n30 = _scaled(b_kk30, g_cumsum, beta, value_base, t0, 3, 0, T, HV, BC)
        b_n31 = _scaled(b_kk31, g_cumsum, beta, value_base, t0, 3, 1, T, HV, BC)
        b_n32 = _scaled(b_kk32, g_cumsum, beta, value_base, t0, 3, 2, T, HV, BC)
        b_x10 = -tl.dot(b_x11, tl.dot(b_n10, b_x00))
        b_x21 = -tl.dot(b_x22, tl.dot(b_n21, b_x11))
        b_x20 = -tl.dot(b_x22, tl.dot(b_n20, b_x00) + tl.dot(b_n21, b_x10))
        b_x32 = -tl.dot(b_x33, tl.dot(b_n32, b_x22))
        b_x31 = -tl.dot(b_x33, tl.dot(b_n31, b_x11) + tl.dot(b_n32, b_x21))
        b_x30 = -tl.dot(b_x33, tl.dot(b_n30, b_x00) + tl.dot(b_n31, b_x10) + tl.dot(b_n32, b_x20))
        zero = tl.zeros([BC, BC], dtype=tl.float32)
        _store_block(A, value_base, t0, 0, 0, b_x00, T, HV, BT, BC)
        _store_block(A, value_base, t0, 0, 1, zero, T, HV, BT, BC)
        _store_block(A, value_base, t0, 0, 2, zero, T, HV, BT, BC)
        _store_block(A, value_base, t0, 0, 3, zero, T, HV, BT, BC)
        _store_block(A, value_base, t0, 1, 0, b_x10, T, HV, BT, BC)
        _store_block(A, value_base, t0, 1, 1, b_x11, T, HV, BT, BC)
        _store_block(A, value_base, t0, 1, 2, zero, T, HV, BT, BC)
        _store_block(A, value_base, t0, 1, 3, zero, T, HV, BT, BC)
        _store_block(A, value_base, t0, 2, 0, b_x20, T, HV, BT, BC)
        _store_block(A, value_base, t0, 2, 1, b_x21, T, HV, BT, BC)
        _store_block(A, value_base, t0, 2, 2, b_x22, T, HV, BT, BC)
        _store_block(A, value_base, t0, 2, 3, zero, T, HV, BT, BC)
        _store_block(A, value_base, t0, 3, 0, b_x30, T, HV, BT, BC)
        _store_block(A, value_base, t0, 3, 1, b_x31, T, HV, BT, BC)
        _store_block(A, value_base, t0, 3, 2, b_x32, T, HV, BT, BC)
        _store_block(A, value_base, t0, 3, 3, b_x33, T, HV, BT, BC)
        tl.debug_barrier()  # the blocks stored before A is read back whole

        _w_and_u(k, v, A, w, u, b_b, b_g, value_base, k_base, t0, T, H, HV, K, V, BT, BK, BV)

    @triton.jit
    def _w_and_u(k, v, A, w, u, b_b, b_g, value_base, k_base, t0, T, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        """w = A·(β·2^g ⊙ k) and u = A·(β ⊙ v) from the chunk's A as stored (rounded as FLA's recompute_w_u
        reads it)."""
        p_a = tl.make_block_ptr(A + value_base * BT, (T, BT), (HV * BT, 1), (t0, 0), (BT, BT), (1, 0))
        b_a = tl.load(p_a, boundary_check=(0,), padding_option="zero")
        for v0 in range(0, V, BV):
            p_v = tl.make_block_ptr(v + value_base * V, (T, V), (HV * V, 1), (t0, v0), (BT, BV), (1, 0))
            b_v = tl.load(p_v, boundary_check=(0,), padding_option="zero")
            b_vb = (b_v * b_b[:, None]).to(b_v.dtype)
            p_u = tl.make_block_ptr(u + value_base * V, (T, V), (HV * V, 1), (t0, v0), (BT, BV), (1, 0))
            tl.store(p_u, tl.dot(b_a, b_vb).to(u.dtype.element_ty), boundary_check=(0,))
        b_bg = b_b * tl.exp2(b_g)
        for k0 in range(0, K, BK):
            p_k = tl.make_block_ptr(k + k_base, (T, K), (H * K, 1), (t0, k0), (BT, BK), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0,), padding_option="zero")
            b_kb = (b_k * b_bg[:, None]).to(b_k.dtype)
            p_w = tl.make_block_ptr(w + value_base * K, (T, K), (HV * K, 1), (t0, k0), (BT, BK), (1, 0))
            tl.store(p_w, tl.dot(b_a, b_kb).to(w.dtype.element_ty), boundary_check=(0,))

    @triton.jit
    def _recompute_w_u_kernel(
        k, v, beta, g_cumsum, A, w, u, T,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
        BV: tl.constexpr,
    ):  # fmt: skip
        i_t = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_b, i_h = i_bh // HV, i_bh % HV
        t0 = i_t * BT
        o_t = t0 + tl.arange(0, BT)
        rows = ((i_b * T + o_t) * HV + i_h).to(tl.int64)
        b_b = tl.load(beta + rows, mask=o_t < T, other=0.0)
        b_g = tl.load(g_cumsum + rows, mask=o_t < T, other=0.0).to(tl.float32)
        _w_and_u(k, v, A, w, u, b_b, b_g, (i_b * T * HV + i_h).to(tl.int64),
                 (i_b * T * H + i_h // (HV // H)).to(tl.int64) * K, t0, T, H, HV, K, V, BT, BK, BV)

    def _dividing_tiles(configs, named_args, **kwargs):
        """The tiles whose blocks divide the key and value dims (the kernels check only the sequence's end)."""
        return [c for c in configs if kwargs["K"] % c.kwargs["BK"] == 0 and kwargs["V"] % c.kwargs["BV"] == 0]

    _tuned = triton.autotune(
        configs=[triton.Config({"BK": bk, "BV": bv}, num_warps=warps) for bk, bv, warps in CONFIGS],
        key=["H", "HV", "K", "V"],
        prune_configs_by={"early_config_prune": _dividing_tiles},
    )(_chunk_fwd_intra_kernel)


def _first_dividing_tile(key_dim: int, value_dim: int) -> tuple[int, int, int]:
    return next(c for c in CONFIGS if key_dim % c[0] == 0 and value_dim % c[1] == 0)


def recompute_w_u(k, v, beta, g_cumsum, a_inverse):
    """(w, u) from the forward's g_cumsum and A, as FLA's `recompute_w_u_fwd` (the backward of a forward that did not
    keep its chunk states); the intra kernel's own w and u step, one program per (chunk, value head)."""
    batch, seq_len, heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    w, u = k.new_empty(batch, seq_len, value_heads, key_dim), torch.empty_like(v)
    block_k, block_v, warps = _INTERPRETER_CONFIG if _INTERPRETING else _first_dividing_tile(key_dim, value_dim)
    _recompute_w_u_kernel[(triton.cdiv(seq_len, CHUNK), batch * value_heads)](
        k, v, beta, g_cumsum, a_inverse, w, u, seq_len, H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=CHUNK,
        BK=block_k, BV=block_v, num_warps=warps)
    return w, u


def chunk_fwd_intra(k, v, g, beta, config=None):
    """(g_cumsum [B, T, HV] fp32, w like k per value head [B, T, HV, K], u like v, A [B, T, HV, 64] in k's dtype),
    as FLA's `chunk_local_cumsum(g, scale=RCP_LN2)` and `chunk_gated_delta_rule_fwd_intra`; `config` = (key block,
    value block, warps) pins a tile instead of autotuning."""
    batch, seq_len, heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    g_cumsum = torch.empty(batch, seq_len, value_heads, dtype=torch.float32, device=k.device)
    a_inverse = k.new_empty(batch, seq_len, value_heads, CHUNK)
    w, u = k.new_empty(batch, seq_len, value_heads, key_dim), torch.empty_like(v)
    args = (k, v, g, beta, g_cumsum, a_inverse, w, u, seq_len, RCP_LN2)
    constants = dict(H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=CHUNK, BC=BLOCK)
    grid = (chunks, batch * value_heads)
    config = config or (_INTERPRETER_CONFIG if _INTERPRETING else None)
    if config is None:
        _tuned[grid](*args, **constants)
    else:
        block_k, block_v, warps = config
        if key_dim % block_k or value_dim % block_v:
            raise ValueError(f"tile {config} does not divide key dim {key_dim} and value dim {value_dim}; pick key "
                             "and value blocks that do (chunk_fwd_intra.CONFIGS lists the tiles)")
        _chunk_fwd_intra_kernel[grid](*args, **constants, BK=block_k, BV=block_v, num_warps=warps)
    return g_cumsum, w, u, a_inverse
