"""One GPU stands in for one rank of a W-way data-parallel job: the training step of `muon` with the distributed
optimizer (the owner engine) against megatron's distributed AdamW, each collective a local copy of its bytes.

  python benchmarks/dist_sim_step.py --recipe hybrid-1.5b-h200 --world 4 8 --set training.torch_compile=false \\
      --out benchmarks/results/dist_sim_step_hybrid.md
  python benchmarks/dist_sim_step.py --recipe gpt-7b-h200 --world 4 8 --out benchmarks/results/dist_sim_step_gpt7b.md

The process joins a W-rank group of torch's fake process-group backend (its collectives do nothing), so megatron
builds DDP, the owner layout and both distributed optimizers for dp=W exactly as on W GPUs; this rank runs its own
forward and backward, the Newton–Schulz of the matrices it owns and its AdamW shard. Each gradient reduce-scatter
becomes a sum of the bucket's W shard-sized slices (it reads the bucket and writes a shard, as a ring reduce-scatter
does per rank), each parameter all-gather a copy of the shard into all W slots. Network time is not modelled:
what is measured is the computation one rank adds to the step, and how much of it the backward hides.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import free_memory, git_revision, package_versions, write_table_and_rows  # noqa: E402
from e2e import train_steps  # noqa: E402
from fake_group import join_fake_group, leave_fake_group  # noqa: E402
from step_digests import param_digest, poisonfree_memory, tensor_digests  # noqa: E402

VARIANTS = {  # label, optimizer, where Newton-Schulz starts (+ graphs), whether the step runs on a high-priority stream
    "adam": ("megatron DistributedOptimizer, AdamW (fused)", "adam", "bucket", False),
    "ours": ("muon + distributed optimizer: owner engine, each bucket's Newton-Schulz in the backward", "muon",
             "bucket", False),
    "ours-graphs": ("owner engine, Newton-Schulz in the backward replayed from CUDA graphs", "muon", "bucket+graphs",
                    False),
    "ours-end": ("owner engine (default; without megatron's DDP NaN check the norm is read before the update), "
                 "Newton-Schulz of all owned matrices at the backward's end, queued before the host reads the norm",
                 "muon", "backward_end", False),
    "ours-end-graphs": ("owner engine, Newton-Schulz of all owned matrices at the backward's end replayed from one "
                        "CUDA graph", "muon", "backward_end+graphs", False),
    "ours-after": ("owner engine, Newton-Schulz after the backward", "muon", "step", False),
    "adam-priority": ("AdamW, the step on a high-priority stream", "adam", "bucket", True),
    "ours-priority": ("owner engine, the step on a high-priority stream above its Newton-Schulz", "muon", "bucket",
                      True),
    "ours-end-pe4": ("owner engine (default start), Polar Express in 4 Newton-Schulz steps instead of the recipe's "
                     "schedule", "muon", "backward_end", False),
    "ours-end-next": ("owner engine (default start), a non-finite norm reported by the next step: the host does not "
                      "read the norm before the update", "muon", "backward_end", False),
    "adam-nancheck": ("AdamW, megatron's DDP checking each bucket's gradient for NaN/Inf (Megatron-LM's default)",
                      "adam", "bucket", False),
    "ours-end-nancheck": ("owner engine (defaults), megatron's DDP checking each bucket's gradient for NaN/Inf "
                          "(Megatron-LM's default): the norm then checked by the next step", "muon", "backward_end",
                          False),
}
# optimizer settings a variant changes over the recipe's: a different schedule (different results, not a speed-up
# of the same computation; ns_schedule_training.md holds its training loss against the 5-step default), or the
# norm kept on the device (under clipping megatron's fp32 tensor clip instead of its host double: rounding apart)
SCHEDULES = {"ours-end-pe4": {"muon_num_ns_steps": 4, "muon_coefficient_type": "polar_express"},
             "ours-end-next": {"muon_nonfinite_check": "next_step"}}
# parallel settings a variant changes over the recipe's
PARALLEL_SETTINGS = {"adam-nancheck": {"check_for_nan_in_grad": True},
                     "ours-end-nancheck": {"check_for_nan_in_grad": True}}


def build(recipe, newton_schulz_start: str):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_muon.megatron.fast_paths import install_fast_paths
    from megatron_muon.training.optimizer_setup import optimizer_config
    from megatron_muon.training.model import build_model, transformer_config, uses_owner_engine, wrap_model

    torch.manual_seed(recipe.training.seed)
    model_parallel_cuda_manual_seed(recipe.training.seed)
    config = transformer_config(recipe, on_gpu=torch.cuda.is_available())
    module = build_model(recipe, config)
    if recipe.training.torch_compile:
        from megatron_muon.training.compile import compile_model

        compile_model(module, recipe.training.compile_mode, recipe.training.compile_scope)
    model = wrap_model(module, config, recipe)
    optimizer = get_megatron_optimizer(optimizer_config(recipe), [model], use_gloo_process_groups=False)
    install_fast_paths(optimizer, [model], main_grad_add=False, first_grad_overwrite=not uses_owner_engine(recipe))
    for member in getattr(optimizer, "chained_optimizers", []):
        if hasattr(member, "newton_schulz_start"):
            member.newton_schulz_start = newton_schulz_start.removesuffix("+graphs")
            member.graph_newton_schulz = newton_schulz_start.endswith("+graphs")
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def plan_summary(model, rank: int) -> dict | None:
    layouts = getattr(getattr(model, "full_param_layout", None), "layouts", {})
    plans = [layout.owner_plan for layout in layouts.values() if getattr(layout, "owner_plan", None)]
    if not plans:
        return None
    work = plans[0].work_s
    return {"method": plans[0].method, "rank_share": work[rank] / max(work.values()),
            "busiest_predicted_ms": max(work.values()) * 1e3, "mean_predicted_ms": sum(work.values()) / len(work) * 1e3,
            "padding": plans[0].padding()}


def micro_batches_per_rank(args, world: int) -> int:
    """--micro-batches as given, or the share of --global-batch sequences that one of `world` ranks runs."""
    if args.global_batch is None:
        return args.micro_batches
    return args.global_batch // world


def run(base, key: str, world: int, rank: int, args) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_muon.metrics.memory import measured_memory
    from megatron_muon.training.data import MicroBatches, build_train_dataset

    label, name, newton_schulz_start, high_priority = VARIANTS[key]
    micro = micro_batches_per_rank(args, world)
    recipe = replace(base, optimizer=replace(base.optimizer, name=name, **SCHEDULES.get(key, {})),
                     parallel=replace(base.parallel, data_parallel_size=world, overlap_grad_reduce=True,
                                      use_distributed_optimizer=True, **PARALLEL_SETTINGS.get(key, {})),
                     training=replace(base.training, micro_batch_size=1, global_batch_size=world * micro))
    row = {"variant": key, "label": label, "world": world, "rank": rank, "micro_batches": micro}
    join_fake_group(world, rank)
    free_memory()
    if args.poison:
        poisonfree_memory()
    model = optimizer = None
    # a high-priority step stream: the backward's blocks go first, the side stream's Newton-Schulz fills what is left
    step_stream = torch.cuda.Stream(priority=-1) if high_priority and torch.cuda.is_available() else None
    try:
        with torch.cuda.stream(step_stream) if step_stream is not None else contextlib.nullcontext():
            model, optimizer = build(recipe, newton_schulz_start)
            batches = MicroBatches(build_train_dataset(recipe, args.data_dir), 1, world * micro,
                                   ps.get_data_parallel_rank(), world,
                                   torch.device("cuda" if torch.cuda.is_available() else "cpu"))
            trace = [] if args.trace else None
            inspect = None if trace is None else lambda stage, step: trace.append(
                {"step": step, "stage": stage, **tensor_digests(model, optimizer, stage)})
            if args.sync_phases and inspect is None:
                inspect = lambda stage, step: torch.cuda.synchronize() if torch.cuda.is_available() else None  # noqa: E731
            records = train_steps(model, optimizer, batches, recipe, args.steps, inspect=inspect)
            if trace is not None:
                row["trace"] = trace
            if args.trace or args.digest:
                row["losses"] = [float(loss).hex() for _, _, loss, _ in records]
            records = records[args.warmup:]
            if args.timeline == f"{key}@{world}":
                row["timeline"] = stream_overlap(
                    lambda: train_steps(model, optimizer, batches, recipe, 1, args.steps + 2))
                print(json.dumps(row["timeline"]), flush=True)
            if f"{key}@{world}" in (args.profile or "").split(","):  # two more steps: kernels, categories, gaps
                from types import SimpleNamespace

                from e2e_report import write_profile

                args.out.parent.mkdir(parents=True, exist_ok=True)
                write_profile(args.out.with_name(f"{args.out.stem}_profile_{key}_w{world}.md"),
                              SimpleNamespace(key=f"{key} at W={world}", label=label),
                              lambda: train_steps(model, optimizer, batches, recipe, 2, args.steps))
            engines = [e for m in getattr(optimizer, "chained_optimizers", []) for e in getattr(m, "engines", [])]
            if args.digest:
                row["param_digest"] = param_digest(model)
            memory = measured_memory([model], optimizer)
            row.update(step_ms=statistics.median(f + o for f, o, _, _ in records) * 1e3,
                       fwd_bwd_ms=statistics.median(f for f, _, _, _ in records) * 1e3,
                       optimizer_ms=statistics.median(o for _, o, _, _ in records) * 1e3,
                       speculated=sum(e.speculated_buckets for e in engines),
                       speculation_used=sum(e.speculation_used for e in engines),
                       speculation_discarded=sum(e.speculation_discarded for e in engines),
                       graphs={"captures": sum(e.graphs.captures for e in engines),
                               "replays": sum(e.graphs.replays for e in engines),
                               "disabled": next((e.graphs.disabled for e in engines if e.graphs.disabled), None)},
                       optimizer_state_gib=memory.optimizer_state_bytes / 2**30,
                       peak_gib=None if memory.peak_bytes is None else memory.peak_bytes / 2**30,
                       plan=plan_summary(model, rank),
                       nonfinite_check=next((m.nonfinite_check for m in getattr(optimizer, "chained_optimizers", [])
                                             if hasattr(m, "nonfinite_check")), None))
    except Exception as error:  # an OOM in one variant must not hide the others
        row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:300]
        traceback.print_exc()
    del model, optimizer
    free_memory()
    print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    return row


def first_difference(rows: list[dict]) -> list[str]:
    """Each traced run against the first traced run of the same optimizer and W (variants of one optimizer compute
    the same numbers): the first (step, stage) where they part, and which tensors differ there."""
    first, lines = {}, []
    for number, row in enumerate(rows, 1):
        if not row.get("trace"):
            continue
        bad = next((point for point in row["trace"] if point.get("nonfinite")), None)
        if bad is not None:
            lines.append(f"- run {number} ({row['variant']}): first non-finite at step {bad['step']} after the "
                         f"{bad['stage']}: {len(bad['nonfinite'])} tensors, in order {', '.join(bad['nonfinite'][:12])}")
        key = (VARIANTS[row["variant"]][1], str(SCHEDULES.get(row["variant"])), row["world"])
        if key not in first:
            first[key] = (number, row)
            continue
        base_number, base = first[key]
        found = "identical at every traced point"
        for a, b in zip(base["trace"], row["trace"]):
            diff = [f"{kind}:{name}" for kind in ("grads", "params", "state") for name in a.get(kind, {})
                    if a[kind][name] != b.get(kind, {}).get(name)]
            if diff:
                found = f"first differ at step {a['step']} after the {a['stage']}: {len(diff)} tensors, " \
                        f"e.g. {', '.join(diff[:4])}"
                break
        losses = "same losses" if row.get("losses") == base.get("losses") else "losses differ"
        lines.append(f"- run {number} ({row['variant']}) against run {base_number} ({base['variant']}), "
                     f"W = {row['world']}: {found}; "
                     f"{losses}")
    return ["", "## Where runs part (--trace)", "", *lines] if lines else []


def stream_overlap(run_step) -> dict:
    """One profiled step: kernels on the owner engine's side stream (its speculative Newton–Schulz) against the
    main stream's; how many side kernels start before the main stream's last backward kernel, and how much of
    their time runs while a main-stream kernel runs too."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        run_step()
        return {"side_kernels": None}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_step()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
               and "Memcpy" not in e.name and "Memset" not in e.name]
    by_stream: dict = {}
    for event in kernels:
        by_stream.setdefault(getattr(event, "device_resource_id", 0), []).append(event)
    main = max(by_stream, key=lambda s: len(by_stream[s]))
    side = [e for s, events in by_stream.items() if s != main for e in events]
    model = [e for e in by_stream[main] if any(k in e.name.lower() for k in ("chunk", "flash", "cudnn", "fmha", "conv"))]
    last_backward = max((e.time_range.start for e in model), default=0)
    intervals = sorted((e.time_range.start, e.time_range.end) for e in by_stream[main])

    starts = [a for a, _ in intervals]

    def overlapped(event) -> float:
        start, end = event.time_range.start, event.time_range.end
        total, index = 0, max(0, bisect.bisect_left(starts, start) - 1)
        while index < len(intervals) and intervals[index][0] < end:
            a, b = intervals[index]
            total += max(0, min(end, b) - max(start, a))
            index += 1
        return total

    return {"main_kernels": len(by_stream[main]), "side_kernels": len(side),
            "side_before_last_backward_kernel": sum(e.time_range.start < last_backward for e in side),
            "side_kernel_ms": sum(e.time_range.end - e.time_range.start for e in side) / 1e3,
            "side_ms_alongside_main": sum(overlapped(e) for e in side) / 1e3}


