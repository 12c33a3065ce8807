"""Thin calls into flash-linear-attention 0.6's kernels (the fla-triton / fla-tilelang backends).

We call FLA's kernel launchers directly (not its autograd.Functions, which are wrapped in
``torch.compiler.disable``) so that our custom ops own autograd and the compiled graph never breaks, and so the
forward can hand its chunk states to the backward instead of recomputing them. FLA's own
dispatch picks TileLang for the gated backward on Hopper when the fla-tilelang backend was selected.
On Hopper, where the inputs qualify, three of those kernels are ours instead, as `ops/kernel_choice` chooses per
stage: the chunk-state recurrences (warp-specialized Gluon kernels, `state_ws`, where they apply; else the Triton
ones, `state_tma`) and the chunk output gradients (`dqkwg`); when chosen, one fused kernel (`chunk_fwd_fused`)
replaces the forward state kernel and FLA's output kernel, and one (`chunk_bwd_fused`) the output gradients, FLA's WY
backward and its reverse cumsum of the gate gradient.
Imports are lazy: this module is only touched when a CUDA op runs with an FLA backend (or a CPU check runs our
kernels under Triton's interpreter), and FLA itself only for the kernels of FLA's that a call runs.
"""

import contextlib
import functools
import importlib.util

import torch

from megatron_muon.ops import (chunk_bwd_fused, chunk_bwd_onepass, chunk_fwd_fused, chunk_fwd_fused_ws,
                               chunk_fwd_intra, dqkwg, state_segments, state_tma, state_ws)
from megatron_muon.ops.group_sum import group_sum
from megatron_muon.ops.kernel_choice import gdn_kernels

CHUNK_SIZE = 64
# Recurrent state stored [V, K] inside the kernels (FLA's own layers run this way, so both share kernels and autotune
# entries); our API keeps [N, HV, K, V] and transposes the few [N, HV, ., .] boundary states.
STATE_V_FIRST = True


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


def _chunk_indices(cu_seqlens):
    if cu_seqlens is None:
        return None
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, CHUNK_SIZE)


def _state_layout(state):
    """Our [N, HV, K, V] <-> the kernels' layout (a transpose either way when V-first)."""
    return None if state is None else (state.transpose(-1, -2) if STATE_V_FIRST else state).contiguous()


def chunk_states_shape(batch, seq_len, value_heads, key_dim, value_dim):
    """Shape of the per-chunk states ``h`` the forward can keep for the backward (not for varlen)."""
    num_chunks = -(-seq_len // CHUNK_SIZE)
    inner = (value_dim, key_dim) if STATE_V_FIRST else (key_dim, value_dim)
    return (batch, num_chunks, value_heads, *inner)


def gdn_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, keep_states):
    """(o, final_state or empty, g_cumsum (log2 space), A = (I + Akk)^-1, w, h, v_new) from FLA's chunk kernels.

    The same four kernels as FLA's ``chunk_gated_delta_rule_fwd`` (fewer with ours chosen for the chunk-parallel
    part or the fused forward); with ``keep_states`` (equal-length batches only) w, the per-chunk states h and the
    corrected values v_new are returned so the backward does not recompute them; otherwise those three are empty and
    the backward recomputes them as FLA does. FLA is imported only for the kernels of FLA's a call runs.
    """
    q, k, v, g, beta = _contiguous(q, k, v, g, beta)
    chunk_indices = _chunk_indices(cu_seqlens)
    with _on_device(q.device):
        if _on_intra(k, v, g, beta, cu_seqlens):
            g_cumsum, w, u, a_inverse = chunk_fwd_intra.chunk_fwd_intra(k, v, g, beta)
        else:
            g_cumsum, w, u, a_inverse = _flas_intra(k, v, g, beta, cu_seqlens, chunk_indices)
        if _on_fused_forward(q, k, w, u, g_cumsum, cu_seqlens):
            o, final_state, h, v_new = _fused_forward(q, k, w, u, g_cumsum, scale, _state_layout(initial_state),
                                                      output_final_state, keep_states)
        else:
            from fla.ops.common.chunk_o import chunk_fwd_o

            h, v_new, final_state = _forward_states(k, w, u, g_cumsum, _state_layout(initial_state),
                                                    output_final_state, cu_seqlens, chunk_indices)
            o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cumsum, scale=scale, state_v_first=STATE_V_FIRST,
                            cu_seqlens=cu_seqlens, chunk_size=CHUNK_SIZE, chunk_indices=chunk_indices)
    final_state = _state_layout(final_state)
    if final_state is None:
        final_state = torch.empty(0, dtype=torch.float32, device=q.device)
    if not (keep_states and cu_seqlens is None):
        w, h, v_new = (q.new_empty(0) for _ in range(3))
    return o.to(v.dtype), final_state.float(), g_cumsum.float(), a_inverse.to(k.dtype), w, h, v_new


