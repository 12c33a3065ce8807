"""Gradient clipping's in-place scale over the hybrid-1.5B's fp32 gradients: ours (`optimizer/clip_scale.py`)
against torch's foreach multiply (what megatron runs without Transformer Engine), both in one run on one GPU.

The gradients are views into one buffer, laid out as megatron's DDP does (the reference shapes, with gaps). Factor 1
is an unclipped step (ours moves nothing), 0.999 a clipped one.

    python benchmarks/clip_scale.py --out benchmarks/results/clip_scale.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_env import emit_markdown, gpu_result_header, views_of_one_buffer  # benchmarks/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_muon.optimizer.clip_scale import scale_in_place  # noqa: E402

GAP = 64


def timed_ms(fn, reps: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, rep=reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--elements", type=int, default=1_478_000_000, help="fp32 gradient elements (1.48B)")
    parser.add_argument("--reps", type=int, default=200, help="milliseconds of repetitions per timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("clip_scale.py times CUDA kernels; run it on a GPU machine")
    views = views_of_one_buffer(args.elements, "cuda", gap=GAP)
    rows = ["| factor | torch `_foreach_mul_` ms | ours ms | ours / torch |", "|---:|---:|---:|---:|"]
    for factor in (1.0, 0.999):
        scale = torch.tensor([factor], device="cuda")
        torch_ms = timed_ms(lambda: torch._foreach_mul_(views, scale.reshape(())), args.reps)
        ours_ms = timed_ms(lambda: scale_in_place(views, scale), args.reps)
        rows.append(f"| {factor} | {torch_ms:.3f} | {ours_ms:.3f} | {ours_ms / torch_ms:.3f} |")
    lines = gpu_result_header(
        "Gradient clipping's in-place scale (hybrid-1.5B gradients)", "clip_scale.py", sys.argv[1:],
        f"{len(views)} fp32 views, {sum(v.numel() for v in views) / 1e9:.3f}B elements in one buffer; "
        "triton.testing.do_bench medians (CPU launch time included)",
    ) + ["", *rows]
    emit_markdown(lines, args.out)


if __name__ == "__main__":
    main()
