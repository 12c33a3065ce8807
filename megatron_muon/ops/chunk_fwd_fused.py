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
a CPU: `state_tma`'s forward state kernel with its WITH_OUTPUT option; rounding follows the split path's (the state
and v_new enter the products in the input dtype).
"""

from __future__ import annotations

import torch

from megatron_muon.ops import state_tma
from megatron_muon.ops.state_tma import CHUNK, KEY_SLICE

try:
    import triton
except ImportError:  # the caller keeps the split forward
    triton = None


def qualifies(q, k, w, u, g, cu_seqlens, chunk_size: int) -> bool:
    """Where the state kernels qualify (`state_tma.qualifies`), with q shaped like k."""
    return q.shape == k.shape and state_tma.qualifies([q, k, w], [u], g, cu_seqlens, chunk_size)


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
    state_tma._chunk_state_fwd_kernel[(value_dim // block_v, batch * heads)](
        state_tma._descriptor(q, KEY_SLICE), state_tma._descriptor(k, KEY_SLICE), state_tma._descriptor(w, KEY_SLICE),
        state_tma._descriptor(u, block_v), g.contiguous(), h0, h, v_new, o, final, float(scale), seq_len, chunks,
        H=heads, GROUP=heads // k.shape[2], K=key_dim, V=value_dim, BT=CHUNK, BV=block_v, STAGES=stages,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=output_final_state, STORE_STATES=store_states,
        WITH_OUTPUT=True, num_warps=warps,
    )
    return o, final, h, v_new
