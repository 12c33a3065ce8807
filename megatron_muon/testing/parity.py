"""Cross-layout parity of Muon training: the same tiny model trained on any (tp, pp, dp) layout must end where the
single-process run ends, up to the rounding that megatron's layout-dependent reductions introduce.

`run` trains on one layout (NCCL with one GPU per rank when GPUs are present, gloo + CPU mode otherwise) from
layout-independent initial weights and saves the full parameters; `compare` checks every saved run against the
reference layout's run of the same model and precision. Usage:

    torchrun --standalone --nproc-per-node 8 -m megatron_muon.testing.parity run --layout 2,2,2 \\
        --model gpt --precision bf16 --optimizer dist_muon --steps 20 --out DIR
    python -m megatron_muon.testing.parity compare DIR --reference 1,1,1

Checkpoints that reshard: `run --layout 2,1,2 --save-at 10 --checkpoint CKPT` trains 20 steps and saves after 10;
`run --layout 1,1,4 4,1,1 --resume CKPT` loads that checkpoint on other layouts and trains steps 11-20 (run files
`*_resumed.pt`); `compare DIR --reference 2,1,2` then holds every resumed run to the uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

# Bounds on the max relative parameter error after 20 steps: fp32 is the rounding bound the CPU layout tests use;
# fp64 leaves layout rounding at ~1e-16, so issue #5's 1e-6 holds as stated, with a wide margin on gloo and NCCL.
# bf16 rounds every forward/backward to 8 bits of mantissa, and 20 Muon steps amplify that across layouts beyond
# 3e-2 on gloo and NCCL: layout exactness is fp64's check; bf16's bound is for `--reference same` (megatron's Muon
# at the same layout). The measured errors: docs/design/distributed.md.
DEFAULT_RTOL = {"fp32": 2e-3, "bf16": 3e-2, "fp64": 1e-6}
SEED = 1234
SAVED_STEP_FILE = "parity_step.txt"
# The tiny models with as many key/value heads as attention heads, so that every tp up to 4 divides them; the
# reference run uses the same shapes, so layouts stay comparable.
MAX_TP, MAX_PP = 4, 2
TP_READY_SIZES = {"gpt": dict(num_query_groups=4),
                  "hybrid": dict(num_query_groups=4, linear_num_key_heads=4, linear_num_value_heads=8)}


def parse_layout(text: str) -> tuple[int, int, int]:
    try:
        tp, pp, dp = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"layout must be three integers TP,PP,DP such as 2,1,4; got {text!r}") from None
    if min(tp, pp, dp) < 1:
        raise ValueError(f"layout sizes must be >= 1, got {text!r}")
    if MAX_TP % tp != 0 or MAX_PP % pp != 0:
        raise ValueError(f"the tiny models have {MAX_TP} heads and {MAX_PP} layers: tp must divide {MAX_TP} and pp "
                         f"must divide {MAX_PP}; got {text!r} (put the remaining GPUs into dp)")
    return tp, pp, dp


def run_file_name(model: str, precision: str, optimizer: str, layout: tuple[int, int, int],
                  resumed: bool = False) -> str:
    tp, pp, dp = layout
    return f"{model}_{precision}_{optimizer}_tp{tp}pp{pp}dp{dp}{'_resumed' if resumed else ''}.pt"


def checkpoint_directory(root: str | Path, model: str, precision: str, optimizer: str) -> Path:
    """Where `--save-at` writes (and `--resume` reads) the checkpoint of one model, precision and optimizer."""
    return Path(root) / f"{model}_{precision}_{optimizer}"


def _saved_step(directory: Path) -> int:
    """The step a `--save-at` checkpoint was written after (a dist checkpoint alone does not record it)."""
    marker = directory / SAVED_STEP_FILE
    if not marker.is_file():
        raise ValueError(f"{directory} holds no parity checkpoint ({SAVED_STEP_FILE} missing); write one with "
                         "`parity run --save-at K --checkpoint ROOT` using the same model, precision and optimizer")
    return int(marker.read_text())


def command(ranks: int | None = None) -> list[str]:
    """The command line that runs this module: directly, or under torchrun with `ranks` local ranks on a free port."""
    module = [sys.executable, "-m", "megatron_muon.testing.parity"]
    if ranks is None:
        return module
    from megatron_muon.testing.pool import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *module[1:]]


def check_launch(layout: tuple[int, int, int]) -> None:
    """Fail before any process group exists when the launch cannot hold `layout`."""
    from megatron_muon.training.distributed import launched_world_size

    tp, pp, dp = layout
    world_size = launched_world_size()
    if world_size != tp * pp * dp:
        raise ValueError(f"layout tp={tp} pp={pp} dp={dp} needs {tp * pp * dp} ranks but the launch has "
                         f"{world_size}; use torchrun --nproc-per-node {tp * pp * dp} (or change --layout)")
    if torch.cuda.is_available():
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if torch.cuda.device_count() < local_ranks:
            raise ValueError(f"{local_ranks} ranks on this node but only {torch.cuda.device_count()} visible GPUs; "
                             "launch one rank per GPU (check CUDA_VISIBLE_DEVICES and --nproc-per-node)")


def _pipeline_loss(loss: float, device: torch.device) -> float:
    """The step's loss (known on the last pipeline stage only) on every rank of the pipeline."""
    from megatron.core import parallel_state as ps

    tensor = torch.tensor([loss], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, group=ps.get_pipeline_model_parallel_group())
    return float(tensor)


