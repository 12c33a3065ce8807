"""GDN's chunk output gradients (FLA's value-first `chunk_bwd_dqkwg` with gates): dq, dk, dw and dg in one
Triton kernel that is correct on Hopper with Triton 3.6.

Per chunk t and head, with h_t the state before the chunk, dh_t the gradient of the state after it, v the corrected
values v_new, dv their gradient and g FLA's chunk-local cumulative log2 gate (reference:
`ops/reference.chunk_output_grads_reference`):
    ds = causal(do·vᵀ ⊙ 2^(g_i − g_j))·scale,  dq = scale·2^g ⊙ (do·h_t) + ds·k,
    dk = 2^(g_last − g) ⊙ (v·dh_t) + dsᵀ·q,  dw = −dv·h_t,
    dg = rowsum(dq ⊙ q) − rowsum(dk ⊙ k), plus 2^g_last·Σ(h_t ⊙ dh_t) + Σ(2^(g_last − g) ⊙ (v·dh_t) ⊙ k)
    on the chunk's last row (FLA adds the reverse cumulative sum afterwards).
FLA's Triton kernel forms dsᵀ by transposing ds, a tensor in the tensor-core accumulator layout, which Triton 3.4 to
3.7.0 miscompiles on Hopper (FLA issue #640; FLA routes it to TileLang there). This kernel computes dsᵀ as its own
product, v·doᵀ, instead: a [BT, BT] product beside three [BT, BK] ones per value block.
One program per (key block, chunk, value head); with more value heads than query/key heads (GVA) a value head reads
its group's q and k, as in FLA. The key blocks of a chunk run next to each other, so the chunk's value-side
tiles (do, v, dv) come from L2 after the first. dg is written per key block and summed. On an H200 at the
hybrid-1.5B shape it is faster than FLA's call, which runs TileLang there (docs/design/gdn_kernels.md).
"""

from __future__ import annotations

import torch

from megatron_muon.kernels.triton_math import INTERPRETING as _INTERPRETING
from megatron_muon.ops.group_sum import group_sum

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps FLA's kernel
    triton = None

CHUNK = 64
MIN_KEY_BLOCK = 64
# (key block, value block, warps, stages); the autotuner picks one on the first call per shape. Each compiles for
# sm90 without register spills (Triton's ptxas, pointers specialized as at run time); 128-row key blocks on 4 warps
# and 128-column value blocks on 4 warps spilled and are left out (docs/design/gdn_kernels.md).
CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3),
           (64, 128, 8, 2), (64, 32, 4, 3)]
_INTERPRETER_CONFIG = (64, 32, 4, 1)
KEY_DIMS = (64, 128, 256)
VALUE_DIM_MULTIPLE = 128  # the widest value block in CONFIGS
COVERAGE = (f"dense equal-length batches with key dim {', '.join(map(str, KEY_DIMS))} and a value dim that is a "
            f"multiple of {VALUE_DIM_MULTIPLE}")


