"""The NeMo-Run example with the real nemo_run package: the local executor trains the tiny hybrid on CPU with 2 ranks,
and the Slurm executor's dry run writes the sbatch script a cluster would get."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import EXAMPLES, check_pretrain_args

pytestmark = [pytest.mark.nemo_run, pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # leptonai v0
EXAMPLE = EXAMPLES / "nemo_run_hybrid_muon.py"


def _example(args: list[str], cwd, timeout: int, path: str | None = None) -> subprocess.CompletedProcess:
    """The example under this interpreter, with its environment's bin first on PATH as an activated venv has it."""
    env = dict(os.environ, PATH=path if path is not None
               else f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_local_executor_trains_on_cpu_with_two_ranks(nemo_run_home, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--executor", "local", "--gpus", "2", "--threads", "1", "--recipe", "tiny-cpu", "--output-dir",
            str(run_dir), "--set", "training.micro_batch_size=4", "--set", "training.train_iters=4",
            "--set", "optimizer.lr_warmup_iters=1", "--set", "logging.log_interval=1"]
    result = _example(args, tmp_path, timeout=600)
    assert result.returncode == 0, f"the NeMo-Run local job failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 for r in steps) and steps[-1]["loss"] < steps[0]["loss"]
    assert start["world_size"] == 2
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert "step      4/4" in result.stdout + result.stderr  # the rank's console, tailed by NeMo-Run


def test_local_executor_reports_a_failed_job(nemo_run_home, tmp_path):
    args = ["--executor", "local", "--gpus", "2", "--threads", "1", "--recipe", "tiny-cpu", "--output-dir",
            str(tmp_path / "run"), "--set", "training.train_iters=4"]  # micro batch 8 x 2 ranks > global batch 8
    result = _example(args, tmp_path, timeout=600)
    assert result.returncode == 1
    assert "did not succeed" in result.stderr and "FAILED" in result.stderr
    assert "global_batch_size (8) must be a multiple" in result.stdout + result.stderr


def test_slurm_dry_run_writes_one_torchrun_per_node_that_saves_on_the_time_limit_signal(nemo_run_home, tmp_path):
    out = "/shared/runs/hybrid-1.5b-muon"
    args = ["--executor", "slurm", "--account", "acc", "--partition", "batch", "--nodes", "4", "--gpus", "8",
            "--time", "02:00:00", "--job-dir", str(tmp_path / "jobs"), "--output-dir", out,
            "--set", "optimizer.lr=2e-4", "--dryrun"]
    result = _example(args, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    scripts = list(nemo_run_home.rglob("*_sbatch.sh"))
    assert len(scripts) == 1, f"expected one sbatch script under {nemo_run_home}, found {scripts}"
    script = scripts[0].read_text()
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, flags=re.M))
    assert {k: header[k] for k in ("nodes", "ntasks-per-node", "gpus-per-node", "signal", "time", "account",
                                    "partition")} == {
        "nodes": "4", "ntasks-per-node": "1", "gpus-per-node": "8", "signal": "TERM@180", "time": "02:00:00",
        "account": "acc", "partition": "batch"}
    launch = [line for line in script.splitlines() if line.startswith("srun") and "torchrun" in line]
    assert len(launch) == 1, script
    argv = launch[0].split()
    torchrun = argv[argv.index("torchrun"):]
    assert torchrun[torchrun.index("--nnodes") + 1] == "4" and torchrun[torchrun.index("--nproc-per-node") + 1] == "8"
    assert "--node-rank" in torchrun and torchrun[torchrun.index("--rdzv-backend") + 1] == "c10d"
    module = torchrun.index("-m")
    assert torchrun[module:module + 3] == ["-m", "megatron_muon.cli", "pretrain"]
    pretrain = torchrun[module + 3:]
    assert pretrain[pretrain.index("--save") + 1] == pretrain[pretrain.index("--load") + 1] == f"{out}/checkpoints"
    assert pretrain[-1] == "--set=optimizer.lr=2e-4"
    check_pretrain_args(pretrain, world_size=32)


def test_local_executor_without_torchrun_on_path_says_what_to_activate(nemo_run_home, tmp_path):
    result = _example(["--executor", "local", "--recipe", "tiny-cpu"], tmp_path, 120, path="/nonexistent")
    assert result.returncode == 2 and "torchrun is not on PATH: activate the environment" in result.stderr


def test_slurm_executor_refuses_a_relative_run_directory(nemo_run_home, tmp_path):
    result = _example(["--executor", "slurm", "--account", "acc", "--output-dir", "runs/x", "--dryrun"], tmp_path, 120)
    assert result.returncode == 2 and "absolute path on the cluster's shared storage" in result.stderr
