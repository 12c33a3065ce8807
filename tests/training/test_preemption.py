"""SIGTERM (Slurm's time-limit and preemption signal) ends the run after the current step with a checkpoint."""

import os
import signal

import pytest

from megatron_muon.training.checkpoint import TRACKER_FILE
from megatron_muon.training.report import read_jsonl

SIGNAL_AT_STEP = 6  # one micro-batch per step; log interval 4, so step 6 is in the middle of a window


def _train(rank, world_size, run_dir, signalled_rank, train_iters, load, handler="training.exit_signal_handler=true"):
    from megatron_muon.training import loop
    from megatron_muon.training.distributed import current_context, init_parallel_state
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    overrides = [
        f"training.train_iters={train_iters}", "training.micro_batch_size=2",
        f"training.global_batch_size={2 * world_size}", "model.seq_length=32", "optimizer.lr_warmup_iters=1",
        "logging.log_interval=4", "logging.plot=false", "logging.progress_bar=false",
        f"logging.output_dir={run_dir}/log{load}", f"checkpoint.save={run_dir}/ckpt",
    ] + ([handler] if handler else [])
    recipe = validate(load_recipe("tiny-cpu", overrides + ([f"checkpoint.load={run_dir}/ckpt"] if load else [])),
                      world_size)
    init_parallel_state(1, 1)
    original, calls = loop.forward_step, []

    def forward_step(data_iterator, model_chunk):
        calls.append(None)
        if rank == signalled_rank and len(calls) == SIGNAL_AT_STEP:
            os.kill(os.getpid(), signal.SIGTERM)  # as torchrun forwards it: mid-step, to this rank only
        return original(data_iterator, model_chunk)

    before = signal.getsignal(signal.SIGTERM)
    loop.forward_step = forward_step
    try:
        summary = loop.pretrain(recipe, current_context())
    finally:
        loop.forward_step = original
    return summary, signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("handler", ["training.exit_signal_handler=true", None], ids=["asked", "default-with-save"])
def test_sigterm_on_one_rank_stops_every_rank_after_the_step_with_a_checkpoint(rank_pool_2, tmp_path, handler):
    """Asked for, or by default when the run saves (`--save`)."""
    results = rank_pool_2.run(_train, str(tmp_path), 1, 10, False, handler)
    for summary, handler_restored in results:
        assert summary["stopped_by_signal"] and summary["steps"] == SIGNAL_AT_STEP and handler_restored
    assert (tmp_path / "ckpt" / TRACKER_FILE).read_text().strip() == str(SIGNAL_AT_STEP)
    records = read_jsonl(tmp_path / "logFalse" / "train_log.jsonl")
    assert [r["step"] for r in records if r["event"] == "step"] == [4, SIGNAL_AT_STEP]
    assert records[-1]["event"] == "end" and records[-1]["stopped_by_signal"]
    # the job's next submission resumes there and finishes (no signal this time)
    results = rank_pool_2.run(_train, str(tmp_path), -1, 10, True)
    for summary, _ in results:
        assert not summary["stopped_by_signal"] and summary["steps"] == 10 - SIGNAL_AT_STEP
    assert (tmp_path / "ckpt" / TRACKER_FILE).read_text().strip() == "10"


def test_without_the_handler_sigterm_is_left_alone():
    from megatron_muon.training.preemption import StopOnSignal

    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSignal(False, device=None)
    assert not stop.agreed() and signal.getsignal(signal.SIGTERM) is before
    stop.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_another_signal_is_recorded_and_its_handler_restored():
    """training.exit_signal=SIGUSR1: that signal is caught (the process lives on), SIGTERM is left alone."""
    import torch

    from megatron_muon.training.preemption import StopOnSignal

    before_usr1, before_term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    stop = StopOnSignal(True, device=torch.device("cpu"), signal_name="SIGUSR1")
    try:
        assert signal.getsignal(signal.SIGTERM) is before_term
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agreed()
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR1) is before_usr1


def test_an_unknown_exit_signal_is_refused_with_the_choices():
    import pytest

    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import RecipeError, validate

    with pytest.raises(RecipeError, match="SIGUSR1"):
        validate(load_recipe("tiny-cpu", ["training.exit_signal=SIGKILL"]))
