"""End-to-end ladder: the hybrid-1.5B recipe on one GPU, from megatron-core upstream to our specs and our Muon.

  python benchmarks/e2e.py --out benchmarks/results/e2e.md                       # every rung, one process
  python benchmarks/e2e.py --rungs 4,6 --profile-rung 4,6 --out /tmp/e2e.md      # a subset, with kernel profiles

Every rung rebuilds the model from the same seed and trains on the same mock batches, so the loss columns are
comparable: AdamW rungs should agree within bf16 tolerance, and eager vs compiled on the same spec is printed as a
correctness check. Timings are medians over the steps after `--warmup` (those include compilation); steps run back
to back as in megatron's loop, timed by CUDA events (`training/step_timer.py`). The rungs are listed in `e2e_rungs.py`.
`--append` merges into an existing result (same recipe), so a long ladder can be measured in parts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import free_memory, git_revision, memory_outside_allocator_gib, package_versions  # noqa: E402
from e2e_report import write_profile, write_report  # noqa: E402
from e2e_rungs import (Rung, build_upstream_model, build_upstream_te_model, parse_rungs,  # noqa: E402
                       rung_gdn_kernels)

from megatron_muon.ops.backend import fla_own_backward_refusal  # noqa: E402
from megatron_muon.ops.kernel_choice import set_gdn_kernels  # noqa: E402
from megatron_muon.training.te_cudnn import transformer_engine_compile_disabled  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rung_recipe(recipe, rung: Rung):
    """The recipe with the rung's optimizer and compile setting (everything else identical across rungs)."""
    from dataclasses import replace

    return replace(recipe, optimizer=replace(recipe.optimizer, name=rung.optimizer,
                                             muon_graph_newton_schulz=rung.muon_graphs),
                   training=replace(recipe.training, torch_compile=rung.compiled),
                   # the rung's GDN kernels are set before the build (`rung_gdn_kernels`); the build must not reset them
                   model=replace(recipe.model, spec_backend=rung.spec_backend, gdn_kernels=None))


def build_rung(recipe, rung: Rung, on_gpu: bool, owner_plan=None):
    """(DDP-wrapped model, megatron optimizer, config) for the rung, from the recipe's seed; `owner_plan`: the owner
    engine's `OwnerPlanSettings` (default: the training CLI's)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_muon.megatron.fast_paths import install_fast_paths
    from megatron_muon.training.optimizer_setup import optimizer_config
    from megatron_muon.training.model import build_model, transformer_config, wrap_model
    from megatron_muon.training.validation import full_layer_pattern

    torch.manual_seed(recipe.training.seed)
    model_parallel_cuda_manual_seed(recipe.training.seed)
    config = transformer_config(recipe, on_gpu=on_gpu)
    if rung.recompute_attention:
        config.recompute_granularity, config.recompute_modules = "selective", ["core_attn"]
    m = recipe.model
    if rung.spec == "upstream":
        module = build_upstream_model(config, full_layer_pattern(recipe), rung.attention, m.vocab_size,
                                      m.seq_length, m.untie_embeddings, m.rotary_base)
    elif rung.spec == "upstream-te":
        module = build_upstream_te_model(config, full_layer_pattern(recipe), m.vocab_size, m.seq_length,
                                         m.untie_embeddings, m.rotary_base)
    else:
        module = build_model(recipe, config)
    if rung.compiled:
        from megatron_muon.training.compile import compile_model

        compile_model(module, recipe.training.compile_mode, recipe.training.compile_scope)
    model = wrap_model(module, config, recipe, fast_main_grad_add=rung.main_grad_add, owner_plan=owner_plan)
    optimizer = get_megatron_optimizer(optimizer_config(recipe), [model])
    install_fast_paths(optimizer, [model], fused_adam=rung.fused_adam, one_pass_adamw=rung.one_pass_adamw,
                       muon_clip_in_momentum=rung.muon_clip_in_momentum, muon_model_copy=rung.muon_model_copy,
                       main_grad_add=False, first_grad_overwrite=rung.first_grad_overwrite)  # wrap_model hooked the add
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, config


def train_steps(
    model, optimizer, batches, recipe, steps: int, first_step: int = 0, inspect=None
) -> list[tuple[float, float, float, float | None]]:
    """(fwd+bwd seconds, optimizer seconds, loss, grad norm) per step; the two times add up to the step's time.

    Steps run back to back as in megatron's loop: nothing synchronizes between or inside them, so the CPU queues
    the next step (batch upload, graph guards, launches) while the GPU finishes the current one. Times come from
    CUDA events on the stream (`StepTimer`), losses and grad norms are read after the last step. `inspect(stage,
    step)` ("backward" | "step") is called after each phase, for tracing runs that must agree bit for bit (it may
    synchronize; timings then mean nothing)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_muon.training.loop import forward_step, global_mean_loss
    from megatron_muon.training.step_timer import StepTimer

    forward_backward = get_forward_backward_func()
    timer = StepTimer(torch.cuda.is_available())
    _sync()
    step_losses, grad_norms = [], []
    for step in range(first_step, first_step + steps):
        timer.start_step()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        step_losses.append(forward_backward(
            forward_step_func=forward_step, data_iterator=batches.for_step(step), model=[model],
            num_microbatches=batches.num_microbatches, seq_length=recipe.model.seq_length,
            micro_batch_size=recipe.training.micro_batch_size, forward_only=False))
        timer.end_forward_backward()
        if inspect is not None:
            inspect("backward", step)
        grad_norms.append(optimizer.step()[1])  # megatron returns the pre-clipping norm (a device tensor)
        if inspect is not None:
            inspect("step", step)
    return [(step_s - optimizer_s, optimizer_s, global_mean_loss(losses), None if norm is None else float(norm))
            for (step_s, optimizer_s), losses, norm in zip(timer.read(), step_losses, grad_norms, strict=True)]


