"""The pretrain loop on megatron-core: model, optimizer (get_megatron_optimizer), LR schedule, data, logging."""

from __future__ import annotations


import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_muon.megatron.fast_paths import install_fast_paths
from megatron_muon.megatron.qk_clip import QkClipAfterStep
from megatron_muon.metrics import MfuCalculator, peak_tflops
from megatron_muon.training.checkpoint import load_checkpoint, save_checkpoint
from megatron_muon.training.compile import compile_model
from megatron_muon.training.config import Recipe
from megatron_muon.training.data import MicroBatches, build_train_dataset
from megatron_muon.training.distributed import RunContext
from megatron_muon.training.memory_hint import out_of_memory_hint
from megatron_muon.training.model import (
    build_model,
    count_parameters,
    transformer_config,
    uses_owner_engine,
    wrap_model,
)
from megatron_muon.training.optimizer_setup import lr_scheduler, optimizer_config, sharded_optimizer
from megatron_muon.training.preemption import StopOnSignal
from megatron_muon.training.autotune import pin_run_table, write_run_table
from megatron_muon.training.report import JsonlLog, format_step, plot_run, read_jsonl
from megatron_muon.training.step_timer import StepTimer
from megatron_muon.training.validation import data_parallel_size, model_shape

LOG_FILE = "train_log.jsonl"
PLOT_FILE = "loss_mfu.png"


