"""Symmetric products (X·Xᵀ, R·R) alone: our kernels against cuBLAS's full product, per Newton–Schulz stack shape.

Newton–Schulz's time is mostly these products (`optimizer_step.py`'s kernel table), so this says how far each of
our kernels is from cuBLAS's rate on the same shapes, and which ring depth and register budget the warp-specialized
kernel runs best with. TFLOP/s count what each kernel executes: the full product for cuBLAS, half of it for ours
(lower tiles only, mirrored). "× cuBLAS time": ours over cuBLAS's full product (0.5 would be cuBLAS's rate).

  python benchmarks/symmetric_kernel.py --out benchmarks/results/symmetric_kernel.md
  python benchmarks/symmetric_kernel.py --stages 3 4 5 --registers 224 240     # the Gluon kernel's settings
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench_env import emit_markdown, timed  # benchmarks/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (count, rows, inner) of the hybrid-1.5B's Muon step: the Gram of fc1 (X·Xᵀ over the long side), the m×m products
# of every 2048-row stack, the Gram of the GDN in_proj's q/k sections.
DEFAULT_SHAPES = ("24x2048x11264", "24x2048x2048", "36x2048x3072", "36x1536x2048")


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        count, rows, inner = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: write it as COUNTxROWSxINNER, e.g. 24x2048x11264") from None
    return count, rows, inner


def kernels(device, stages: list[int], registers: list[int]):
    """(name, executed fraction of the full product, call(A) -> out, setup) for every kernel that runs here."""
    yield "cuBLAS full product (torch.bmm)", 1.0, lambda A: torch.bmm(A, A.mT), None
    if device.type != "cuda":
        return
    from megatron_muon.kernels import symmetric, symmetric_ws

    yield "ours, Triton (autotuned)", 0.5, lambda A: symmetric.symmetric_matmul(A, A), None
    for depth in stages:
        for budget in registers:
            def setup(depth=depth, budget=budget):
                symmetric_ws.STAGES, symmetric_ws.CONSUMER_REGISTERS = depth, budget
            yield (f"ours, Gluon warp-specialized, {depth} stages, {budget} registers", 0.5,
                   lambda A: symmetric_ws.symmetric_matmul_ws(A, A), setup)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES])
    parser.add_argument("--stages", nargs="+", type=int, default=[4], help="the Gluon kernel's ring depths to time")
    parser.add_argument("--registers", nargs="+", type=int, default=[224],
                        help="the Gluon kernel's register budgets per consumer thread to time")
    parser.add_argument("--scale", type=int, default=1, help="divide rows and inner by this (CPU smoke tests)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    from megatron_muon.kernels import symmetric_ws

    defaults = (symmetric_ws.STAGES, symmetric_ws.CONSUMER_REGISTERS)
    lines = ["| stack (count × rows × inner) | kernel | ms | executed TFLOP/s | × cuBLAS time | max abs. diff. |",
             "|---|---|---:|---:|---:|---:|"]
    for count, rows, inner in args.shapes:
        rows, inner = max(1, rows // args.scale), max(1, inner // args.scale)
        A = torch.randn(count, rows, inner, device=device, dtype=dtype) / inner ** 0.5
        full_flop = 2 * count * rows * rows * inner
        reference = torch.bmm(A.double(), A.double().mT)
        base_ms = None
        for name, fraction, call, setup in kernels(device, args.stages, args.registers):
            if setup is not None:
                setup()
            if device.type == "cuda" and name.startswith("ours, Gluon") and not symmetric_ws.ready(A, A, None):
                lines.append(f"| {count} × {rows} × {inner} | {name} | - | - | - | not run: `symmetric_ws.ready` "
                             "is false here |")
                continue
            ms = timed(lambda: call(A), device, args.warmup, args.repeats)
            base_ms = ms if base_ms is None else base_ms
            error = (call(A).double() - reference).abs().max().item()
            lines.append(f"| {count} × {rows} × {inner} | {name} | {ms:.3f} | {fraction * full_flop / ms / 1e9:.0f} "
                         f"| {ms / base_ms:.3f} | {error:.1e} |")
            print(lines[-1], flush=True)
    symmetric_ws.STAGES, symmetric_ws.CONSUMER_REGISTERS = defaults
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = ["# Symmetric products alone: ours against cuBLAS's full product", "",
              f"- device: {gpu}; torch {torch.__version__}; {dtype}; median of {args.repeats} after {args.warmup}",
              f"- command: `python {' '.join(sys.argv)}`", ""]
    emit_markdown(header + lines, args.out)


if __name__ == "__main__":
    main()