def compile_stats() -> dict:
    """Graph counts, recompiles with their reasons, and the slowest compile phases (Dynamo's own timers, seconds
    summed over the process: what of `first_steps_s` is compilation rather than kernels' JIT and autotuning)."""
    from torch._dynamo.utils import compile_times, counters, guard_failures

    names, seconds = compile_times(repr="csv", aggregate=True)
    phases = sorted(zip(names, map(float, seconds)), key=lambda item: -item[1])[:12]
    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(len(v) for v in guard_failures.values()),
            "recompile_reasons": sorted({f"{getattr(code, 'co_name', code)}: {reason}"[:300]
                                         for code, reasons in guard_failures.items() for reason in reasons}),
            "compile_phases_s": {name: round(value, 2) for name, value in phases}}


def _measured(args) -> str:
    return f"{time.strftime('%Y-%m-%d %H:%M')} {args.revision}"


def run_rung(base_recipe, rung: Rung, ctx, args, profile_path: Path | None) -> dict:
    from megatron_muon.metrics import MfuCalculator, peak_tflops
    from megatron_muon.training.data import MicroBatches, build_train_dataset
    from megatron_muon.training.validation import model_shape

    recipe = rung_recipe(base_recipe, rung)
    row = {"rung": rung.key, "label": rung.label, "optimizer": rung.optimizer, "compiled": rung.compiled,
           "compile_scope": recipe.training.compile_scope if rung.compiled else None}
    refusal = fla_own_backward_refusal() if rung.spec.startswith("upstream") and ctx.device.type == "cuda" else None
    if refusal is not None:  # megatron-core's GDN calls FLA directly: say so now, not after building and a forward
        print(f"rung {rung.key} not run: {refusal}", flush=True)
        return {**row, "error": f"not run: {refusal}"[:300], "wall_s": 0.0,
                "measured": _measured(args)}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    free_memory()
    on_gpu = ctx.device.type == "cuda"
    start = time.perf_counter()
    model = optimizer = None
    kernels = rung_gdn_kernels(rung, base_recipe.model.gdn_kernels)
    set_gdn_kernels(kernels)
    if rung.spec == "ours":
        row["gdn_kernels"] = kernels.name or repr(kernels)
    attention_environment = {k: v for k, v in os.environ.items() if k.startswith("NVTE_")}
    try:
        model, optimizer, _ = build_rung(recipe, rung, on_gpu)
        train = recipe.training
        batches = MicroBatches(build_train_dataset(recipe, args.data_dir), train.micro_batch_size,
                               train.global_batch_size, 0, 1, ctx.device)
        records = train_steps(model, optimizer, batches, recipe, args.steps)
        timed = records[args.warmup:]
        step_s = statistics.median(f + o for f, o, _, _ in timed)
        tokens_per_step = train.global_batch_size * recipe.model.seq_length
        peak = recipe.metrics.peak_tflops or peak_tflops(ctx.device_name, recipe.metrics.peak_precision)
        mfu_of = MfuCalculator.for_model(model_shape(recipe), peak)
        row.update(
            step_ms=step_s * 1e3, fwd_bwd_ms=statistics.median(f for f, _, _, _ in timed) * 1e3,
            optimizer_ms=statistics.median(o for _, o, _, _ in timed) * 1e3, tokens_per_s=tokens_per_step / step_s,
            losses=[loss for _, _, loss, _ in records],
            first_steps_s=sum(f + o for f, o, _, _ in records[:args.warmup]),
            grad_norms=[norm for _, _, _, norm in records], clip_grad=recipe.optimizer.clip_grad,
            peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
            # cudaMalloc retries free cached blocks and synchronize the device: a sign of allocator pressure.
            allocator_retries=torch.cuda.memory_stats().get("num_alloc_retries") if on_gpu else None,
            **mfu_of(tokens_per_step / step_s),
        )
        row["optimizer_share"] = row["optimizer_ms"] / row["step_ms"]
        if rung.compiled:
            row.update(compile_stats())
        if profile_path is not None:
            write_profile(profile_path, rung, lambda: train_steps(model, optimizer, batches, recipe, 2, args.steps))
    except Exception as error:  # one failing rung (OOM, a missing kernel) must not hide the others
        row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:300]
        traceback.print_exc()
    finally:
        _restore_attention_environment(attention_environment)
        if on_gpu:  # an out-of-memory rung says how much of the card was not PyTorch's to give
            row["outside_allocator_gib"] = memory_outside_allocator_gib()
    row["wall_s"] = time.perf_counter() - start
    row["measured"] = _measured(args)
    del model, optimizer
    free_memory()
    print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="hybrid-1.5b-h200")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--rungs", default="all", help="'all' or a comma list of rung keys (see e2e_rungs.py)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (compile, autotune)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e.md"))
    parser.add_argument("--append", action="store_true", help="merge into the rungs already in --out's json")
    parser.add_argument("--profile-rung", default="", help="profile two extra steps of these rungs (comma list)")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/megatron_muon_e2e_data"))
    parser.add_argument("--revision", default=None,
                        help="code revision recorded with each rung (default: `git describe` of this checkout)")
    parser.add_argument("--autotune-table", type=Path, default=None,
                        help="pin the Triton autotune choices of this table before the first rung (a cold start "
                             "then compiles one config per kernel and key: compare first_steps_s)")
    parser.add_argument("--write-autotune-table", type=Path, default=None,
                        help="write the autotune choices of every rung run here to this file at the end")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup must be in [0, --steps), got warmup={args.warmup} steps={args.steps}")
    rungs = parse_rungs(args.rungs)
    profiled = {r.key for r in parse_rungs(args.profile_rung)} if args.profile_rung else set()
    if profiled - {r.key for r in rungs}:
        raise SystemExit(f"--profile-rung {args.profile_rung} names rungs that --rungs {args.rungs} does not run; "
                         "add them to --rungs")
    args.revision = args.revision or git_revision()

    from megatron_muon import register
    from megatron_muon.training.distributed import init_distributed, shutdown_distributed
    from megatron_muon.training.recipes import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    register()
    ctx = init_distributed(1, 1, torch_compile=True)
    json_path = args.out.with_suffix(".json")
    rows, commands = {}, []
    if args.append and json_path.exists():
        previous = json.loads(json_path.read_text())
        rows = {r["rung"]: r for r in previous["rows"]}
        commands = previous["meta"].get("commands") or [previous["meta"]["command"]]
    command = "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])])
    meta = {"recipe": args.recipe, "overrides": args.set, "steps": args.steps, "warmup": args.warmup,
            "device": ctx.device_name, "command": command, "commands": [*commands, command],
            "date": time.strftime("%Y-%m-%d"), "te_compile_disabled": transformer_engine_compile_disabled(),
            **package_versions()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.autotune_table is not None:
        from megatron_muon.training.autotune import pin_table

        meta["autotune_table_pinned"] = pin_table(args.autotune_table)
        print(f"autotune table {args.autotune_table}: {meta['autotune_table_pinned']}", flush=True)
    for rung in rungs:
        profile = args.out.with_name(args.out.stem + f"_profile_rung{rung.key}.md") \
            if rung.key in profiled else None
        rows[rung.key] = run_rung(recipe, rung, ctx, args, profile)
        write_report(args.out, json_path, rows, meta)  # after every rung: a run cut short keeps its numbers
    if args.write_autotune_table is not None:
        from megatron_muon.kernels import autotune_table

        print(f"{autotune_table.write(args.write_autotune_table)} autotune choices written to "
              f"{args.write_autotune_table}", flush=True)
    shutdown_distributed()


def _restore_attention_environment(saved: dict[str, str]) -> None:
    """megatron's model build exports its attention backend to TE's NVTE_* variables; the next rung builds its own
    (one rung's `auto` left NVTE_FLASH_ATTN=1, which a later rung pinned to cuDNN refused)."""
    for key in [k for k in os.environ if k.startswith("NVTE_") and k not in saved]:
        del os.environ[key]
    os.environ.update(saved)


if __name__ == "__main__":
    main()
