"""The example sbatch script submitted to a real Slurm (one node, CPU mode, 2 ranks): the first job trains until the
scheduler's pre-time-limit SIGTERM, saves and stops; the same script submitted again resumes from that checkpoint."""

import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import EXAMPLES

pytestmark = pytest.mark.slurm
SBATCH = EXAMPLES / "slurm_hybrid_muon.sbatch"
CPU_MODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2"]
TRAIN = ["--set", "training.micro_batch_size=4", "--set", "logging.log_interval=10"]


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: srun and slurmstepd open their I/O sockets on ephemeral ports,
    so a port the kernel handed out (bind to 0) and released can be taken by srun before torchrun binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(20000, min(low, 32768)), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between 20000 and {low}")


def _submit(env: dict[str, str], cwd: Path, name: str, sbatch_args: list[str], pretrain_args: list[str]) -> str:
    log = cwd / f"{name}.out"
    result = subprocess.run(["sbatch", "--parsable", f"--output={log}", f"--chdir={cwd}", *CPU_MODE, *sbatch_args,
                             str(SBATCH), *TRAIN, *pretrain_args], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"sbatch refused the job: {result.stderr.strip()}"
    return result.stdout.strip().split(";")[0]


def _wait(env: dict[str, str], job_id: str, log: Path, timeout_s: float) -> str:
    """Polls squeue until the job has left the queue; cancels it and fails (with its log) past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True,
                               timeout=30)
        if not queue.stdout.strip():
            return log.read_text() if log.exists() else ""
        time.sleep(2)
    subprocess.run(["scancel", job_id], env=env, timeout=30)
    tail = log.read_text()[-3000:] if log.exists() else "(no log)"
    pytest.fail(f"Slurm job {job_id} still queued or running after {timeout_s:.0f} s (state "
                f"{queue.stdout.strip()}); cancelled. Its log ends:\n{tail}")


def test_sbatch_script_saves_on_the_time_limit_signal_and_the_next_submission_resumes(slurm_cluster, tmp_path):
    env = dict(slurm_cluster, RUN_DIR=str(tmp_path / "run"), RECIPE="tiny-cpu", GPUS_PER_NODE="2",
               OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # this venv's torchrun
    # 3 minutes with SIGTERM 2 minutes before the end: about a minute of training, then the save
    first = _submit(env, tmp_path, "first", ["--time=3", "--signal=TERM@120"], ["--set", "training.train_iters=1000000"])
    log = _wait(env, first, tmp_path / "first.out", timeout_s=420)
    stopped = re.search(r"stopped by SIGTERM after (\d+) steps; checkpoint in (\S+)", log)
    assert stopped, f"the first job did not save on the scheduler's signal; its log ends:\n{log[-3000:]}"
    saved = int(stopped.group(1))
    assert saved > 0 and "no checkpoint in" in log and "starting from scratch" in log
    latest = tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert latest.read_text().strip() == str(saved)

    env["MASTER_PORT"] = str(_free_port())
    second = _submit(env, tmp_path, "second", ["--time=10"], ["--set", f"training.train_iters={saved + 3}"])
    log = _wait(env, second, tmp_path / "second.out", timeout_s=300)
    assert f"resumed from iteration {saved}" in log, f"the second job did not resume; its log ends:\n{log[-3000:]}"
    assert re.search(rf"done: .* in 3 steps", log), log[-3000:]
    assert latest.read_text().strip() == str(saved + 3)