def _on_intra(k, v, g, beta, cu_seqlens) -> bool:
    """Whether the chunk-parallel forward (gate cumsum, WY inverse, w, u) runs as our one kernel for these inputs."""
    return gdn_kernels().intra == "ours" and chunk_fwd_intra.qualifies(k, v, g, beta, cu_seqlens, CHUNK_SIZE)


def _flas_intra(k, v, g, beta, cu_seqlens, chunk_indices):
    """(g_cumsum, w, u, A) from FLA's gate cumsum and its fused kkt + solve + `recompute_w_u`."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    g_cumsum = chunk_local_cumsum(g, chunk_size=CHUNK_SIZE, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                  chunk_indices=chunk_indices)
    w, u, a_inverse = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cumsum, beta=beta, cu_seqlens=cu_seqlens,
                                                       chunk_size=CHUNK_SIZE, chunk_indices=chunk_indices)
    return g_cumsum, w, u, a_inverse


def _state_kernel(name: str, key_side: list, value_side: list, *args, **kwargs):
    """`state_ws.<name>` where the Gluon kernels apply (a front end that rejects them hands every later call to the
    Triton kernels, with one warning), the Triton kernels in segments where chosen and the sequence splits into
    whole-chunk segments (`state_segments.windowed_<name>`), else `state_tma.<name>`."""
    states = gdn_kernels().states
    if states == "segments" and (segments := state_segments.segment_count(key_side[0].shape[1], CHUNK_SIZE)) > 1:
        return getattr(state_segments, f"windowed_{name}")(state_tma, *args, segments=segments, **kwargs)
    if states == "gluon" and state_ws.ready(key_side, value_side):
        try:
            return getattr(state_ws, name)(*args, **kwargs)
        except state_ws.FRONTEND_ERRORS as error:  # raised while compiling, before anything ran
            state_ws.SWITCH.disable(error)
    return getattr(state_tma, name)(*args, **kwargs)


def _on_state_tma(key_side, value_side, g_cumsum, cu_seqlens) -> bool:
    """Whether the chunk-state recurrences run on our TMA kernels for these inputs."""
    return STATE_V_FIRST and gdn_kernels().states != "fla" and state_tma.qualifies(
        key_side, value_side, g_cumsum, cu_seqlens, CHUNK_SIZE)


def _on_fused_forward(q, k, w, u, g_cumsum, cu_seqlens) -> bool:
    """Whether the forward runs our fused kernel for these inputs."""
    return STATE_V_FIRST and gdn_kernels().output_terms == "fused" and chunk_fwd_fused.qualifies(
        q, k, w, u, g_cumsum, cu_seqlens, CHUNK_SIZE)


def _fused_forward(q, k, w, u, g_cumsum, scale, initial_state, output_final_state, keep_states):
    """(o, final state, h, v_new) from the fused forward: the warp-specialized Gluon kernel where the state kernels
    are "gluon" and it applies (a front end that rejects it hands every later call to Triton, with one warning),
    else the Triton kernel."""
    args = (q, k, w, u, g_cumsum, scale, initial_state, output_final_state, keep_states)
    if gdn_kernels().states == "segments" and (segments := state_segments.segment_count(q.shape[1], CHUNK_SIZE)) > 1:
        h, v_new, o, final = state_segments.windowed_chunk_forward(
            state_tma, k, w, u, g_cumsum, initial_state, output_final_state, segments=segments, q=q, scale=scale,
            store_states=keep_states, configs=chunk_fwd_fused.FUSED_CONFIGS)
        return o, final, h, v_new
    if gdn_kernels().states == "gluon" and chunk_fwd_fused_ws.ready(q, k, w, u):
        try:
            return chunk_fwd_fused_ws.chunk_fwd_fused(*args)
        except state_ws.FRONTEND_ERRORS as error:  # raised while compiling, before anything ran
            chunk_fwd_fused_ws.SWITCH.disable(error)
    return chunk_fwd_fused.chunk_fwd_fused(*args)


def _on_dqkwg(q, k, v_new, w, g_cumsum, h, do, dh, dv, cu_seqlens) -> bool:
    """Whether the chunk output gradients run on our kernel for these inputs."""
    return STATE_V_FIRST and gdn_kernels().output_grads == "ours" and dqkwg.qualifies(
        q, k, v_new, w, g_cumsum, h, do, dh, dv, cu_seqlens, CHUNK_SIZE)


def _forward_states(k, w, u, g_cumsum, initial_state, output_final_state, cu_seqlens, chunk_indices):
    """(per-chunk states h, v_new, final state) from FLA's forward state kernel or, where enabled, ours."""
    if _on_state_tma([k, w], [u], g_cumsum, cu_seqlens):
        return _state_kernel("chunk_fwd_h", [k, w], [u], k, w, u, g_cumsum, initial_state, output_final_state)
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    return chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=g_cumsum, initial_state=initial_state, output_final_state=output_final_state,
        chunk_size=CHUNK_SIZE, state_v_first=STATE_V_FIRST, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
    )


