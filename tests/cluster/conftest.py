"""The cluster tests need NeMo-Run (the `cluster` extra) or a running Slurm. Elsewhere they skip and say what to install;
under CI (MEGATRON_MUON_CLUSTER_CI=1, set by .ci/run) a missing prerequisite fails instead, naming it."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cluster"


def check_pretrain_args(args: list[str], world_size: int) -> None:
    """The arguments after `pretrain` parse, and the recipe validates for the job's world size."""
    from megatron_muon.cli.main import build_parser
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    parsed = build_parser().parse_args(["pretrain", *args])
    validate(load_recipe(parsed.recipe, [item.removeprefix("--set=") for item in parsed.overrides]), world_size)


def missing(what: str) -> None:
    """Skips (or under CI fails) the test, naming what is missing and how to get it."""
    if os.environ.get("MEGATRON_MUON_CLUSTER_CI") == "1":
        pytest.fail(f"CI runs the cluster tests, but {what}")
    pytest.skip(what)


@pytest.fixture
def nemo_run_home(tmp_path, monkeypatch) -> Path:
    try:
        import nemo_run  # noqa: F401
    except ImportError as error:
        missing(f"nemo_run does not import ({error}); install it with: pip install -e '.[cluster]'")
    home = tmp_path / "nemo_run_home"
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    return home


@pytest.fixture
def slurm_cluster() -> dict[str, str]:
    """Environment that reaches a running Slurm whose node is idle (scripts/slurm_local.sh start makes one)."""
    env = dict(os.environ)
    conf = Path(env.get("SLURM_LOCAL_DIR", "/tmp/megatron-muon-slurm")) / "slurm.conf"
    if "SLURM_CONF" not in env and conf.exists():
        env["SLURM_CONF"] = str(conf)
    if shutil.which("sbatch") is None:
        missing("sbatch is not installed; run: bash scripts/slurm_local.sh install && bash scripts/slurm_local.sh start")
    state = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30)
    if state.returncode != 0 or not state.stdout.split():
        missing(f"no Slurm controller answers sinfo ({state.stderr.strip() or 'no nodes'}); "
                "start one with: bash scripts/slurm_local.sh start")
    if state.stdout.split()[0] not in ("idle", "mix"):
        missing(f"the Slurm node is '{state.stdout.split()[0]}', not idle; see its slurmd log")
    return env
