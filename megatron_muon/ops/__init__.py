"""Compile-friendly Gated DeltaNet ops: torch.library custom ops with an FLA (Triton / TileLang) or pure-torch backend.

``chunk_gated_delta_rule``, ``causal_conv1d``, ``gated_rms_norm`` and ``l2norm`` each dispatch to custom ops with
``register_fake`` and ``register_autograd``, so ``torch.compile(fullgraph=True)`` traces through them without graph
breaks. ``selected_backend()`` reports which implementation CUDA tensors use; CPU tensors always use pure torch.
"""

from megatron_muon.ops.backend import selected_backend, set_backend
from megatron_muon.ops.conv import causal_conv1d
from megatron_muon.ops.gdn import chunk_gated_delta_rule
from megatron_muon.ops.norm import gated_rms_norm, l2norm

__all__ = ["chunk_gated_delta_rule", "causal_conv1d", "gated_rms_norm", "l2norm", "selected_backend", "set_backend"]
