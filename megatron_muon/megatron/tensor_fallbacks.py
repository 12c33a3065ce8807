"""Foreach versions of megatron's TE/Apex-less multi-tensor fallbacks (grad norm, grad clipping, master copies).

Without Transformer Engine or Apex, megatron-core 0.19.2 computes the global grad norm with one `torch.norm` per
tensor and then `torch.tensor(list_of_device_scalars)`, which copies every norm to the host (one device sync per
parameter), and scales/copies tensors one `dst.copy_(src * scale)` at a time (a temporary per tensor, even for the
scale-1 master-to-model copy). It also lacks TE's `multi_tensor_scale_tensor`, so gradient clipping reads the norm
on the host (`.item()`): one device sync per step, which keeps the CPU from queueing the next step while the GPU
finishes this one. The versions here compute the same values with torch's multi-tensor (`_foreach_*`) kernels and
keep the norm and the clip factor on the device, as TE does. They replace megatron's fallbacks only where those are
installed, so a Transformer Engine or Apex installation is never touched.
"""

from __future__ import annotations

import torch

from megatron_muon.optimizer import clip_scale

_PATCHED_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for `amp_C.multi_tensor_l2norm` (global norm only): ([norm] float32 on the tensors' device, None)."""
    if per_tensor:
        raise ValueError("foreach_l2_norm computes the global norm only (per_tensor=False), as megatron's fallback")
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for `amp_C.multi_tensor_scale`: dst = src * scale for each pair (any float dtypes)."""
    sources, targets = list(tensor_lists[0]), list(tensor_lists[1])
    if not sources:
        return
    if all(s is d for s, d in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    elif scale == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def foreach_scale_tensor(chunk_size, noop_flag, tensor_lists, scale: torch.Tensor):
    """Drop-in for TE's `multi_tensor_scale_tensor`: dst = src * scale, `scale` a one-element device tensor."""
    sources, targets = list(tensor_lists[0]), list(tensor_lists[1])
    if not sources:
        return
    scale = scale.reshape(())
    if all(s is d for s, d in zip(sources, targets)):
        if not clip_scale.scale_in_place(targets, scale):  # one launch, nothing moved when the factor is 1
            torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def install_foreach_fallbacks() -> list[str]:
    """Swap megatron's local fallbacks for the foreach versions; returns the module attributes replaced."""
    import importlib

    from megatron.core import utils

    replaced = []
    for module_name in _PATCHED_MODULES:
        module = importlib.import_module(module_name)
        if getattr(module, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
            module.l2_norm_impl = foreach_l2_norm
            replaced.append(f"{module_name}.l2_norm_impl")
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
            replaced.append(f"{module_name}.multi_tensor_scale_impl")
        # Only beside our norm: with Apex (norm kernel, no tensor scale) megatron keeps its host-side clipping.
        tensor_scale = "multi_tensor_scale_tensor_impl"
        if getattr(module, "l2_norm_impl", None) is foreach_l2_norm and getattr(module, tensor_scale, 0) is None:
            setattr(module, tensor_scale, foreach_scale_tensor)
            replaced.append(f"{module_name}.{tensor_scale}")
    return replaced
