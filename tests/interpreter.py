"""Run a check script under TRITON_INTERPRET=1 in a subprocess (the interpreter must be on before Triton loads)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(script: Path, timeout: float = 240) -> None:
    """Fails the calling test unless the script exits 0 and prints "interpreter ok"."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and "interpreter ok" in done.stdout, (done.stdout + done.stderr)[-3000:]
