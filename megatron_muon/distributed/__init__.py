"""Owner-centric distributed Muon, the pure parts: owner plans balanced by Newton–Schulz cost (`plan`, `cost`,
`profile`), owner-ordered DDP bucket layouts (`owner_layout`) and the stage grid (`comm`).

`megatron_muon.megatron.dist_muon` builds the engine megatron runs for `--optimizer muon --use-distributed-optimizer`
on these.
"""

from megatron_muon.distributed.owner_layout import LayoutItem, OwnerLayout, plan_owner_layout
from megatron_muon.distributed.plan import (
    AnalyticCost,
    MatrixSpec,
    MeasuredCost,
    OwnerPlan,
    lower_bound,
    plan_owners,
)

__all__ = ["AnalyticCost", "LayoutItem", "MatrixSpec", "MeasuredCost", "OwnerLayout", "OwnerPlan", "lower_bound",
           "plan_owner_layout", "plan_owners"]
