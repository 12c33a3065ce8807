"""The symmetric-product benchmark runs on CPU at a reduced scale (cuBLAS's row only: our kernels need a GPU) and
rejects malformed shapes with the fix."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_symmetric_kernel_benchmark_smoke(tmp_path):
    out = tmp_path / "symmetric_kernel.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "symmetric_kernel.py"), "--scale", "64", "--warmup", "0",
                    "--repeats", "1", "--out", str(out)], check=True, cwd=BENCHMARKS.parent, timeout=300)
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 24 × 32 × 176 |")]
    assert len(rows) == 1 and "cuBLAS full product" in rows[0] and rows[0].split("|")[5].strip() == "1.000"
    assert float(rows[0].split("|")[6]) < 1e-4  # fp32 product against the fp64 one (unit-scale entries)
    assert text.count("cuBLAS full product") == 5  # one per default shape
    square = [line for line in text.splitlines() if line.startswith("| 24 × 32 × 32 |")]
    assert len(square) == 1 and float(square[0].split("|")[6]) < 1e-4  # b·R + c·R·R against fp64


def test_symmetric_kernel_benchmark_names_the_shape_format():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "symmetric_kernel.py"), "--shapes", "24by2048"],
                            cwd=BENCHMARKS.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "COUNTxROWSxINNER" in result.stderr


def test_symmetric_kernel_benchmark_refuses_a_wide_layout_that_does_not_fit():
    """64-wide k-slices three deep with two epilogue buffers need 272 KiB: refused before anything runs."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "symmetric_kernel.py"), "--wide", "64x3x2"],
                            cwd=BENCHMARKS.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "272 KiB" in result.stderr and "shorten the ring" in result.stderr
