"""The fused-terms kernel benchmark's front door on a CPU: unknown sizes name the valid ones; without a GPU it says
what it needs instead of failing inside a kernel."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gdn_fused_terms.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))


def test_unknown_sizes_name_the_valid_ones():
    done = _run("--sizes", "qwen3-next,tiny")
    assert done.returncode != 0 and "--sizes tiny: choose from hybrid-1.5b, qwen3-next" in done.stderr


def test_without_a_gpu_it_says_what_it_needs():
    done = _run()
    assert done.returncode != 0 and "run it on an sm90 GPU with FLA installed" in done.stderr
