"""The Slurm example renders to a torchrun command line that `megatron-muon pretrain` accepts, without a Slurm (the
real submissions and NeMo-Run are in tests/cluster)."""

import os
import stat
import subprocess
from pathlib import Path

from megatron_muon.cli.main import intended_world_size
from megatron_muon.training.recipes import load_recipe

from .conftest import EXAMPLES, check_pretrain_args


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_runs_one_torchrun_per_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun_args"
    _stub(bin_dir, "srun", f'printf "%s\\n" "$@" > {record}\n')
    _stub(bin_dir, "scontrol", 'printf "gpu-node-01\\ngpu-node-02\\ngpu-node-03\\ngpu-node-04\\n"\n')
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[01-04]",
               SLURM_NNODES="4", SLURM_JOB_ID="4242", SLURM_JOB_NAME="hybrid-1.5b-muon")
    script = EXAMPLES / "slurm_hybrid_muon.sbatch"
    result = subprocess.run(["bash", str(script), "--set", "optimizer.lr=2e-4"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    argv = record.read_text().splitlines()
    torchrun = argv.index("torchrun")
    assert argv[:torchrun] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    module = argv.index("-m")
    assert argv[torchrun:module] == [
        "torchrun", "--nnodes", "4", "--nproc-per-node", "8", "--rdzv-id", "4242", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "gpu-node-01:29500",
    ]
    assert argv[module:module + 3] == ["-m", "megatron_muon.cli", "pretrain"]
    pretrain_args = argv[module + 3:]
    assert pretrain_args[-2:] == ["--set", "optimizer.lr=2e-4"]
    checkpoints = "runs/hybrid-1.5b-muon/checkpoints"  # the job name's, not the job id's: a resubmission resumes
    assert pretrain_args[pretrain_args.index("--save") + 1] == pretrain_args[pretrain_args.index("--load") + 1] \
        == checkpoints
    header = {line.split("=")[0]: line.split("=")[1] for line in script.read_text().splitlines()
              if line.startswith("#SBATCH") and "=" in line}
    nodes, gpus = int(header["#SBATCH --nodes"]), int(header["#SBATCH --gpus-per-node"])
    assert nodes * gpus == intended_world_size(load_recipe("hybrid-1.5b-multinode")) == 32
    check_pretrain_args(pretrain_args, world_size=nodes * gpus)