def forward_step(data_iterator, model_chunk):
    """megatron's `forward_step_func` for the recipe's batches: the model's output and the masked mean-loss function
    (benchmarks that drive megatron's schedule themselves use it too)."""
    batch = next(data_iterator)
    output = model_chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_mask = batch["loss_mask"]

    def loss_func(per_token_losses):
        loss = (per_token_losses.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        # clone: megatron divides the returned loss in place by the number of micro-batches
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def global_mean_loss(losses: list[dict]) -> float:
    """Mean loss over the step's global batch, visible on every rank (only the last stage's tp-rank-0s count)."""
    from megatron.core import parallel_state as ps

    contributes = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and losses
    device = "cuda" if torch.cuda.is_available() else "cpu"
    local = torch.stack([entry["loss"].float() for entry in losses]).mean() if contributes else torch.zeros(())
    pair = torch.stack([local.to(device), torch.tensor(1.0 if contributes else 0.0, device=device)]).double()
    torch.distributed.all_reduce(pair)
    return float(pair[0] / pair[1])


def _local_losses(unread: list[list[dict]], first_step: int) -> dict[int, float] | None:
    """This rank's mean loss for each step not yet logged, by 1-based step, without collectives (after a failure the
    other ranks may be gone); None when the device cannot be read any more."""
    try:
        return {first_step + i: float(torch.stack([entry["loss"].float() for entry in losses]).mean())
                for i, losses in enumerate(unread) if losses}
    except Exception:  # noqa: BLE001 - a failed device (CUDA error) raises anything; the original error matters
        return None


def _record_failure(error: BaseException, log, output_dir: Path, local_losses) -> None:
    """End the log with a `failed` record. Under pipeline parallelism the losses live on the last stage, so the
    last stage of the logging rank's pipeline writes them beside the log (`failed_rank<R>.json`) and the log's
    record names that rank. No collectives: the other ranks may be gone."""
    from megatron.core import parallel_state as ps

    record = {"event": "failed", "error": f"{type(error).__name__}: {error}"}
    try:
        last_stage, first_rank = ps.is_pipeline_last_stage(), ps.get_pipeline_model_parallel_first_rank()
        last_rank = ps.get_pipeline_model_parallel_last_rank()
    except (AssertionError, RuntimeError):  # model parallel state not set up yet: one stage
        last_stage, first_rank, last_rank = True, 0, 0
    if log:
        record["unlogged_local_losses"] = local_losses if last_stage else None
        if not last_stage:
            record["losses_written_by_rank"] = last_rank
        log.write(record)
        log.close()
    elif last_stage and first_rank == 0 and torch.distributed.is_initialized():
        output_dir.mkdir(parents=True, exist_ok=True)
        record["unlogged_local_losses"] = local_losses
        (output_dir / f"failed_rank{torch.distributed.get_rank()}.json").write_text(json.dumps(record))


def optimizer_classes(optimizer) -> list[str]:
    """Qualified class names of the torch optimizers inside megatron's wrappers (what really steps the params)."""
    names = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", part)
        names.append(f"{type(inner).__module__}.{type(inner).__qualname__}")
    return names


def _memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        pass


def _progress_bar(show: bool, total: int, initial: int):
    """tqdm on a terminal; plain lines elsewhere (and where tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, initial=initial, disable=None if show else True, unit="step", dynamic_ncols=True)


@dataclass
class _Window:
    """Accumulates steps between two log lines."""

    steps: int = 0
    seconds: float = 0.0
    optimizer_seconds: float = 0.0
    losses: list[float] = field(default_factory=list)

    def add(self, seconds: float, optimizer_seconds: float, loss: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.optimizer_seconds += optimizer_seconds
        self.losses.append(loss)


@dataclass
class _Run:
    """What a run builds once before its first step (model, optimizer, data, metrics, log)."""

    model: Any
    optimizer: Any
    scheduler: Any
    batches: MicroBatches
    mfu_of: MfuCalculator
    tokens_per_step: int
    start_step: int
    output_dir: Path
    log: JsonlLog | None
    qk_clip: QkClipAfterStep | None = None  # model.qk_clip / log_max_attention_logit


def _start_run(recipe: Recipe, ctx: RunContext) -> _Run:
    """Build the model, optimizer and schedule (resuming from `checkpoint.load`), the data and the MFU calculator,
    and open the log with a `start` record on the main rank."""
    import megatron_muon
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    megatron_muon.register()
    torch.manual_seed(recipe.training.seed)
    model_parallel_cuda_manual_seed(recipe.training.seed)
    output_dir, train = Path(recipe.output_dir), recipe.training

    resume_step, saved = _resume_plan(recipe)
    config = transformer_config(recipe, on_gpu=ctx.device.type == "cuda")
    module = build_model(recipe, config)
    if train.torch_compile:
        compile_model(module, train.compile_mode, train.compile_scope)
    model = wrap_model(module, config, recipe)
    optimizer = get_megatron_optimizer(optimizer_config(_with_checkpoint_lr(recipe, saved)), [model])
    fast_paths = install_fast_paths(  # wrap_model already hooked the gradient add
        optimizer, [model], one_pass_adamw=recipe.optimizer.one_pass_adamw,
        muon_clip_in_momentum=recipe.optimizer.muon_clip_in_momentum,
        muon_model_copy=recipe.optimizer.muon_model_copy, main_grad_add=False,
        # the owner engine leaves megatron's DDP as it is (its buffers are zeroed by megatron every step)
        first_grad_overwrite=recipe.optimizer.first_grad_overwrite and not uses_owner_engine(recipe))
    scheduler = lr_scheduler(recipe, optimizer)
    qk_clip = QkClipAfterStep.for_config(config, [model], optimizer)  # checks the model can record its logits
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    start_step, notes = _resume(recipe, resume_step, saved, model, optimizer, scheduler)
    autotune_note = pin_run_table(recipe, on_gpu=ctx.device.type == "cuda")
    notes += [autotune_note] if autotune_note else []
    if recipe.data.path:  # before megatron indexes an embedding row the vocabulary lacks
        from megatron_muon.training.corpus import check_token_ids

        eod = recipe.data.eod_id if recipe.data.eod_id is not None else recipe.model.vocab_size - 1
        check_token_ids(recipe.data.path, recipe.model.vocab_size, eod)
    batches = MicroBatches(build_train_dataset(recipe, output_dir), train.micro_batch_size, train.global_batch_size,
                           ps.get_data_parallel_rank(), data_parallel_size(recipe, ctx.world_size), ctx.device)
    peak = recipe.metrics.peak_tflops or peak_tflops(ctx.device_name, recipe.metrics.peak_precision)
    mfu_of = MfuCalculator.for_model(model_shape(recipe), peak, num_gpus=ctx.world_size)
    tokens_per_step = train.global_batch_size * recipe.model.seq_length

    log = JsonlLog(output_dir / LOG_FILE, append=start_step > 0) if ctx.is_main else None
    if not peak:
        notes.append(f"MFU n/a: no peak FLOP/s is known for {ctx.device_name}; set metrics.peak_tflops to report it")
    if ctx.is_main:
        for note in notes:
            print(note, flush=True)
    if log:
        log.write({
            "event": "start", "recipe": recipe.to_dict(), "world_size": ctx.world_size, "device": ctx.device_name,
            "resumed_from": start_step or None, "notes": notes,
            "torch": torch.__version__, "start_step": start_step, "flops_per_token": mfu_of.flops_per_token,
            "all_sdpa_flops_per_token": mfu_of.all_attention_flops_per_token, "peak_tflops_per_gpu": peak,
            "tokens_per_step": tokens_per_step, "local_parameters_rank0": count_parameters(model),
            "optimizer_classes": optimizer_classes(optimizer),
            **{key: fast_paths[key] for key in ("fused_adam_groups", "one_pass_adamw", "muon_clip_in_momentum",
                                                "muon_model_copy", "first_grad_overwrite_chunks")},
        })
    return _Run(model, optimizer, scheduler, batches, mfu_of, tokens_per_step, start_step, output_dir, log, qk_clip)


def _resume_plan(recipe: Recipe) -> tuple[int | None, dict | None]:
    """The iteration to resume from (None: none, or nothing saved there yet) and its saved LR schedule."""
    from megatron_muon.training.resume import choose_iteration, saved_schedule

    if not recipe.checkpoint.load:
        return None, None
    step = choose_iteration(recipe.checkpoint.load, recipe.checkpoint.load_iteration)
    return step, (saved_schedule(recipe.checkpoint.load, step) if step is not None else None)


def _with_checkpoint_lr(recipe: Recipe, saved: dict | None) -> Recipe:
    """The recipe whose lr builds the optimizer's param groups: the checkpoint's when it resumes with its schedule
    (megatron matches saved param groups by their lr, and the schedule reads each group's own)."""
    if not saved or recipe.checkpoint.override_lr_schedule or "max_lr" not in saved:
        return recipe
    return replace(recipe, optimizer=replace(recipe.optimizer, lr=saved["max_lr"], min_lr=saved["min_lr"]))


def _resume(recipe: Recipe, step: int | None, saved: dict | None, model, optimizer, scheduler) -> tuple[int, list[str]]:
    """(first step, console notes): load `step` (from `_resume_plan`), or say nothing was there yet (start from
    scratch, as Megatron-LM does), and where the checkpoint's LR schedule differs from the recipe's."""
    from megatron_muon.training.resume import remap_group_lrs, schedule_changes, schedule_of

    root = recipe.checkpoint.load
    if not root:
        return 0, []
    if step is None:
        return 0, [f"no checkpoint in {root} yet: starting from scratch"]
    recipe_schedule = {**schedule_of(scheduler), "max_lr": recipe.optimizer.lr, "min_lr": recipe.optimizer.min_lr}
    changes = schedule_changes(recipe_schedule, saved)
    override = recipe.checkpoint.override_lr_schedule

    def transform(state):
        if override and "max_lr" in saved:
            remap_group_lrs(state, saved, recipe_schedule)

    load_checkpoint(root, step, model, optimizer, scheduler, sharded_optimizer(recipe), transform)
    notes = [f"resumed from iteration {step} ({root})"]
    if changes and override:
        notes.append(f"LR schedule from the recipe, not the checkpoint (checkpoint.override_lr_schedule): "
                     f"{'; '.join(changes)}")
    elif changes:
        notes.append(f"warning: the checkpoint's LR schedule replaces the recipe's ({'; '.join(changes)}); add "
                     "--set checkpoint.override_lr_schedule=true to train with the recipe's")
    return step, notes


def _step_record(run: _Run, window: _Window, done: int, update_ok: bool, grad_norm) -> dict[str, Any]:
    """The log line for the window that ends at step `done`."""
    tokens_per_s = window.steps * run.tokens_per_step / window.seconds
    return {
        "event": "step", "step": done, "loss": sum(window.losses) / len(window.losses), "loss_steps": len(window.losses),
        "lr": run.optimizer.param_groups[0]["lr"], "grad_norm": None if grad_norm is None else float(grad_norm),
        "tokens_per_s": tokens_per_s, "step_time_s": window.seconds / window.steps,
        "optimizer_share": window.optimizer_seconds / window.seconds, "memory_gib": _memory_gib(),
        "skipped_update": not update_ok, **run.mfu_of(tokens_per_s),
        **(run.qk_clip.record() if run.qk_clip else {}),  # a collective: every rank builds the record
    }


def _log_memory(run: _Run, bar) -> None:
    """After the first step: every rank's optimizer state, parameter and gradient bytes (and device peak) as one
    `memory` record; the busiest rank's figures on the console (collective)."""
    from megatron_muon.metrics.memory import busiest_rank, memory_record

    record = memory_record([run.model], run.optimizer)
    if run.log:
        run.log.write({"event": "memory", "memory": record})
        rank = busiest_rank(record)
        size = {key: _bytes_text(record[key][rank]) for key in record}
        bar.write(f"memory, busiest rank {rank}: optimizer state {size['optimizer_state_bytes']}, parameters "
                  f"{size['param_bytes']}, gradients {size['grad_bytes']}, device peak {size['peak_bytes']}")


def _bytes_text(count: int | None) -> str:
    if count is None:
        return "n/a"
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.2f} MiB"


def _save(recipe: Recipe, run: _Run, step: int) -> None:
    save_checkpoint(recipe.checkpoint.save, step, run.model, run.optimizer, run.scheduler, sharded_optimizer(recipe))


def pretrain(recipe: Recipe, ctx: RunContext, evaluate: Callable[[Any], dict[str, Any]] | None = None
             ) -> dict[str, Any]:
    """Train the recipe's model on this rank (every rank of the job calls it); returns a summary on every rank.
    `evaluate(model)`, when given, runs on every rank after the last step (the loop has no eval of its own) and its
    entries join the summary and the log's end record."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    train, run = recipe.training, _start_run(recipe, ctx)
    model, optimizer, log, start_step = run.model, run.optimizer, run.log, run.start_step
    bar = _progress_bar(ctx.is_main and recipe.logging.progress_bar, train.train_iters, start_step)
    forward_backward = get_forward_backward_func()
    timer = StepTimer(ctx.device.type == "cuda")
    window, first_loss, last_loss, run_start = _Window(), None, None, time.perf_counter()
    unread_losses: list[list[dict]] = []  # per step, read (one sync) when the window is logged or saved
    first_unread = start_step + 1  # 1-based number of the oldest step in unread_losses
    on_signal = train.exit_signal_handler if train.exit_signal_handler is not None else bool(recipe.checkpoint.save)
    stop = StopOnSignal(on_signal, ctx.device, train.exit_signal)
    done, saved_at = start_step, None
    try:
        for step in range(start_step, train.train_iters):
            timer.start_step()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=forward_step,
                data_iterator=run.batches.for_step(step),
                model=[model],
                num_microbatches=run.batches.num_microbatches,
                seq_length=recipe.model.seq_length,
                micro_batch_size=train.micro_batch_size,
                forward_only=False,
            )
            timer.end_forward_backward()
            update_ok, grad_norm, _ = optimizer.step()
            if run.qk_clip:  # MuonClip: part of the step, after the update (a skipped step clips nothing)
                run.qk_clip.after_step(update_ok)
            if update_ok:
                run.scheduler.step(increment=1)  # schedule counted in iterations
            unread_losses.append(losses)
            bar.update(1)
            done = step + 1
            if done == start_step + 1:
                _log_memory(run, bar)
                write_run_table(recipe, on_gpu=ctx.device.type == "cuda", is_main=ctx.is_main)  # collective
            stop_now = stop.agreed()  # the exit signal on any rank: log, save and end after this step, on every rank
            log_now = done % recipe.logging.log_interval == 0 or done == train.train_iters or stop_now
            save_now = bool(recipe.checkpoint.save and (stop_now or recipe.checkpoint.save_interval
                                                        and done % recipe.checkpoint.save_interval == 0))
            if log_now or save_now:  # a save is not timed as part of the next step
                for (step_s, optimizer_s), step_losses in zip(timer.read(), unread_losses, strict=True):
                    loss = global_mean_loss(step_losses)
                    first_loss = loss if first_loss is None else first_loss
                    last_loss = loss
                    window.add(step_s, optimizer_s, loss)
                unread_losses, first_unread = [], done + 1
            if log_now:
                record = _step_record(run, window, done, update_ok, grad_norm)
                if log:
                    log.write(record)
                    bar.write(format_step(record, train.train_iters))
                window = _Window()
            if save_now:
                _save(recipe, run, done)
                saved_at = done
            if stop_now:
                break
    except BaseException as error:  # a crash or Ctrl-C: keep what the log has not shown yet
        if isinstance(error, torch.OutOfMemoryError):
            error.add_note(out_of_memory_hint(recipe))
        _record_failure(error, log, run.output_dir, _local_losses(unread_losses, first_unread))
        bar.close()
        raise
    finally:
        stop.close()
    bar.close()
    if recipe.checkpoint.save and saved_at != done and done > start_step:
        _save(recipe, run, done)
    summary = {"first_loss": first_loss, "last_loss": last_loss, "steps": done - start_step,
               "seconds": time.perf_counter() - run_start, "log": str(run.output_dir / LOG_FILE),
               "stopped_by_signal": done < train.train_iters}
    if evaluate is not None:
        summary.update(evaluate(model))
    if log:
        log.write({"event": "end", **summary})
        log.close()
        if recipe.logging.plot:
            plot = plot_run(read_jsonl(run.output_dir / LOG_FILE), run.output_dir / PLOT_FILE, recipe.name)
            if plot is not None:
                summary["plot"] = str(plot)
    return summary
