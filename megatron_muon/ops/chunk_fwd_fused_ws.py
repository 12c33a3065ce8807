"""The fused chunk forward (`chunk_fwd_fused.py`: state recurrence and output in one kernel) as a warp-specialized
Hopper kernel in Gluon: `state_ws`'s forward state kernel with its WITH_OUTPUT option.

The producer warp streams k, w and q slices and the u tile into the two-stage ring by TMA; the consumer warpgroup
keeps the state key-major in registers and writes it to shared memory once per chunk (the B operand of its
products), as `state_ws` does, and adds the output: oᵀ's rows o = scale·(2^g ⊙ (q·S) + M·v_new) with
M = causal(q·kᵀ ⊙ 2^(g_i − g_j)), three more wgmma products (q·S, q·kᵀ, M·v_new) that do not depend on the state
update. h and v_new go to HBM only when the backward keeps them. The q, k and w rings take 48 KiB per key slice,
so the kernel takes key dims up to 128 (Qwen3-Next's heads); wider keys stay on the Triton kernel.
"""

from __future__ import annotations

import torch

from megatron_muon.kernels.gluon_support import KernelSwitch
from megatron_muon.ops import state_ws
from megatron_muon.ops.state_ws import BLOCK_V, CHUNK, KEY_SLICE

MAX_KEY_DIM = 128
SWITCH = KernelSwitch("warp-specialized Hopper GDN fused chunk forward")


def ready(q, k, w, u) -> bool:
    """On top of `chunk_fwd_fused.qualifies` (which the caller checked): what `state_ws.ready` asks, K ≤ 128, and
    no earlier compile failure of this kernel."""
    return q.shape[-1] <= MAX_KEY_DIM and SWITCH.available() and state_ws.ready([q, k, w], [u])


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
    state_ws._chunk_state_fwd_ws_kernel[(value_dim // BLOCK_V, batch * heads)](
        state_ws._rows(q, [CHUNK, KEY_SLICE], key), state_ws._rows(k, [CHUNK, KEY_SLICE], key),
        state_ws._rows(w, [CHUNK, KEY_SLICE], key), state_ws._rows(u, [CHUNK, BLOCK_V], value),
        state_ws._rows(h, [BLOCK_V, KEY_SLICE], state), state_ws._rows(v_new, [CHUNK, BLOCK_V], value),
        state_ws._rows(o, [CHUNK, BLOCK_V], value), g.contiguous(), h if h0 is None else h0,
        h if final is None else final, float(scale), seq_len, chunks, heads, heads // k.shape[2], key_dim, value_dim,
        BLOCK_V, h0 is not None, output_final_state, store_states, True, num_warps=4,
    )
    return o, final, (h if store_states else None), (v_new if store_states else None)

