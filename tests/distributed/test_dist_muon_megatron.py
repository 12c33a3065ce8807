"""The owner engine (`dist_muon` = `muon` with the distributed optimizer) through megatron-core's optimizer factory
on CPU/gloo: layouts, Newton–Schulz counts, checkpoints.

Why three kinds of comparison: at a given (tp, pp, dp) layout megatron's forward/backward is the same for every
optimizer, so dist_muon must equal single-process-semantics Muon (`muon`, TP-gathered, all-reduced gradients) there
exactly. Across layouts megatron's own reductions round differently and Muon's orthogonalization amplifies those
~1e-7 gradient differences, so the fp32 world-1 comparison uses a layout tolerance (2e-3). In fp64 (parameters,
gradient buffers, momentum, Newton–Schulz and the loss all float64; no clipping, which megatron does in fp32 only)
layout rounding is ~1e-16: there every claimed layout ends within 1e-9 of the world-1 `muon` run after 20 steps.
A 1e-4 scale error planted on one rank moves weights by ~8e-4: it fails the fp64 check, and would pass the fp32
tolerance.
"""

import pytest
import torch

from tests.distributed.dist_training import (
    OVERLAP,
    checkpoint_then_continue,
    interrupted_save,
    max_relative_error,
    merged_params,
    train,
    train_pair,
    train_with_a_wrong_scale_on_the_last_rank,
)

LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 1, 2), (1, 1, 4), (1, 2, 2)]  # (tp, pp, dp)
CI_CASES = [((2, 1, 2), "gpt", "fp64"), ((1, 2, 2), "gpt", "fp32"), ((2, 1, 1), "hybrid", "fp32"),
            ((1, 1, 2), "gpt", "bf16"), ((1, 1, 2), "hybrid", "fp64")]
SLOW_CASES = [(layout, model, precision) for layout in LAYOUTS for model in ("gpt", "hybrid")
              for precision in ("fp32", "bf16") if (layout, model, precision) not in CI_CASES]


def _pool(pools, world_size):
    return pools[world_size]


@pytest.fixture
def pools(rank_pool_1, rank_pool_2, rank_pool_4):
    return {1: rank_pool_1, 2: rank_pool_2, 4: rank_pool_4}


def _check_same_layout(pools, layout, model, precision, steps, ddp_overrides=None, newton_schulz_start=None):
    """Without clipping the two runs differ only in how gradients reach owners (a reduce-scatter instead of an
    all-reduce) and how updates come back (an all-gather of the 16-bit parameters), which is exact at dp <= 2 (a sum
    of two numbers has one rounding): bit-exact there. At dp > 2 the two collectives add up the ranks' gradients in
    different orders (on NCCL as on gloo), so the runs agree to rounding, amplified by every later step."""
    tp, pp, dp = layout
    results = _pool(pools, tp * pp * dp).run(train_pair, tp, pp, precision, model, steps, 0.0, ddp_overrides,
                                             newton_schulz_start)
    assert results[0]["layout"] == {**results[0]["layout"], "tp": tp, "pp": pp, "dp": dp}
    name, error = max_relative_error(merged_params(results, "muon"), merged_params(results, "dist_muon"))
    if dp <= 2:
        assert error == 0.0, f"{layout} {model} {precision}: {name} differs by {error:.2e} (relative to its max)"
    else:
        assert error <= 1e-9 if precision == "fp64" else 1e-4, f"{layout} {model}: {name} differs by {error:.2e}"
    last = [r for r in results if r["muon"]["losses"][-1] != 0.0]
    loss_rel = 1e-9 if dp <= 2 or precision == "fp64" else 1e-4  # the parameters' bound: rounding, amplified
    assert last[0]["dist_muon"]["losses"] == pytest.approx(last[0]["muon"]["losses"], rel=loss_rel)
    for result in results:  # world-wide norm over owner-reduced gradients = the all-reduced run's norm
        assert result["dist_muon"]["grad_norms"] == pytest.approx(result["muon"]["grad_norms"], rel=1e-6)
    # every matrix orthogonalized exactly once per step across all ranks
    matrices = sum(r["matrices_per_step"] for r in results)
    assert matrices > 0
    assert sum(r["dist_muon"]["orthogonalized"] for r in results) == matrices * steps
    if dp > 1:  # gradients cross data parallelism by reduce-scatter only: no large all-reduce is left
        for result in results:
            assert result["dist_muon"]["collective_numel_per_step"].get("all_reduce", 0) == 0
            assert result["muon"]["collective_numel_per_step"].get("all_reduce", 0) >= result["muon"]["param_numel"]
    return results


@pytest.mark.parametrize("layout,model,precision", CI_CASES, ids=lambda v: str(v))
def test_dist_muon_equals_muon_on_the_same_layout(pools, layout, model, precision):
    _check_same_layout(pools, layout, model, precision, steps=5)


