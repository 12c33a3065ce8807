"""What a Megatron user expects of --save/--load: a first `--save X --load X` run starts from scratch, an unreadable
checkpoint ends in one sentence naming the file and an intact iteration, a resumed run says so, appends to its log
and tolerates a changed learning rate (CPU, one gloo rank)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.training.report import read_jsonl
from megatron_muon.training.resume import CheckpointError, choose_iteration

REPO = Path(__file__).resolve().parents[2]
TINY = ["training.micro_batch_size=2", "training.global_batch_size=2", "model.seq_length=32",
        "optimizer.lr_warmup_iters=1", "logging.log_interval=2", "logging.plot=false", "logging.progress_bar=false"]


def _train(rank, world_size, overrides):
    from megatron_muon.training.distributed import current_context, init_parallel_state
    from megatron_muon.training.loop import pretrain
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    recipe = validate(load_recipe("tiny-cpu", TINY + overrides), world_size)
    init_parallel_state(1, 1)
    return pretrain(recipe, current_context())


def _records(directory: Path) -> list[dict]:
    return read_jsonl(directory / "train_log.jsonl")


def test_first_run_with_the_same_save_and_load_starts_from_scratch_then_resumes(rank_pool_1, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    both = [f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}", f"logging.output_dir={log}"]
    rank_pool_1.run(_train, both + ["training.train_iters=4"])
    first = _records(log)
    assert first[0]["notes"][0] == f"no checkpoint in {ckpt} yet: starting from scratch"
    assert first[0]["resumed_from"] is None and [r["step"] for r in first if r["event"] == "step"] == [2, 4]
    # the next submission resumes, appends to the same log, and takes a new lr without a traceback
    rank_pool_1.run(_train, both + ["training.train_iters=6", "optimizer.lr=1.0e-3", "logging.plot=true"])
    assert (log / "loss_mfu.png").stat().st_size > 10_000  # drawn from both runs' steps
    records = _records(log)
    assert [r["event"] for r in records].count("start") == 2, "the resumed run replaced the log"
    second = records[len(first):]
    assert second[0]["resumed_from"] == 4 and second[0]["notes"][0] == f"resumed from iteration 4 ({ckpt})"
    assert "checkpoint's LR schedule replaces the recipe's" in second[0]["notes"][1]
    assert "optimizer.lr 0.005 (checkpoint) vs 0.001 (recipe)" in second[0]["notes"][1]
    assert [r["step"] for r in second if r["event"] == "step"] == [6]
    assert [r for r in second if r["event"] == "step"][0]["lr"] < 0.005  # the checkpoint's cosine schedule


def test_the_recipes_lr_schedule_on_request(rank_pool_1, tmp_path):
    ckpt = tmp_path / "ckpt"
    rank_pool_1.run(_train, [f"checkpoint.save={ckpt}", f"logging.output_dir={tmp_path / 'a'}", "training.train_iters=2"])
    rank_pool_1.run(_train, [f"checkpoint.load={ckpt}", f"logging.output_dir={tmp_path / 'b'}", "training.train_iters=4",
                             "optimizer.lr=1.0e-3", "optimizer.min_lr=1.0e-3", "checkpoint.override_lr_schedule=true"])
    records = _records(tmp_path / "b")
    assert "LR schedule from the recipe" in records[0]["notes"][1]
    assert [r["lr"] for r in records if r["event"] == "step"] == [pytest.approx(1.0e-3)]


def _save_two(rank_pool_1, tmp_path) -> Path:
    ckpt = tmp_path / "ckpt"
    rank_pool_1.run(_train, [f"checkpoint.save={ckpt}", "checkpoint.save_interval=2", "training.train_iters=4",
                             f"logging.output_dir={tmp_path / 'log'}"])
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000004"]
    return ckpt


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_an_unreadable_checkpoint_names_the_file_and_an_intact_iteration(rank_pool_1, tmp_path, damage):
    ckpt = _save_two(rank_pool_1, tmp_path)
    shard = next((ckpt / "iter_0000004").glob("*.distcp"))
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        shard.unlink()
    with pytest.raises(CheckpointError) as error:
        choose_iteration(ckpt)
    message = str(error.value)
    assert "iteration 4" in message and shard.name in message and ("truncated" if damage == "truncate" else "missing") \
        in message
    assert "the newest intact one is iteration 2: resume from it with --load-iteration 2" in message
    assert choose_iteration(ckpt, requested=2) == 2
    with pytest.raises(CheckpointError, match=r"iteration 3 is not in .* \(saved iterations: 4, 2\)"):
        choose_iteration(ckpt, requested=3)
    if damage == "delete":
        return  # the command's path is the same for every damage: checked once, on the truncated shard
    # the command ends in that one sentence, exit code 2, no traceback; --load-iteration 2 resumes
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "megatron_muon.cli.main", "pretrain", "--recipe", "tiny-cpu", "--load", str(ckpt),
               "--output-dir", str(tmp_path / "resume"), *[f"--set={item}" for item in TINY + ["training.train_iters=4"]]]
    failed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert failed.stderr.strip().splitlines()[-1].startswith("megatron-muon: error: iteration 4 in")
    resumed = subprocess.run(command + ["--load-iteration", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from iteration 2" in resumed.stdout
