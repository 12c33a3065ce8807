"""Orthogonalization speed on the reference model's 96 Megatron-fused matrices, all baselines in one run (GPU).

Methods: torch.optim.Muon's per-matrix NS (its internal `_zeropower_via_newtonschulz`), our standard / gram / auto
(stacked per shape, Triton symmetric kernels), auto with the symmetric kernels' loads restricted to pointers (no TMA),
our gram on the torch backend, auto with restarts before iterations
2 and 4 (the default before restarts followed the coefficients), and megatron-core's emerging_optimizers
`newton_schulz` (per matrix, fp32 input as Megatron passes it; once with fp32 GEMMs, once in its bf16 mode).
Inputs are pre-stacked per shape (stacking is the optimizer's job).

    python benchmarks/orthogonalize.py --out benchmarks/results/orthogonalize.md [--auto-sweep FILE] [--kernels]
        [--methods "ours auto" "ours auto, torch input pass" ...]

Effective TFLOP/s = FLOPs of standard NS with full GEMMs (the work torch.optim.Muon does) / time, so it compares
methods on equal terms; "achieved" counts what the method executes (symmetric products at half).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import shlex
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_muon.kernels import flops, orthogonalize  # noqa: E402
from megatron_muon.kernels.coefficients import SIMPLE  # noqa: E402
from megatron_muon.kernels.reference import newton_schulz_reference  # noqa: E402

# hybrid-1.5B (DESIGN.md): name -> ((rows, cols), count); 96 matrices.
REFERENCE_SHAPES = {
    "gdn in_proj": ((9228, 2048), 18),
    "gdn out_proj": ((2048, 3072), 18),
    "attn qkv": ((3072, 2048), 6),
    "attn proj": ((2048, 2048), 6),
    "fc1": ((11264, 2048), 24),
    "fc2": ((2048, 5632), 24),
}
STEPS = 5


def cuda_ms(fn, warmup: int, reps: int) -> float:
    """Median milliseconds over `reps` timed calls (CUDA events), after `warmup` untimed ones (autotune, JIT)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def torch_muon_ns():
    from torch.optim._muon import _zeropower_via_newtonschulz

    return lambda g: _zeropower_via_newtonschulz(g, SIMPLE, STEPS, 1e-7)


def emerging_ns(precision: str):
    try:
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
    except ImportError:
        return None

    def run(g32):
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            # its "simple" set is Keller's quintic (its "quintic" is a different schedule)
            return newton_schulz(g32, steps=STEPS, coefficient_type="simple")
        finally:
            torch.set_float32_matmul_precision(previous)

    return run


def method_table():
    """name -> (kind, callable, method for the FLOP count). kind 'matrix' runs per matrix, 'stack' per stack."""
    table = {"torch.optim.Muon NS": ("matrix", torch_muon_ns(), "torch_muon")}
    for method in ("standard", "gram", "auto"):
        table[f"ours {method}"] = ("stack", lambda G, m=method: orthogonalize(G, method=m), method)
    table["ours gram, torch backend"] = (
        "stack",
        lambda G: orthogonalize(G, method="gram", backend="torch"),
        "gram_torch",
    )
    table["ours auto, pointer loads (no TMA)"] = ("stack", lambda G: _without_tma(orthogonalize, G), "auto")
    table["ours auto, torch input pass"] = ("stack", lambda G: _with_torch_input_pass(orthogonalize, G), "auto")
    table["ours auto, restarts (2, 4)"] = (
        "stack",
        lambda G: orthogonalize(G, method="auto", restarts=(2, 4)),
        "auto24",
    )
    for precision, label in (("highest", "fp32 GEMMs"), ("medium", "bf16 mode")):
        fn = emerging_ns(precision)
        if fn is not None:
            table[f"emerging_optimizers NS ({label})"] = ("matrix32", fn, "emerging")
    return table


