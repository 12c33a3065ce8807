"""First-call cost of orthogonalizing the reference set: Triton compiles and autotunes on the first call per shape.

A training job pays this in its first Muon step, and again on every restart unless the caches survive. Each run is a
fresh process sharing one Triton cache directory, in this order: a cold cache; the same again with the kernels
compiled and the autotune choices cached on disk (our default); compiled kernels but the autotune cache off (the
autotuner benchmarks every config again).

    python benchmarks/first_call.py --out benchmarks/results/first_call.md [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_env import emit_markdown, package_versions  # noqa: E402
from orthogonalize import REFERENCE_SHAPES  # noqa: E402  (benchmarks/orthogonalize.py)

RUNS = (("cold caches", True), ("warm caches", True), ("compiled, autotune cache off", False))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(autotune_cache: bool, scale: int) -> dict[str, float]:
    """Seconds of the first and of the second orthogonalize call per shape group, in this fresh process."""
    from megatron_muon.kernels import orthogonalize
    from megatron_muon.kernels import symmetric

    symmetric._sym_mm_tuned.cache_results = autotune_cache
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seconds = {}
    for name, ((rows, cols), count) in REFERENCE_SHAPES.items():
        G = torch.randn(count, rows // scale, cols // scale, device=device, dtype=torch.bfloat16)
        for call in ("first", "second"):
            synchronize()
            start = time.perf_counter()
            orthogonalize(G)
            synchronize()
            seconds[f"{name} / {call}"] = time.perf_counter() - start
    return seconds


def run_child(cache_dir: Path, autotune_cache: bool, scale: int) -> dict[str, float]:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir))
    env.pop("TRITON_CACHE_AUTOTUNING", None)  # the run's own setting decides
    command = [sys.executable, __file__, "--child", "on" if autotune_cache else "off", "--scale", str(scale)]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    seconds = json.loads(done.stdout.strip().splitlines()[-1])
    seconds["process"] = time.perf_counter() - start
    return seconds


def table(results: list[dict[str, float]]) -> list[str]:
    names = [name for name, _ in RUNS]
    lines = ["| seconds | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    rows = [*results[0]]
    totals = {"all first calls": "first", "all second calls": "second"}
    for label, call in totals.items():
        lines.append(f"| {label} | " + " | ".join(
            f"{sum(v for k, v in r.items() if k.endswith(f'/ {call}')):.2f}" for r in results) + " |")
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(f"{r[row]:.2f}" for r in results) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="markdown result file")
    parser.add_argument("--cache-dir", type=Path, default=None, help="Triton cache for the runs (default: a new "
                        "temporary directory, so the first run is cold)")
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension (CPU smoke tests)")
    parser.add_argument("--child", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "on", args.scale)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        cache_dir = args.cache_dir or Path(scratch)
        results = []
        for name, autotune_cache in RUNS:
            results.append(run_child(cache_dir, autotune_cache, args.scale))
            print(f"{name}: {results[-1]['process']:.1f} s", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    versions = ", ".join(f"{k} {v}" for k, v in package_versions().items())
    command = "python benchmarks/first_call.py " + " ".join(sys.argv[1:])
    lines = ["# First calls of orthogonalize on the reference set (compile + autotune)", "",
             f"- date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, device {device}, {versions}",
             f"- command: `{command}`",
             "- fresh process per column, one Triton cache directory shared by the three, in this order; `process` "
             "includes imports and CUDA start-up", "", *table(results)]
    emit_markdown(lines, args.out)


if __name__ == "__main__":
    main()