def _gather_full_parameters(model) -> dict[str, torch.Tensor]:
    """All stages' tp-gathered fp32 parameters on rank 0 (empty elsewhere); one replica per stage sends."""
    from megatron.core import parallel_state as ps

    from megatron_muon.testing.training import full_parameters

    params = {name: tensor.cpu() for name, tensor in full_parameters(model).items()}
    sends = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    gathered = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(params if sends else {}, gathered, dst=0)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered or []:
        overlap = merged.keys() & part.keys()
        assert not overlap, f"two pipeline stages claim {sorted(overlap)[:3]}"
        merged.update(part)
    return merged


def run(args: argparse.Namespace) -> int:
    """Train each layout in turn in this launch (they share the world size) and write one run file per layout."""
    from megatron_muon.training.distributed import shutdown_distributed

    layouts = [parse_layout(text) for text in args.layout]
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if (args.save_at is None) != (args.checkpoint is None):
        raise ValueError("--save-at K and --checkpoint DIR go together: save after step K into DIR")
    if args.save_at is not None and not (0 < args.save_at < args.steps and len(layouts) == 1 and not args.resume):
        raise ValueError(f"--save-at needs 0 < K < --steps ({args.steps}), one --layout and no --resume; got "
                         f"K={args.save_at} with {len(layouts)} layouts")
    for tp, pp, dp in layouts:
        if args.global_microbatches % dp != 0:
            raise ValueError(f"--global-microbatches {args.global_microbatches} must be divisible by dp={dp}")
        check_launch((tp, pp, dp))
    for model in args.model:
        for precision in args.precision:
            if args.resume:  # before any training: a missing checkpoint fails the launch at once
                _saved_step(checkpoint_directory(args.resume, model, precision, args.optimizer))
            for layout in layouts:
                run_layout(args, layout, model, precision)
    shutdown_distributed()
    return 0


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "unknown"


def run_layout(args: argparse.Namespace, layout: tuple[int, int, int], model_name: str, precision: str) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_muon.megatron.checkpointing import load_checkpoint, save_checkpoint
    from megatron_muon.testing.training import build_muon_setup, train_step
    from megatron_muon.training.distributed import init_distributed

    tp, pp, dp = layout
    context = init_distributed(tp, pp)
    if precision == "fp64":  # FLA's GDN kernels have no fp64; the torch GDN ops iterate in the input dtype
        from megatron_muon.ops.backend import set_backend

        set_backend("torch")
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    model, optimizer = build_muon_setup(args.optimizer, precision, model_name, lr=args.lr,
                                        config_overrides=TP_READY_SIZES[model_name])
    first_step = 0
    if args.resume:
        source = checkpoint_directory(args.resume, model_name, precision, args.optimizer)
        first_step = _saved_step(source)
        load_checkpoint(model, optimizer, source)
    backend = torch.distributed.get_backend()
    if context.is_main:
        print(f"parity run: {model_name} {precision} {args.optimizer} tp={tp} pp={pp} dp={dp} "
              f"on {context.world_size} x {context.device_name} ({backend})"
              + (f", resumed after step {first_step}" if args.resume else ""), flush=True)
    losses = []
    for step in range(first_step, args.steps):
        start = time.perf_counter()
        loss = _pipeline_loss(train_step(model, optimizer, step, global_microbatches=args.global_microbatches),
                              context.device)
        losses.append(loss)
        if context.is_main:
            print(f"step {step + 1:3d}/{args.steps}  loss {loss:.6f}  {time.perf_counter() - start:.3f} s",
                  flush=True)
        if args.save_at == step + 1:
            target = checkpoint_directory(args.checkpoint, model_name, precision, args.optimizer)
            save_checkpoint(model, optimizer, target)
            if context.is_main:
                (target / SAVED_STEP_FILE).write_text(f"{step + 1}\n")
    params = _gather_full_parameters(model)
    if context.is_main:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / run_file_name(model_name, precision, args.optimizer, layout, resumed=bool(args.resume))
        record = dict(
            model=model_name, precision=precision, optimizer=args.optimizer, first_step=first_step,
            layout=dict(tp=tp, pp=pp, dp=dp), world_size=context.world_size, backend=backend,
            device=context.device_name, steps=args.steps, global_microbatches=args.global_microbatches,
            lr=args.lr, torch_version=str(torch.__version__), megatron_core_version=_megatron_version(),
            losses=losses, params=params,
        )
        torch.save(record, path)
        print(f"wrote {path} ({len(params)} parameters)", flush=True)