def _with_torch_input_pass(fn, G):
    """`fn(G)` with the NS input pass (normalize, cast, pad) on torch instead of the Triton kernel."""
    from megatron_muon.kernels.ops import TorchOps
    from megatron_muon.kernels.symmetric import TritonOps

    triton_pass = TritonOps.scaled_copy
    TritonOps.scaled_copy = staticmethod(TorchOps.scaled_copy)
    try:
        return fn(G)
    finally:
        TritonOps.scaled_copy = triton_pass


def _without_tma(fn, G):
    """`fn(G)` with the symmetric products loading A and B through pointers instead of TMA descriptors."""
    from megatron_muon.kernels import symmetric

    tma_ready = symmetric.tma_ready
    symmetric.tma_ready = lambda *tensors: False
    try:
        return fn(G)
    finally:
        symmetric.tma_ready = tma_ready


def executed_flops(method: str, m: int, n: int, count: int) -> int:
    if method in ("torch_muon", "emerging"):
        return flops(m, n, "standard", STEPS, count)
    if method == "gram_torch":
        return flops(m, n, "gram", STEPS, count)
    if method == "auto24":
        return flops(m, n, "auto", STEPS, count, restarts=(2, 4), symmetric=True)
    return flops(m, n, method, STEPS, count, symmetric=True)


