"""megatron's mixed-precision AdamW step over the hybrid-1.5B's parameters: the clip multiply, torch's fused AdamW
and the master-to-model copy as megatron runs them (with our clip kernel and foreach copy), against the one pass
of `optimizer/one_pass_adamw.py` (installed by `megatron/master_adamw.py`), in one run on one GPU.

fp32 master weights (one tensor each, the reference shapes), fp32 gradients as views of one buffer (megatron's
DDP), bf16 model parameters. Factor 1 is an unclipped step, 0.999 a clipped one.

    python benchmarks/master_adamw.py --sweep --out benchmarks/results/master_adamw.md

`--sweep` also times the pass at other tiles (elements per program, warps): how `one_pass_adamw.BLOCK` was chosen.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_env import emit_markdown, gpu_result_header, views_of_one_buffer  # benchmarks/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_muon.optimizer.clip_scale import scale_in_place  # noqa: E402
from megatron_muon.optimizer import one_pass_adamw  # noqa: E402
from megatron_muon.optimizer.one_pass_adamw import OnePassAdamW  # noqa: E402

BYTES_PER_ELEMENT = 4 * 7 + 2
SWEEP_TILES = ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16))

def parameters(total: int, gap: int = 0):
    """(fp32 masters, fp32 gradient views of one buffer `gap` elements apart, bf16 model copies) of about `total`
    elements."""
    grads = views_of_one_buffer(total, "cuda", gap=gap, scale=1e-3)
    masters = [torch.randn(grad.shape, device="cuda") * 0.02 for grad in grads]
    return masters, grads, [m.bfloat16() for m in masters]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--elements", type=int, default=1_478_000_000, help="parameters (1.48B)")
    parser.add_argument("--reps", type=int, default=300, help="milliseconds of repetitions per timing")
    parser.add_argument("--sweep", action="store_true", help="also time the pass at other tiles")
    parser.add_argument("--grad-gap", type=int, default=0,
                        help="elements between gradient views (2: every other one 8-byte aligned, as DDP's views "
                             "after a parameter of 6 elements)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("master_adamw.py times CUDA kernels; run it on a GPU machine")
    from triton.testing import do_bench

    masters, grads, models = parameters(args.elements, args.grad_gap)
    for master, grad in zip(masters, grads):
        master.grad = grad
    options = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW(masters, fused=True, **options)
    one_pass = OnePassAdamW(torch.optim.AdamW(masters, **options), {id(m): c for m, c in zip(masters, models)})

    def three_passes(factor):
        if not scale_in_place(grads, factor):
            torch._foreach_mul_(grads, factor.reshape(()))
        torch_adamw.step()
        torch._foreach_copy_(models, masters)

    def ours(factor):
        one_pass.pending = factor
        assert one_pass.run()

    rows = ["| factor | clip + fused AdamW + copy ms | one pass ms | one pass / three |", "|---:|---:|---:|---:|"]
    for value in (1.0, 0.999):
        factor = torch.tensor([value], device="cuda")
        three_ms = do_bench(lambda: three_passes(factor), rep=args.reps)
        ours_ms = do_bench(lambda: ours(factor), rep=args.reps)
        rows.append(f"| {value} | {three_ms:.3f} | {ours_ms:.3f} | {ours_ms / three_ms:.3f} |")
    adamw_ms = do_bench(torch_adamw.step, rep=args.reps)
    copy_ms = do_bench(lambda: torch._foreach_copy_(models, masters), rep=args.reps)
    numel = sum(m.numel() for m in masters)
    sweep = tile_sweep(ours, numel, args.reps) if args.sweep else []
    lines = gpu_result_header(
        "Mixed-precision AdamW step: megatron's three passes against one (hybrid-1.5B parameters)", "master_adamw.py",
        sys.argv[1:], f"{len(masters)} fp32 masters, {numel / 1e9:.3f}B elements; gradients are views of one fp32 "
        f"buffer, {args.grad_gap} elements apart; bf16 model copies; triton.testing.do_bench medians (CPU launch time "
        "included)",
    ) + ["", *rows, "", f"Alone: torch's fused AdamW step {adamw_ms:.3f} ms; the foreach master-to-model copy "
                        f"{copy_ms:.3f} ms.", *sweep]
    emit_markdown(lines, args.out)


def tile_sweep(ours, numel: int, reps: int) -> list[str]:
    """The pass (clipped) at each tile of SWEEP_TILES; the module's tile is restored after."""
    from triton.testing import do_bench

    chosen = (one_pass_adamw.BLOCK, one_pass_adamw.NUM_WARPS)
    factor = torch.tensor([0.999], device="cuda")
    rows = ["", "| elements per program | warps | one pass ms | TB/s |", "|---:|---:|---:|---:|"]
    try:
        for block, warps in SWEEP_TILES:
            one_pass_adamw.BLOCK, one_pass_adamw.NUM_WARPS = block, warps
            one_pass_adamw._tables.cache_clear()  # the block tables depend on BLOCK
            ms = do_bench(lambda: ours(factor), rep=reps)
            mark = " (chosen)" if (block, warps) == chosen else ""
            rows.append(f"| {block}{mark} | {warps} | {ms:.3f} | {numel * BYTES_PER_ELEMENT / ms / 1e9:.2f} |")
    finally:
        one_pass_adamw.BLOCK, one_pass_adamw.NUM_WARPS = chosen
        one_pass_adamw._tables.cache_clear()
    return rows + ["", f"TB/s counts {BYTES_PER_ELEMENT} bytes per element: reads of the master weight, gradient and "
                       "two moments, writes of the master weight, the moments and the bf16 copy."]


if __name__ == "__main__":
    main()