def qualifies(q, k, v_new, w, g, h, do, dh, dv, cu_seqlens, chunk_size: int) -> bool:
    """Dense equal-length bf16/fp16 inputs (q, k [B, T, H, K]; w [B, T, HV, K]; v_new, do, dv [B, T, HV, V]; HV a
    multiple of H) on an sm90 GPU (or the interpreter), contiguous, with key dim 64, 128 or 256 and a value dim that
    the value blocks divide."""
    on_device = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
    if triton is None or not (on_device or (_INTERPRETING and q.device.type == "cpu")):
        return False
    if cu_seqlens is not None or chunk_size != CHUNK or g is None or w is None or dv is None or q.dim() != 4:
        return False
    value_dim, value_heads = v_new.shape[-1], w.shape[2]
    key_side, value_side = (q, k, w), (v_new, do, dv)
    return (
        k.shape == q.shape
        and w.shape == (*q.shape[:2], value_heads, q.shape[3])
        and value_heads % q.shape[2] == 0
        and all(t.shape == (*w.shape[:3], value_dim) for t in value_side)
        and g.shape == w.shape[:3]
        and h.shape == dh.shape == (q.shape[0], -(-q.shape[1] // CHUNK), value_heads, value_dim, q.shape[3])
        and all(t.dtype == q.dtype for t in (*key_side, *value_side, h, dh))
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in KEY_DIMS
        and value_dim % VALUE_DIM_MULTIPLE == 0
        and all(t.is_contiguous() for t in (*key_side, *value_side, h, dh, g))
    )


if triton is not None:

    @triton.jit
    def _chunk_dqkwg_kernel(
        q, k, v, w_grad, g, h, do, dh, dv, dq, dk, dg, scale, T, NT,
        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
        BV: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        i_k = tl.program_id(0)
        i_t = tl.program_id(1)
        i_bh = tl.program_id(2)
        i_b, i_h = i_bh // HV, i_bh % HV  # a value head; it reads query/key head i_h // (HV // H)
        o_t = i_t * BT + tl.arange(0, BT)
        inside = o_t < T
        o_k = i_k * BK + tl.arange(0, BK)
        key_rows = ((i_b * T + o_t) * HV + i_h).to(tl.int64)  # row offsets in [B, T, HV] units
        qk_rows = ((i_b * T + o_t) * H + i_h // (HV // H)).to(tl.int64)  # in [B, T, H] units
        state = ((i_b * NT + i_t) * HV + i_h).to(tl.int64) * V * K
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_ds = tl.zeros([BT, BT], dtype=tl.float32)
        b_ds_t = tl.zeros([BT, BT], dtype=tl.float32)
        b_state_dot = tl.zeros([BV, BK], dtype=tl.float32)
        for v0 in tl.range(0, V, BV, num_stages=STAGES):
            o_v = v0 + tl.arange(0, BV)
            rows_v = key_rows[:, None] * V + o_v[None, :]
            b_v = tl.load(v + rows_v, mask=inside[:, None], other=0.0)
            b_do = tl.load(do + rows_v, mask=inside[:, None], other=0.0)
            b_dv = tl.load(dv + rows_v, mask=inside[:, None], other=0.0)
            tile = state + o_v[:, None] * K + o_k[None, :]
            b_h = tl.load(h + tile)
            b_dh = tl.load(dh + tile)
            b_state_dot += b_h.to(tl.float32) * b_dh.to(tl.float32)
            b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)
            b_ds_t = tl.dot(b_v, tl.trans(b_do), b_ds_t)
            b_dq = tl.dot(b_do, b_h, b_dq)
            b_dk = tl.dot(b_v, b_dh, b_dk)
            b_dw = tl.dot(b_dv, b_h, b_dw)

        rows_k = key_rows[:, None] * K + o_k[None, :]
        tl.store(w_grad + rows_k, (-b_dw).to(w_grad.dtype.element_ty), mask=inside[:, None])
        rows_qk = qk_rows[:, None] * K + o_k[None, :]
        b_q = tl.load(q + rows_qk, mask=inside[:, None], other=0.0)
        b_k = tl.load(k + rows_qk, mask=inside[:, None], other=0.0)
        b_g = tl.load(g + key_rows, mask=inside, other=0.0).to(tl.float32)
        last_t = tl.minimum(i_t * BT + BT, T) - 1
        b_g_last = tl.load(g + (i_b * T + last_t) * HV + i_h).to(tl.float32)

        b_dq = b_dq * (tl.exp2(b_g) * scale)[:, None]
        b_dk = b_dk * tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)[:, None]
        b_dg_last = tl.sum(b_state_dot) * tl.exp2(b_g_last) + tl.sum(b_dk * b_k.to(tl.float32))
        # row i at or after column j, both real tokens: a padding row of a partial last chunk reads gate 0, and its
        # gap to a real token's gate (below -128 under strong decay) would overflow exp2 and turn 0 * inf into NaN
        later = (o_t[:, None] >= o_t[None, :]) & inside[:, None]
        gaps = tl.where(later, b_g[:, None] - b_g[None, :], 0.0)
        b_ds = tl.where(later, b_ds * tl.exp2(gaps), 0.0) * scale
        # b_ds_t[j, i] = ds[i, j]: the same gates on the transposed mask
        earlier = (o_t[:, None] <= o_t[None, :]) & inside[None, :]
        gaps_t = tl.where(earlier, b_g[None, :] - b_g[:, None], 0.0)
        b_ds_t = tl.where(earlier, b_ds_t * tl.exp2(gaps_t), 0.0) * scale
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
        b_dk = tl.dot(b_ds_t.to(b_q.dtype), b_q, b_dk)
        b_dg = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
        b_dg = tl.where(o_t == last_t, b_dg + b_dg_last, b_dg)
        tl.store(dq + rows_k, b_dq.to(dq.dtype.element_ty), mask=inside[:, None])
        tl.store(dk + rows_k, b_dk.to(dk.dtype.element_ty), mask=inside[:, None])
        tl.store(dg + i_k * (tl.num_programs(2) * T).to(tl.int64) + key_rows, b_dg, mask=inside)

    def _fitting_tiles(configs, named_args, **kwargs):
        """The tiles whose key block fits the key dim: a wider one would launch no program at all."""
        return [c for c in configs if c.kwargs["BK"] <= kwargs["K"]]

    _dqkwg_tuned = triton.autotune(
        configs=[triton.Config({"BK": bk, "BV": bv, "STAGES": stages}, num_warps=warps)
                 for bk, bv, warps, stages in CONFIGS],
        key=["H", "HV", "K", "V"],
        reset_to_zero=["dg"],  # a narrower key block tried first would leave its slots in the sum
        prune_configs_by={"early_config_prune": _fitting_tiles},
    )(_chunk_dqkwg_kernel)


def chunk_dqkwg(q, k, v_new, w, g, h, do, dh, dv, scale: float, config=None, dk_per_value_head: bool = False):
    """(dq, dk like q, dw like w, dg [B, T, HV] fp32) as FLA's value-first gated `chunk_bwd_dqkwg`; `config` =
    (key block, value block, warps, stages) pins a tile instead of autotuning. With more value heads than query/key
    heads, dq and dk are written per value head and summed over each group (`group_sum`), as FLA does;
    `dk_per_value_head` leaves dk unsummed, like w, for a caller that adds another per-value-head part first."""
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v_new.shape[2], v_new.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    dq, dk, dw = (torch.empty_like(w) for _ in range(3))  # dq, dk per value head
    # one slot per smallest key block, zeros where a wider block leaves slots unwritten: a deterministic sum
    dg = torch.zeros(key_dim // MIN_KEY_BLOCK, batch, seq_len, value_heads, dtype=torch.float32, device=q.device)
    args = (q, k, v_new, dw, g, h, do, dh, dv, dq, dk, dg, float(scale), seq_len, chunks)
    constants = dict(H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=CHUNK)
    config = config or (_INTERPRETER_CONFIG if _INTERPRETING else None)
    if config is None:
        _dqkwg_tuned[lambda meta: (key_dim // meta["BK"], chunks, batch * value_heads)](*args, **constants)
    else:
        block_k, block_v, warps, stages = config
        if key_dim % block_k or value_dim % block_v:
            raise ValueError(f"tile {config} does not divide key dim {key_dim} and value dim {value_dim}; pick key "
                             "and value blocks that do (dqkwg.CONFIGS lists the tiles)")
        _chunk_dqkwg_kernel[(key_dim // block_k, chunks, batch * value_heads)](
            *args, **constants, BK=block_k, BV=block_v, STAGES=stages, num_warps=warps)
    if value_heads != heads:
        dq = group_sum(dq, heads)
        dk = dk if dk_per_value_head else group_sum(dk, heads)
    return dq, dk, dw, dg.sum(0)
