"""The data-parallel training step on W GPUs: our Muon with the distributed optimizer against megatron's distributed
AdamW and upstream's layer-wise Muon, in one launch, on the same model, seed and mock batches.

  torchrun --nproc-per-node 4 benchmarks/dist_step.py --variants adam,ours,upstream --out results/dist_step.md
  torchrun --nproc-per-node 4 benchmarks/dist_step.py --recipe gpt-7b-h200 --out results/dist_step_gpt7b.md
  torchrun --nproc-per-node 4 benchmarks/dist_step.py --variants ours,ours-greedy,ours-numel,ours-no-overlap \\
      --set training.torch_compile=false --out results/dist_step_balance.md

Every rank is a data-parallel rank (tp = pp = 1) with one micro-batch of the recipe's sequence length per step.
Per variant: ms/step, fwd+bwd and optimizer ms (medians over the steps after --warmup, CUDA events as in e2e.py),
MFU per GPU, peak memory, and per rank the Newton–Schulz time of the Muon engine (CUDA-event intervals around each
orthogonalization, mean per step): the slowest rank over the mean is the owner plan's load spread.
Gradient reduction overlaps the backward in every variant (`overlap_grad_reduce`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import free_memory, git_revision, package_versions, write_table_and_rows  # noqa: E402
from e2e import build_rung, compile_stats, train_steps  # noqa: E402
from e2e_report import write_profile  # noqa: E402
from e2e_rungs import Rung  # noqa: E402


class NumelCost:
    """A plan cost of one unit per element and none per launch: upstream's numel balancing on our planner."""

    def launch_cost(self, shape) -> float:
        return 0.0

    def matrix_cost(self, shape) -> float:
        return float(shape[0] * shape[1])


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    optimizer: str  # registered megatron optimizer name (`dist_` = megatron's layer-wise distributed builder)
    distributed_optimizer: bool = False  # megatron's ZeRO-1 DistributedOptimizer (AdamW's usual setting)
    plan_method: str = "auto"
    plan_cost: object = None  # None: Newton–Schulz FLOPs, or a CostModel
    newton_schulz_start: str = "backward_end"  # the owner engine's NEWTON_SCHULZ_STARTS


VARIANTS = {v.key: v for v in (
    Variant("adam", "megatron DistributedOptimizer, AdamW (fused)", "adam", distributed_optimizer=True),
    Variant("ours", "our muon + distributed optimizer (owner plan: MILP on NS FLOPs, NS queued at the backward's "
            "end)", "muon", distributed_optimizer=True),
    Variant("ours-buckets", "ours, each bucket's Newton-Schulz in the backward", "muon", distributed_optimizer=True,
            newton_schulz_start="bucket"),
    Variant("ours-no-overlap", "ours, Newton-Schulz after the backward", "muon", distributed_optimizer=True,
            newton_schulz_start="step"),
    Variant("ours-greedy", "ours (owner plan: greedy on NS FLOPs)", "muon", distributed_optimizer=True,
            plan_method="greedy"),
    Variant("ours-numel", "ours (owner plan: balanced by numel, as upstream)", "muon", distributed_optimizer=True,
            plan_method="greedy", plan_cost=NumelCost()),
    Variant("upstream", "megatron-core dist_muon (LayerWiseDistributedOptimizer + TensorParallelMuon)",
            "dist_mcore_muon"),
)}


class NewtonSchulzTimer:
    """Intervals around every orthogonalization of both engines (events on GPU, wall clock on CPU)."""

    def __init__(self):
        self.intervals: list = []
        self.active = False
        self._restore = []

    def install(self) -> None:
        from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

        from megatron_muon.optimizer.wave_muon import WaveMuon

        for owner, name in ((WaveMuon, "_orthogonalize_bucket"), (TensorParallelMuon, "orthogonalize")):
            original = getattr(owner, name)
            self._restore.append((owner, name, original))
            setattr(owner, name, self._timed(original))

    def uninstall(self) -> None:
        for owner, name, original in self._restore:
            setattr(owner, name, original)
        self._restore.clear()

    def _timed(self, function):
        def timed(*args, **kwargs):
            if not self.active:
                return function(*args, **kwargs)
            start = self._mark()
            result = function(*args, **kwargs)
            self.intervals.append((start, self._mark()))
            return result
        return timed

    @staticmethod
    def _mark():
        if torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def total_ms(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in self.intervals)
        return sum(end - start for start, end in self.intervals) * 1e3


