"""Symmetric products (X·Xᵀ, R·R) alone: our kernels against cuBLAS's full product, per Newton–Schulz stack shape.

Newton–Schulz's time is mostly these products (`optimizer_step.py`'s kernel table), so this says how far each of
our kernels is from cuBLAS's rate on the same shapes, and which settings the Gluon kernels run best with. TFLOP/s
count what each kernel executes: the full product for cuBLAS, half of it for ours (lower tiles only, mirrored).
"× cuBLAS time": ours over cuBLAS's full product (0.5 would be cuBLAS's rate). Square stacks (rows = inner) are
Newton–Schulz's m×m products: c·R·R + b·R with R symmetric, C read in the epilogue.

  python benchmarks/symmetric_kernel.py --out benchmarks/results/symmetric_kernel.md
  python benchmarks/symmetric_kernel.py --stages 3 4 5 --registers 224 240     # the ping-pong kernel's settings
  python benchmarks/symmetric_kernel.py --wide 64x3x1 32x4x2        # the wide kernel's k-slice, ring, epilogue buffers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench_env import emit_markdown, timed  # benchmarks/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (count, rows, inner) of the hybrid-1.5B's Muon step: the Gram of fc1 (X·Xᵀ over the long side), the m×m products
# of every 2048-row stack, the Gram of the GDN in_proj's q/k sections and their m×m products.
DEFAULT_SHAPES = ("24x2048x11264", "24x2048x2048", "36x2048x3072", "36x1536x2048", "36x1536x1536")
ALPHA, BETA = 2.0315, -4.775  # the m×m products' c·R·R + b·R (rows == inner), as `simple`'s last two coefficients


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        count, rows, inner = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: write it as COUNTxROWSxINNER, e.g. 24x2048x11264") from None
    return count, rows, inner


def scales(C) -> tuple[float, float]:
    return (ALPHA, BETA) if C is not None else (1.0, 0.0)


def kernels(device, stages: list[int], registers: list[int], wide: list[tuple[int, int]]):
    """(name, executed fraction of the full product, call(A, C) -> out, setup, ready(A, C)) for every kernel here."""
    yield ("cuBLAS full product (torch.bmm / baddbmm)", 1.0,
           lambda A, C: torch.bmm(A, A.mT) if C is None else torch.baddbmm(C, A, A.mT, beta=BETA, alpha=ALPHA),
           None, None)  # alpha and beta apply where C is given (the m×m products); X·Xᵀ is the plain product
    if device.type != "cuda":
        return
    from megatron_muon.kernels import symmetric, symmetric_wide, symmetric_ws

    yield "ours, Triton (autotuned)", 0.5, lambda A, C: symmetric.symmetric_matmul(A, A, C, *scales(C)), None, None
    for tile_k, depth, buffers in wide:
        def setup(tile_k=tile_k, depth=depth, buffers=buffers):
            symmetric_wide.set_layout(tile_k, depth, buffers)
        yield (f"ours, Gluon wide 128 × 256 tiles, k-slices of {tile_k}, {depth} stages, "
               f"{buffers} epilogue buffer{'s' if buffers > 1 else ''}", 0.5,
               lambda A, C: symmetric_wide.symmetric_matmul_wide(A, A, C, *scales(C)), setup,
               lambda A, C: symmetric_wide.ready(A, A, C))
    for depth in stages:
        for budget in registers:
            def setup(depth=depth, budget=budget):
                symmetric_ws.STAGES, symmetric_ws.CONSUMER_REGISTERS = depth, budget
            yield (f"ours, Gluon ping-pong 128 × 128 tiles, {depth} stages, {budget} registers", 0.5,
                   lambda A, C: symmetric_ws.symmetric_matmul_ws(A, A, C, *scales(C)), setup,
                   lambda A, C: symmetric_ws.ready(A, A, C))


def parse_wide(text: str) -> tuple[int, int, int]:
    """KSLICExSTAGES[xBUFFERS] (one epilogue buffer unless given), refused where it does not fit one block."""
    from megatron_muon.kernels import symmetric_wide
    from megatron_muon.kernels.gluon_support import SM90_SHARED_MEMORY_PER_BLOCK

    try:
        tile_k, depth, *buffers = (int(part) for part in text.lower().split("x"))
        buffers = buffers or [1]
        (buffers, ) = buffers
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write it as KSLICExSTAGES[xBUFFERS], e.g. 64x3 or 32x4x2") from None
    if buffers not in (1, 2) or tile_k % 16 or depth < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: the k-slice is a multiple of 16, the ring at least 2 deep and "
                                         "the epilogue 1 or 2 buffers")
    needed = symmetric_wide.shared_bytes(tile_k, depth, buffers)
    if needed > SM90_SHARED_MEMORY_PER_BLOCK:
        raise argparse.ArgumentTypeError(
            f"{text!r} needs {needed // 1024} KiB of shared memory, more than a Hopper block's "
            f"{SM90_SHARED_MEMORY_PER_BLOCK // 1024}: shorten the ring or the k-slice")
    return tile_k, depth, buffers


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES])
    parser.add_argument("--stages", nargs="+", type=int, default=[4],
                        help="the ping-pong kernel's ring depths to time")
    parser.add_argument("--registers", nargs="+", type=int, default=[224],
                        help="the ping-pong kernel's register budgets per consumer thread to time")
    parser.add_argument("--wide", nargs="+", type=parse_wide, default=None,
                        help="the wide kernel's k-slice, ring depth and epilogue buffers to time, as "
                             "KSLICExSTAGES[xBUFFERS] (default: the kernel's own)")
    parser.add_argument("--scale", type=int, default=1, help="divide rows and inner by this (CPU smoke tests)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    from megatron_muon.kernels import symmetric_wide, symmetric_ws

    defaults = (symmetric_ws.STAGES, symmetric_ws.CONSUMER_REGISTERS, symmetric_wide.layout())
    wide = args.wide or [defaults[2]]
    lines = ["| stack (count × rows × inner) | kernel | ms | executed TFLOP/s | × cuBLAS time | max abs. diff. |",
             "|---|---|---:|---:|---:|---:|"]
    for count, rows, inner in args.shapes:
        rows, inner = max(1, rows // args.scale), max(1, inner // args.scale)
        A = torch.randn(count, rows, inner, device=device, dtype=dtype) / inner ** 0.5
        C = None
        if rows == inner:  # an m×m product as Newton–Schulz runs it: b·R + c·R·R with R symmetric
            A = C = ((A + A.mT) * 0.5).contiguous()
        full_flop = 2 * count * rows * rows * inner
        reference = torch.bmm(A.double(), A.double().mT)
        if C is not None:
            reference = ALPHA * reference + BETA * C.double()
        base_ms = None
        for name, fraction, call, setup, ready in kernels(device, args.stages, args.registers, wide):
            if setup is not None:
                setup()
            if ready is not None and not ready(A, C):
                lines.append(f"| {count} × {rows} × {inner} | {name} | - | - | - | not run: the kernel's `ready` "
                             "is false here |")
                continue
            ms = timed(lambda: call(A, C), device, args.warmup, args.repeats)
            base_ms = ms if base_ms is None else base_ms
            error = (call(A, C).double() - reference).abs().max().item()
            lines.append(f"| {count} × {rows} × {inner} | {name} | {ms:.3f} | {fraction * full_flop / ms / 1e9:.0f} "
                         f"| {ms / base_ms:.3f} | {error:.1e} |")
            print(lines[-1], flush=True)
    symmetric_ws.STAGES, symmetric_ws.CONSUMER_REGISTERS = defaults[:2]
    symmetric_wide.set_layout(*defaults[2])
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = ["# Symmetric products alone: ours against cuBLAS's full product", "",
              f"- device: {gpu}; torch {torch.__version__}; {dtype}; median of {args.repeats} after {args.warmup}",
              f"- command: `python {' '.join(sys.argv)}`", ""]
    emit_markdown(header + lines, args.out)


if __name__ == "__main__":
    main()
