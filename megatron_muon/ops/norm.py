"""The q/k L2 norm and the gated RMSNorm of the GDN output, as torch.library custom ops.

gated_rms_norm(x, gate, weight) = x / sqrt(mean(x^2) + eps) * weight * silu(gate) over the last dim, computed in fp32
and returned in x.dtype: the same math as FLA's / megatron-core's FusedRMSNormGated with activation silu.
l2norm(x) = x / sqrt(sum(x^2) + eps) (FLA's definition). CUDA tensors use FLA's Triton kernels when an FLA backend is
selected, otherwise the torch versions below. Both save what FLA saves for backward (output or input, plus rstd).
"""

import torch
from torch import Tensor

from megatron_muon.ops import fla_backend
from megatron_muon.ops.backend import backend_for


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in x.dtype."""
    y, _ = l2norm_fwd(x, float(eps))
    return y


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """rmsnorm(x) * weight * silu(gate) over the last dim; x and gate [..., D], weight [D]; returns x.dtype."""
    if gate.shape != x.shape or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"gated_rms_norm expects gate shaped like x and weight [D] with D = x.shape[-1]; got x {tuple(x.shape)}, "
            f"gate {tuple(gate.shape)}, weight {tuple(weight.shape)}. Reshape x and gate to [..., head_dim] first."
        )
    if torch.compiler.is_compiling():
        return _gated_rms_norm_composite(x, gate, weight, float(eps))
    y, _ = gated_rms_norm_fwd(x, gate, weight, float(eps))
    return y


def _gated_rms_norm_composite(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The same math in plain torch ops, for compiled graphs: Inductor fuses it (and its autograd backward) into
    reductions that read a strided gate in place, where the FLA kernel needs contiguous copies of the gate (in the
    GDN layer a section of the in_proj output) forward and backward."""
    return _gated_rms_norm_torch(x, gate, weight, eps)[0]


def _gated_rms_norm_torch(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y in x.dtype, rstd fp32 [...]) in plain torch ops, computed in fp32 (fp64 for fp64 input)."""
    dtype = _compute_dtype(x)
    x_c = x.to(dtype)
    rstd = torch.rsqrt(x_c.square().mean(-1) + eps)
    y = x_c * rstd[..., None] * weight.to(dtype) * torch.nn.functional.silu(gate.to(dtype))
    return y.to(x.dtype), rstd.float()


@torch.library.custom_op("megatron_muon::l2norm_fwd", mutates_args=())
def l2norm_fwd(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns (y in x.dtype, rstd fp32 [...])."""
    if backend_for(x) != "torch":
        return fla_backend.l2norm_forward(x, eps)
    x_c = x.to(_compute_dtype(x))
    rstd = torch.rsqrt(x_c.square().sum(-1) + eps)
    return (x_c * rstd[..., None]).to(x.dtype).contiguous(), rstd.float()


@l2norm_fwd.register_fake
def _(x, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("megatron_muon::l2norm_bwd", mutates_args=())
def l2norm_bwd(y: Tensor, rstd: Tensor, dy: Tensor, eps: float) -> Tensor:
    if backend_for(y) != "torch":
        return fla_backend.l2norm_backward(y, rstd, dy, eps)
    dtype = _compute_dtype(y)
    y_c, dy_c = y.to(dtype), dy.to(dtype)
    dx = (dy_c - y_c * (dy_c * y_c).sum(-1, keepdim=True)) * rstd.to(dtype)[..., None]
    return dx.to(y.dtype).contiguous()


@l2norm_bwd.register_fake
def _(y, rstd, dy, eps):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _l2norm_setup(ctx, inputs, output):
    ctx.save_for_backward(output[0], output[1])
    ctx.eps = inputs[1]
    ctx.mark_non_differentiable(output[1])


def _l2norm_backward(ctx, dy, _drstd):
    y, rstd = ctx.saved_tensors
    return l2norm_bwd(y, rstd, dy, ctx.eps), None


l2norm_fwd.register_autograd(_l2norm_backward, setup_context=_l2norm_setup)


@torch.library.custom_op("megatron_muon::gated_rms_norm_fwd", mutates_args=())
def gated_rms_norm_fwd(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns (y in x.dtype, rstd fp32 [...])."""
    if backend_for(x) != "torch":
        return fla_backend.gated_rms_norm_forward(x, gate, weight, eps)
    y, rstd = _gated_rms_norm_torch(x, gate, weight, eps)
    return y.contiguous(), rstd


@gated_rms_norm_fwd.register_fake
def _(x, gate, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("megatron_muon::gated_rms_norm_bwd", mutates_args=())
def gated_rms_norm_bwd(
    x: Tensor, gate: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dgate, dweight) in the dtypes of x, gate and weight."""
    if backend_for(x) != "torch":
        return fla_backend.gated_rms_norm_backward(x, gate, weight, rstd, dy, eps)
    dtype = _compute_dtype(x)
    normed = x.to(dtype) * rstd.to(dtype)[..., None]
    gate_c, dy_c, weight_c = gate.to(dtype), dy.to(dtype), weight.to(dtype)
    sig = torch.sigmoid(gate_c)
    affine = normed * weight_c
    dgate = dy_c * affine * sig * (1 + gate_c * (1 - sig))
    d_affine = dy_c * gate_c * sig
    dweight = (d_affine * normed).reshape(-1, x.shape[-1]).sum(0)
    d_normed = d_affine * weight_c
    dx = (d_normed - normed * (d_normed * normed).mean(-1, keepdim=True)) * rstd.to(dtype)[..., None]
    return dx.to(x.dtype).contiguous(), dgate.to(gate.dtype).contiguous(), dweight.to(weight.dtype).contiguous()


@gated_rms_norm_bwd.register_fake
def _(x, gate, weight, rstd, dy, eps):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
    )


def _gated_setup(ctx, inputs, output):
    x, gate, weight, eps = inputs
    ctx.save_for_backward(x, gate, weight, output[1])
    ctx.eps = eps
    ctx.mark_non_differentiable(output[1])


def _gated_backward(ctx, dy, _drstd):
    x, gate, weight, rstd = ctx.saved_tensors
    dx, dgate, dweight = gated_rms_norm_bwd(x, gate, weight, rstd, dy, ctx.eps)
    return dx, dgate, dweight, None


gated_rms_norm_fwd.register_autograd(_gated_backward, setup_context=_gated_setup)