_RUN_KEYS = ("model", "precision", "optimizer", "layout", "steps", "global_microbatches", "lr", "losses", "params")


def _load_run(path: Path) -> dict:
    record = torch.load(path, weights_only=True)
    missing = [key for key in _RUN_KEYS if not isinstance(record, dict) or key not in record]
    if missing:
        raise ValueError(f"not a parity run file (missing {missing})")
    return record


def _layout_of(record: dict) -> tuple[int, int, int]:
    return tuple(record["layout"][key] for key in ("tp", "pp", "dp"))


def _compare_run(record: dict, reference: dict, rtol: float) -> dict:
    """One table row: the worst parameter's relative error and the loss curves' relative gap against `reference`."""
    from megatron_muon.testing.training import max_relative_error

    for key in ("steps", "global_microbatches", "lr"):
        if record[key] != reference[key]:
            return dict(status="FAIL", note=f"{key} {record[key]} != reference {reference[key]}")
    first_step = record.get("first_step", 0)  # a resumed run holds the losses of the steps after its checkpoint
    params, reference_params = record["params"], reference["params"]
    if params.keys() != reference_params.keys():
        difference = sorted(params.keys() ^ reference_params.keys())
        return dict(status="FAIL", note=f"parameter names differ: {difference[:3]}")
    shapes = [n for n, t in reference_params.items() if t.shape != params[n].shape]
    if shapes:
        return dict(status="FAIL", note=f"shapes differ: {shapes[:3]}")
    worst, error = max_relative_error(reference_params, params)
    losses = torch.tensor(record["losses"], dtype=torch.float64)
    reference_losses = torch.tensor(reference["losses"][first_step:], dtype=torch.float64)
    loss_error = float(((losses - reference_losses).abs() / reference_losses.abs().clamp_min(1e-12)).max())
    finite = all(bool(t.isfinite().all()) for t in params.values()) and bool(losses.isfinite().all())
    passed = finite and error <= rtol and loss_error <= rtol
    return dict(status="ok" if passed else "FAIL", param_error=error, loss_error=loss_error, worst=worst,
                note="" if finite else "non-finite values")


def _pick_reference(runs: dict[Path, dict], record: dict, layout) -> tuple[Path, dict] | None:
    """The reference layout's run of the same model and precision (the same optimizer's when there is one); with
    `layout` None, the `muon` run of the record's own layout (isolates the optimizer from layout rounding)."""
    if layout is None:
        candidates = [(path, r) for path, r in runs.items() if _layout_of(r) == _layout_of(record)
                      and r["optimizer"] == "muon" and record["optimizer"] != "muon" and not r.get("first_step")
                      and (r["model"], r["precision"]) == (record["model"], record["precision"])]
        return candidates[0] if candidates else None
    candidates = [(path, r) for path, r in runs.items() if _layout_of(r) == layout and not r.get("first_step")
                  and (r["model"], r["precision"]) == (record["model"], record["precision"])]
    candidates.sort(key=lambda item: (item[1]["optimizer"] != record["optimizer"], item[0].name))
    return candidates[0] if candidates else None


