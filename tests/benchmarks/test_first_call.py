"""The first-call benchmark runs its three fresh processes on CPU at a reduced scale and tables every shape."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_first_call_benchmark_smoke(tmp_path):
    out = tmp_path / "first_call.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "first_call.py"), "--scale", "64", "--cache-dir",
                    str(tmp_path / "triton"), "--out", str(out)], check=True, cwd=BENCHMARKS.parent, timeout=300)
    text = out.read_text()
    assert "| seconds | cold caches | warm caches | compiled, autotune cache off |" in text
    for row in ("all first calls", "gdn in_proj / first", "fc2 / second", "process"):
        assert f"| {row} |" in text
