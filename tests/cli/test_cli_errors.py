"""Bad input ends with one sentence on stderr, exit code 2, and nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.cli.main import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "optimizer.lrr=1"], "unknown recipe key 'optimizer.lrr' in --set; did you mean 'optimizer.lr'?"),
        (["--set", "parallel.tensor_model_parallel_size=2"], "does not divide the world size 1"),
        (["--data-path", "{tmp}/missing"], "has no '{tmp}/missing.bin'"),
        (["--recipe", "tiny-gpu"], "unknown recipe 'tiny-gpu'; did you mean 'tiny-cpu'?"),
        (["--load", "{tmp}/no-checkpoint"], "checkpoint directory '{tmp}/no-checkpoint' does not exist"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    for name in ("WORLD_SIZE", "RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code = main(["pretrain", "--output-dir", str(out), "--save", str(tmp_path / "ckpt"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert err.startswith("megatron-muon: error: ") and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output dir, no checkpoint dir, no cache


def test_console_entry_point_exit_code(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "megatron_muon.cli", "pretrain", "--set", "model.num_layer=2"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "did you mean 'model.num_layers'?" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_validate_and_recipes_commands(capsys):
    assert main(["recipes"]) == 0
    assert "hybrid-1.5b-h200" in capsys.readouterr().out
    assert main(["validate", "--recipe", "hybrid-1.5b-8gpu"]) == 0
    assert '"train_flops_per_token"' in capsys.readouterr().out
    assert main(["validate", "--recipe", "hybrid-1.5b-8gpu", "--world-size", "4"]) == 2
