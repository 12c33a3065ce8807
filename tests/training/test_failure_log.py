"""A run that fails mid-window still logs what it has not shown yet: the error and the unlogged steps' losses."""

from megatron_muon.training.report import read_jsonl

FAIL_AT_CALL = 7  # one micro-batch per step: steps 1-6 finish, the log shows step 4, step 7 raises


def _train_until_failure(rank, world_size, output_dir, out_of_memory=False):
    import torch

    from megatron_muon.training import loop
    from megatron_muon.training.distributed import current_context, init_parallel_state
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    recipe = validate(load_recipe("tiny-cpu", [
        "training.train_iters=10", "training.micro_batch_size=2", "training.global_batch_size=2",
        "model.seq_length=32", "optimizer.lr_warmup_iters=1", "logging.log_interval=4", "logging.plot=false",
        "logging.progress_bar=false", f"logging.output_dir={output_dir}",
    ]), world_size)
    init_parallel_state(1, 1)
    original, calls = loop.forward_step, []

    def failing_forward_step(data_iterator, model_chunk):
        calls.append(None)
        if len(calls) == FAIL_AT_CALL:
            raise (torch.OutOfMemoryError if out_of_memory else RuntimeError)("injected failure")
        return original(data_iterator, model_chunk)

    loop.forward_step = failing_forward_step
    try:
        loop.pretrain(recipe, current_context())
    except RuntimeError as error:
        return type(error).__name__, str(error), getattr(error, "__notes__", [])
    finally:
        loop.forward_step = original
    return None


def test_failure_logs_the_error_and_unlogged_losses(rank_pool_1, tmp_path):
    (raised,) = rank_pool_1.run(_train_until_failure, str(tmp_path / "run"))
    assert raised == ("RuntimeError", "injected failure", [])
    records = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert [r["step"] for r in records if r["event"] == "step"] == [4]
    failed = records[-1]
    assert failed["event"] == "failed" and failed["error"] == "RuntimeError: injected failure"
    losses = failed["unlogged_local_losses"]
    assert sorted(losses) == ["5", "6"] and all(0.0 < loss < 20.0 for loss in losses.values())


def test_out_of_memory_carries_the_recipes_levers_as_a_note(rank_pool_1, tmp_path):
    (raised,) = rank_pool_1.run(_train_until_failure, str(tmp_path / "run"), True)
    name, message, notes = raised
    assert (name, message) == ("OutOfMemoryError", "injected failure") and len(notes) == 1
    assert notes[0].startswith("Out of device memory while training recipe 'tiny-cpu'")
    assert "--set model.gdn_keep_chunk_states=false" in notes[0]  # the tiny hybrid keeps its GDN states
    assert read_jsonl(tmp_path / "run" / "train_log.jsonl")[-1]["error"] == "OutOfMemoryError: injected failure"


def _train_pp2_until_failure(rank, world_size, output_dir):
    """pp=2 on 2 ranks; both ranks fail together while fetching step 7's batch (no transfer left half done)."""
    from megatron_muon.training import data, loop
    from megatron_muon.training.distributed import current_context, init_parallel_state
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    recipe = validate(load_recipe("tiny-cpu", [
        "training.train_iters=10", "training.micro_batch_size=2", "training.global_batch_size=2",
        "model.seq_length=32", "optimizer.lr_warmup_iters=1", "logging.log_interval=4", "logging.plot=false",
        "logging.progress_bar=false", f"logging.output_dir={output_dir}", "parallel.pipeline_model_parallel_size=2",
    ]), world_size)
    init_parallel_state(1, 2)
    original = data.MicroBatches.for_step

    def failing_for_step(self, step):
        if step == FAIL_AT_CALL - 1:
            raise RuntimeError("injected failure")
        return original(self, step)

    data.MicroBatches.for_step = failing_for_step
    try:
        loop.pretrain(recipe, current_context())
    except RuntimeError as error:
        return str(error)
    finally:
        data.MicroBatches.for_step = original
    return None


def test_under_pipeline_parallelism_the_last_stage_keeps_the_losses(rank_pool_2, tmp_path):
    import json

    assert rank_pool_2.run(_train_pp2_until_failure, str(tmp_path / "run")) == ["injected failure"] * 2
    failed = read_jsonl(tmp_path / "run" / "train_log.jsonl")[-1]
    assert failed["event"] == "failed" and failed["unlogged_local_losses"] is None  # the first stage has none
    assert failed["losses_written_by_rank"] == 1
    beside = json.loads((tmp_path / "run" / "failed_rank1.json").read_text())
    assert beside["error"] == "RuntimeError: injected failure"
    assert sorted(beside["unlogged_local_losses"]) == ["5", "6"]
    assert all(0.0 < loss < 20.0 for loss in beside["unlogged_local_losses"].values())

