"""torch.compile of the model the training loop built, over the whole model or layer by layer.

Whole-model compilation traces every layer into one graph, so its compile time grows with the depth. Compiling each
decoder layer instead lets Dynamo trace one graph per distinct layer kind (a GDN layer, an attention layer) and
reuse it for every layer of that kind: parameters are graph inputs, and nothing a layer's forward reads differs
between layers of one kind. Every kind gets its own entry function (its own code object, so its own Dynamo cache):
all kinds share `TransformerLayer.forward`, and one cache for all of them would count each kind after the first as
a recompile. The loss (cross entropy over the vocabulary, the largest elementwise work outside the layers) is
compiled on its own; the embedding, the final norm and the output layer's matmul stay eager.
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_muon.training.validation import COMPILE_SCOPES


def compile_model(module: torch.nn.Module, mode: str | None = "default", scope: str = "model",
                  backend="inductor") -> list[str]:
    """Compile `module` in place: its forward ("model"), or each decoder layer and the loss ("layer"). Returns the
    names of the compiled regions: each traces one graph, however many layers share it."""
    if scope == "model":
        module.forward = torch.compile(module.forward, mode=mode, backend=backend)
        return ["model"]
    if scope != "layer":
        raise ValueError(f"compile scope {scope!r}: use one of {', '.join(COMPILE_SCOPES)} (training.compile_scope).")
    layers = _decoder_layers(module)
    if not layers:
        raise ValueError(f"{type(module).__name__} has no decoder layers to compile one by one (this pipeline stage "
                         "may hold none); use training.compile_scope: model.")
    regions = {}
    for layer in layers:
        assert "forward" not in vars(layer), "a layer's forward is already replaced (compiled twice?)"
        key = layer_kind(layer)
        if key not in regions:
            name = f"{_kind_name(layer)}_layer_{len(regions)}"
            regions[key] = (name, torch.compile(_entry_function(name), mode=mode, backend=backend))
        layer.forward = functools.partial(_call_with_standard_strides, regions[key][1], layer)
    names = [name for name, _ in regions.values()]
    if getattr(module, "post_process", False) and hasattr(module, "compute_language_model_loss"):
        module.compute_language_model_loss = torch.compile(module.compute_language_model_loss, mode=mode,
                                                           backend=backend)
        names.append("loss")
    return names


def layer_kind(layer: torch.nn.Module) -> tuple:
    """What makes two layers share a graph: the same classes at the same places in the module tree."""
    return tuple((name, type(child)) for name, child in layer.named_modules())


def distinct_layer_kinds(module: torch.nn.Module) -> int:
    """How many layer graphs layer-scope compilation traces."""
    return len({layer_kind(layer) for layer in _decoder_layers(module)})


def _decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    return list(getattr(getattr(module, "decoder", None), "layers", None) or [])


def _kind_name(layer: torch.nn.Module) -> str:
    mixer = getattr(layer, "self_attention", None)
    return type(mixer if mixer is not None else layer).__name__


def _call_with_standard_strides(compiled, layer, *args, **kwargs):
    """Dynamo guards on strides, including those of size-1 dimensions, which do not change the layout: at micro
    batch 1 the embedding hands the first layer [s, 1, h] with the batch stride of its [1, s, h] source, and every
    later layer gets standard strides. Giving the first layer's input standard strides too (a view, no copy) keeps
    all layers of a kind on one graph instead of recompiling for the first."""
    if args and isinstance(args[0], torch.Tensor) and args[0].is_contiguous():
        args = (args[0].view(args[0].shape), *args[1:])
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.is_contiguous():
        kwargs["hidden_states"] = hidden.view(hidden.shape)
    return compiled(layer, *args, **kwargs)


def _run_layer(layer, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


def _entry_function(name: str):
    """`_run_layer` under its own code object: Dynamo keeps its compiled graphs and guards per code object."""
    code = _run_layer.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, _run_layer.__globals__, name)
