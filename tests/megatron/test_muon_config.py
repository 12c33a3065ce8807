"""`MuonConfig`: one value for the Muon settings, read the same way from megatron's OptimizerConfig, Megatron-LM's
parsed arguments and the recipe, and the same iterations for Muon and the owner plan's cost model."""

import sys
from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer import OptimizerConfig

from megatron_muon.distributed.cost import AnalyticCost
from megatron_muon.kernels.coefficients import resolve_coefficients
from megatron_muon.kernels.settings import Orthogonalizer
from megatron_muon.megatron import owner_layout
from megatron_muon.megatron.muon_config import MuonConfig, muon_kwargs_from_config


def _config(**muon):
    return OptimizerConfig(optimizer="muon", lr=1e-3, weight_decay=0.1, **muon)


def test_megatron_options_become_one_value():
    config = _config(muon_num_ns_steps=4, muon_coefficient_type="polar_express", muon_fp32_matmul_prec="high",
                     muon_momentum=0.9, muon_nesterov=True, muon_tp_mode="duplicated")
    muon = MuonConfig.from_options(config)
    assert muon.orthogonalizer.steps == 4 and muon.orthogonalizer.compute_dtype == torch.float32
    assert list(muon.orthogonalizer.schedule) == resolve_coefficients("polar_express", 4)
    assert (muon.momentum, muon.nesterov, muon.tp_mode) == (0.9, True, "duplicated")
    kwargs = muon_kwargs_from_config(config, [], None)
    assert {key: kwargs[key] for key in muon.muon_kwargs()} == muon.muon_kwargs()
    assert (kwargs["lr"], kwargs["weight_decay"], kwargs["weight_decay_mode"]) == (1e-3, 0.1, "decoupled")


def test_defaults_are_megatrons():
    assert MuonConfig.from_options(_config()) == MuonConfig() == MuonConfig.from_options(SimpleNamespace())


def test_the_recipe_and_the_optimizer_config_it_builds_agree():
    from megatron_muon.training.optimizer_setup import optimizer_config
    from megatron_muon.training.recipes import load_recipe

    recipe = load_recipe("tiny-cpu", ["optimizer.muon_num_ns_steps=4", "optimizer.muon_coefficient_type=cans"])
    assert MuonConfig.from_options(recipe.optimizer) == MuonConfig.from_options(optimizer_config(recipe))
    assert MuonConfig.from_options(recipe.optimizer).orthogonalizer.steps == 4


def test_the_recipes_newton_schulz_start_reaches_the_optimizer_config_and_is_checked():
    from megatron_muon.training.optimizer_setup import optimizer_config
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.config import RecipeError
    from megatron_muon.training.validation import validate

    assert optimizer_config(load_recipe("tiny-cpu")).muon_newton_schulz_start == "backward_end"
    recipe = load_recipe("tiny-cpu", ["optimizer.muon_newton_schulz_start=bucket"])
    assert optimizer_config(recipe).muon_newton_schulz_start == "bucket"
    with pytest.raises(RecipeError, match="optimizer.muon_newton_schulz_start.*backward_end"):
        validate(load_recipe("tiny-cpu", ["optimizer.muon_newton_schulz_start=forward"]))


@pytest.mark.parametrize("options, match", [
    (dict(muon_fp32_matmul_prec="low"), "muon_fp32_matmul_prec"),
    (dict(muon_coefficient_type="fancy"), "muon_coefficient_type"),
    (dict(muon_num_ns_steps=0), "muon_num_ns_steps"),
    (dict(muon_ns_method="fast"), "valid choices"),
])
def test_bad_options_name_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        MuonConfig.from_options(SimpleNamespace(**options))


def test_orthogonalizer_is_hashable_after_a_state_dict_round_trip_and_checks_itself():
    schedule = [[3.4445, -4.775, 2.0315]] * 3
    assert hash(Orthogonalizer(3, schedule)) == hash(Orthogonalizer(3, tuple(map(tuple, schedule))))
    assert Orthogonalizer(1, [3.4445, -4.775, 2.0315]).schedule == [(3.4445, -4.775, 2.0315)]
    with pytest.raises(ValueError, match="pass steps=3"):
        Orthogonalizer(2, schedule)
    with pytest.raises(ValueError, match="eps"):
        Orthogonalizer(eps=0.0)


def test_the_owner_plan_costs_the_jobs_own_iterations(monkeypatch):
    """Megatron-LM's parsed --muon-* arguments set the default cost of the owner plan; without them, megatron's
    defaults; a cost passed by value wins (the training CLI passes its recipe's)."""
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", SimpleNamespace(
        _GLOBAL_ARGS=SimpleNamespace(muon_num_ns_steps=3, muon_coefficient_type="simple")))
    cost = owner_layout._default_cost()
    assert (cost.steps, cost.coefficients) == (3, tuple(resolve_coefficients("simple", 3)))
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", SimpleNamespace(_GLOBAL_ARGS=None))
    assert owner_layout._default_cost() == AnalyticCost.for_orthogonalizer(MuonConfig().orthogonalizer)
    four = AnalyticCost.for_orthogonalizer(Orthogonalizer(4))
    assert four.matrix_cost((512, 512)) == pytest.approx(AnalyticCost(steps=5).matrix_cost((512, 512)) * 4 / 5)


