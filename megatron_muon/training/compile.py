"""torch.compile of the model the training loop built, over the whole model or layer by layer.

Whole-model compilation traces every layer into one graph, so its compile time grows with the depth. Compiling each
decoder layer's forward instead lets Dynamo trace one graph per distinct layer kind (a GDN layer, an attention
layer) and reuse it for every layer of that kind: parameters are graph inputs, and nothing a layer's forward reads
differs between layers of one kind. The embedding, the final norm, the output layer and the loss stay eager. The
second kind is one guard miss on the shared `TransformerLayer.forward`, which Dynamo counts as a recompile.
"""

from __future__ import annotations

import torch


def compile_model(module: torch.nn.Module, mode: str | None = "default", scope: str = "model",
                  backend: str = "inductor") -> None:
    """Compile `module` in place: its forward ("model") or each of its decoder layers' forwards ("layer")."""
    if scope == "model":
        module.forward = torch.compile(module.forward, mode=mode, backend=backend)
        return
    if scope != "layer":
        raise ValueError(f"compile scope {scope!r}: use 'model' or 'layer' (training.compile_scope).")
    layers = getattr(getattr(module, "decoder", None), "layers", None)
    if not layers:
        raise ValueError(f"{type(module).__name__} has no decoder layers to compile one by one (this pipeline stage "
                         "may hold none); use training.compile_scope: model.")
    for layer in layers:
        layer.forward = torch.compile(layer.forward, mode=mode, backend=backend)


def distinct_layer_kinds(module: torch.nn.Module) -> int:
    """How many different graphs layer-scope compilation traces: one per distinct (layer, mixer, mlp) class."""
    layers = getattr(getattr(module, "decoder", None), "layers", None) or []
    return len({(type(layer), type(getattr(layer, "self_attention", None)), type(getattr(layer, "mlp", None)))
                for layer in layers})
