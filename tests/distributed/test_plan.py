"""Owner planning: quality against the lower bound, MILP vs LPT, batching, determinism, input checks."""

import random

import pytest

from megatron_muon.distributed.plan import (
    AnalyticCost,
    MatrixSpec,
    MeasuredCost,
    lower_bound,
    plan_hash,
    plan_lpt,
    plan_owners,
    rank_loads,
)

COST = AnalyticCost()


def reference_model(layers: int = 24, ranks: int = 8) -> list[MatrixSpec]:
    """hybrid-1.5B's Muon matrices (DESIGN.md): GDN,GDN,GDN,attention repeating, SwiGLU FFN everywhere."""
    holders = tuple(range(ranks))
    specs = []
    for layer in range(layers):
        if layer % 4 == 3:
            specs += [MatrixSpec(f"{layer}.qkv", (3072, 2048), holders), MatrixSpec(f"{layer}.proj", (2048, 2048), holders)]
        else:
            specs += [MatrixSpec(f"{layer}.in_proj", (9228, 2048), holders),
                      MatrixSpec(f"{layer}.out_proj", (2048, 3072), holders)]
        specs += [MatrixSpec(f"{layer}.fc1", (11264, 2048), holders), MatrixSpec(f"{layer}.fc2", (2048, 5632), holders)]
    return specs


def synthetic_mix(seed: int) -> list[MatrixSpec]:
    """A model-like mix: 2-6 matrix kinds repeated over layers, on 2-8 ranks."""
    rng = random.Random(seed)
    ranks = rng.choice([2, 4, 8])
    sides = [512, 1024, 1536, 2048, 3072, 4096, 5632, 8192]
    kinds = [(rng.choice(sides), rng.choice(sides)) for _ in range(rng.randint(2, 6))]
    layers = rng.randint(ranks, 48)
    return [MatrixSpec(f"{layer}.{k}", shape, tuple(range(ranks))) for layer in range(layers)
            for k, shape in enumerate(kinds)]


def test_reference_model_has_96_matrices():
    specs = reference_model()
    assert len(specs) == 96
    assert sum(m.shape[0] * m.shape[1] for m in specs) == pytest.approx(1.35e9, rel=0.01)


@pytest.mark.parametrize("seed", range(6))
def test_milp_no_worse_than_lpt_and_both_near_lower_bound(seed):
    specs = synthetic_mix(seed)
    milp = plan_owners(specs, COST, method="milp")
    lpt = plan_owners(specs, COST, method="lpt")
    assert lpt.method == "lpt"
    bound = lower_bound(specs, COST)
    assert milp.makespan <= lpt.makespan * (1 + 1e-12)
    assert lpt.makespan <= 1.1 * bound, (lpt.makespan / bound)
    assert milp.makespan <= 1.1 * bound, (milp.makespan / bound)
    assert milp.lower_bound >= bound * (1 - 1e-9)  # the solver's dual bound can only tighten it


@pytest.mark.parametrize("layers,ranks", [(24, 2), (24, 8), (64, 8)])
def test_reference_and_large_model_plans_are_balanced(layers, ranks):
    specs = reference_model(layers, ranks)
    plan = plan_owners(specs, COST)
    assert plan.makespan <= 1.1 * plan.lower_bound
    assert set(plan.owners) == set(range(ranks))
    loads = rank_loads(specs, plan.owners, COST)
    assert max(loads.values()) == pytest.approx(plan.makespan)
    # every matrix lands in exactly one of its owner's shape batches
    assert sorted(n for r in range(ranks) for names in plan.buckets(r).values() for n in names) == sorted(
        m.name for m in specs)


def test_milp_finds_the_optimum():
    """Sizes 3,3,2,2,2 on 2 ranks: plain LPT gives 7, the optimum is 6 ({3,3} | {2,2,2}), one launch each."""
    launch = 1e-6
    cost = MeasuredCost({(30, 1, 1): 3.0 + launch, (30, 1, 2): 6.0 + launch,
                         (20, 1, 1): 2.0 + launch, (20, 1, 2): 4.0 + launch})
    specs = [MatrixSpec(f"a{i}", (30, 1), (0, 1)) for i in range(2)] + [
        MatrixSpec(f"b{i}", (20, 1), (0, 1)) for i in range(3)]
    plain_lpt = rank_loads(specs, plan_lpt(specs, cost, batch_fraction=0.0), cost)
    assert max(plain_lpt.values()) == pytest.approx(7.0, abs=1e-4)
    milp = plan_owners(specs, cost, method="milp", time_limit_s=30)
    assert milp.method == "milp"
    assert milp.makespan == pytest.approx(6.0 + launch, abs=1e-9)
    assert milp.makespan <= plan_owners(specs, cost, method="lpt").makespan


