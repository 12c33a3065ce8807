"""The owner layout planner on its own: every matrix whole in its owner's shard, little padding, and a busiest rank
close to the even split of Newton–Schulz work (closer than megatron's element-balanced layer-wise layout)."""

import pytest
import torch

from megatron_muon.distributed.cost import AnalyticCost
from megatron_muon.distributed.owner_layout import (
    MAX_PADDING,
    PARAM_ALIGNMENT,
    LayoutItem,
    finish_times,
    plan_owner_layout,
)

COST = AnalyticCost()
DIVISOR = 64 * 128


def _item(name, units, rows, cols):
    return LayoutItem(name, rows * cols, tuple(units), sum(COST.matrix_cost(u) for u in units),
                      COST.launch_s * len(set(units)))


def hybrid_items():
    """The hybrid-1.5B's Muon matrices (GGG* layers), split as Muon orthogonalizes them."""
    items = []
    for layer in range(24):
        if layer % 4 == 3:
            items += [_item(f"{layer}.qkv", [(2048, 2048), (512, 2048), (512, 2048)], 3072, 2048),
                      _item(f"{layer}.proj", [(2048, 2048)], 2048, 2048)]
        else:
            items += [_item(f"{layer}.in_proj", [(1536, 2048)] * 2 + [(3072, 2048)] * 2 + [(6, 2048)] * 2, 9228, 2048),
                      _item(f"{layer}.out_proj", [(2048, 3072)], 2048, 3072)]
        items += [_item(f"{layer}.fc1", [(5632, 2048)] * 2, 11264, 2048), _item(f"{layer}.fc2", [(2048, 5632)], 2048, 5632)]
    return items


def gpt7b_items():
    items = []
    for layer in range(32):
        items += [_item(f"{layer}.qkv", [(4096, 4096)] * 3, 12288, 4096), _item(f"{layer}.proj", [(4096, 4096)], 4096, 4096),
                  _item(f"{layer}.fc1", [(11008, 4096)] * 2, 22016, 4096), _item(f"{layer}.fc2", [(4096, 11008)], 4096, 11008)]
    return items


def _check_placement(items, plan, dp):
    seen = set()
    for b, ((start, end), members) in enumerate(zip(plan.bucket_ranges, plan.buckets)):
        assert (end - start) % (dp * DIVISOR // 128) == 0 or (end - start) % dp == 0
        shard = (end - start) // dp
        assert shard % 64 == 0
        if b:
            assert start == plan.bucket_ranges[b - 1][1], "buckets are contiguous"
        for i in members:
            lo, hi = plan.ranges[i]
            assert hi - lo == items[i].numel and lo % PARAM_ALIGNMENT == 0
            assert start + plan.owners[i] * shard <= lo and hi <= start + (plan.owners[i] + 1) * shard, \
                f"{items[i].name} not inside its owner's shard"
            seen.add(i)
    assert seen == set(range(len(items)))
    spans = sorted(plan.ranges)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "parameters overlap"
    ordered = [i for members in plan.buckets for i in members]
    assert sorted(ordered) == list(range(len(items)))
    assert [min(m) for m in plan.buckets] == sorted((min(m) for m in plan.buckets), reverse=True), \
        "buckets run in backward order"


@pytest.mark.parametrize("dp", [2, 4, 8])
@pytest.mark.parametrize("workload", ["hybrid", "gpt7b"])
def test_matrices_stay_whole_in_their_owners_shard_with_little_padding(workload, dp):
    items = hybrid_items() if workload == "hybrid" else gpt7b_items()
    plan = plan_owner_layout(items, dp, max(40_000_000, 1_000_000 * dp), DIVISOR, time_limit_s=1.0)
    _check_placement(items, plan, dp)
    assert plan.padding() <= MAX_PADDING * sum(i.numel for i in items)
    ideal = sum(i.cost for i in items) / dp
    assert plan.makespan_s <= 1.2 * ideal, f"{plan.method}: {plan.makespan_s / ideal:.3f} x the even split"
    assert len(set(plan.owners)) == dp


def _megatron_layer_wise_makespan(items, dp):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    params = [torch.nn.Parameter(torch.empty(item.numel, device="meta")) for item in items]
    layout = LayerWiseDistributedOptimizer._compute_per_buffer_param_layout(
        params, max(40_000_000, 1_000_000 * dp), dp, DistributedDataParallelConfig(use_distributed_optimizer=True))
    loads = [0.0] * dp
    for param, item in zip(params, items):
        start, _, bucket = layout.param_index_map[param]
        bucket_start, bucket_end = layout.bucket_indices[bucket]
        loads[(start - bucket_start) // ((bucket_end - bucket_start) // dp)] += item.cost
    padding = layout.bucket_indices[-1][1] - sum(item.numel for item in items)
    return max(loads), padding


def test_cost_balanced_owners_beat_megatrons_element_balanced_layout():
    """gpt-7b at dp=8: megatron's layer-wise layout balances elements per bucket; the plan balances Newton–Schulz
    time and leaves less padding."""
    items = gpt7b_items()
    plan = plan_owner_layout(items, 8, 40_000_000, DIVISOR, time_limit_s=1.0)
    upstream_makespan, upstream_padding = _megatron_layer_wise_makespan(items, 8)
    assert plan.makespan_s < 0.95 * upstream_makespan
    assert plan.padding() < upstream_padding


def test_release_times_count_the_backward_that_hides_early_buckets():
    """With buckets released as the backward produces them, a rank's finish time is its work after the last
    release, not its total: the plan then balances late work."""
    items = hybrid_items()
    at_once = plan_owner_layout(items, 4, 40_000_000, DIVISOR, method="greedy")
    spaced = plan_owner_layout(items, 4, 40_000_000, DIVISOR, backward_s_per_element=1e-9, method="greedy")
    assert spaced.buckets == at_once.buckets
    release = [0.0]
    for members in spaced.buckets[:-1]:
        release.append(release[-1] + 1e-9 * sum(items[i].numel for i in members))
    assert spaced.finish_s == finish_times(items, list(spaced.buckets), spaced.owners, 4, release)
    assert max(spaced.finish_s.values()) >= release[-1]


def test_a_given_assignment_is_placed_and_checked():
    items = hybrid_items()[:12]
    plan = plan_owner_layout(items, 2, 40_000_000, DIVISOR)
    again = plan_owner_layout(items, 2, 40_000_000, DIVISOR, owners=list(plan.owners))
    assert (again.ranges, again.bucket_ranges, again.method) == (plan.ranges, plan.bucket_ranges, "given")
    with pytest.raises(ValueError, match="rank in"):
        plan_owner_layout(items, 2, 40_000_000, DIVISOR, owners=[5] * len(items))
    with pytest.raises(ValueError, match="method"):
        plan_owner_layout(items, 2, 40_000_000, DIVISOR, method="lpt")