def prepare_autotuners() -> None:
    """Give FLA's autotuners the configs our backend adds, before anything pins choices into them (an autotune
    table's choice of an added config is only pinned once the config is in the kernel's list)."""
    if importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None:
        _extend_dhu_autotune()


@functools.cache
def _extend_dhu_autotune() -> None:
    """Let FLA's backward state kernel also try 16-column value blocks on two warps.

    The kernel walks the chunks in sequence, one program per (head, value block), so at 6 heads its time is
    latency, not work: FLA's space (32 or 64 columns, 2 or 4 warps) leaves most SMs idle or waiting. At the
    hybrid-1.5B layer on the H200, 16 columns on two warps beat FLA's best (docs/design/gdn_kernels.md); the
    autotuner still picks per shape, so other shapes lose nothing.
    """
    import triton
    from fla.ops.common import chunk_delta_h

    autotuner = chunk_delta_h.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64.fn
    assert hasattr(autotuner, "configs"), "FLA's dhu kernel is no longer heuristics(autotune(jit))"
    autotuner.configs += [triton.Config({"BV": 16}, num_warps=2, num_stages=stages) for stages in (2, 3)]


def _state_gradients(q, k, w, g_cumsum, do, scale, h0, dht, cu_seqlens, chunk_indices):
    """(per-chunk state gradients dh, dh0, the gradient of u): the chunks' own value gradient (FLA's
    `chunk_bwd_dv_local`) and the state-gradient recurrence, as two kernels or, with fused output terms, one of ours
    (Gluon or Triton, as for the state kernels)."""
    if STATE_V_FIRST and gdn_kernels().output_terms in ("fused", "backward") and state_tma.qualifies(
            [q, k, w], [do], g_cumsum, cu_seqlens, CHUNK_SIZE):
        return _state_kernel("chunk_dhu", [q, k, w], [do], q, k, w, g_cumsum, do, None, scale, dht=dht,
                             want_dh0=h0 is not None)
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    common = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    dv = chunk_bwd_dv_local(q=q, k=k, g=g_cumsum, do=do, scale=scale, chunk_size=CHUNK_SIZE, **common)
    if _on_state_tma([q, k, w], [do, dv], g_cumsum, cu_seqlens):
        return _state_kernel("chunk_dhu", [q, k, w], [do, dv], q, k, w, g_cumsum, do, dv, scale, dht=dht,
                             want_dh0=h0 is not None)
    _extend_dhu_autotune()
    return chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g_cumsum, h0=h0, dht=dht, do=do, dv=dv, scale=scale,
                                          state_v_first=STATE_V_FIRST, chunk_size=CHUNK_SIZE, **common)


