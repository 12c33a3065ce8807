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

from megatron_muon.kernels.gluon_support import KernelSwitch
from megatron_muon.ops import state_ws

MAX_KEY_DIM = 128
SWITCH = KernelSwitch("warp-specialized Hopper GDN fused chunk forward")


def ready(q, k, w, u) -> bool:
    """On top of `chunk_fwd_fused.qualifies` (which the caller checked): what `state_ws.ready` asks, K ≤ 128, and
    no earlier compile failure of this kernel."""
    return q.shape[-1] <= MAX_KEY_DIM and SWITCH.available() and state_ws.ready([q, k, w], [u])


def chunk_fwd_fused(q, k, w, u, g, scale: float, initial_state=None, output_final_state: bool = False,
                    store_states: bool = False):
    """`chunk_fwd_fused.chunk_fwd_fused` on the warp-specialized kernel (where `ready`)."""
    h, v_new, o, final = state_ws.chunk_forward(k, w, u, g, initial_state, output_final_state, q=q, scale=scale,
                                                store_states=store_states)
    return o, final, h, v_new
