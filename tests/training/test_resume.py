"""Resume from a dist checkpoint continues exactly like the uninterrupted run (2 gloo ranks, Muon; dp, tp, pp)."""

import pytest

from megatron_muon.training.report import read_jsonl

TINY = [
    "training.train_iters=6", "training.micro_batch_size=2", "training.global_batch_size=4",
    "model.seq_length=32", "optimizer.lr_warmup_iters=2", "logging.log_interval=1", "logging.plot=false",
    "logging.progress_bar=false",
]


def _train(rank, world_size, overrides):
    from megatron_muon.training.distributed import current_context, init_parallel_state
    from megatron_muon.training.loop import pretrain
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    recipe = validate(load_recipe("tiny-cpu", TINY + overrides), world_size)
    init_parallel_state(recipe.parallel.tensor_model_parallel_size, recipe.parallel.pipeline_model_parallel_size)
    return pretrain(recipe, current_context())


def _losses(output_dir):
    return {r["step"]: r["loss"] for r in read_jsonl(output_dir / "train_log.jsonl") if r["event"] == "step"}


@pytest.mark.parametrize("layout", ["parallel.tensor_model_parallel_size=1", "parallel.tensor_model_parallel_size=2",
                                    "parallel.pipeline_model_parallel_size=2"], ids=["dp2", "tp2", "pp2"])
def test_resume_equals_uninterrupted(rank_pool_2, tmp_path, layout):
    full, first, second, ckpt = (tmp_path / name for name in ("full", "first", "second", "ckpt"))
    rank_pool_2.run(_train, [layout, f"logging.output_dir={full}"])
    rank_pool_2.run(_train, [layout, f"logging.output_dir={first}", f"checkpoint.save={ckpt}",
                             "checkpoint.save_interval=3"])
    assert (ckpt / "iter_0000003").is_dir() and (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")  # resume from the middle
    rank_pool_2.run(_train, [layout, f"logging.output_dir={second}", f"checkpoint.load={ckpt}"])
    uninterrupted, resumed = _losses(full), _losses(second)
    assert sorted(resumed) == [4, 5, 6]
    assert _losses(first) == uninterrupted  # saving does not perturb training
    # Same data order, restored optimizer state, LR schedule and RNG: the resumed steps are bit-identical.
    assert [resumed[s] for s in range(4, 7)] == [uninterrupted[s] for s in range(4, 7)]
    assert uninterrupted[6] < uninterrupted[1]
