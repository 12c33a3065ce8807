"""The Slurm and NeMo-Run examples render to torchrun command lines that `megatron-muon pretrain` accepts."""

import importlib.util
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_muon.cli.main import build_parser, intended_world_size
from megatron_muon.training.recipes import load_recipe
from megatron_muon.training.validation import validate

CLUSTER = Path(__file__).resolve().parents[2] / "examples" / "cluster"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _check_pretrain_args(args: list[str], world_size: int) -> None:
    """The arguments after `-m megatron_muon.cli` parse, and the recipe validates for the job's world size."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == "pretrain"
    overrides = [item.removeprefix("--set=") for item in parsed.overrides]
    validate(load_recipe(parsed.recipe, overrides), world_size)


def test_slurm_script_runs_one_torchrun_per_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun_args"
    _stub(bin_dir, "srun", f'printf "%s\\n" "$@" > {record}\n')
    _stub(bin_dir, "scontrol", 'printf "gpu-node-01\\ngpu-node-02\\ngpu-node-03\\ngpu-node-04\\n"\n')
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[01-04]",
               SLURM_NNODES="4", SLURM_JOB_ID="4242", SLURM_JOB_NAME="hybrid-1.5b-muon")
    script = CLUSTER / "slurm_hybrid_muon.sbatch"
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
    pretrain_args = argv[module + 2:]
    assert pretrain_args[-2:] == ["--set", "optimizer.lr=2e-4"]
    assert "--save" in pretrain_args and "runs/hybrid-1.5b-muon-4242/checkpoints" in pretrain_args
    header = {line.split("=")[0]: line.split("=")[1] for line in script.read_text().splitlines()
              if line.startswith("#SBATCH") and "=" in line}
    nodes, gpus = int(header["#SBATCH --nodes"]), int(header["#SBATCH --gpus-per-node"])
    assert nodes * gpus == intended_world_size(load_recipe("hybrid-1.5b-multinode")) == 32
    _check_pretrain_args(pretrain_args, world_size=nodes * gpus)


def _fake_nemo_run() -> types.ModuleType:
    """Stands in for nemo_run 0.11 (not a test dependency): same class names, keyword names checked strictly."""

    def strict(name, fields, required=()):
        def __init__(self, **kwargs):
            unknown = set(kwargs) - set(fields)
            assert not unknown, f"{name} got unknown arguments {unknown}"
            assert set(required) <= set(kwargs), f"{name} is missing {set(required) - set(kwargs)}"
            self.__dict__.update(kwargs)
        return type(name, (), {"__init__": __init__})

    fake = types.ModuleType("nemo_run")
    fake.Script = strict("Script", ("path", "inline", "args", "env", "entrypoint", "m", "metadata"))
    fake.SlurmExecutor = strict("SlurmExecutor", (
        "account", "partition", "job_name_prefix", "time", "nodes", "ntasks_per_node", "cpus_per_task",
        "gpus_per_node", "gpus_per_task", "qos", "mem", "exclusive", "container_image", "container_mounts",
        "container_env", "additional_parameters", "srun_args", "tunnel", "packager", "launcher", "env_vars",
        "torchrun_nproc_per_node", "setup_lines", "retries"), required=("account",))
    fake.LocalExecutor = strict("LocalExecutor", ("ntasks_per_node", "nodes", "launcher", "env_vars", "packager"))
    fake.SSHTunnel = strict("SSHTunnel", ("host", "user", "job_dir", "port", "identity", "shell", "pre_command"),
                            required=("host", "user", "job_dir"))
    fake.LocalTunnel = strict("LocalTunnel", ("job_dir",), required=("job_dir",))
    fake.calls = []
    fake.run = lambda script, executor=None, name="", dryrun=False, **kw: fake.calls.append((script, executor, name))
    return fake


@pytest.fixture
def nemo_run_example(monkeypatch):
    fake = _fake_nemo_run()
    monkeypatch.setitem(sys.modules, "nemo_run", fake)
    spec = importlib.util.spec_from_file_location("nemo_run_example", CLUSTER / "nemo_run_hybrid_muon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, fake


def _command(script) -> list[str]:
    """What NeMo-Run executes for a python -m Script (its Script.to_command with the entrypoint)."""
    return [script.entrypoint, *(["-m"] if script.m else []), script.path, *script.args]


def test_nemo_run_slurm_job(nemo_run_example):
    example, fake = nemo_run_example
    example.main(["--executor", "slurm", "--account", "acc", "--partition", "batch", "--nodes", "4", "--gpus", "8",
                  "--ssh-host", "login", "--ssh-user", "me", "--set", "training.train_iters=200"])
    script, executor, name = fake.calls[-1]
    command = _command(script)
    assert command[:4] == ["python", "-m", "megatron_muon.cli", "pretrain"]
    assert command[-1] == "--set=training.train_iters=200" and name == "hybrid-1.5b-multinode-muon"
    assert (executor.nodes, executor.ntasks_per_node, executor.gpus_per_node, executor.launcher) == (4, 8, 8, "torchrun")
    assert (executor.tunnel.host, executor.tunnel.user) == ("login", "me")
    _check_pretrain_args(command[3:], world_size=executor.nodes * executor.ntasks_per_node)


def test_nemo_run_local_job(nemo_run_example):
    example, fake = nemo_run_example
    script, executor, name, dryrun = example.build(["--executor", "local", "--gpus", "8", "--recipe",
                                                    "hybrid-1.5b-8gpu", "--dryrun"])
    assert (executor.ntasks_per_node, executor.launcher, dryrun) == (8, "torchrun", True)
    _check_pretrain_args(_command(script)[3:], world_size=8)
    with pytest.raises(SystemExit):
        example.build(["--executor", "slurm"])  # no --account: argparse error, exit 2
