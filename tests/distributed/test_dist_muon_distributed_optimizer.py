"""`muon` with use_distributed_optimizer=True through megatron's factory: owner engine for the Muon matrices,
megatron's DistributedOptimizer (sharded AdamW) for the rest, on CPU/gloo.

At one layout the distributed optimizer changes only where AdamW runs (on a shard instead of everywhere) and how its
gradients are reduced (a reduce-scatter instead of an all-reduce, exact at dp 2), so the run must equal `dist_muon`
within the same-layout tolerance of test_dist_muon_megatron.py.
"""

import pytest

from tests.distributed.dist_training import max_relative_error, merged_params
from tests.distributed.distopt_training import build_error, sharded_checkpoint_then_continue, train_sharded_and_replicated


CASES = [((1, 1, 2), "fp32", False), ((1, 1, 2), "bf16", False), ((1, 1, 2), "fp32", True)]


@pytest.mark.parametrize("layout,precision,overlap_param_gather", CASES, ids=str)
def test_muon_with_distributed_optimizer_equals_dist_muon(rank_pool_2, layout, precision, overlap_param_gather):
    """`overlap_param_gather`: DDP's forward pre-hooks gather AdamW shards during the next forward and find the
    Muon matrices already updated by their owners."""
    tp, pp, dp = layout
    steps = 4
    results = rank_pool_2.run(train_sharded_and_replicated, tp, pp, precision, steps, overlap_param_gather)
    assert results[0]["layout"] == {**results[0]["layout"], "tp": tp, "pp": pp, "dp": dp}
    sharded = results[0]["sharded"]
    assert sharded["types"] == ["DistributedOptimizer", "Float16OptimizerWithFloat16Params" if precision == "bf16"
                                else "FP32Optimizer"]
    shard, whole = sharded["adamw_numel"]
    assert 0 < shard < whole, "AdamW state is not sharded over data parallelism"
    assert sum(r["sharded"]["adamw_numel"][0] for r in results) >= whole
    # the owner engine ran: every matrix once per step across the ranks, as in dist_muon
    assert sum(r["sharded"]["orthogonalized"] for r in results) == sum(r["dist_muon"]["orthogonalized"] for r in results)
    assert sum(r["sharded"]["orthogonalized"] for r in results) > 0
    name, error = max_relative_error(merged_params(results, "dist_muon"), merged_params(results, "sharded"))
    assert error <= 1e-6, f"{layout} {precision}: {name} differs by {error:.2e} (relative to its max)"
    assert sharded["losses"] == pytest.approx(results[0]["dist_muon"]["losses"], rel=1e-6)
    assert results[0]["sharded"]["params"].keys() == results[1]["sharded"]["params"].keys()
    for key in results[0]["sharded"]["params"]:  # replicas hold the same weights after the sharded step
        assert (results[0]["sharded"]["params"][key] == results[1]["sharded"]["params"][key]).all(), key


def test_sharded_checkpoint_resumes_bit_exact(rank_pool_2, tmp_path):
    directory = str(tmp_path / "ckpt")
    uninterrupted = merged_params(rank_pool_2.run(sharded_checkpoint_then_continue, 1, directory, 2, 4, False))
    resumed = merged_params(rank_pool_2.run(sharded_checkpoint_then_continue, 1, directory, 2, 4, True))
    name, error = max_relative_error(uninterrupted, resumed)
    assert error == 0.0, f"resume at the saving layout must be bit-exact: {name} {error:.2e}"


def test_untagged_buffers_name_the_fix(rank_pool_2):
    """Muon matrices and AdamW parameters in one DDP buffer: a clear error instead of a wrong update."""
    for message in rank_pool_2.run(build_error, False):
        assert "tag_params_for_owner_buffers" in message and "--use-distributed-optimizer" in message
