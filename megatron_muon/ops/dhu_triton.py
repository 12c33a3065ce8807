"""GDN's backward state recurrence (FLA's `chunk_gated_delta_rule_bwd_dhu`) with its key-side tiles streamed by TMA.

Walking the chunks backwards, with the state gradient dh ([V, K] per head, value-first as FLA stores it):
    dh_t (stored) = dh
    dv2_t = dv_t + diag(2^(g_last - g)) · k_t · dhᵀ
    dh   ← 2^g_last · dh + scale · (diag(2^g) · do_t)ᵀ · q_t − dv2_tᵀ · w_t
Each program owns one (head, value block) and reads the chunk's whole q, k and w tiles ([BT, K] each) for every
chunk. FLA's kernel loads them into registers, 64 key columns at a time, so each chunk waits on L2
(benchmarks/results/fla_state_kernels.md: 4.5 TB/s of tile reads at 16-column blocks, 2.1 TB/s at 32). Here TMA
descriptors stream the three tiles into shared memory, and the loop is software-pipelined, so chunk t-1's tiles arrive
while chunk t computes; wider value blocks then read fewer bytes in all.

Differences from FLA's rounding: the gate 2^g multiplies do (a [BT, BV] tile) instead of q before the product, and
that product runs in bf16 rather than tf32. Dense equal-length batches with one value head per key head only;
everything else stays on FLA (`qualifies`).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the caller keeps FLA's kernel
    triton = None

_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
CHUNK = 64
ENV_VAR = "MEGATRON_MUON_GDN_DHU"
CHOICES = ("fla", "tma")


def enabled() -> bool:
    """Whether GDN's backward uses this kernel where it qualifies: `MEGATRON_MUON_GDN_DHU=tma` (default `fla`
    until the e2e ladder shows it faster)."""
    choice = os.environ.get(ENV_VAR, "fla")
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}; valid choices: {CHOICES}")
    return choice == "tma"


def qualifies(q, k, w, do, dv, g, cu_seqlens, chunk_size: int) -> bool:
    """Dense [B, T, H, K] / [B, T, H, V] bf16/fp16 inputs, one value head per key head, TMA-able layouts."""
    on_device = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
    if triton is None or not (on_device or (_INTERPRETING and q.device.type == "cpu")):
        return False
    if cu_seqlens is not None or chunk_size != CHUNK or g is None or q.dim() != 4:
        return False
    key_dim, value_dim = q.shape[-1], do.shape[-1]
    return (
        q.shape == k.shape == w.shape
        and do.shape == dv.shape == (*q.shape[:3], value_dim)
        and q.dtype == k.dtype == w.dtype == do.dtype == dv.dtype
        and q.dtype in (torch.bfloat16, torch.float16)
        and key_dim in (64, 128, 256)
        and value_dim % 16 == 0
        and all(t.is_contiguous() for t in (q, k, w, do, dv))
    )


if triton is not None:

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
        o_k = tl.arange(0, K)
        state = (i_bh * V + o_v[:, None]).to(tl.int64) * K + o_k[None, :]  # [BV, K] offsets of a [B, H, V, K] state
        b_dh = tl.zeros([BV, K], dtype=tl.float32)
        if USE_FINAL_STATE_GRADIENT:
            b_dh += tl.load(dht + state).to(tl.float32)
        for i in tl.range(0, NT, num_stages=STAGES):
            i_t = NT - 1 - i
            t0 = i_t * BT
            o_t = t0 + tl.arange(0, BT)
            inside = o_t < T
            # dh[b, t, h] holds the gradient entering chunk t from the chunks after it
            tl.store(dh + ((i_b * NT + i_t) * H * V * K) + state - i_b * H * V * K, b_dh.to(dh.dtype.element_ty))
            b_k = k_desc.load([i_b.to(tl.int32), t0, (i_h * K).to(tl.int32)]).reshape(BT, K)
            b_q = q_desc.load([i_b.to(tl.int32), t0, (i_h * K).to(tl.int32)]).reshape(BT, K)
            b_w = w_desc.load([i_b.to(tl.int32), t0, (i_h * K).to(tl.int32)]).reshape(BT, K)
            b_do = do_desc.load([i_b.to(tl.int32), t0, (i_h * V + i_v * BV).to(tl.int32)]).reshape(BT, BV)
            b_dv = dv_desc.load([i_b.to(tl.int32), t0, (i_h * V + i_v * BV).to(tl.int32)]).reshape(BT, BV)
            g_rows = g + (i_b * T + o_t) * H + i_h
            b_g = tl.load(g_rows, mask=inside, other=0.0).to(tl.float32)
            last = tl.minimum(t0 + BT, T) - 1
            b_g_last = tl.load(g + (i_b * T + last) * H + i_h).to(tl.float32)

            # every product takes the [BV, .] register tile as its left operand and a TMA-loaded tile from shared
            # memory as its right one (dv2 is computed transposed), so the state never goes through shared memory
            b_dv2t = tl.dot(b_dh.to(b_k.dtype), tl.trans(b_k))  # [BV, BT]
            b_dv2t = b_dv2t * tl.where(inside, tl.exp2(b_g_last - b_g), 0.0)[None, :] + tl.trans(b_dv).to(tl.float32)
            b_dv2t = b_dv2t.to(b_dv.dtype)
            rows = (i_b * T + o_t).to(tl.int64)
            tl.store(dv2 + (rows[:, None] * H + i_h) * V + o_v[None, :], tl.trans(b_dv2t), mask=inside[:, None])

            b_do_gated_t = (tl.trans(b_do).to(tl.float32) * tl.exp2(b_g)[None, :]).to(b_q.dtype)  # [BV, BT]
            b_dh = b_dh * tl.exp2(b_g_last)
            b_dh += tl.dot(b_do_gated_t, b_q) * scale
            b_dh -= tl.dot(b_dv2t, b_w)
        if USE_INITIAL_STATE:
            tl.store(dh0 + state, b_dh)


# (BV, warps, stages) that fit the H200's 227 KiB of shared memory per block at key dim 256 (compiled for sm90:
# 64/4/2 takes 217 KiB; 64/8/2 and 32/4/3 do not fit). 64-row blocks run on wgmma; 16 and 32 on mma.sync.
_CONFIGS = [(64, 4, 2), (32, 4, 2), (32, 8, 2), (16, 4, 2), (64, 8, 1), (128, 8, 1)]
_INTERPRETER_CONFIG = (16, 4, 1)


def _descriptor(t: torch.Tensor, block_cols: int):
    """A 3-D [B, T, heads·dim] TMA view of a contiguous [B, T, heads, dim] tensor; edges load zeros per batch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = t.view(t.shape[0], t.shape[1], -1)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, CHUNK, block_cols])


