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

from megatron_muon.ops import state_tma


def qualifies(q, k, w, u, g, cu_seqlens, chunk_size: int) -> bool:
    """Where the state kernels qualify (`state_tma.qualifies`), with q shaped like k."""
    return q.shape == k.shape and state_tma.qualifies([q, k, w], [u], g, cu_seqlens, chunk_size)


# (BV, warps, stages); the first entry is the default. Every entry fits an sm90 block's shared memory at both reference
# shapes without spills (`benchmarks/state_kernel_sass.py --fused`; 64-column value blocks spilled hundreds of bytes
# and are left out); which is fastest is measured by `gdn.py --chunk-op`.
FUSED_CONFIGS = [(32, 8, 2), (32, 4, 2), (16, 4, 2), (16, 8, 2)]


def chunk_fwd_fused(q, k, w, u, g, scale: float, initial_state=None, output_final_state: bool = False,
                    store_states: bool = False, config=None):
    """(o like u, final state [B, HV, V, K] fp32 or None, h [B, NT, HV, V, K] or None, v_new like u or None) for
    q, k [B, T, H, K], w [B, T, HV, K], u [B, T, HV, V] and g [B, T, HV] (chunk-local cumulative log2 gates);
    `store_states` also returns the per-chunk states and v_new (as `state_tma.chunk_fwd_h` does);
    `config` = (BV, warps, stages) pins a tile."""
    h, v_new, o, final = state_tma.chunk_forward(k, w, u, g, initial_state, output_final_state, config, q=q,
                                                 scale=scale, store_states=store_states, configs=FUSED_CONFIGS)
    return o, final, h, v_new