def owner_plan_summary(model) -> dict | None:
    """The owner layout's plan (first Muon buffer): method, matrices, predicted finish time of the busiest rank."""
    layouts = getattr(getattr(model, "full_param_layout", None), "layouts", {})
    plans = [layout.owner_plan for layout in layouts.values() if getattr(layout, "owner_plan", None)]
    if not plans:
        return None
    return {"method": plans[0].method, "matrices": len(plans[0].owners), "predicted_makespan": plans[0].makespan_s,
            "padding": plans[0].padding()}


def variant_recipe(base, variant: Variant, world: int):
    return replace(base, optimizer=replace(base.optimizer, name=variant.optimizer),
                   parallel=replace(base.parallel, data_parallel_size=world, overlap_grad_reduce=True,
                                    use_distributed_optimizer=variant.distributed_optimizer),
                   training=replace(base.training, micro_batch_size=1, global_batch_size=world))


def run_variant(base_recipe, variant: Variant, ctx, args, timer: NewtonSchulzTimer) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_muon.megatron.owner_layout import OwnerPlanSettings
    from megatron_muon.metrics import MfuCalculator, peak_tflops
    from megatron_muon.training.data import MicroBatches, build_train_dataset
    from megatron_muon.training.validation import model_shape

    recipe = variant_recipe(base_recipe, variant, ctx.world_size)
    rung = Rung(variant.key, variant.label, "ours", "cudnn", recipe.training.torch_compile, variant.optimizer, True,
                main_grad_add=True, one_pass_adamw=True, muon_clip_in_momentum=True, muon_model_copy=True,
                first_grad_overwrite=True)
    row = {"variant": variant.key, "label": variant.label}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    free_memory()
    start = time.perf_counter()
    model = optimizer = None
    try:
        plan = OwnerPlanSettings(variant.plan_method, variant.plan_cost)
        model, optimizer, _ = build_rung(recipe, rung, ctx.device.type == "cuda", owner_plan=plan)
        for member in getattr(optimizer, "chained_optimizers", []):
            if hasattr(member, "newton_schulz_start"):
                member.newton_schulz_start = variant.newton_schulz_start
        batches = MicroBatches(build_train_dataset(recipe, args.data_dir), 1, ctx.world_size,
                               ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ctx.device)
        records = train_steps(model, optimizer, batches, recipe, args.warmup)
        timer.intervals.clear()
        timer.active = True
        records += train_steps(model, optimizer, batches, recipe, args.steps - args.warmup, args.warmup)
        timer.active = False
        if args.profile == variant.key:  # two more steps on every rank; rank 0 records its kernels
            more_steps = lambda: train_steps(model, optimizer, batches, recipe, 2, args.steps)  # noqa: E731
            if ctx.is_main:
                write_profile(args.out.with_name(f"{args.out.stem}_profile_{variant.key}.md"), rung, more_steps)
            else:
                more_steps()
        timed = records[args.warmup:]
        step_s = statistics.median(f + o for f, o, _, _ in timed)
        tokens_per_gpu = recipe.model.seq_length
        peak = recipe.metrics.peak_tflops or peak_tflops(ctx.device_name, recipe.metrics.peak_precision)
        row.update(
            step_ms=step_s * 1e3, fwd_bwd_ms=statistics.median(f for f, _, _, _ in timed) * 1e3,
            optimizer_ms=statistics.median(o for _, o, _, _ in timed) * 1e3,
            tokens_per_s=tokens_per_gpu * ctx.world_size / step_s, losses=[loss for _, _, loss, _ in records],
            plan=owner_plan_summary(model), **MfuCalculator.for_model(model_shape(recipe), peak)(
                tokens_per_gpu / step_s))
        if recipe.training.torch_compile:
            row.update(compile_stats())
        local = {"ns_ms": timer.total_ms() / len(timed), "optimizer_ms": row["optimizer_ms"],
                 "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    except Exception as error:  # one failing variant (OOM, a missing kernel) must not hide the others
        row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:300]
        traceback.print_exc()
        local = {"error": row["error"]}
    finally:
        timer.active = False
    ranks = [None] * ctx.world_size
    torch.distributed.all_gather_object(ranks, local)
    row["ranks"] = ranks
    row["wall_s"] = time.perf_counter() - start
    del model, optimizer
    free_memory()
    if ctx.is_main:
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    return row


