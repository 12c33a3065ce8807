"""GDN's chunk-state recurrences cut into segments run side by side as batch rows (`ops/state_segments.py`) against
the same kernel walking the whole sequence, at the hybrid-1.5B's heads (6, key 256, value 512) and Qwen3-Next's
(16 key / 32 value heads of 128), 16k tokens, bf16: the exact form (pass 1 and the transitions on the same kernel,
a scan, pass 3) on the Gluon and Triton kernels, and the windowed form (pass 1 only over the windows whose decay
reaches 2^-24, transitions only for whole segments) on the Triton kernels. w and u are the WY terms of unit-norm
keys and sigmoid β (the dropped weight's bound holds); each row gives the largest difference from the sequential
kernel's states and, for windows, the mean window and the share of whole segments.

    python benchmarks/state_segments.py --out benchmarks/results/state_segments.md   # an sm90 GPU with FLA
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_muon from this checkout

from bench_env import emit_markdown, gdn_chunk_inputs, gpu_result_header  # noqa: E402

SHAPES = {"hybrid-1.5b": dict(heads=6, value_heads=6, key_dim=256, value_dim=512),
          "qwen3-next": dict(heads=16, value_heads=32, key_dim=128, value_dim=128)}
SEGMENTS = (1, 2, 4, 8)


def wy_inputs(heads: int, value_heads: int, key_dim: int, value_dim: int, seq_len: int):
    """q, k, w, u, do, dv, g as the op hands them to the state kernels, w and u the WY terms of k, v, β and g."""
    from megatron_muon.ops.reference import chunk_wy_reference

    q, k, _, _, do, dv, g = gdn_chunk_inputs(1, seq_len, heads, key_dim, value_dim, value_heads=value_heads)
    v = torch.randn(1, seq_len, value_heads, value_dim, device="cuda")
    beta = torch.randn(1, seq_len, value_heads, device="cuda").sigmoid()
    w, u = chunk_wy_reference(k.float(), v, g, beta)
    return q, k, w.bfloat16(), u.bfloat16(), do, dv, g


def calls(q, k, w, u, do, dv, g, module, segments: int, windowed: bool = False):
    """(forward call, backward call) on `module`'s kernels; 1 segment: the sequential kernel itself."""
    from megatron_muon.ops import state_segments

    scale = k.shape[-1] ** -0.5

    def forward(k, w, u, g, initial_state):
        return module.chunk_fwd_h(k, w, u, g, initial_state, True)

    def backward(q, k, w, g, do, dv, scale, dht):
        return module.chunk_dhu(q, k, w, g, do, dv, scale, dht, True)

    if segments == 1:
        return (lambda: forward(k, w, u, g, None)), (lambda: backward(q, k, w, g, do, dv, scale, None))
    if windowed:
        return (lambda: state_segments.windowed_segments_forward(module, k, w, u, g, segments=segments),
                lambda: state_segments.windowed_segments_backward(module, q, k, w, g, do, dv, scale,
                                                                  segments=segments))
    return (lambda: state_segments.batched_segments_forward(forward, k, w, u, g, segments=segments),
            lambda: state_segments.batched_segments_backward(backward, q, k, w, g, do, dv, scale, segments=segments))


def window_summary(g, segments: int, reverse: bool) -> str:
    from megatron_muon.ops.state_segments import plan_segments

    plan = plan_segments(g, g.shape[1] // (segments * 64), reverse=reverse)
    return f"window {plan.window.float().mean().item():.1f} chunks, {plan.exact.float().mean().item():.0%} whole"


def profile_lines(shape: str, kernel: str, windowed: bool, pair, times) -> list[str]:
    """Kernels and host ops of one form's forward and backward at 4 segments: whether its time is the GPU's."""
    from kernel_profile import host_markdown, kernel_table, profile_markdown

    lines = []
    for i, recurrence in enumerate(("forward", "backward")):
        kernels, host = kernel_table(pair[i], "cuda")
        name = f"{shape}, {kernel} {'windowed' if windowed else 'exact'} {recurrence}, 4 segments"
        lines += profile_markdown(name, kernels, statistics.median(times[(4, i)]), top=8, unit="call")
        lines += host_markdown(host, None, top=6)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also profile each form at 4 segments: its kernels and its host ops per call")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("state_segments.py times CUDA kernels; run it on an sm90 GPU with FLA installed")
    from triton.testing import do_bench

    from megatron_muon.ops import state_tma, state_ws

    lines = gpu_result_header(
        "GDN chunk-state recurrences in segments side by side (exact form) against the sequential kernels",
        "state_segments.py", sys.argv[1:], f"batch 1, {args.seq_len} tokens, chunk 64, states value-first; "
        f"{args.rounds} alternated rounds of triton.testing.do_bench, median (min-max) ms")
    lines += ["", "| heads | kernel | form | recurrence | segments | ms | speed-up over sequential | "
              "largest difference in the states | windows |",
              "|---|---|---|---|---:|---:|---:|---:|---|"]
    profiles = []
    forms = (("Gluon", state_ws, False), ("Triton", state_tma, False), ("Triton", state_tma, True))
    for shape, sizes in SHAPES.items():
        inputs = wy_inputs(sizes["heads"], sizes["value_heads"], sizes["key_dim"], sizes["value_dim"], args.seq_len)
        for kernel, module, windowed in forms:
            table = {s: calls(*inputs, module, s, windowed) for s in SEGMENTS}
            outputs = {s: (pair[0](), pair[1]()) for s, pair in table.items()}
            times = {(s, i): [] for s in SEGMENTS for i in range(2)}
            for _ in range(args.rounds):
                for s, pair in table.items():
                    for i, call in enumerate(pair):
                        times[(s, i)].append(do_bench(call, warmup=20, rep=200))
            for i, recurrence in enumerate(("forward", "backward")):
                sequential = statistics.median(times[(1, i)])
                for s in SEGMENTS:
                    spread = times[(s, i)]
                    states, expected = outputs[s][i][0], outputs[1][i][0]
                    difference = (states.float() - expected.float()).abs().max().item()
                    windows = window_summary(inputs[-1], s, i == 1) if windowed and s > 1 else ""
                    lines.append(f"| {shape} | {kernel} | {'windowed' if windowed else 'exact'} | {recurrence} | "
                                 f"{s} | {statistics.median(spread):.3f} ({min(spread):.3f}-{max(spread):.3f}) | "
                                 f"{sequential / statistics.median(spread):.2f} | {difference:.3g} | {windows} |")
            if args.profile:
                profiles += profile_lines(shape, kernel, windowed, table[4], times)
    emit_markdown(lines + profiles, args.out)


if __name__ == "__main__":
    main()
