"""Chunked gated delta rule as torch.library custom ops (forward and backward), so torch.compile keeps one graph.

Public entry point: ``chunk_gated_delta_rule`` with FLA's signature and "BTH*" layout (head_first=False).
GVA (more value heads than q/k heads): value head ``h`` reads key/query head ``h // (HV // H)``, the same grouping as
FLA 0.6 and megatron-core's ``repeat_interleave``. FLA 0.6 handles it natively in its kernels; the torch backend
repeats q/k inside the op and sums their gradients back; either way callers pass un-repeated q/k.
Where FlashQLA runs in this process and a call qualifies (bf16, K = V = 128: ``ops/gdn_flashqla.py``), the call goes to
FlashQLA's kernels through their own custom ops instead.
"""

import torch
from torch import Tensor

from megatron_muon.ops import fla_backend, gdn_flashqla
from megatron_muon.ops.backend import backend_for
from megatron_muon.ops.gdn_torch import CHUNK_SIZE, chunk_gdn_backward_torch, chunk_gdn_forward_torch
from megatron_muon.ops.norm import l2norm


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    keep_states_for_backward: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Gated delta rule over q, k [B, T, H, K], v [B, T, HV, V], g (log decay) and beta [B, T, HV].

    Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or None). ``initial_state`` is [N, HV, K, V]
    where N = B, or the number of sequences when ``cu_seqlens`` packs them into B = 1.
    ``keep_states_for_backward`` (FLA backends, equal-length batches) keeps the per-chunk states until the backward
    instead of recomputing them there: faster, at 2 * B * HV * (ceil(T / 64) * K * V + T * (K + V)) extra bytes.
    It does not apply to the calls FlashQLA runs (``ops/gdn_flashqla.py``), whose backward recomputes its states.
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if gdn_flashqla.qualifies(q, v) and gdn_flashqla.flashqla_enabled():
        o, final_state, *_ = gdn_flashqla.gdn_flashqla_fwd(
            q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens
        )
        return o, (final_state if output_final_state else None)
    o, final_state, *_ = gdn_chunk_fwd(
        q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens, keep_states_for_backward
    )
    return o, (final_state if output_final_state else None)


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"chunk_gated_delta_rule: q and k must both be [B, T, H, K] (head_first=False); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}."
        )
    batch, seq_len, heads, _ = q.shape
    if v.dim() != 4 or v.shape[:2] != (batch, seq_len) or v.shape[2] % heads:
        raise ValueError(
            f"chunk_gated_delta_rule: v must be [B, T, HV, V] (head_first=False) with HV a multiple of the {heads} "
            f"q/k heads; got v {tuple(v.shape)} for q {tuple(q.shape)}."
        )
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(
            f"chunk_gated_delta_rule: g and beta must be [B, T, HV] = {tuple(v.shape[:3])}; got g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}."
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"chunk_gated_delta_rule: q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them "
            "to one dtype (g and beta may be fp32)."
        )
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"chunk_gated_delta_rule: with cu_seqlens pack the sequences into B = 1; got B = {batch}.")
    if initial_state is not None:
        num_states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
        expected = (num_states, v.shape[2], q.shape[3], v.shape[3])
        if initial_state.shape != expected:
            raise ValueError(
                f"chunk_gated_delta_rule: initial_state must be [N, HV, K, V] = {expected}; got "
                f"{tuple(initial_state.shape)}."
            )


def _num_states(q: Tensor, cu_seqlens: Tensor | None):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _keeps_states(q: Tensor, cu_seqlens: Tensor | None, keep_states: bool) -> bool:
    """Whether the forward returns w, h, v_new (FLA backends only; varlen chunk counts depend on the data)."""
    return keep_states and cu_seqlens is None and backend_for(q) != "torch"


@torch.library.custom_op("megatron_muon::gdn_chunk_fwd", mutates_args=())
def gdn_chunk_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor | None,
    output_final_state: bool, cu_seqlens: Tensor | None, keep_states: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (o, final_state or empty, g_cumsum, A, w, h, v_new): all but the first two are backend-private
    tensors kept for backward; w, h and v_new are empty unless the forward keeps its chunk states."""
    if backend_for(q) == "torch":
        outputs = chunk_gdn_forward_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        return (*outputs, *(q.new_empty(0) for _ in range(3)))
    gdn_flashqla.log_first_fallback(q, v)
    return fla_backend.gdn_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, keep_states)


@gdn_chunk_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, keep_states):
    batch, seq_len, value_heads, value_dim = v.shape
    if output_final_state:
        final_state = q.new_empty(_num_states(q, cu_seqlens), value_heads, q.shape[-1], value_dim, dtype=torch.float32)
    else:
        final_state = q.new_empty(0, dtype=torch.float32)
    if _keeps_states(q, cu_seqlens, keep_states):
        states_shape = fla_backend.chunk_states_shape(batch, seq_len, value_heads, k.shape[-1], value_dim)
        kept = (k.new_empty(batch, seq_len, value_heads, k.shape[-1]), k.new_empty(states_shape),
                torch.empty_like(v, memory_format=torch.contiguous_format))
    else:
        kept = tuple(q.new_empty(0) for _ in range(3))
    return (
        torch.empty_like(v, memory_format=torch.contiguous_format),
        final_state,
        q.new_empty(batch, seq_len, value_heads, dtype=torch.float32),
        k.new_empty(batch, seq_len, value_heads, CHUNK_SIZE),
        *kept,
    )


@torch.library.custom_op("megatron_muon::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, g_cumsum: Tensor, a_inverse: Tensor, w: Tensor,
    h: Tensor, v_new: Tensor, scale: float, initial_state: Tensor | None, cu_seqlens: Tensor | None, do: Tensor,
    dht: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dh0); dh0 is empty when there is no initial state."""
    if backend_for(q) == "torch":
        return chunk_gdn_backward_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht)
    return fla_backend.gdn_backward(
        q, k, v, g, beta, g_cumsum, a_inverse, w, h, v_new, scale, initial_state, cu_seqlens, do, dht
    )


@gdn_chunk_bwd.register_fake
def _(q, k, v, g, beta, g_cumsum, a_inverse, w, h, v_new, scale, initial_state, cu_seqlens, do, dht):
    dh0 = initial_state if initial_state is not None else q.new_empty(0)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, g, beta, dh0))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, _ = inputs
    _, _, *private = output
    ctx.save_for_backward(q, k, v, g, beta, *private, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.mark_non_differentiable(*private)
    # no zero gradients for the outputs kept for backward (full-size bf16 fills, several per step); do and dht
    # arrive as None when unused
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dht, *_private_grads):
    q, k, v, g, beta, g_cumsum, a_inverse, w, h, v_new, initial_state, cu_seqlens = ctx.saved_tensors
    dht = dht if ctx.output_final_state else None
    if do is None:  # only the final state is used
        do = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dq, dk, dv, dg, dbeta, dh0 = gdn_chunk_bwd(
        q, k, v, g, beta, g_cumsum, a_inverse, w, h, v_new, ctx.scale, initial_state, cu_seqlens, do.contiguous(), dht
    )
    return dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None, None


gdn_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)
