"""Compile-friendly Gated DeltaNet ops: torch.library custom ops with an FLA (Triton / TileLang) or pure-torch backend.

``chunk_gated_delta_rule``, ``causal_conv1d``, ``gated_rms_norm`` and ``l2norm`` each dispatch to custom ops with
``register_fake`` and ``register_autograd``, so ``torch.compile(fullgraph=True)`` traces through them without graph
breaks. ``selected_backend()`` reports which implementation CUDA tensors use; CPU tensors always use pure torch.
``set_gdn_kernels`` picks, per stage, where our Hopper kernels replace FLA's; where FlashQLA is installed it runs the
bf16 K = V = 128 calls (``flashqla_enabled`` reports it, ``set_flashqla(False)`` keeps our kernels).
"""

from megatron_muon.ops.backend import selected_backend, set_backend
from megatron_muon.ops.conv import causal_conv1d
from megatron_muon.ops.gdn import chunk_gated_delta_rule
from megatron_muon.ops.gdn_flashqla import flashqla_enabled, set_flashqla
from megatron_muon.ops.kernel_choice import GdnKernels, gdn_kernels, set_gdn_kernels
from megatron_muon.ops.norm import gated_rms_norm, l2norm

__all__ = ["GdnKernels", "chunk_gated_delta_rule", "causal_conv1d", "flashqla_enabled", "gated_rms_norm", "gdn_kernels",
           "l2norm", "selected_backend", "set_backend", "set_flashqla", "set_gdn_kernels"]
