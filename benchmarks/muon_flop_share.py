"""What Newton–Schulz adds to a data-parallel training step, in FLOPs: a bound beside the timed simulations.

Builds each recipe's model on the meta device (no memory, no GPU), splits its Muon matrices as the owner engine does
(fused QKV per query group and GDN in_proj per section, megatron's tags), and counts the NS FLOPs of the `auto`
method (`kernels/flops.py`) against the model's training FLOPs (`metrics/flops.py`). With owner sharding each matrix
is orthogonalized once, on one rank: the busiest rank's NS work is the longest processing time of the pieces over W
ranks (LPT), and its share of the rank's step is that over the rank's training FLOPs for its sequences. The share
bounds the step ratio against AdamW when NS is not hidden and runs at the model's FLOP rate; the last columns give
the sequences per rank at which it falls to 2% and 3%. `--split-heads` adds each recipe's rows with the fused
projections orthogonalized per head (`muon_split_heads`), a different optimizer whose FLOPs this counts, not its
training quality.

    python benchmarks/muon_flop_share.py --split-heads --out benchmarks/results/muon_flop_share.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import heapq
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_muon.kernels.flops import flops  # noqa: E402
from megatron_muon.metrics.flops import training_flops_per_token  # noqa: E402

H200_DENSE_FP16_TFLOPS = 989.0  # NVIDIA's spec sheet, without sparsity


def muon_piece_shapes(recipe_name: str, split_heads: bool = False) -> collections.Counter:
    """(rows, cols) -> count of the matrices the owner engine orthogonalizes for the recipe (tp = pp = 1)."""
    from megatron_muon.megatron.owner_layout import tag_fused_projections
    from megatron_muon.optimizer.routing import (is_muon_param, matrix_layout, piece_matrix_count, piece_matrix_shape,
                                                 piece_views)
    from megatron_muon.training.model import build_model, transformer_config
    from megatron_muon.training.recipes import load_recipe

    recipe = load_recipe(recipe_name)
    config = transformer_config(recipe, on_gpu=False)
    config.use_cpu_initialization, config.perform_initialization = True, False
    with torch.device("meta"):
        model = build_model(recipe, config)
    tag_fused_projections([model])
    shapes: collections.Counter = collections.Counter()
    for name, param in model.named_parameters():
        if is_muon_param(param, name):
            layout = matrix_layout(param, split_heads=split_heads, name=name)
            for index, piece in enumerate(piece_views(param, layout)):
                heads = layout.piece_head_rows(index)  # one matrix per expert, or per expert and head
                shapes[piece_matrix_shape(piece, heads)] += piece_matrix_count(piece, heads)
    return shapes


def busiest_rank_flops(piece_flops: list[int], world: int) -> int:
    """Longest processing time first over `world` ranks: the busiest rank's total (each piece whole on one rank)."""
    loads = [0] * world
    heapq.heapify(loads)
    for cost in sorted(piece_flops, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + cost)
    return max(loads)


def rows_for(recipe_name: str, worlds, sequences, split_heads: bool = False) -> list[dict]:
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import model_shape

    recipe = load_recipe(recipe_name)
    shapes = muon_piece_shapes(recipe_name, split_heads)
    piece_flops = [flops(m, n, "auto") for (m, n), count in shapes.items() for _ in range(count)]
    per_sequence = training_flops_per_token(model_shape(recipe)) * recipe.model.seq_length
    rows = []
    for world in worlds:
        busiest = busiest_rank_flops(piece_flops, world)
        for count in sequences:
            rows.append(dict(recipe=recipe_name + (" (per head)" if split_heads else ""), world=world,
                             sequences=count, pieces=len(piece_flops),
                             ns_total_tflop=sum(piece_flops) / 1e12, ns_rank_tflop=busiest / 1e12,
                             train_rank_tflop=per_sequence * count / 1e12, share=busiest / (per_sequence * count),
                             ns_ms_at_peak=busiest / (H200_DENSE_FP16_TFLOPS * 1e9),
                             for_2pct=busiest / (0.02 * per_sequence), for_3pct=busiest / (0.03 * per_sequence)))
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = ["# Newton–Schulz FLOPs against the training step's, per data-parallel rank", "",
             f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; counted on the CPU (no timing)",
             f"- command: `{command}`",
             "- 5 steps of Keller's schedule, `auto` method (Gram NS from aspect 1.25), full-GEMM FLOPs; training "
             "FLOPs per token from `metrics/flops.py` (forward + backward, causal attention, GDN chunks); NS ms at "
             f"the H200's dense fp16 peak ({H200_DENSE_FP16_TFLOPS:.0f} TFLOP/s) is a floor, not a measurement", "",
             "| recipe | W | sequences per rank | NS pieces | NS TFLOP, all | NS TFLOP, busiest rank | training TFLOP "
             "per rank | NS share | NS ms at peak | sequences per rank for ≤ 2% | for ≤ 3% |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['world']} | {r['sequences']} | {r['pieces']} | {r['ns_total_tflop']:.1f} "
                     f"| {r['ns_rank_tflop']:.2f} | {r['train_rank_tflop']:.1f} | {r['share']:.1%} "
                     f"| {r['ns_ms_at_peak']:.1f} | {r['for_2pct']:.1f} | {r['for_3pct']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["hybrid-1.5b-h200", "gpt-7b-h200"])
    parser.add_argument("--world", nargs="+", type=int, default=[4, 8, 64, 256])
    parser.add_argument("--sequences", nargs="+", type=int, default=[1, 8], help="sequences per rank per step")
    parser.add_argument("--split-heads", action="store_true",
                        help="also count each recipe with QKV / GDN in_proj orthogonalized per head")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if any(w < 1 for w in args.world) or any(s < 1 for s in args.sequences):
        raise ValueError("--world and --sequences take positive integers")

    from megatron_muon._cpu import enable_cpu_mode
    from megatron_muon.testing.parallel import destroy_model_parallel, init_model_parallel
    from megatron_muon.testing.pool import free_port

    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
    enable_cpu_mode()
    init_model_parallel(1, 1)
    try:
        rows = [row for name in args.recipes for heads in ((False, True) if args.split_heads else (False,))
                for row in rows_for(name, args.world, args.sequences, heads)]
    finally:
        destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()
    command = "python benchmarks/muon_flop_share.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, command)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