def _batch_words(meta: dict) -> str:
    if meta.get("global_batch") is None:
        return f"{meta['micro_batches']} micro-batch(es)"
    return f"a global batch of {meta['global_batch']} sequences: global batch / W micro-batches"


def write_report(path: Path, rows: list[dict], meta: dict) -> None:
    lines = [f"# One {meta['device']} as one rank of a W-way data-parallel step: {meta['recipe']}", "",
             f"- date: {meta['date']}; code: {meta['revision']}; device: {meta['device']}; "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- command: `{meta['command']}`",
             f"- {_batch_words(meta)} of one {meta['seq_length']}-token sequence per rank per step; "
             f"{meta['steps']} steps, medians of the last {meta['steps'] - meta['warmup']}; gradient reduce "
             "bucketed as in the backward (overlap_grad_reduce); collectives replaced by local copies of their "
             "bytes (fake process group: no network time)", "",
             "| W | variant | ms/step | × AdamW step | fwd+bwd ms | optimizer ms | NS buckets used / discarded | "
             "NS graphs captured / replayed | rank's share of the busiest predicted NS | optimizer state GiB | peak GiB |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    adam = {row["world"]: row for row in rows if row["variant"] == "adam" and "step_ms" in row}
    for row in rows:
        if "step_ms" not in row:
            lines.append(f"| {row['world']} | {row['variant']}: {row['label']} | {row.get('error')} |" + " |" * 8)
            continue
        base = adam.get(row["world"])
        plan = row.get("plan")
        cells = [str(row["world"]), f"{row['variant']}: {row['label']}", f"{row['step_ms']:.1f}",
                 f"{row['step_ms'] / base['step_ms']:.3f}" if base else "-", f"{row['fwd_bwd_ms']:.1f}",
                 f"{row['optimizer_ms']:.1f}", f"{row['speculation_used']} / {row['speculation_discarded']}",
                 "-" if not row["graphs"]["captures"] and not row["graphs"]["disabled"] else
                 f"{row['graphs']['captures']} / {row['graphs']['replays']}"
                 + (f" (off: {row['graphs']['disabled']})" if row["graphs"]["disabled"] else ""),
                 f"{plan['rank_share']:.2f} of {plan['busiest_predicted_ms']:.1f} ms" if plan else "-",
                 f"{row['optimizer_state_gib']:.2f}", "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += repeat_summary(rows, adam)
    lines += first_difference(rows)
    write_table_and_rows(path, lines, meta, rows)


def repeat_summary(rows: list[dict], adam: dict[int, dict]) -> list[str]:
    """Where a variant ran more than once at one W (`--variants adam,ours,ours`): the mean, lowest and highest of
    its step-time ratios to the AdamW step the table uses (`adam`: world -> row), so a difference can be read
    against the spread."""
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        base = adam.get(row["world"])
        if "step_ms" in row and base is not None:
            groups.setdefault((row["world"], row["variant"]), []).append(row["step_ms"] / base["step_ms"])
    if not any(len(ratios) > 1 for ratios in groups.values()):
        return []
    lines = ["", "| W | variant | runs | mean × AdamW | lowest | highest |", "|---:|---|---:|---:|---:|---:|"]
    for (world, variant), ratios in groups.items():
        lines.append(f"| {world} | {variant} | {len(ratios)} | {statistics.fmean(ratios):.3f} | {min(ratios):.3f} | "
                     f"{max(ratios):.3f} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="hybrid-1.5b-h200")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--world", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rank", type=int, default=0, help="which rank of the W this GPU plays")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per rank per step")
    parser.add_argument("--global-batch", type=int, default=None, metavar="SEQUENCES",
                        help="sequences per step over all W ranks (each rank runs global batch / W micro-batches): "
                             "every W at the same batch; replaces --micro-batches")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dist_sim_step.md"))
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/megatron_muon_e2e_data"))
    parser.add_argument("--revision", default=None)
    parser.add_argument("--digest", action="store_true", help="record a hash of the parameters after the steps")
    parser.add_argument("--trace", action="store_true",
                        help="digest every gradient after each backward and every parameter and optimizer state after "
                             "each step (synchronizes: no timing meaning); the report names where runs first differ")
    parser.add_argument("--poison", action="store_true",
                        help="before each run fill the allocator's free memory with NaN bytes: unwritten memory read "
                             "as data turns into NaNs that --trace names")
    parser.add_argument("--sync-phases", action="store_true",
                        help="synchronize the device after each backward and each step (as --trace does, without "
                             "the digests): tells a race between streams from a kernel that reorders its sums")
    parser.add_argument("--cpu", action="store_true", help="a smoke run in CPU mode (no timing meaning)")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch's deterministic algorithms (needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set before the "
                             "run): tells a nondeterministic kernel from a race when --digest runs disagree")
    parser.add_argument("--timeline", default=None, metavar="VARIANT@W",
                        help="one more step of this variant profiled: side-stream Newton-Schulz against the backward")
    parser.add_argument("--profile", default=None, metavar="VARIANT@W[,VARIANT@W...]",
                        help="profile two more steps of these variants at these world sizes (kernel tables next to "
                             "--out)")
    args = parser.parse_args(argv)
    keys = [k for k in args.variants.split(",") if k]
    if any(k not in VARIANTS for k in keys) or not 0 < args.warmup < args.steps:
        raise SystemExit(f"variants must be among {', '.join(VARIANTS)} and 0 < --warmup < --steps")
    if args.global_batch is not None and any(args.global_batch % w or args.global_batch < w for w in args.world):
        raise SystemExit(f"--global-batch {args.global_batch} must be a positive multiple of every --world "
                         f"({' '.join(map(str, args.world))}): each rank runs global batch / W micro-batches")
    if args.cpu:
        from megatron_muon._cpu import enable_cpu_mode

        torch._dynamo.config.disable = True
        enable_cpu_mode()
    elif not torch.cuda.is_available():
        raise SystemExit("dist_sim_step measures a GPU step; run it on a CUDA machine (or --cpu for a smoke run)")
    if args.deterministic:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            raise SystemExit("--deterministic needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment (cuBLAS reads "
                             "it when it starts)")
        torch.use_deterministic_algorithms(True, warn_only=True)

    from megatron_muon import register
    from megatron_muon.training.recipes import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    register()
    meta = {"recipe": args.recipe, "overrides": args.set,
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
            "steps": args.steps, "warmup": args.warmup, "seq_length": recipe.model.seq_length,
            "micro_batches": args.micro_batches, "global_batch": args.global_batch,
            "deterministic": args.deterministic,
            "revision": args.revision or git_revision(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python " + " ".join(sys.argv), "versions": package_versions()}
    rows = []
    for world in args.world:
        for key in keys:
            rows.append(run(recipe, key, world, args.rank, args))
            write_report(args.out, rows, meta)  # a run cut short keeps its numbers
    leave_fake_group()
    return rows


if __name__ == "__main__":
    main()
