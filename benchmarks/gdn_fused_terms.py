"""GDN's intra-chunk output terms inside the state recurrences against beside them, kernel by kernel, at the two
reference shapes (16k tokens): the forward (state kernel, then FLA's `chunk_fwd_o`; against the fused forward in
Triton and, for K <= 128, in Gluon) and the backward's state gradients (FLA's `chunk_bwd_dv_local`, then the state
gradient kernel; against that kernel computing the local dv itself), Gluon and Triton, in the same process,
alternated over rounds (medians of do_bench per round); each row gives its outputs' largest relative difference from
the split Gluon row's.

    python benchmarks/gdn_fused_terms.py --out benchmarks/results/gdn_fused_terms.md   # an sm90 GPU with FLA
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_muon from this checkout

from bench_env import emit_markdown, gdn_chunk_inputs, gpu_result_header  # noqa: E402

# (key heads, value heads, key dim, value dim)
SHAPES = {"hybrid-1.5b": (6, 6, 256, 512), "qwen3-next": (16, 32, 128, 128)}
SEQ_LEN = 16384
SPLIT = "split, Gluon states"


def calls(q, k, w, u, do, dv, g) -> dict:
    """{(pass, variant): call returning its outputs} for the forward and the backward's state gradients."""
    from fla.ops.common.chunk_o import chunk_bwd_dv_local, chunk_fwd_o

    from megatron_muon.ops import chunk_fwd_fused, chunk_fwd_fused_ws, state_tma, state_ws

    scale = q.shape[-1] ** -0.5

    def split_forward(module):
        def run():
            h, v_new, _ = module.chunk_fwd_h(k, w, u, g)
            return chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, state_v_first=True, chunk_size=64), h, v_new
        return run

    def split_backward(module):
        def run():
            local = chunk_bwd_dv_local(q=q, k=k, g=g, do=do, scale=scale, chunk_size=64)
            return module.chunk_dhu(q, k, w, g, do, local, scale)
        return run

    def fused_forward(module):
        def run():
            o, _, h, v_new = module.chunk_fwd_fused(q, k, w, u, g, scale, store_states=True)
            return o, h, v_new
        return run

    table = {
        ("forward", SPLIT): split_forward(state_ws),
        ("forward", "split, Triton states"): split_forward(state_tma),
        ("forward", "fused, Triton"): fused_forward(chunk_fwd_fused),
        ("backward", SPLIT): split_backward(state_ws),
        ("backward", "split, Triton states"): split_backward(state_tma),
        ("backward", "local dv, Gluon"): lambda: state_ws.chunk_dhu(q, k, w, g, do, None, scale),
        ("backward", "local dv, Triton"): lambda: state_tma.chunk_dhu(q, k, w, g, do, None, scale),
    }
    if q.shape[-1] <= chunk_fwd_fused_ws.MAX_KEY_DIM:
        table[("forward", "fused, Gluon")] = fused_forward(chunk_fwd_fused_ws)
    return table


def largest_difference(got, want) -> float:
    return max(((a.float() - b.float()).norm() / b.float().norm()).item()
               for a, b in zip(got, want) if a is not None and b is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    if unknown := [size for size in sizes if size not in SHAPES]:
        raise SystemExit(f"--sizes {','.join(unknown)}: choose from {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("gdn_fused_terms.py times CUDA kernels; run it on an sm90 GPU with FLA installed")
    from triton.testing import do_bench

    lines = gpu_result_header(
        "GDN output terms inside the state recurrences against beside them", "gdn_fused_terms.py", sys.argv[1:],
        f"{SEQ_LEN} tokens, batch 1, chunk 64, states value-first, states kept (h and v_new written) in the forward; "
        f"{args.rounds} alternated rounds of triton.testing.do_bench, median (min-max) ms; 'difference': the largest "
        f"relative (Frobenius) difference of any output from the '{SPLIT}' row's")
    lines += ["", "| shape | pass | variant | ms | × split (Gluon) | difference |", "|---|---|---|---:|---:|---:|"]
    for size in sizes:
        key_heads, heads, key_dim, value_dim = SHAPES[size]
        table = calls(*gdn_chunk_inputs(1, SEQ_LEN, key_heads, key_dim, value_dim, value_heads=heads))
        outputs = {key: call() for key, call in table.items()}
        times = {key: [] for key in table}
        for _ in range(args.rounds):
            for key, call in table.items():
                times[key].append(do_bench(call, warmup=50, rep=300))
        for (stage, variant), spread in times.items():
            ms, split = statistics.median(spread), statistics.median(times[(stage, SPLIT)])
            difference = largest_difference(outputs[(stage, variant)], outputs[(stage, SPLIT)])
            lines.append(f"| {size} | {stage} | {variant} | {ms:.3f} ({min(spread):.3f}-{max(spread):.3f}) | "
                         f"{ms / split:.3f} | {difference:.2e} |")
        del table, outputs
    emit_markdown(lines, args.out)


if __name__ == "__main__":
    main()
