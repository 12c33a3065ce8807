"""Compile-friendly Gated DeltaNet ops: torch.library custom ops with an FLA (Triton / TileLang) or pure-torch backend.

``chunk_gated_delta_rule``, ``causal_conv1d``, ``gated_rms_norm`` and ``l2norm`` each dispatch to custom ops with
``register_fake`` and ``register_autograd``, so ``torch.compile(fullgraph=True)`` traces through them without graph
breaks. ``selected_backend()`` reports which implementation CUDA tensors use; CPU tensors always use pure torch.
``set_gdn_kernels`` picks, per stage, where our Hopper kernels replace FLA's.
"""

from megatron_muon.ops.backend import selected_backend, set_backend
from megatron_muon.ops.conv import causal_conv1d
from megatron_muon.ops.gdn import chunk_gated_delta_rule
from megatron_muon.ops.kernel_choice import GdnKernels, gdn_kernels, set_gdn_kernels
from megatron_muon.ops.norm import gated_rms_norm, l2norm

__all__ = ["GdnKernels", "chunk_gated_delta_rule", "causal_conv1d", "gated_rms_norm", "gdn_kernels", "l2norm",
           "selected_backend", "set_backend", "set_gdn_kernels"]