def test_owner_plan_settings_name_the_fix():
    with pytest.raises(ValueError, match="'auto', 'milp', 'greedy'"):
        owner_layout.OwnerPlanSettings(method="lpt")
    with pytest.raises(ValueError, match="tokens_per_step"):
        owner_layout.OwnerPlanSettings(tokens_per_step=0)


def test_the_recipes_nonfinite_check_reaches_the_owner_engine_through_megatrons_config(rank_pool_1):
    for checks in rank_pool_1.run(_owner_nonfinite_check):
        assert checks == [True] * 5, checks


def _owner_nonfinite_check(rank, world_size):
    from megatron.core.optimizer import get_megatron_optimizer

    import megatron_muon
    from megatron_muon.megatron.owner_optimizer import OwnerMuonOptimizer
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.training.model import build_model, transformer_config, wrap_model
    from megatron_muon.training.optimizer_setup import optimizer_config
    from megatron_muon.training.recipes import load_recipe

    megatron_muon.register()
    init_model_parallel(tp=1)
    checks = []
    # (recipe's choice, megatron's DDP NaN check) -> what the engine runs; auto trusts megatron's check when it is on
    for value, ddp_check, expected in (("before_update", False, "before_update"), ("next_step", False, "next_step"),
                                       ("auto", False, "before_update"), ("auto", True, "next_step"),
                                       ("before_update", True, "before_update")):
        recipe = load_recipe("tiny-cpu", ["parallel.use_distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
                                          f"parallel.check_for_nan_in_grad={str(ddp_check).lower()}",
                                          f"optimizer.muon_nonfinite_check={value}"])
        config = transformer_config(recipe, on_gpu=False)
        model = wrap_model(build_model(recipe, config), config, recipe)
        optimizer = get_megatron_optimizer(optimizer_config(recipe), [model], use_gloo_process_groups=False)
        owners = [c for c in optimizer.chained_optimizers if isinstance(c, OwnerMuonOptimizer)]
        checks.append(len(owners) == 1 and owners[0].nonfinite_check == expected
                      and model.ddp_config.check_for_nan_in_grad is ddp_check)
    return checks


def test_the_recipes_graph_setting_reaches_muon_through_megatrons_config():
    from megatron_muon.optimizer.muon import Muon
    from megatron_muon.training.optimizer_setup import optimizer_config
    from megatron_muon.training.recipes import load_recipe

    assert MuonConfig.from_options(optimizer_config(load_recipe("tiny-cpu"))).graph_newton_schulz is False
    config = optimizer_config(load_recipe("tiny-cpu", ["optimizer.muon_graph_newton_schulz=true"]))
    kwargs = muon_kwargs_from_config(config, [], None)
    assert kwargs["graph_newton_schulz"] is True
    assert Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs).graph_newton_schulz is True


def test_the_recipes_split_heads_reaches_muon_and_needs_the_section_split():
    from megatron_muon.training.config import RecipeError
    from megatron_muon.training.optimizer_setup import optimizer_config
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    assert MuonConfig.from_options(optimizer_config(load_recipe("tiny-cpu"))).split_heads is False
    recipe = load_recipe("tiny-cpu", ["optimizer.muon_split_heads=true"])
    muon = MuonConfig.from_options(optimizer_config(recipe))
    assert muon.split_heads and muon.muon_kwargs()["split_heads"]
    with pytest.raises(RecipeError, match="muon_split_qkv=true"):
        validate(load_recipe("tiny-cpu", ["optimizer.muon_split_heads=true", "optimizer.muon_split_qkv=false"]))


def test_the_owner_plan_costs_one_matrix_per_head():
    qkv = torch.nn.Parameter(torch.zeros(2 * (32 + 16 + 16), 64))
    qkv.is_qkv, qkv.qkv_split_shapes = True, [32, 16, 16]
    qkv.tensor_model_parallel, qkv.partition_dim = True, 0  # column-parallel: whole query groups per rank
    cost = AnalyticCost()
    (sections,) = owner_layout.layout_items([qkv], cost, tp_size=2)
    (heads,) = owner_layout.layout_items([qkv], cost, tp_size=2, split_heads=True)
    assert sorted(set(sections.kind)) == [(64, 64), (128, 64)]  # q of both groups; k, v: rows doubled over tp=2
    assert heads.kind == ((16, 64),) * 8  # 2 groups × (2 q + 1 k + 1 v) heads, never sharded


def test_the_launchers_plugin_default_fills_in_what_megatrons_options_lack():
    from megatron_muon.megatron.muon_config import set_plugin_default

    set_plugin_default("muon_split_heads", True)
    try:
        assert MuonConfig.from_options(_config()).split_heads  # OptimizerConfig has no muon_split_heads field
        assert not MuonConfig.from_options(SimpleNamespace(muon_split_heads=False)).split_heads  # a set value wins
    finally:
        set_plugin_default("muon_split_heads", False)
    assert not MuonConfig.from_options(_config()).split_heads
    with pytest.raises(ValueError, match="valid choices"):
        set_plugin_default("muon_split_everything", True)