def gdn_backward(q, k, v, g, beta, g_cumsum, a_inverse, w, h, v_new, scale, initial_state, cu_seqlens, do, dht):
    """FLA's ``chunk_gated_delta_rule_bwd`` without its recomputation when the forward kept w, h and v_new. FLA is
    imported only for the kernels it runs, so with kept states and our kernels throughout (output terms "backward"
    or "fused", output gradients "fused") the backward runs wherever ours do (the interpreter on a CPU included)."""
    q, k, v, beta, g_cumsum, a_inverse, do = _contiguous(q, k, v, beta, g_cumsum, a_inverse, do)
    h0, dht = _state_layout(initial_state), _state_layout(dht)
    chunk_indices = _chunk_indices(cu_seqlens)
    with _on_device(q.device):
        if h.numel() == 0:
            w, u = _recomputed_w_u(k, v, beta, g_cumsum, a_inverse, cu_seqlens, chunk_indices)
            h, v_new, _ = _forward_states(k, w, u, g_cumsum, h0, False, cu_seqlens, chunk_indices)
        if _on_onepass_backward(q, k, v, v_new, w, beta, g_cumsum, a_inverse, h, do, cu_seqlens):
            ends, segments = None, chunk_bwd_onepass.segments_for(q, v)
            if segments > 1:  # one program per value head would leave SMs idle: segments side by side
                dh, _, _ = _state_gradients(q, k, w, g_cumsum, do, scale, None, dht, cu_seqlens, chunk_indices)
                ends = chunk_bwd_onepass.segment_ends(dh, dht, segments)
            dq, dk, dv, dbeta, dg, dh0 = chunk_bwd_onepass.chunk_bwd_onepass(
                q, k, v, v_new, w, beta, g_cumsum, a_inverse, h, do, scale, dht=dht, want_dh0=h0 is not None,
                ends=ends)
            return _backward_outputs(q, k, v, g, beta, initial_state, dq, dk, dv, dg, dbeta, dh0)
        dh, dh0, dv = _state_gradients(q, k, w, g_cumsum, do, scale, h0, dht, cu_seqlens, chunk_indices)
        if _on_fused_backward(q, k, v, v_new, beta, g_cumsum, a_inverse, h, do, dh, dv, cu_seqlens):
            dq, dk, dv, dbeta, dg = chunk_bwd_fused.chunk_bwd_fused(q, k, v, v_new, beta, g_cumsum, a_inverse, h, do,
                                                                    dh, dv, scale)
        else:
            dq, dk, dv, dbeta, dg = _output_and_wy_gradients(q, k, v, v_new, w, beta, g_cumsum, a_inverse, h, do, dh,
                                                             dv, scale, cu_seqlens, chunk_indices)
    return _backward_outputs(q, k, v, g, beta, initial_state, dq, dk, dv, dg, dbeta, dh0)


def _recomputed_w_u(k, v, beta, g_cumsum, a_inverse, cu_seqlens, chunk_indices):
    """The forward's w and u again (its chunk states were not kept): ours where the intra kernel is chosen, else
    FLA's `recompute_w_u_fwd`."""
    if _on_intra(k, v, g_cumsum, beta, cu_seqlens):
        return chunk_fwd_intra.recompute_w_u(k, v, beta, g_cumsum, a_inverse)
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    return recompute_w_u_fwd(k=k, v=v, beta=beta, A=a_inverse, g=g_cumsum, cu_seqlens=cu_seqlens,
                             chunk_indices=chunk_indices)