def spread(values: list[float]) -> float | None:
    return max(values) / statistics.mean(values) if values and statistics.mean(values) > 0 else None


def write_report(path: Path, rows: list[dict], meta: dict) -> None:
    by_key = {row["variant"]: row for row in rows if "step_ms" in row}
    adam, upstream = by_key.get("adam"), by_key.get("upstream")
    lines = [f"# Data-parallel training step on {meta['world']} GPUs: {meta['recipe']}", "",
             f"- date: {meta['date']}; code: {meta['revision']}",
             f"- device: {meta['world']} x {meta['device']}, {meta['backend']}, one process per device, "
             f"dp={meta['world']}; "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- command: `{meta['command']}`",
             f"- batch: one sequence of {meta['seq_length']} tokens per GPU per step; {meta['steps']} steps per "
             f"variant, medians of the last {meta['steps'] - meta['warmup']}; gradient reduce overlapped with the "
             "backward in every variant", "",
             "| variant | ms/step | × AdamW step | fwd+bwd ms | optimizer ms | upstream optimizer ÷ this | MFU | "
             "NS ms per rank (min-max) | NS max/mean | owner plan | peak GiB (max) | loss first → last |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for row in rows:
        if "step_ms" not in row:
            lines.append(f"| {row['variant']}: {row['label']} | {row.get('error', 'no result')} |" + " |" * 10)
            continue
        ns = [r["ns_ms"] for r in row["ranks"] if r and "ns_ms" in r]
        memory = [r["peak_memory_gib"] for r in row["ranks"] if r and r.get("peak_memory_gib") is not None]
        plan = row.get("plan")
        cells = [
            f"{row['variant']}: {row['label']}", f"{row['step_ms']:.1f}",
            f"{row['step_ms'] / adam['step_ms']:.3f}" if adam else "-",
            f"{row['fwd_bwd_ms']:.1f}", f"{row['optimizer_ms']:.1f}",
            f"{upstream['optimizer_ms'] / row['optimizer_ms']:.2f}" if upstream else "-",
            f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-",
            f"{min(ns):.1f}-{max(ns):.1f}" if ns and max(ns) > 0 else "-",
            f"{spread(ns):.3f}" if ns and max(ns) > 0 else "-",
            f"{plan['method']}, predicted {plan['predicted_makespan']:.3g}, padding {plan['padding']}"
            if plan else "-",
            f"{max(memory):.1f}" if memory else "-",
            f"{row['losses'][0]:.3f} → {row['losses'][-1]:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    write_table_and_rows(path, lines, meta, rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="hybrid-1.5b-h200")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--variants", default="adam,ours,upstream",
                        help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the timing (compile, autotune)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dist_step.md"))
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/megatron_muon_e2e_data"))
    parser.add_argument("--revision", default=None)
    parser.add_argument("--profile", default=None, metavar="VARIANT",
                        help="profile two more steps of this variant on rank 0 (kernel table next to --out)")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.variants.split(",") if k.strip()]
    unknown = [k for k in keys if k not in VARIANTS]
    if unknown or not keys:
        raise SystemExit(f"unknown variant(s) {unknown or args.variants!r}; choose from {', '.join(VARIANTS)}")
    if not 0 < args.warmup < args.steps:
        raise SystemExit(f"--warmup must be in (0, --steps), got warmup={args.warmup} steps={args.steps}")

    from megatron_muon import register
    from megatron_muon.training.distributed import init_distributed, shutdown_distributed
    from megatron_muon.training.recipes import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    register()
    ctx = init_distributed(1, 1, torch_compile=recipe.training.torch_compile)
    meta = {"recipe": args.recipe, "overrides": args.set, "world": ctx.world_size, "device": ctx.device_name,
            "backend": torch.distributed.get_backend(),
            "steps": args.steps, "warmup": args.warmup, "seq_length": recipe.model.seq_length,
            "revision": args.revision or git_revision(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "torchrun --nproc-per-node {} ".format(ctx.world_size) + " ".join(sys.argv),
            "versions": package_versions()}
    timer = NewtonSchulzTimer()
    timer.install()
    rows = []
    try:
        for key in keys:
            rows.append(run_variant(recipe, VARIANTS[key], ctx, args, timer))
            if ctx.is_main:  # after every variant: a run cut short keeps its numbers
                write_report(args.out, rows, meta)
    finally:
        timer.uninstall()
    shutdown_distributed()


if __name__ == "__main__":
    main()