@pytest.mark.parametrize("start", ["bucket", "backward_end"])
def test_newton_schulz_before_the_step_is_bit_exact(pools, start):
    """overlap_grad_reduce with several buckets: each owner orthogonalizes a bucket as soon as its reduce-scatter
    lands, during the backward (`bucket`), or all its matrices at the backward's end (`backward_end`), and the step
    uses those results (no clipping): still bit-exact against muon."""
    results = _check_same_layout(pools, (1, 1, 2), "gpt", "fp64", steps=4, ddp_overrides=OVERLAP,
                                 newton_schulz_start=start)
    assert all(r["dist_muon"]["speculation_used"] > 0 for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("layout,model,precision", SLOW_CASES, ids=lambda v: str(v))
def test_dist_muon_equals_muon_on_every_layout_20_steps(pools, layout, model, precision):
    _check_same_layout(pools, layout, model, precision, steps=20 if layout[2] <= 2 else 2)


_reference: dict = {}


def _single_process_run(pools, model: str, precision: str) -> dict:
    """The world-1 `muon` run of 20 steps, computed once per (model, precision) for every layout test."""
    if (model, precision) not in _reference:
        _reference[model, precision] = pools[1].run(train, 1, 1, "muon", precision, model, 20)[0]
    return _reference[model, precision]


@pytest.mark.parametrize("layout", [(2, 1, 2), (1, 2, 2)], ids=str)
def test_dist_muon_layouts_track_the_single_process_run(pools, layout):
    """GPT fp32, 20 steps: within megatron's layout rounding of the world-1 Muon run (a wrong owner, shard or
    scale moves weights by a whole step, ~1e-1 of their size)."""
    reference = _single_process_run(pools, "gpt", "fp32")
    tp, pp, dp = layout
    results = pools[tp * pp * dp].run(train, tp, pp, "dist_muon", "fp32", "gpt", 20)
    name, error = max_relative_error(reference["params"], merged_params(results, None))
    assert error < 2e-3, f"{layout}: {name} off by {error:.2e}"
    last = [r for r in results if r["losses"][-1] != 0.0][0]
    assert last["losses"] == pytest.approx(reference["losses"], rel=1e-4)


FP64_CI_CASES = [((1, 1, 2), "gpt"), ((1, 1, 4), "gpt"), ((2, 1, 2), "gpt"), ((1, 2, 2), "gpt"),
                 ((1, 1, 2), "hybrid"), ((1, 1, 4), "hybrid"), ((2, 1, 2), "hybrid"), ((1, 2, 2), "hybrid")]
FP64_SLOW_CASES = [(layout, model) for layout in LAYOUTS for model in ("gpt", "hybrid")
                   if (layout, model) not in FP64_CI_CASES]


def _fp64_layout_errors(pools, layout, model, rank_function=train, *bug) -> tuple[str, float, float]:
    """(worst parameter, its max relative error, max relative loss error) of dist_muon at `layout` after 20 fp64
    steps against the world-1 `muon` run."""
    reference = _single_process_run(pools, model, "fp64")
    assert all(t.dtype == torch.float64 for t in reference["params"].values())
    tp, pp, dp = layout
    results = pools[tp * pp * dp].run(rank_function, tp, pp, "dist_muon", "fp64", model, 20, *bug)
    assert results[0]["layout"] == {**results[0]["layout"], "tp": tp, "pp": pp, "dp": dp}
    assert all(r["ns_dtypes"] == ["torch.float64"] for r in results if r["owned"])
    name, error = max_relative_error(reference["params"], merged_params(results, None))
    last = [r for r in results if r["losses"][-1] != 0.0][0]
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(last["losses"], reference["losses"]))
    return name, error, loss_error


def _check_fp64_parity(pools, layout, model):
    name, error, loss_error = _fp64_layout_errors(pools, layout, model)
    assert error <= 1e-9, f"{layout} {model} fp64: {name} off by {error:.2e}"
    assert loss_error <= 1e-9, f"{layout} {model} fp64: loss curves differ by {loss_error:.2e}"


@pytest.mark.parametrize("layout,model", FP64_CI_CASES, ids=str)
def test_dist_muon_fp64_layouts_equal_the_single_process_run(pools, layout, model):
    """20 fp64 steps of the owner engine at every claimed layout within 1e-9 of the world-1 muon run."""
    _check_fp64_parity(pools, layout, model)


@pytest.mark.slow
@pytest.mark.parametrize("layout,model", FP64_SLOW_CASES, ids=str)
def test_dist_muon_fp64_every_layout_equals_the_single_process_run(pools, layout, model):
    _check_fp64_parity(pools, layout, model)


def test_fp64_parity_catches_a_small_scale_error_on_one_rank(pools):
    """The check can fail: one rank scaling its Muon updates 1e-4 too large is seen far above 1e-6."""
    _, error, _ = _fp64_layout_errors(pools, (1, 1, 2), "gpt", train_with_a_wrong_scale_on_the_last_rank, 1e-4)
    assert error > 1e-5


def test_checkpoint_reshards_and_resumes(pools, tmp_path):
    """Save at (tp2, dp2) on 4 ranks; load at (tp1, dp1) on 1 rank and (tp1, dp2) on 2 ranks; continue."""
    directory = str(tmp_path / "ckpt")
    saved = pools[4].run(checkpoint_then_continue, 2, directory, 2, 4, False)
    uninterrupted = merged_params(saved, None)
    same_layout = pools[4].run(checkpoint_then_continue, 2, directory, 2, 4, True)
    name, error = max_relative_error(uninterrupted, merged_params(same_layout, None))
    assert error == 0.0, f"resume at the saving layout must be bit-exact: {name} {error:.2e}"
    for world_size in (1, 2):
        resumed = pools[world_size].run(checkpoint_then_continue, 1, directory, 2, 4, True)
        name, error = max_relative_error(uninterrupted, merged_params(resumed, None))
        assert error < 1e-4, f"world {world_size}: {name} off by {error:.2e}"
    # the comparison can fail: dropping the loaded momentum is visible far above the layout tolerance
    no_momentum = pools[1].run(checkpoint_then_continue, 1, directory, 2, 4, True, True)
    assert max_relative_error(uninterrupted, merged_params(no_momentum, None))[1] > 1e-3


def test_failed_save_leaves_nothing_loadable(pools, tmp_path):
    for result in pools[2].run(interrupted_save, str(tmp_path / "ckpt")):
        assert result == {"raised": True, "loadable": False, "complete": False}
