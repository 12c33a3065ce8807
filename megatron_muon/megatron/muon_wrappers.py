"""The megatron mixed-precision wrappers around our Muon whose elementwise passes run fused: the wrappers that the
clip deferral and the model-copy fast path both take over."""

from __future__ import annotations


def fused_muon_wrappers(optimizer) -> list[tuple[object, object]]:
    """(wrapper, Muon) for every Float16OptimizerWithFloat16Params in `optimizer` (or its chain) that holds our
    single-process Muon with parameters, where Muon's fused passes run on the parameters' device. Only the chain's
    own members are looked at: the owner engine's wrappers sit inside `OwnerMuonOptimizer` and keep megatron's clip
    and copy."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_muon.optimizer import Muon
    from megatron_muon.optimizer.fused_elementwise import use_fused

    found = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        muon = getattr(part, "optimizer", None)
        if type(part) is not Float16OptimizerWithFloat16Params or not isinstance(muon, Muon):
            continue
        params = [p for group in muon.param_groups for p in group["params"]]
        if params and use_fused(muon.fused_elementwise, params[0].device):
            found.append((part, muon))
    return found