def chunk_dhu(q, k, w, g, do, dv, scale: float, dht=None, want_dh0: bool = False, config=None):
    """(dh [B, NT, H, V, K], dh0 [B, H, V, K] fp32 or None, dv2 like dv) as FLA's value-first
    `chunk_gated_delta_rule_bwd_dhu`; `config` = (BV, warps, stages) pins a tile (default: the best measured)."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = do.shape[-1]
    chunks = triton.cdiv(seq_len, CHUNK)
    block_v, warps, stages = config or (_INTERPRETER_CONFIG if _INTERPRETING else _CONFIGS[0])
    if value_dim % block_v:
        raise ValueError(f"value dim {value_dim} is not a multiple of the value block {block_v}")
    dh = q.new_empty(batch, chunks, heads, value_dim, key_dim)
    dv2 = torch.empty_like(dv)
    dh0 = q.new_empty(batch, heads, value_dim, key_dim, dtype=torch.float32) if want_dh0 else None
    if dht is not None:
        dht = dht.contiguous()
    _dhu_kernel[(value_dim // block_v, batch * heads)](
        _descriptor(q, key_dim), _descriptor(k, key_dim), _descriptor(w, key_dim), _descriptor(do, block_v),
        _descriptor(dv, block_v), g.contiguous(), dht, dh, dv2, dh0, float(scale), seq_len, chunks,
        H=heads, K=key_dim, V=value_dim, BT=CHUNK, BV=block_v, STAGES=stages,
        USE_FINAL_STATE_GRADIENT=dht is not None, USE_INITIAL_STATE=want_dh0, num_warps=warps,
    )
    return dh, dh0, dv2


def reference_dhu(q, k, w, g, do, dv, scale: float, dht=None):
    """The recurrence above in fp32 torch, chunk by chunk: (dh, dh0, dv2) for tests."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = do.shape[-1]
    q, k, w, do, dv, g = (t.float() for t in (q, k, w, do, dv, g))
    state = torch.zeros(batch, heads, value_dim, key_dim) if dht is None else dht.float().clone()
    chunks = -(-seq_len // CHUNK)
    dh = torch.empty(batch, chunks, heads, value_dim, key_dim)
    dv2 = torch.empty_like(dv)
    for t in reversed(range(chunks)):
        rows = slice(t * CHUNK, min((t + 1) * CHUNK, seq_len))
        dh[:, t] = state
        gates, last = g[:, rows], g[:, rows][:, -1]  # [B, L, H], [B, H]
        decay = torch.exp2(last[:, None] - gates)[..., None]
        dv2[:, rows] = dv[:, rows] + torch.einsum("blhk,bhvk->blhv", k[:, rows], state) * decay
        gated_do = do[:, rows] * torch.exp2(gates)[..., None]
        state = (state * torch.exp2(last)[..., None, None]
                 + scale * torch.einsum("blhv,blhk->bhvk", gated_do, q[:, rows])
                 - torch.einsum("blhv,blhk->bhvk", dv2[:, rows], w[:, rows]))
    return dh, state, dv2
