"""The optimizer-step benchmark runs end to end on CPU at a reduced scale, breakdown and per-stack NS included."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_optimizer_step_benchmark_smoke(tmp_path):
    out = tmp_path / "optimizer_step.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "optimizer_step.py"), "--scale", "32", "--warmup", "0",
                    "--repeats", "1", "--only-ours", "--out", str(out)], check=True, cwd=BENCHMARKS.parent, timeout=300)
    text = out.read_text()
    assert "| ours (auto, MegaBatch, fused splits) |" in text
    assert "| building the NS stacks" in text and "| Newton–Schulz (batched calls alone) |" in text
    assert "| 24 × 352 × 64 | auto: gram |" in text  # fc1 (11264 × 2048 / 32) as one stack of 24
    assert "| all stacks, summed |" in text
    assert text.count("| ours (auto, MegaBatch, fused splits, CUDA graph) |") == 2  # step table and host table
    assert "| ours (auto, MegaBatch, heads split) |" in text  # GDN in_proj tagged with its head rows