def _output_and_wy_gradients(q, k, v, v_new, w, beta, g_cumsum, a_inverse, h, do, dh, du, scale, cu_seqlens,
                             chunk_indices):
    """(dq, dk, dv, dβ, dg) as two kernels: the chunk output gradients (ours or FLA's) and FLA's WY backward, then the
    adds and FLA's reverse cumsum of dg."""
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
    from fla.ops.utils import chunk_local_cumsum

    common = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    ours = _on_dqkwg(q, k, v_new, w, g_cumsum, h, do, dh, du, cu_seqlens)
    dk_per_value_head = ours and v.shape[2] != q.shape[2]  # GVA: both dk parts summed over groups in one pass
    if ours:
        dq, dk, dw, dg = dqkwg.chunk_dqkwg(q, k, v_new, w, g_cumsum, h, do, dh, du, scale,
                                           dk_per_value_head=dk_per_value_head)
    else:
        dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g_cumsum, h=h, dv=du, do=do, dh=dh,
                                         scale=scale, state_v_first=STATE_V_FIRST, chunk_size=CHUNK_SIZE, **common)
    if dk_per_value_head:
        dk2, dv, dbeta, dg2 = _wy_backward_per_value_head(k, v, beta, g_cumsum, a_inverse, dw, du)
        dk = group_sum(dk, q.shape[2], dk2)
    else:
        dk2, dv, dbeta, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g_cumsum, A=a_inverse, dw=dw, du=du,
                                                  **common)
        dk.add_(dk2)
    dg.add_(dg2)
    return dq, dk, dv, dbeta, chunk_local_cumsum(dg, chunk_size=CHUNK_SIZE, reverse=True, **common)


def _on_device(device: torch.device):
    """`torch.cuda.device(device)` for a CUDA tensor's kernels (FLA's launchers read the current device); nothing
    to enter for CPU tensors under the interpreter."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _on_onepass_backward(q, k, v, v_new, w, beta, g_cumsum, a_inverse, h, do, cu_seqlens) -> bool:
    """Whether the whole backward runs as our one-pass kernel (dh in registers) for these inputs."""
    return STATE_V_FIRST and gdn_kernels().output_grads == "one-pass" and chunk_bwd_onepass.qualifies(
        q, k, v, v_new, w, beta, g_cumsum, a_inverse, h, do, cu_seqlens, CHUNK_SIZE)


def _on_fused_backward(q, k, v, v_new, beta, g_cumsum, a_inverse, h, do, dh, du, cu_seqlens) -> bool:
    """Whether the chunk-parallel rest of the backward runs as our one kernel for these inputs ("one-pass" falls
    back to it where its own kernel does not qualify)."""
    return STATE_V_FIRST and gdn_kernels().output_grads in ("fused", "one-pass") and chunk_bwd_fused.qualifies(
        q, k, v, v_new, beta, g_cumsum, a_inverse, h, do, dh, du, cu_seqlens, CHUNK_SIZE)


def _backward_outputs(q, k, v, g, beta, initial_state, dq, dk, dv, dg, dbeta, dh0):
    """(dq, dk, dv, dg, dbeta, dh0) in the inputs' dtypes and layouts; dh0 empty without an initial state."""
    if initial_state is None:
        dh0 = torch.empty(0, dtype=q.dtype, device=q.device)
    else:
        dh0 = _state_layout(dh0).to(initial_state.dtype)
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0
    return tuple(grad.contiguous() for grad in grads)


