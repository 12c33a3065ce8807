"""DDP's parameter layout for `--optimizer muon --use-distributed-optimizer`: each Muon matrix whole in its owner's shard.

`compute_full_param_layout` has the signature of megatron's `LayerWiseDistributedOptimizer.compute_full_param_layout`
and returns megatron's `FullParamLayout`, which megatron-core's `DistributedDataParallel(full_param_layout=...)`
takes: buffers of parameters tagged `is_managed_by_layer_wise_optimizer` (the Muon matrices, see
`tag_params_for_owner_buffers`) get the owner plan of `distributed.owner_layout`, every other buffer megatron's
distributed-optimizer layout. The plan is computed on the first rank of each pipeline stage and broadcast, so every
replica lays its buffers out identically even when the solver's time limit makes the plan machine-dependent.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import torch

from megatron_muon.distributed.cost import AnalyticCost, CostModel
from megatron_muon.distributed.owner_layout import LayoutItem, plan_owner_layout
from megatron_muon.optimizer.routing import (is_muon_param, matrix_layout, piece_matrix_count, piece_matrix_shape,
                                             piece_views, tag_fused_in_proj)

TAG = "is_managed_by_layer_wise_optimizer"  # megatron's attribute that splits DDP buffers (BufferKey)

PLAN_METHODS = ("auto", "milp", "greedy")


@dataclass(frozen=True)
class OwnerPlanSettings:
    """How a layout plans owners: `method` "auto" (MILP, LPT when it times out), "milp" or "greedy"; `cost` a
    `distributed.cost.CostModel` (None: the Newton–Schulz FLOPs of the job's own settings). `tokens_per_step` (per
    rank) tells the plan how long the backward runs after each bucket and counts work released early as hidden
    behind it: right where the backward leaves the GPU idle (a network-bound step), wrong where it keeps the GPU
    busy, which is why the default (None) balances every rank's total work. `split_heads`: whether the optimizer
    orthogonalizes fused sections per head (`Muon(split_heads=True)`; the plan then costs one matrix per head);
    None: the job's own setting."""

    method: str = "auto"
    cost: CostModel | None = None
    tokens_per_step: int | None = None
    split_heads: bool | None = None

    def __post_init__(self):
        if self.method not in PLAN_METHODS:
            raise ValueError(f"owner plan method must be one of {PLAN_METHODS}, got {self.method!r}")
        if self.tokens_per_step is not None and self.tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be a positive int or None, got {self.tokens_per_step}")


def tag_fused_projections(model_chunks) -> None:
    """megatron's `is_qkv` split tags on QKV weights (as its emerging-optimizer factory sets them) and ours on GDN
    in_proj weights, so Muon orthogonalizes each part on its own."""
    from megatron.core.optimizer.emerging_optimizers import _get_qkv_split_shapes

    for chunk in model_chunks:
        tag_fused_in_proj(chunk)
        config = getattr(chunk, "config", None)
        for name, param in chunk.named_parameters():
            if config is not None and "linear_qkv.weight" in name and param.ndim == 2 \
                    and not getattr(param, "is_qkv", False):
                shapes = _get_qkv_split_shapes(config)
                if param.shape[0] % sum(shapes) == 0:
                    param.is_qkv, param.qkv_split_shapes = True, shapes


def tag_params_for_owner_buffers(model_chunks) -> None:
    """Mark the Muon matrices so megatron's DDP gives them their own buffers, and tag fused projections (QKV, GDN
    in_proj) so the plan costs their parts. Call on the model chunks before wrapping them in DDP."""
    tag_fused_projections(model_chunks)
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                setattr(param, TAG, is_muon_param(param, name))


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1


def layout_items(params, cost: CostModel, tp_size: int, split_heads: bool = False) -> list[LayoutItem]:
    """One planning item per parameter: its full (unsharded) matrices' Newton–Schulz cost (a head is never
    sharded)."""
    items = []
    for index, param in enumerate(params):
        layout = matrix_layout(param, split_heads=split_heads)
        shapes = []
        for piece_index, piece in enumerate(piece_views(param, layout)):
            heads = layout.piece_head_rows(piece_index)
            rows, cols = piece_matrix_shape(piece, heads)
            if layout.partition_dim == 0 and not heads:
                rows *= tp_size
            elif layout.partition_dim == 1:
                cols *= tp_size
            shapes += [(rows, cols)] * piece_matrix_count(piece, heads)
        kind = tuple(shapes)
        launch = sum(cost.launch_cost(shape) for shape in set(shapes))
        items.append(LayoutItem(f"param{index}", param.numel(), kind,
                                sum(cost.matrix_cost(shape) for shape in shapes), launch))
    return items


def _stage_grid():
    """This pipeline stage's TP × DP ranks (None outside a process group)."""
    from megatron.core import parallel_state

    from megatron_muon.distributed.comm import StageGrid

    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else None
    return StageGrid(parallel_state.get_tensor_model_parallel_group(),
                     parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
                     device=device)


