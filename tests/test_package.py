"""The package installs, registers idempotently, and explains unsupported environments in one sentence."""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_muon
from megatron_muon.version_check import check_megatron_core

REPO = Path(__file__).resolve().parents[1]


def test_version_and_register_are_idempotent():
    assert megatron_muon.__version__
    megatron_muon.register()
    megatron_muon.register()


@pytest.mark.parametrize("version", ["0.19.2", "0.19.3", "0.19.5rc1"])
def test_supported_megatron_versions(version):
    assert check_megatron_core(version) == version


@pytest.mark.parametrize("version", ["0.18.0", "0.19.1", "0.20.0", "1.0.0"])
def test_unsupported_megatron_version_names_the_fix(version):
    with pytest.raises(RuntimeError, match=r'pip install "megatron-core>=0.19.2,<0.20"') as info:
        check_megatron_core(version)
    assert version in str(info.value)


def _older_python() -> str | None:
    for pattern in ("/root/.pyenv/versions/3.11*/bin/python3.11", "/usr/bin/python3.11", "/usr/local/bin/python3.11"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return None


@pytest.mark.skipif(_older_python() is None, reason="no Python 3.11 interpreter on this machine to try the import with")
def test_old_python_gets_one_clear_sentence():
    result = subprocess.run(
        [_older_python(), "-c", "import megatron_muon"],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode != 0
    assert "megatron_muon needs Python >= 3.12" in result.stderr
    assert "Install Python 3.12" in result.stderr


def test_cpu_mode_refuses_to_run_with_cuda(monkeypatch):
    import torch

    from megatron_muon import _cpu

    if _cpu.cpu_mode_enabled():
        pytest.skip("CPU mode already enabled in this process; the refusal is checked before enabling")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="only for machines without a GPU"):
        _cpu.enable_cpu_mode()
    assert not _cpu.cpu_mode_enabled()


def test_nan_filled_empty_marks_unwritten_memory():
    import torch

    from megatron_muon._cpu import nan_filled_empty

    with nan_filled_empty():
        assert torch.isnan(torch.empty(4, 4)).all()
        assert torch.isnan(torch.empty_like(torch.zeros(3))).all()
        assert torch.empty(3, dtype=torch.int64).dtype == torch.int64
