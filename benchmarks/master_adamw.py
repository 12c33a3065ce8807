"""megatron's mixed-precision AdamW step over the hybrid-1.5B's parameters: the clip multiply, torch's fused AdamW
and the master-to-model copy as megatron runs them (with our clip kernel and foreach copy), against the one pass
of `megatron/master_adamw.py`, in one run on one GPU.

fp32 master weights (one tensor each, the reference shapes), fp32 gradients as views of one buffer (megatron's
DDP), bf16 model parameters. Factor 1 is an unclipped step, 0.999 a clipped one.

    python benchmarks/master_adamw.py --out benchmarks/results/master_adamw.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_env import emit_markdown, gpu_result_header, views_of_one_buffer  # benchmarks/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_muon.megatron.clip_scale import scale_in_place  # noqa: E402
from megatron_muon.megatron.master_adamw import OnePassAdamW  # noqa: E402

def parameters(total: int):
    """(fp32 masters, fp32 gradient views of one buffer, bf16 model copies) of about `total` elements."""
    grads = views_of_one_buffer(total, "cuda", scale=1e-3)
    masters = [torch.randn(grad.shape, device="cuda") * 0.02 for grad in grads]
    return masters, grads, [m.bfloat16() for m in masters]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--elements", type=int, default=1_478_000_000, help="parameters (1.48B)")
    parser.add_argument("--reps", type=int, default=300, help="milliseconds of repetitions per timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("master_adamw.py times CUDA kernels; run it on a GPU machine")
    from triton.testing import do_bench

    masters, grads, models = parameters(args.elements)
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
    lines = gpu_result_header(
        "Mixed-precision AdamW step: megatron's three passes against one (hybrid-1.5B parameters)", "master_adamw.py",
        sys.argv[1:], f"{len(masters)} fp32 masters, {numel / 1e9:.3f}B elements; gradients are views of one fp32 "
        "buffer; bf16 model copies; triton.testing.do_bench medians (CPU launch time included)",
    ) + ["", *rows, "", f"Alone: torch's fused AdamW step {adamw_ms:.3f} ms; the foreach master-to-model copy "
                        f"{copy_ms:.3f} ms."]
    emit_markdown(lines, args.out)


if __name__ == "__main__":
    main()