def relative_error(fn, kind, G: torch.Tensor) -> float:
    """Against the fp64 iteration on one matrix of the shape (quality next to speed)."""
    x = G.float() if kind == "matrix32" else G
    out = fn(x) if kind != "stack" else fn(x.unsqueeze(0))[0]
    ref = newton_schulz_reference(G, STEPS, "simple")
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_reference_set(args) -> tuple[list[str], dict]:
    torch.manual_seed(0)
    stacks = {
        name: torch.randn(count, *shape, device="cuda", dtype=torch.bfloat16)
        for name, (shape, count) in REFERENCE_SHAPES.items()
    }
    stacks32 = {name: s.float() for name, s in stacks.items()}
    table = method_table()
    if args.methods:
        unknown = set(args.methods) - set(table)
        if unknown:
            raise SystemExit(f"unknown --methods {sorted(unknown)}; valid: {list(table)}")
        table = {k: v for k, v in table.items() if k == "torch.optim.Muon NS" or k in args.methods}
    rows, totals = [], {}
    for label, (kind, fn, method) in table.items():
        per_shape, all_fns = {}, []
        for name, ((m, n), count) in REFERENCE_SHAPES.items():
            src = stacks32[name] if kind == "matrix32" else stacks[name]
            if kind == "stack":
                call = lambda src=src: fn(src)  # noqa: E731
            else:
                call = lambda src=src: [fn(src[i]) for i in range(src.size(0))]  # noqa: E731
            all_fns.append(call)
            slow = label.startswith("emerging") and "fp32" in label
            ms = cuda_ms(call, 1 if slow else args.warmup, 2 if slow else args.reps)
            err = relative_error(fn, kind, stacks[name][0])
            per_shape[name] = (ms, err)
        whole = cuda_ms(lambda: [f() for f in all_fns], 1, 2 if label.startswith("emerging") else args.reps)
        totals[label] = whole
        per_shape["whole set"] = (whole, None)
        for name, (ms, err) in per_shape.items():
            if name == "whole set":
                work = sum(flops(m, n, "standard", STEPS, c) for (m, n), c in REFERENCE_SHAPES.values())
                done = sum(executed_flops(method, m, n, c) for (m, n), c in REFERENCE_SHAPES.values())
            else:
                (m, n), c = REFERENCE_SHAPES[name]
                work, done = flops(m, n, "standard", STEPS, c), executed_flops(method, m, n, c)
            rows.append((label, name, ms, work / ms / 1e9, done / ms / 1e9, err))
        print(f"{label:40s} whole set {whole:9.2f} ms", flush=True)
    base = totals["torch.optim.Muon NS"]
    lines = [
        "| method | shape (count) | ms | effective TFLOP/s | achieved TFLOP/s | rel. err vs fp64 | × torch Muon |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, name, ms, eff, ach, err in rows:
        count = f" ({REFERENCE_SHAPES[name][1]})" if name in REFERENCE_SHAPES else " (96)"
        ratio = f"{totals[label] / base:.3f}" if name == "whole set" else ""
        err_s = f"{err:.4f}" if err is not None else ""
        lines.append(f"| {label} | {name}{count} | {ms:.2f} | {eff:.0f} | {ach:.0f} | {err_s} | {ratio} |")
    return lines, totals


def run_auto_sweep(args) -> list[str]:
    """Standard vs Gram (Triton) over aspect ratios and stack sizes: the measurement behind the `auto` rule. The
    two methods alternate for three rounds (medians), since single timings of small stacks drift by 10-30%."""
    lines = ["| m × n | batch | standard ms | gram ms | gram / standard |", "|---|---:|---:|---:|---:|"]
    grid = [(2048, (1.0, 1.125, 1.25, 1.3125, 1.375, 1.5, 2.0, 2.75, 4.0), (6, 24)),
            (1536, (1.0, 1.125, 1.25, 1.3333, 1.5), (6, 36)),
            (1024, (1.5, 2.0, 2.25, 2.5, 2.75), (8, 32)),
            (4096, (1.0, 1.25, 1.5), (2,))]
    for m, aspects, batches in grid:
        for aspect, batch in itertools.product(aspects, batches):
            G = torch.randn(batch, m, round(m * aspect / 64) * 64, device="cuda", dtype=torch.bfloat16)
            times = {"standard": [], "gram": []}
            for _ in range(3):
                for method, runs in times.items():
                    runs.append(cuda_ms(lambda: orthogonalize(G, method=method), args.warmup, args.reps))
            t_std, t_gram = (statistics.median(runs) for runs in times.values())
            lines.append(f"| {m} × {G.size(-1)} | {batch} | {t_std:.3f} | {t_gram:.3f} | {t_gram / t_std:.3f} |")
            print(lines[-1], flush=True)
    return lines + [""] + kernel_lines(args)


def kernel_lines(args) -> list[str]:
    """The symmetric product kernels against cuBLAS computing the full product (TFLOP/s on the full-GEMM count)."""
    from megatron_muon.kernels import symmetric_ws
    from megatron_muon.kernels.ops import TorchOps
    from megatron_muon.kernels.symmetric import symmetric_matmul

    lines = [
        "| product | shape | cuBLAS ms | Triton, pointer loads ms | Triton, TMA ms | Triton, autotuned ms "
        "| Hopper warp-specialized ms | full-GEMM-equivalent TFLOP/s (autotuned / warp-specialized) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b, m, k, with_c in ((24, 2048, 11264, False), (18, 2048, 9216, False), (24, 2048, 2048, True),
                            (36, 1536, 2048, True)):
        X = torch.randn(b, m, k, device="cuda", dtype=torch.float16) / k**0.5
        C = TorchOps.sym_mm(X[..., :m], X[..., :m]) if with_c else None
        A = C if with_c else X
        t_torch = cuda_ms(lambda: TorchOps.sym_mm(A, A, C, 2.0, -1.0), args.warmup, args.reps)
        t_pointer = cuda_ms(lambda: symmetric_matmul(A, A, C, 2.0, -1.0, tma=False), args.warmup, args.reps)
        t_tma = cuda_ms(lambda: symmetric_matmul(A, A, C, 2.0, -1.0, tma=True), args.warmup, args.reps)
        t_auto = cuda_ms(lambda: symmetric_matmul(A, A, C, 2.0, -1.0), args.warmup, args.reps)
        t_ws = float("nan")
        if symmetric_ws.ready(A, A, C):
            t_ws = cuda_ms(lambda: symmetric_ws.symmetric_matmul_ws(A, A, C, 2.0, -1.0), args.warmup, args.reps)
        inner = A.size(-1)
        label = "b·A + c·A²" if with_c else "X·Xᵀ"
        work = 2 * b * m * m * inner / 1e9
        lines.append(f"| {label} | {b}×{m}×{inner} | {t_torch:.3f} | {t_pointer:.3f} | {t_tma:.3f} | {t_auto:.3f} "
                     f"| {t_ws:.3f} | {work / t_auto:.0f} / {work / t_ws:.0f} |")
        print(lines[-1], flush=True)
    return lines + ["", "NS input pass (X / ‖X‖_F, cast to fp16, long side padded to 64) alone:", "",
                    *input_pass_lines(args)]


def input_pass_lines(args) -> list[str]:
    """torch's division into the padded buffer against the Triton pass, for tall (transposed) and wide stacks."""
    from megatron_muon.kernels.ops import TorchOps
    from megatron_muon.kernels.scaled_copy import scaled_copy

    lines = ["| source | torch ms | Triton ms | Triton GB/s |", "|---|---:|---:|---:|"]
    for (rows, cols), count, dtype in (((11264, 2048), 24, torch.float32), ((9228, 2048), 18, torch.bfloat16),
                                       ((2048, 5632), 24, torch.bfloat16)):
        G = torch.randn(count, rows, cols, device="cuda", dtype=dtype)
        X = G.mT if rows > cols else G
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)
        out = torch.empty(*X.shape[:-1], -(-X.size(-1) // 64) * 64, device="cuda", dtype=torch.float16)
        t_torch = cuda_ms(lambda: TorchOps.scaled_copy(X, norm, out), args.warmup, args.reps)
        t_triton = cuda_ms(lambda: scaled_copy(X, norm, out), args.warmup, args.reps)
        moved = X.numel() * X.element_size() + out.numel() * out.element_size()
        label = f"{count}×{rows}×{cols} {str(dtype).removeprefix('torch.')}" + (" (transposed)" if X is not G else "")
        lines.append(f"| {label} | {t_torch:.3f} | {t_triton:.3f} | {moved / t_triton / 1e6:.0f} |")
        print(lines[-1], flush=True)
    return lines


def header(command: str) -> list[str]:
    import triton

    return [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- torch {torch.__version__}, Triton {triton.__version__}, CUDA {torch.version.cuda}",
        f"- command: `{command}`",
        f"- {STEPS} steps of Keller's quintic (\"simple\"), bf16 inputs (fp32 for emerging_optimizers), median of {{reps}} CUDA-event timings",
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown result for the reference set")
    parser.add_argument("--auto-sweep", type=Path, help="also write the standard-vs-Gram aspect sweep here")
    parser.add_argument("--kernels", action="store_true", help="append the Triton-vs-torch kernel tables")
    parser.add_argument("--methods", nargs="+",
                        help="method labels to time, one argument each (torch.optim.Muon NS always runs); default all")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/orthogonalize.py needs a CUDA GPU")
    command = "python " + shlex.join(sys.argv)
    head = [line.replace("{reps}", str(args.reps)) for line in header(command)]
    if args.auto_sweep:
        sweep = run_auto_sweep(args)
        title = "# Standard vs Gram NS by aspect ratio (auto rule)\n\n"
        args.auto_sweep.write_text(title + "\n".join(head + [""] + sweep) + "\n")
    lines, totals = run_reference_set(args)
    if args.kernels:
        lines += ["", "Symmetric products alone:", ""] + kernel_lines(args)
    base = totals["torch.optim.Muon NS"]
    summary = [f"- whole set, {name}: {ms:.2f} ms = {ms / base:.3f}× torch.optim.Muon" for name, ms in totals.items()]
    title = "# Orthogonalization of the reference set (96 matrices)\n\n"
    body = title + "\n".join(head + [""] + summary + [""] + lines)
    args.out.write_text(body + "\n")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
