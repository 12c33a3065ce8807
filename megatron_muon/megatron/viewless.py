"""megatron's `make_viewless_tensor` made a no-op inside torch.compile'd code.

megatron turns a layer's output into a "viewless" tensor so that a view does not keep its base alive: it creates a
one-element tensor and assigns the view's storage to its `.data`. Dynamo cannot trace either step (a tensor created
with `requires_grad=True`, then `.data =`): it breaks the graph there and, with grad enabled, hands the resumed
graph the one-element tensor whose shape the assignment changed, which Inductor's input check rejects ("wrong
number of dimensions"). Layers whose last linear returns a view (Transformer Engine's modules do) hit this when
compiled. Inside a compiled region the graph's outputs are fresh tensors that Inductor lays out itself, so there is
nothing to detach from; outside one megatron's function runs unchanged.
"""

from __future__ import annotations

import importlib

import torch

# megatron modules whose `make_viewless_tensor` runs inside the regions the plugin compiles (a layer; the block
# around the layers when the whole model is compiled)
COMPILED_CALLERS = (
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.models.hybrid.hybrid_block",
)


def make_viewless_tensor(inp, requires_grad, keep_graph):
    """megatron's `make_viewless_tensor`, returning `inp` itself while Dynamo traces a graph that keeps it."""
    if keep_graph and torch.compiler.is_compiling():
        return inp
    from megatron.core.utils import make_viewless_tensor as megatron_make_viewless_tensor

    return megatron_make_viewless_tensor(inp, requires_grad, keep_graph)


def install_compile_aware_viewless_tensor() -> int:
    """Replace the name in each caller that imports it; returns how many modules it replaced it in."""
    replaced = 0
    for name in COMPILED_CALLERS:
        module = importlib.import_module(name)
        if module.make_viewless_tensor is not make_viewless_tensor:
            module.make_viewless_tensor = make_viewless_tensor
            replaced += 1
    return replaced