def _job_muon_config():
    """The job's own Muon settings: Megatron-LM's parsed `--muon-*` arguments when a Megatron-LM script is running
    (with the launcher's plugin flags), megatron's defaults otherwise."""
    from megatron_muon.megatron.muon_config import MuonConfig

    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars is not None else None
    return MuonConfig.from_options(args if args is not None else object())


def _default_cost() -> CostModel:
    """Newton–Schulz FLOPs of the job's own settings (`_job_muon_config`)."""
    return AnalyticCost.for_orthogonalizer(_job_muon_config().orthogonalizer)


def owner_buffer_layout(params, bucket_size, dp: int, ddp_config, param_indices=None,
                        plan_settings: OwnerPlanSettings = OwnerPlanSettings()):
    """megatron's PerBufferParamLayout for one Muon buffer: owner-planned, whole matrices per shard."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.param_layout import PerBufferParamLayout

    cost = plan_settings.cost or _default_cost()
    split_heads = plan_settings.split_heads
    if split_heads is None:
        split_heads = _job_muon_config().split_heads
    items = layout_items(params, cost, _tp_size(), split_heads)
    tokens = plan_settings.tokens_per_step
    # a matrix's weight and input gradients are ~4·tokens FLOPs per element, at the cost model's rate
    per_element = 4.0 * tokens / getattr(cost, "flops_per_s", AnalyticCost().flops_per_s) if tokens else 0.0
    divisor = math.lcm(LayerWiseDistributedOptimizer._shard_divisor(dp, ddp_config), 64)
    grid = _stage_grid() if dp > 1 else None
    first = grid is None or grid.slot == 0  # only the first rank solves; the others adopt its plan
    plan = plan_owner_layout(items, dp, bucket_size, divisor, per_element, plan_settings.method if first else "greedy")
    if grid is not None:
        methods = ("greedy", "milp")
        shared = grid.broadcast_from_first_slot(torch.tensor([*plan.owners, methods.index(plan.method)])).tolist()
        plan = replace(plan_owner_layout(items, dp, bucket_size, divisor, per_element, owners=shared[:-1]),
                       method=methods[shared[-1]])
    index_map = {}
    for bucket_id, members in enumerate(plan.buckets):
        for i in members:
            index_map[params[i]] = (*plan.ranges[i], bucket_id)
    layout = PerBufferParamLayout(
        param_index_map=index_map,
        bucket_indices=list(plan.bucket_ranges),
        per_bucket_numel_unpadded=[sum(params[i].numel() for i in members) for members in plan.buckets],
        param_indices=param_indices if param_indices is not None else [],
        num_optimizer_shards=dp,
    )
    layout.owner_plan = plan  # for reports: method, predicted finish times, padding
    return layout


def compute_full_param_layout(params, bucket_size, data_parallel_world_size, ddp_config,
                              expert_data_parallel_world_size=None,
                              plan_settings: OwnerPlanSettings = OwnerPlanSettings()):
    """megatron's `FullParamLayout` for all of `params`: owner-planned Muon buffers (as `plan_settings` say; the
    training CLI passes the cost of its recipe's Newton–Schulz settings), distributed-optimizer rest."""
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.param_layout import FullParamLayout

    layouts = {}
    for key, (group, param_indices) in group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32).items():
        dp = data_parallel_world_size
        if key.is_expert_parallel:
            dp = expert_data_parallel_world_size or data_parallel_world_size
        if key.is_managed_by_layer_wise_optimizer:
            if key.is_expert_parallel:
                raise ValueError("expert-parallel Muon matrices are not laid out by owner yet; use --optimizer muon "
                                 "without --use-distributed-optimizer for MoE models")
            layouts[key] = owner_buffer_layout(group, bucket_size, dp, ddp_config, param_indices, plan_settings)
        else:
            layouts[key] = DistributedOptimizer._compute_per_buffer_param_layout(
                group, bucket_size, dp, ddp_config, param_indices)
    return FullParamLayout(layouts=layouts)


def use_owner_layout_in_megatron() -> None:
    """Make megatron's `LayerWiseDistributedOptimizer.compute_full_param_layout` (what Megatron-LM's training loop
    calls to wrap DDP for `--optimizer muon --use-distributed-optimizer`) compute the owner layout, and make
    Megatron-LM's config-container model builder take that wiring too (`layer_wise_ddp`); idempotent."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    from megatron_muon.megatron.layer_wise_ddp import use_layer_wise_wiring_on_the_config_path

    use_layer_wise_wiring_on_the_config_path()
    if getattr(LayerWiseDistributedOptimizer.compute_full_param_layout, "_megatron_muon", False):
        return
    layout = staticmethod(compute_full_param_layout)
    compute_full_param_layout._megatron_muon = True
    LayerWiseDistributedOptimizer.compute_full_param_layout = layout
