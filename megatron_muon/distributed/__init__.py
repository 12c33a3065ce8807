"""Owner-centric distributed Muon: cost-balanced owners (plan), shard movement (comm), gradients reduced to their
owners (grad_reduce), the engine (owner_muon).

Each matrix is orthogonalized exactly once per step, by one owner chosen among the data- and tensor-parallel
ranks of its pipeline stage; `megatron_muon.megatron.dist_muon` puts it behind megatron's `dist_muon` and routes
megatron DDP's Muon gradients to the owners by reduce-scatter.
"""

from megatron_muon.distributed.plan import (
    AnalyticCost,
    MatrixSpec,
    MeasuredCost,
    OwnerPlan,
    lower_bound,
    plan_owners,
)

__all__ = ["AnalyticCost", "MatrixSpec", "MeasuredCost", "OwnerPlan", "lower_bound", "plan_owners", "OwnerMuon"]


def __getattr__(name: str):
    if name == "OwnerMuon":  # the engine imports the optimizer package; the planner alone stays light
        from megatron_muon.distributed.owner_muon import OwnerMuon

        return OwnerMuon
    raise AttributeError(f"module 'megatron_muon.distributed' has no attribute {name!r}")
