"""Newton–Schulz schedules side by side: how far down the spectrum each one orthogonalizes, how far its result is
from the exact polar factor on ill-conditioned inputs (fp64 and bf16), and what it costs in FLOPs against the
5-step default. Every megatron-core name at 4 and 5 steps; deterministic, runs on CPU.

  python benchmarks/ns_schedules.py --out benchmarks/results/ns_schedules.md

The numbers are properties of the polynomials and of bf16 rounding (CPU bf16 GEMMs accumulate in fp32 as cuBLAS
does, but tile orders differ): they say which short schedules are candidates, not how they train; that needs the
loss curves of a training run per schedule on the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import REFERENCE_SHAPES, package_versions, write_table_and_rows  # noqa: E402

from megatron_muon.kernels import orthogonalize  # noqa: E402
from megatron_muon.kernels.coefficients import COEFFICIENT_SETS  # noqa: E402
from megatron_muon.kernels.flops import flops  # noqa: E402
from megatron_muon.kernels.reference import newton_schulz_reference, polar_factor_svd, singular_value_map  # noqa: E402

STEPS = (4, 5)


def reach(name: str, steps: int) -> float:
    """The smallest normalized singular value the schedule lifts to at least 0.5 (lower reaches deeper)."""
    sigma = torch.logspace(-6, 0, 60001, dtype=torch.float64)
    lifted = singular_value_map(sigma, steps, name) >= 0.5
    return float(sigma[lifted.nonzero()[0, 0]]) if lifted.any() else float("nan")


def band(name: str, steps: int, low: float = 1e-2) -> tuple[float, float]:
    """Where the schedule sends the normalized singular values in [low, 1]: (min, max) of the map."""
    mapped = singular_value_map(torch.logspace(torch.log10(torch.tensor(low)).item(), 0, 20001,
                                               dtype=torch.float64), steps, name)
    return float(mapped.min()), float(mapped.max())


def ill_conditioned(m: int, n: int, seed: int, decades: float = 4.0) -> torch.Tensor:
    """U·diag(σ)·Vᵀ with σ log-spaced over `decades` decades (a gradient-like spread), fp64."""
    k = min(m, n)
    generator = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=generator, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=generator, dtype=torch.float64))
    return (U * torch.logspace(0, -decades, k, dtype=torch.float64)) @ V.T


def polar_gap(Y: torch.Tensor, polar: torch.Tensor) -> float:
    """‖Y − U·Vᵀ‖_F / ‖U·Vᵀ‖_F: the distance from the exact polar factor."""
    return float(torch.linalg.matrix_norm(Y.double() - polar) / torch.linalg.matrix_norm(polar))


def row(name: str, steps: int, inputs: list[torch.Tensor], polars: list[torch.Tensor]) -> dict:
    lo, hi = band(name, steps)
    fp64 = [polar_gap(newton_schulz_reference(G, steps, name), P) for G, P in zip(inputs, polars)]
    bf16 = [polar_gap(orthogonalize(G.to(torch.bfloat16), steps=steps, coefficients=name, backend="torch"), P)
            for G, P in zip(inputs, polars)]
    cost = sum(flops(m, n, "auto", steps, coefficients=name) for m, n in REFERENCE_SHAPES)
    base = sum(flops(m, n, "auto", 5, coefficients="simple") for m, n in REFERENCE_SHAPES)
    return {"name": name, "steps": steps, "reach": reach(name, steps), "band": [lo, hi],
            "polar_gap_fp64": max(fp64), "polar_gap_bf16": max(bf16), "flops_vs_simple5": cost / base}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ns_schedules.md"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    inputs = [ill_conditioned(256, 1024, 1), ill_conditioned(512, 512, 2), ill_conditioned(1024, 256, 3, 6.0)]
    polars = [polar_factor_svd(G) for G in inputs]
    rows = [row(name, steps, inputs, polars) for name in sorted(COEFFICIENT_SETS) for steps in STEPS]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": package_versions(),
            "command": "python " + " ".join(sys.argv)}
    lines = ["# Newton–Schulz schedules: reach, distance from the polar factor, cost", "",
             f"- {meta['date']}; CPU; " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- command: `{meta['command']}`",
             "- reach: the smallest normalized singular value mapped to ≥ 0.5; band: min and max of the map over "
             "[0.01, 1]; polar gap: worst ‖Y − U·Vᵀ‖_F / ‖U·Vᵀ‖_F over three ill-conditioned inputs (256×1024 and "
             "512×512 with σ over 4 decades, 1024×256 over 6), fp64 iteration and ours in bf16 (torch backend, "
             "method auto); FLOPs: the hybrid-1.5B's matrix shapes, method auto, relative to 5 steps of `simple`", "",
             "| schedule | steps | reach | band on [0.01, 1] | polar gap fp64 | polar gap bf16 | FLOPs vs simple×5 |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['steps']} | {r['reach']:.2e} | {r['band'][0]:.3f} – {r['band'][1]:.3f} | "
                     f"{r['polar_gap_fp64']:.3f} | {r['polar_gap_bf16']:.3f} | {r['flops_vs_simple5']:.2f} |")
    write_table_and_rows(args.out, lines, meta, rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
