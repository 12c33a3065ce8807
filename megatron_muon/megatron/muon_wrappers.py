"""The megatron mixed-precision wrappers around our Muon whose elementwise passes run fused: the wrappers that the
clip deferral and the model-copy fast path both take over."""

from __future__ import annotations


def fused_muon_wrappers(optimizer) -> list[tuple[object, object]]:
    """(wrapper, Muon) for every Float16OptimizerWithFloat16Params in `optimizer` (or its chain) that holds our
    single-process Muon with parameters, where Muon's fused passes run on the parameters' device. The owner-centric
    engine (dist_muon) is left out: its step neither reads a deferred clip factor nor writes model copies, so
    megatron's own clip and copy must stay."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_muon.distributed.owner_muon import OwnerMuon
    from megatron_muon.optimizer import Muon
    from megatron_muon.optimizer.fused_elementwise import use_fused

    found = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        muon = getattr(part, "optimizer", None)
        if type(part) is not Float16OptimizerWithFloat16Params or not isinstance(muon, Muon) \
                or isinstance(muon, OwnerMuon):
            continue
        params = [p for group in muon.param_groups for p in group["params"]]
        if params and use_fused(muon.fused_elementwise, params[0].device):
            found.append((part, muon))
    return found
