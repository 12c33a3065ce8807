"""The TE-pieces benchmark runs end to end on CPU (ours only: TE needs a GPU), every piece timed."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_te_pieces_benchmark_smoke(tmp_path):
    out = tmp_path / "te_pieces.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "te_pieces.py"), "--device", "cpu", "--tiny", "--warmup", "0",
                    "--reps", "1", "--out", str(out)], check=True, cwd=BENCHMARKS.parent, timeout=300)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert {row.split("|")[1].strip() for row in rows} == {"attention", "rmsnorm", "norm + fc1", "wgrad into fp32",
                                                            "adamw"}
    assert not any("failed" in row for row in rows), rows