def test_launch_cost_keeps_shapes_together():
    """With a launch cost comparable to the work, splitting a shape over ranks costs more than it gains."""
    holders = (0, 1)
    specs = [MatrixSpec(f"a{i}", (64, 64), holders) for i in range(4)] + [
        MatrixSpec(f"b{i}", (64, 128), holders) for i in range(4)]
    cost = MeasuredCost({(64, 64, 1): 1.1, (64, 64, 4): 1.4, (64, 128, 1): 1.2, (64, 128, 4): 1.8})
    plan = plan_owners(specs, cost, method="milp")
    assert all(len(shapes) == 1 for shapes in (plan.buckets(0), plan.buckets(1)))


def test_holders_are_respected():
    specs = [MatrixSpec(f"m{i}", (128, 128), (0, 1) if i % 2 else (2, 3)) for i in range(10)]
    specs.append(MatrixSpec("only3", (512, 512), (3,)))
    for method in ("milp", "lpt"):
        plan = plan_owners(specs, COST, method=method)
        for spec, owner in zip(specs, plan.owners):
            assert owner in spec.holders
        assert plan.owner_of("only3") == 3


def test_plan_is_deterministic_and_hash_tracks_inputs():
    specs = reference_model(24, 4)
    first, second = plan_owners(specs, COST, method="lpt"), plan_owners(specs, COST, method="lpt")
    assert first.owners == second.owners and first.hash == second.hash
    assert plan_lpt(specs, COST) == plan_lpt(specs, COST)
    changed = list(specs)
    changed[5] = MatrixSpec(changed[5].name, (changed[5].shape[0] + 1, changed[5].shape[1]), changed[5].holders)
    assert plan_hash(changed) != plan_hash(specs)
    other_owners = list(first.owners)
    other_owners[0] = (other_owners[0] + 1) % 4
    assert plan_hash(specs, other_owners) != first.hash
    assert 0 <= first.hash < 2**63


def test_measured_cost_fits_affine_and_scales_unknown_shapes():
    cost = MeasuredCost({(100, 100, 1): 3.0, (100, 100, 5): 7.0, (200, 200, 2): 10.0})
    assert cost.launch_cost((100, 100)) == pytest.approx(2.0)
    assert cost.matrix_cost((100, 100)) == pytest.approx(1.0)
    assert cost.matrix_cost((200, 200)) == pytest.approx(5.0)
    analytic = AnalyticCost()
    ratio = cost.matrix_cost((300, 300)) / analytic.matrix_cost((300, 300))
    measured_ratios = sorted([1.0 / analytic.matrix_cost((100, 100)), 5.0 / analytic.matrix_cost((200, 200))])
    assert ratio == pytest.approx(sum(measured_ratios) / 2)  # the median of two


def test_bad_inputs_raise_with_the_fix():
    with pytest.raises(ValueError, match="holders"):
        MatrixSpec("w", (4, 4), ())
    with pytest.raises(ValueError, match="two positive ints"):
        MatrixSpec("w", (4, 0), (0,))
    with pytest.raises(ValueError, match="unique"):
        plan_owners([MatrixSpec("w", (4, 4), (0,)), MatrixSpec("w", (4, 4), (0,))])
    with pytest.raises(ValueError, match="method"):
        plan_owners([MatrixSpec("w", (4, 4), (0,))], method="greedy")
    with pytest.raises(ValueError, match="batch >= 1"):
        MeasuredCost({(4, 4, 0): 1.0})


def test_empty_and_single_rank():
    assert plan_owners([]).owners == ()
    plan = plan_owners(reference_model(4, 1), COST)
    assert set(plan.owners) == {0} and plan.makespan == pytest.approx(plan.lower_bound)


def test_analytic_cost_follows_the_coefficient_schedule():
    """Gram shapes cost what their schedule's restarts cost (Keller's quintic: one restart; megatron's: two)."""
    from megatron_muon.megatron.muon_config import megatron_coefficient_schedule

    steep = tuple(megatron_coefficient_schedule("quintic", 5))
    gentle, megatron = AnalyticCost(), AnalyticCost(coefficients=steep)
    assert gentle.matrix_cost((2048, 9228)) < 0.9 * megatron.matrix_cost((2048, 9228))
    assert gentle.matrix_cost((2048, 2048)) == megatron.matrix_cost((2048, 2048))  # standard NS: no restarts
