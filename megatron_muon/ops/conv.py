"""Causal depthwise conv1d (+ SiLU) as torch.library custom ops, so compiled graphs do not break around it.

y[t] = act(sum_w x[t - (W-1) + w] * weight[:, w] + bias) over x [B, T, D], weight [D, W]; with ``cu_seqlens``
(B = 1, packed sequences) no tap reaches across a sequence start. CUDA tensors use FLA's Triton kernels when an FLA
backend is selected (the backward of a dense conv without activation runs `conv_triton`'s one-pass kernel);
otherwise the pure-torch version below (W shifted multiply-adds, fp32 accumulation).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_muon.ops import conv_triton, fla_backend
from megatron_muon.ops.backend import backend_for

_ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = "silu",
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Depthwise causal conv over time: x [B, T, D], weight [D, W], bias [D] or None -> y [B, T, D] (x.dtype)."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"causal_conv1d expects x [B, T, D] and weight [D, W] with the same D; got x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)}. A Conv1d weight [D, 1, W] must be squeezed to [D, W] first."
        )
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"causal_conv1d: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}.")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {_ACTIVATIONS}, got {activation!r}.")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"causal_conv1d: with cu_seqlens pack the sequences into batch 1; got batch {x.shape[0]}.")
    return causal_conv1d_fwd(x, weight, bias, activation, cu_seqlens)


def _positions_in_sequence(cu_seqlens: Tensor | None, seq_len: int, device) -> Tensor | None:
    if cu_seqlens is None:
        return None
    positions = torch.arange(seq_len, device=device)
    segment = torch.searchsorted(cu_seqlens[1:].to(device), positions, right=True)
    return (positions - cu_seqlens.to(device)[segment])[None, :, None]


def _shifted(x: Tensor, shift: int, positions: Tensor | None) -> Tensor:
    """x[t - shift] (zero before the sequence start)."""
    out = F.pad(x[:, : x.shape[1] - shift], (0, 0, shift, 0))
    return out if positions is None else out * (positions >= shift)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _pre_activation(x, weight, bias, positions):
    width = weight.shape[1]
    x = x.to(_compute_dtype(x))
    weight = weight.to(x.dtype)
    out = x * weight[:, width - 1]
    for shift in range(1, min(width, x.shape[1] + 1)):
        out = out + _shifted(x, shift, positions) * weight[:, width - 1 - shift]
    return out if bias is None else out + bias.to(x.dtype)


def _torch_forward(x, weight, bias, activation, cu_seqlens):
    pre = _pre_activation(x, weight, bias, _positions_in_sequence(cu_seqlens, x.shape[1], x.device))
    return (F.silu(pre) if activation else pre).to(x.dtype).contiguous()


def _torch_backward(x, weight, bias, activation, cu_seqlens, dy):
    positions = _positions_in_sequence(cu_seqlens, x.shape[1], x.device)
    pre = _pre_activation(x, weight, bias, positions)
    d_pre = dy.to(pre.dtype)
    if activation:
        sig = torch.sigmoid(pre)
        d_pre = d_pre * sig * (1 + pre * (1 - sig))
    width, seq_len = weight.shape[1], x.shape[1]
    w = weight.to(pre.dtype)
    x_c = x.to(pre.dtype)
    dx = d_pre * w[:, width - 1]
    dweight = torch.zeros(weight.shape, dtype=pre.dtype, device=x.device)
    dweight[:, width - 1] = (d_pre * x_c).sum((0, 1))
    for shift in range(1, min(width, seq_len + 1)):
        masked = d_pre if positions is None else d_pre * (positions >= shift)
        dx = dx + F.pad(masked[:, shift:], (0, 0, 0, shift)) * w[:, width - 1 - shift]
        dweight[:, width - 1 - shift] = (masked * _shifted(x_c, shift, None)).sum((0, 1))
    dbias = d_pre.sum((0, 1)).to(bias.dtype) if bias is not None else x.new_empty(0)
    return dx.to(x.dtype).contiguous(), dweight.to(weight.dtype), dbias


@torch.library.custom_op("megatron_muon::causal_conv1d_fwd", mutates_args=())
def causal_conv1d_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, cu_seqlens: Tensor | None
) -> Tensor:
    if backend_for(x) == "torch":
        return _torch_forward(x, weight, bias, activation, cu_seqlens)
    return fla_backend.conv_forward(x, weight, bias, activation, cu_seqlens)


@causal_conv1d_fwd.register_fake
def _(x, weight, bias, activation, cu_seqlens):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("megatron_muon::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, cu_seqlens: Tensor | None, dy: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dweight, dbias); dbias is empty when there is no bias."""
    if backend_for(x) == "torch":
        return _torch_backward(x, weight, bias, activation, cu_seqlens, dy)
    if conv_triton.qualifies(x, weight, dy, activation, cu_seqlens):
        dx, dweight, dbias = conv_triton.conv_backward(x, weight, bias, dy)
    else:
        dx, dweight, dbias = fla_backend.conv_backward(x, weight, bias, activation, cu_seqlens, dy)
    return dx, dweight, dbias if dbias is not None else x.new_empty(0)


@causal_conv1d_bwd.register_fake
def _(x, weight, bias, activation, cu_seqlens, dy):
    dbias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias is not None else x.new_empty(0)
    contiguous = torch.contiguous_format
    return torch.empty_like(x, memory_format=contiguous), torch.empty_like(weight, memory_format=contiguous), dbias


def _setup_context(ctx, inputs, output):
    x, weight, bias, activation, cu_seqlens = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens)
    ctx.activation = activation


def _backward(ctx, dy):
    x, weight, bias, cu_seqlens = ctx.saved_tensors
    dx, dweight, dbias = causal_conv1d_bwd(x, weight, bias, ctx.activation, cu_seqlens, dy)
    return dx, dweight, dbias if bias is not None else None, None, None


causal_conv1d_fwd.register_autograd(_backward, setup_context=_setup_context)