def _wy_backward_per_value_head(k, v, beta, g_cumsum, a_inverse, dw, du):
    """FLA's `prepare_wy_repr_bwd` for dense batches with more value heads than key heads, with dk left per value
    head: FLA's wrapper launches the same kernel and then sums dk over each group with a torch reduction, which the
    caller's `group_sum` does together with dqkwg's part (gated_delta_rule registers no other backend for it)."""
    import triton
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd_kernel
    from fla.utils import check_shared_mem

    batch, seq_len, heads, key_dim = k.shape
    value_heads, value_dim, chunk = v.shape[2], v.shape[-1], a_inverse.shape[-1]
    tiling = 64 if check_shared_mem() else 32
    block_k, block_v = (min(max(triton.next_power_of_2(dim), 16), tiling) for dim in (key_dim, value_dim))
    dk = k.new_empty(batch, seq_len, value_heads, key_dim)
    dv, dg, dbeta = torch.empty_like(v), torch.empty_like(g_cumsum), torch.empty_like(beta)
    prepare_wy_repr_bwd_kernel[(triton.cdiv(seq_len, chunk), batch * value_heads)](
        k=k, v=v, beta=beta, g=g_cumsum, A=a_inverse, dw=dw, du=du, dk=dk, dv=dv, db=dbeta, dg=dg, cu_seqlens=None,
        chunk_indices=None, T=seq_len, H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=chunk, BK=block_k,
        BV=block_v,
    )  # fmt: skip
    return dk, dv, dbeta, dg


def conv_forward(x, weight, bias, activation, cu_seqlens):
    from fla.modules.causal_conv1d.ops import causal_conv1d_fwd

    with torch.cuda.device(x.device):
        y, _ = causal_conv1d_fwd(
            x=x, weight=weight.contiguous(), bias=None if bias is None else bias.contiguous(), residual=None,
            activation=activation, cu_seqlens=cu_seqlens,
        )
    return y.contiguous()


def conv_backward(x, weight, bias, activation, cu_seqlens, dy):
    from fla.modules.causal_conv1d.ops import causal_conv1d_bwd

    with torch.cuda.device(x.device):
        dx, dweight, dbias, _, _ = causal_conv1d_bwd(
            x=x, dy=dy.contiguous(), dht=None, weight=weight.contiguous(),
            bias=None if bias is None else bias.contiguous(), activation=activation, cu_seqlens=cu_seqlens,
        )
    return dx.contiguous(), dweight.contiguous(), None if dbias is None else dbias.contiguous()


def l2norm_forward(x, eps):
    from fla.modules.norm.l2norm import l2norm_fwd

    with torch.cuda.device(x.device):
        y, rstd = l2norm_fwd(x.contiguous(), eps=eps)
    return y.contiguous(), rstd.contiguous()


def l2norm_backward(y, rstd, dy, eps):
    from fla.modules.norm.l2norm import l2norm_bwd

    with torch.cuda.device(y.device):
        return l2norm_bwd(y.contiguous(), rstd.contiguous(), dy.contiguous(), eps=eps).contiguous()


def gated_rms_norm_forward(x, gate, weight, eps):
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd

    width = x.shape[-1]
    with torch.cuda.device(x.device):
        y, _, rstd, _ = layer_norm_gated_fwd(
            x=x.reshape(-1, width).contiguous(), g=gate.reshape(-1, width).contiguous(), weight=weight.contiguous(),
            bias=None, activation="swish", eps=eps, is_rms_norm=True,
        )
    return y.view(x.shape), rstd.view(x.shape[:-1])


def gated_rms_norm_backward(x, gate, weight, rstd, dy, eps):
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_bwd

    width = x.shape[-1]
    with torch.cuda.device(x.device):
        dx, dgate, dweight, _, _ = layer_norm_gated_bwd(
            dy=dy.reshape(-1, width).contiguous(), x=x.reshape(-1, width).contiguous(),
            g=gate.reshape(-1, width).contiguous(), weight=weight.contiguous(), bias=None, activation="swish",
            eps=eps, rstd=rstd.reshape(-1).contiguous(), is_rms_norm=True,
        )
    return dx.view(x.shape), dgate.view(gate.shape), dweight
