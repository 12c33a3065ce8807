"""The GDN layer's causal depthwise conv backward at the hybrid-1.5B's shape: ours (`ops/conv_triton.py`) against
FLA's Triton kernel (what the op ran before) in one run on one GPU, and ours per tile; FLA's forward for scale.

The input is what the layer passes: q|k|v channels (6144) sliced from the in_proj output padded to 9280 columns,
bf16, width-4 taps, no bias, no activation (SiLU is fused into the ops after the conv).

    python benchmarks/causal_conv.py --out benchmarks/results/causal_conv.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_env import emit_markdown, gpu_result_header  # benchmarks/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_muon.ops import conv_triton, fla_backend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=200, help="milliseconds of repetitions per timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("causal_conv.py times CUDA kernels; run it on a GPU machine")
    from triton.testing import do_bench

    seq, channels, width = args.seq, 6144, 4
    torch.manual_seed(0)
    x = torch.randn(1, seq, 9280, device="cuda", dtype=torch.bfloat16)[..., :channels]
    weight = torch.randn(channels, width, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(1, seq, channels, device="cuda", dtype=torch.bfloat16)
    moved_gb = 3 * x.numel() * 2 / 1e9
    fla_ms = do_bench(lambda: fla_backend.conv_backward(x, weight, None, None, None, dy), rep=args.reps)
    ours_ms = do_bench(lambda: conv_triton.conv_backward(x, weight, None, dy), rep=args.reps)
    forward_ms = do_bench(lambda: fla_backend.conv_forward(x, weight, None, None, None), rep=args.reps)
    rows = [
        "| backward | FLA ms | ours ms | ours / FLA | ours TB/s (x, dy, dx once) |", "|---|---:|---:|---:|---:|",
        f"| dx, dweight | {fla_ms:.4f} | {ours_ms:.4f} | {ours_ms / fla_ms:.3f} | {moved_gb / ours_ms:.2f} |",
        "", f"FLA's forward (kept): {forward_ms:.4f} ms.",
    ]
    tiles = ["| backward tile (BT × BD, warps) | ms |", "|---|---:|"]
    dx = torch.empty_like(dy)
    parts = torch.empty(-(-seq // 32), channels, width, device="cuda")
    for bt, bd in ((32, 64), (32, 128), (64, 64), (64, 128), (128, 64), (128, 128)):
        for warps in (1, 2, 4, 8):
            def run(bt=bt, bd=bd, warps=warps):
                conv_triton._conv_bwd_kernel[(-(-channels // bd), -(-seq // bt), 1)](
                    x, dy, weight, dx, parts, None, seq, channels, x.stride(0), x.stride(1), dy.stride(0),
                    dy.stride(1), dx.stride(0), dx.stride(1), W=width, HAS_BIAS=False, BT=bt, BD=bd, num_warps=warps)
            tiles.append(f"| {bt} × {bd}, {warps} | {do_bench(run, rep=args.reps):.4f} |")
    lines = gpu_result_header(
        "Causal depthwise conv (GDN q|k|v, hybrid-1.5B shape)", "causal_conv.py", sys.argv[1:],
        f"x [1, {seq}, {channels}] bf16 (a slice of [1, {seq}, 9280]), weight [{channels}, {width}]; "
        "triton.testing.do_bench medians (CPU launch time included); the backward includes the dweight reduction",
    ) + [
        f"- tile chosen by the autotuner: {conv_triton._conv_bwd_tuned.best_config}", "",
        *rows, "", "Backward kernel alone (no dweight reduction), per tile:", "", *tiles,
    ]
    emit_markdown(lines, args.out)


if __name__ == "__main__":
    main()
