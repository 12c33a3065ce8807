"""Thin calls into flash-linear-attention 0.6's kernels (the fla-triton / fla-tilelang backends).

We call FLA's forward/backward functions directly (not its autograd.Functions, which are wrapped in
``torch.compiler.disable``) so that our custom ops own autograd and the compiled graph never breaks. FLA's own
dispatch picks TileLang for the gated backward on Hopper when the fla-tilelang backend was selected.
Imports are lazy: this module is only touched when a CUDA op runs with an FLA backend.
"""

import torch

CHUNK_SIZE = 64


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


def _chunk_indices(cu_seqlens):
    if cu_seqlens is None:
        return None
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, CHUNK_SIZE)


def gdn_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """(o, final_state or empty, g_cumsum (log2 space, FLA-private), A = (I + Akk)^-1) from FLA's chunk kernels."""
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    with torch.cuda.device(q.device):
        g_cumsum, o, a_inverse, final_state, _, _ = chunk_gated_delta_rule_fwd(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_indices=_chunk_indices(cu_seqlens),
            chunk_size=CHUNK_SIZE,
        )
    if final_state is None:
        final_state = torch.empty(0, dtype=torch.float32, device=q.device)
    return tuple(t.contiguous() for t in (o.to(v.dtype), final_state.float(), g_cumsum.float(), a_inverse.to(k.dtype)))


def gdn_backward(q, k, v, g, beta, g_cumsum, a_inverse, scale, initial_state, cu_seqlens, do, dht):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    q, k, v, beta, g_cumsum, a_inverse, initial_state, do, dht = _contiguous(
        q, k, v, beta, g_cumsum, a_inverse, initial_state, do, dht
    )
    with torch.cuda.device(q.device):
        dq, dk, dv, dbeta, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
            q=q, k=k, v=v, g=g_cumsum, beta=beta, A=a_inverse, scale=scale, initial_state=initial_state, do=do,
            dht=dht, cu_seqlens=cu_seqlens, chunk_indices=_chunk_indices(cu_seqlens), chunk_size=CHUNK_SIZE,
        )
    dh0 = torch.empty(0, dtype=q.dtype, device=q.device) if initial_state is None else dh0.to(initial_state.dtype)
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0
    return tuple(grad.contiguous() for grad in grads)


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
