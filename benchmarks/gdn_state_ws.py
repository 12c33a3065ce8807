"""GDN's chunk-state recurrences at the hybrid-1.5B layer shape (16k tokens, 6 heads, key 256, value 512): the
warp-specialized Gluon kernels (`megatron_muon.ops.state_ws`) against our Triton kernels (`state_tma`, default
tiles) and FLA's autotuned kernels, in the same process, alternated over rounds (medians of do_bench per round);
each row gives the largest difference from the Triton kernel's outputs. `--block-v` adds the Gluon kernels at other
value blocks (is one chunk's latency fixed, whatever the block's width?); `--sizes qwen3-next` takes Qwen3-Next's
heads (16 q/k and 32 value heads of 128) instead.

    python benchmarks/gdn_state_ws.py --out benchmarks/results/gdn_state_ws.md   # an sm90 GPU with FLA
    python benchmarks/gdn_state_ws.py --sizes qwen3-next --block-v 16,32,64,128
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_muon from this checkout

from bench_env import emit_markdown, gdn_chunk_inputs, gpu_result_header  # noqa: E402

# (batch, tokens, q/k heads, value heads, key dim, value dim)
SIZES = {"hybrid": (1, 16384, 6, 6, 256, 512), "qwen3-next": (1, 16384, 16, 32, 128, 128)}


def calls(q, k, w, u, do, dv, g, block_vs=()):
    """{(recurrence, kernel): call} for the forward states and the backward state gradients; the Gluon kernels
    also at each value block of `block_vs` other than the default."""
    from fla.ops.common import chunk_delta_h as fla

    from megatron_muon.ops import state_tma, state_ws

    scale = k.shape[-1] ** -0.5
    others = [b for b in block_vs if b != state_ws.BLOCK_V]
    return {
        ("forward", "FLA"): lambda: fla.chunk_gated_delta_rule_fwd_h(
            k=k, w=w, u=u, g=g, initial_state=None, output_final_state=False, chunk_size=64, state_v_first=True),
        ("forward", "Triton"): lambda: state_tma.chunk_fwd_h(k, w, u, g),
        ("forward", "Gluon"): lambda: state_ws.chunk_fwd_h(k, w, u, g),
        ("backward", "FLA"): lambda: fla.chunk_gated_delta_rule_bwd_dhu(
            q=q, k=k, w=w, g=g, h0=None, dht=None, do=do, dv=dv, scale=scale, state_v_first=True, chunk_size=64),
        ("backward", "Triton"): lambda: state_tma.chunk_dhu(q, k, w, g, do, dv, scale),
        ("backward", "Gluon"): lambda: state_ws.chunk_dhu(q, k, w, g, do, dv, scale),
        **{("forward", f"Gluon, value block {b}"): functools.partial(state_ws.chunk_fwd_h, k, w, u, g, block_v=b)
           for b in others},
        **{("backward", f"Gluon, value block {b}"): functools.partial(state_ws.chunk_dhu, q, k, w, g, do, dv, scale,
                                                                       block_v=b) for b in others},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", choices=tuple(SIZES), default="hybrid")
    parser.add_argument("--block-v", default="", help="comma list of value blocks for extra Gluon rows (16,64,...)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gdn_state_ws.py times CUDA kernels; run it on an sm90 GPU with FLA installed")
    from triton.testing import do_bench

    B, T, H, HV, K, V = SIZES[args.sizes]
    block_vs = [int(b) for b in args.block_v.split(",") if b]
    table = calls(*gdn_chunk_inputs(B, T, H, K, V, value_heads=HV), block_vs=block_vs)
    outputs = {key: call() for key, call in table.items()}
    times = {key: [] for key in table}
    for _ in range(args.rounds):
        for key, call in table.items():
            times[key].append(do_bench(call, warmup=50, rep=300))
    lines = gpu_result_header(
        "GDN chunk-state recurrences: warp-specialized Gluon kernels against Triton and FLA", "gdn_state_ws.py",
        sys.argv[1:], f"shape: batch {B}, {T} tokens, {H} q/k heads, {HV} value heads, key {K}, value {V}, chunk 64, "
        f"states value-first; {args.rounds} alternated rounds of triton.testing.do_bench, median (min-max) ms")
    lines += ["", "| recurrence | kernel | ms | × Triton | × FLA | largest difference from Triton |",
              "|---|---|---:|---:|---:|---:|"]
    for recurrence in ("forward", "backward"):
        median = {kernel: statistics.median(spread) for (rec, kernel), spread in times.items() if rec == recurrence}
        for kernel, ms in median.items():
            spread = times[(recurrence, kernel)]
            difference = max((a.float() - b.float()).abs().max().item()
                             for a, b in zip(outputs[(recurrence, kernel)], outputs[(recurrence, "Triton")])
                             if a is not None and b is not None)
            lines.append(f"| {recurrence} | {kernel} | {ms:.3f} ({min(spread):.3f}-{max(spread):.3f}) | "
                         f"{ms / median['Triton']:.3f} | {ms / median['FLA']:.3f} | {difference:.3g} |")
    emit_markdown(lines, args.out)


if __name__ == "__main__":
    main()