def compare(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    reference_layout = None if args.reference == "same" else parse_layout(args.reference)
    paths = sorted(directory.glob("*.pt"))
    if not paths:
        raise ValueError(f"no run files (*.pt) in {directory}; write them with `parity run --out {directory}`")
    runs, rows = {}, []
    for path in paths:
        try:
            runs[path] = _load_run(path)
        except Exception as error:  # a truncated or foreign file is a failed comparison, not a crash
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            rows.append((path.name, "-", dict(status="FAIL", note=f"unreadable: {type(error).__name__}: {first_line}")))
    for path, record in runs.items():
        picked = _pick_reference(runs, record, reference_layout)
        if picked is None and reference_layout is None and record["optimizer"] == "muon":
            continue  # a same-layout reference itself
        if picked is None:
            rows.append((path.name, "-", dict(status="FAIL", note=f"no {record['model']} {record['precision']} run "
                                                                   f"at reference layout {args.reference} "
                                                                   f"({record['optimizer']} {_layout_of(record)})")))
            continue
        reference_path, reference = picked
        if reference_path == path:
            continue
        rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[record["precision"]]
        row = _compare_run(record, reference, rtol)
        row["rtol"] = rtol
        rows.append((path.name, reference_path.name, row))
    if not rows:
        raise ValueError(f"only reference-layout runs in {directory}: nothing to compare")
    _print_table(rows)
    failed = sum(row["status"] != "ok" for _, _, row in rows)
    print(f"{len(rows) - failed} of {len(rows)} runs match the reference" + (f"; {failed} FAILED" if failed else ""))
    return 1 if failed else 0


def _print_table(rows: list[tuple[str, str, dict]]) -> None:
    header = f"{'run':<44} {'reference':<44} {'param rel err':>13} {'loss rel err':>12} {'rtol':>8}  status"
    print(header)
    print("-" * len(header))
    for name, reference, row in rows:
        numbers = (f"{row['param_error']:>13.3e} {row['loss_error']:>12.3e} {row['rtol']:>8.1e}"
                   if "param_error" in row else f"{'-':>13} {'-':>12} {'-':>8}")
        detail = f"worst {row['worst']}" if row.get("worst") else ""
        notes = "; ".join(part for part in (row.get("note"), detail) if part)
        print(f"{name:<44} {reference:<44} {numbers}  {row['status']}  {notes}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_muon.testing.parity", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="train one layout (launch with torchrun) and save its parameters")
    run_parser.add_argument("--layout", required=True, nargs="+",
                            help="TP,PP,DP, e.g. 2,1,4; several layouts of the launch's world size run in turn")
    run_parser.add_argument("--model", choices=("gpt", "hybrid"), nargs="+", default=["gpt"],
                            help="one or more; each model runs every precision and layout in turn")
    run_parser.add_argument("--precision", choices=("fp32", "bf16", "fp64"), nargs="+", default=["fp32"],
                            help="fp64: float64 parameters, gradients, momentum, Newton–Schulz and loss, no "
                                 "gradient clipping (megatron clips fp32 gradients only)")
    run_parser.add_argument("--optimizer", choices=("dist_muon", "muon"), default="dist_muon")
    run_parser.add_argument("--steps", type=int, default=20)
    run_parser.add_argument("--global-microbatches", type=int, default=8,
                            help="micro-batches per step over all dp ranks (divisible by dp; same for every layout)")
    run_parser.add_argument("--lr", type=float, default=0.01)
    run_parser.add_argument("--out", required=True, help="directory for the run file")
    run_parser.add_argument("--save-at", type=int, default=None, metavar="K",
                            help="save a checkpoint after step K (with --checkpoint; one layout) and keep training")
    run_parser.add_argument("--checkpoint", default=None, metavar="DIR", help="where --save-at writes")
    run_parser.add_argument("--resume", default=None, metavar="DIR",
                            help="load the --save-at checkpoint under DIR and train the steps after it")
    compare_parser = commands.add_parser("compare", help="compare every run in a directory with the reference")
    compare_parser.add_argument("directory")
    compare_parser.add_argument("--reference", default="1,1,1",
                                help="reference layout TP,PP,DP, or 'same': each run against the muon run of its "
                                     "own layout")
    compare_parser.add_argument("--rtol", type=float, default=None,
                                help=f"max relative error allowed (default by precision: {DEFAULT_RTOL})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args) if args.command == "run" else compare(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
