"""megatron's own optimizer and dist_checkpointing on CPU: equal results across layouts, exact resume."""

import pytest
import torch

from megatron_muon.testing.parallel import init_model_parallel, layout
from megatron_muon.testing.training import build_training_setup, full_parameters, train_step

STEPS = 3


def _train_adam(rank, world_size, tp, pp, steps, fp64=False):
    init_model_parallel(tp=tp, pp=pp)
    if fp64:  # megatron-core clips fp32 gradients only
        model, optimizer = build_training_setup("adam", config_overrides={"params_dtype": torch.float64}, clip_grad=0.0)
    else:
        model, optimizer = build_training_setup("adam")
    losses = [train_step(model, optimizer, step) for step in range(steps)]
    return {"losses": losses, "params": full_parameters(model), "layout": layout()}


def _assert_same_params(reference: dict, other: dict, rtol: float, atol: float):
    assert reference.keys() == other.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(other[name], tensor, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_megatron_adam_steps_on_cpu(rank_pool_1):
    result = rank_pool_1.run(_train_adam, 1, 1, 6)[0]
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_adam_layouts_equal_single_process(rank_pool_1, rank_pool_2, tp, pp):
    single = rank_pool_1.run(_train_adam, 1, 1, STEPS, True)[0]
    split = rank_pool_2.run(_train_adam, tp, pp, STEPS, True)
    assert split[0]["layout"]["tp"] == tp and split[0]["layout"]["pp"] == pp
    last_stage = [r for r in split if r["losses"][-1] != 0.0][0]
    assert last_stage["losses"] == pytest.approx(single["losses"], rel=1e-12)
    merged = {name: tensor for result in split for name, tensor in result["params"].items()}
    # fp64: Adam's m / sqrt(v) turns an fp32 rounding difference of a near-zero gradient into up to a whole step
    # (a layout-dependent matmul order flipped one of 16384 elements by 1.1e-3 on one CPU); in fp64 the layouts'
    # rounding stays near 1e-16, and a layout bug still moves parameters by about lr = 1e-2.
    _assert_same_params(single["params"], merged, rtol=1e-9, atol=1e-12)


def test_adam_dp4_equals_single_process(rank_pool_1, rank_pool_4):
    single = rank_pool_1.run(_train_adam, 1, 1, STEPS)[0]
    split = rank_pool_4.run(_train_adam, 1, 1, STEPS)
    assert [r["layout"]["dp"] for r in split] == [4] * 4
    for result in split:
        assert result["losses"] == pytest.approx(single["losses"], rel=1e-5)
        _assert_same_params(single["params"], result["params"], rtol=1e-4, atol=2e-4)


def _checkpoint_resume(rank, world_size, tp, directory):
    from megatron_muon.megatron.checkpointing import load_checkpoint, save_checkpoint

    init_model_parallel(tp=tp)
    model, optimizer = build_training_setup("adam")
    for step in range(2):
        train_step(model, optimizer, step)
    save_checkpoint(model, optimizer, directory)
    uninterrupted = [train_step(model, optimizer, step) for step in (2, 3)]
    expected = full_parameters(model)

    init_model_parallel(tp=tp)
    model, optimizer = build_training_setup("adam")  # fresh weights and empty optimizer state
    load_checkpoint(model, optimizer, directory)
    resumed = [train_step(model, optimizer, step) for step in (2, 3)]
    return uninterrupted, resumed, expected, full_parameters(model)


@pytest.mark.parametrize("world_size", [1, 2])
def test_dist_checkpoint_resume_is_exact(rank_pool_1, rank_pool_2, tmp_path, world_size):
    pool = rank_pool_1 if world_size == 1 else rank_pool_2
    for uninterrupted, resumed, expected, actual in pool.run(_checkpoint_resume, world_size, str(tmp_path / "ckpt")):
        assert resumed == uninterrupted
        _assert_same_params(expected, actual, rtol=0, atol=0)
