"""Newton–Schulz schedules in training: loss curves of a small GPT and a small GDN hybrid trained with Muon on real
text, one run per (schedule, model, seed), so a 4-step schedule can be judged against the 5-step default
(`simple`×5) within run-to-run noise.

  python benchmarks/ns_schedule_training.py --out benchmarks/results/ns_schedule_training.md     # one GPU
  python benchmarks/ns_schedule_training.py --tiny --out /tmp/ns_schedule_training.md            # CPU smoke run

The text is the Python standard library's own `.py` sources (`sysconfig.get_paths()["stdlib"]`, site-packages left
out): it ships with every interpreter, so nothing is downloaded. Files in sorted path order; the ones whose path's
CRC32 is 0 mod 20 (about 5%) are the validation split, chosen by name so the split survives files coming and going
between Python versions. Both splits go through the package's own data path (`training/corpus.py`, byte tokenizer,
vocab 256) into megatron's GPTDataset, and each run is `training.loop.pretrain` on the `tiny-cpu` recipe with the
sizes below as `--set` overrides; per-step losses come from its JSONL log, the validation loss from its `evaluate`
hook. For one seed every schedule starts from the same weights and reads the same batches (both follow
`training.seed`), so only the schedule differs; the seeds measure the run-to-run noise.

Where one command may only run for minutes, split the runs over commands with the same `--out`: `--kinds gpt`, then
`--kinds hybrid --append` (runs already there with the same recipe are reused, the others kept). Outputs are
rewritten after every run, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import platform
import statistics
import sys
import sysconfig
import time
import zlib
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import package_versions, write_table_and_rows  # noqa: E402
from ns_schedule_training_report import (  # noqa: E402
    BASELINE, FINAL_WINDOW, HEADS, label, plot_curves, summarize, table_lines)

DEFAULT_SCHEDULES = "simple:5,polar_express:4,cans:4,simple:4,quintic:5"
KINDS = ("gpt", "hybrid")
VALID_EVERY, VALID_SEED = 20, 0  # the validation set is the same for every run
SKIPPED_DIRS = {"site-packages", "dist-packages"}
# Keys the variants set; `--set` may change anything else.
VARIANT_KEYS = {"optimizer.muon_coefficient_type": "--schedules", "optimizer.muon_num_ns_steps": "--schedules",
                "optimizer.muon_split_heads": "--schedules (NAME+heads:STEPS)",
                "model.kind": "--kinds", "training.seed": "--seeds", "data.path": "the corpus (fixed)",
                "logging.output_dir": "--work-dir"}
COMMON = ["model.vocab_size=256", "data.eod_id=255", "optimizer.name=muon", "logging.log_interval=1",
          "logging.progress_bar=false", "logging.plot=false"]
# default: about 24M (GPT) and 25M (hybrid) parameters, 16k tokens a step; tiny: the tiny-cpu model, a few steps.
SIZES = {
    "default": {
        "common": ["model.num_layers=8", "model.hidden_size=512", "model.ffn_hidden_size=1408",
                   "model.num_attention_heads=8", "model.num_query_groups=4", "model.kv_channels=64",
                   "model.seq_length=1024", "model.spec_backend=auto", "training.precision=bf16",
                   "training.train_iters=300", "training.micro_batch_size=16", "training.global_batch_size=16",
                   "optimizer.lr=2e-3", "optimizer.min_lr=2e-4", "optimizer.lr_warmup_iters=30"],
        "hybrid": ["model.layer_pattern=GGG*", "model.gdn_num_key_heads=4", "model.gdn_num_value_heads=4",
                   "model.gdn_key_head_dim=64", "model.gdn_value_head_dim=128"],
        "gpt": [], "valid_batches": 8, "corpus_stride": 1,
    },
    "tiny": {
        "common": ["model.num_layers=2", "model.layer_pattern=G*", "training.train_iters=20",
                   "optimizer.lr_warmup_iters=3", "model.seq_length=128", "training.micro_batch_size=8",
                   "training.global_batch_size=8", "training.precision=fp32"],
        "hybrid": [], "gpt": [], "valid_batches": 2, "corpus_stride": 16,
    },
}


def parse_schedules(text: str) -> list[tuple[str, int]]:
    """'simple:5,cans:4,simple+heads:5' -> [('simple', 5), ('cans', 4), ('simple+heads', 5)], checked against the
    coefficient table (`+heads`: per-head orthogonalization of the fused projections)."""
    from megatron_muon.kernels.coefficients import COEFFICIENT_SETS

    schedules = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, _, steps = item.partition(":")
        if name.removesuffix(HEADS) not in COEFFICIENT_SETS or not steps.isdigit() or int(steps) < 1:
            raise ValueError(f"--schedules entry '{item}' must be NAME:STEPS or NAME{HEADS}:STEPS with NAME one of "
                             f"{', '.join(sorted(COEFFICIENT_SETS))} and STEPS >= 1, e.g. polar_express:4")
        schedules.append((name, int(steps)))
    if BASELINE not in schedules:
        raise ValueError(f"--schedules must include {BASELINE[0]}:{BASELINE[1]}, the default every difference is "
                         f"measured against; add it, e.g. --schedules {BASELINE[0]}:{BASELINE[1]},{text}")
    if len(set(schedules)) != len(schedules):
        raise ValueError(f"--schedules '{text}' names a schedule twice; list each NAME:STEPS once")
    return schedules


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--seeds '{text}' must be a comma list of integers, e.g. 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds '{text}' must name at least one seed, each once, e.g. 1,2,3")
    return seeds


def parse_kinds(text: str) -> list[str]:
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    if not kinds or set(kinds) - set(KINDS) or len(set(kinds)) != len(kinds):
        raise ValueError(f"--kinds '{text}' must be a comma list of {', '.join(KINDS)}, each once")
    return kinds


def stdlib_corpus(stride: int = 1) -> dict:
    """The standard library's `.py` files (relative paths, sorted) split into train and validation by name; `stride`
    keeps every stride-th file of each split (smoke runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                   if not SKIPPED_DIRS & set(path.relative_to(root).parts[:-1]))
    if not names:
        raise ValueError(f"no .py files under {root}; run with an interpreter that ships its standard library sources")
    valid = [n for n in names if zlib.crc32(n.encode()) % VALID_EVERY == 0]
    train = [n for n in names if zlib.crc32(n.encode()) % VALID_EVERY != 0]
    train, valid = train[::stride], valid[::stride]
    listing = "\n".join(f"{split}\t{n}\t{(root / n).stat().st_size}"
                        for split, files in (("train", train), ("valid", valid)) for n in files)
    return {"root": str(root), "python": platform.python_version(), "train_files": train, "valid_files": valid,
            "fingerprint": hashlib.sha256(listing.encode()).hexdigest()[:12]}


def prepare_corpus(corpus: dict, data_dir: Path) -> dict[str, dict]:
    """Each split as a megatron indexed dataset, written once per corpus fingerprint: {split: {prefix, tokens, ...}}."""
    from megatron_muon.training.corpus import ByteTokenizer, read_documents, write_indexed_dataset

    prepared = {}
    for split in ("train", "valid"):
        prefix = data_dir / f"stdlib-{corpus['fingerprint']}-{split}"
        meta_path = Path(f"{prefix}.meta.json")  # written last: its presence means a finished dataset
        if not meta_path.is_file():
            files = [str(Path(corpus["root"]) / name) for name in corpus[f"{split}_files"]]
            write_indexed_dataset(read_documents(files), str(prefix), ByteTokenizer())
        prepared[split] = {"prefix": str(prefix), **json.loads(meta_path.read_text())}
    return prepared


def check_overrides(user: list[str]) -> None:
    for assignment in user:
        key = assignment.partition("=")[0].strip()
        if key in VARIANT_KEYS:
            raise ValueError(f"--set {key} is what the variants vary; choose it with {VARIANT_KEYS[key]}")


def variant_recipe(size: str, kind: str, schedule: tuple[str, int], seed: int, train_prefix: str, work_dir: Path,
                   user: list[str]):
    from megatron_muon.training.recipes import load_recipe
    from megatron_muon.training.validation import validate

    check_overrides(user)
    name, steps = schedule
    run_dir = work_dir / f"{kind}_{name.replace(HEADS, '_heads')}{steps}_seed{seed}"
    overrides = [*COMMON, *SIZES[size]["common"], *SIZES[size][kind], *user, f"model.kind={kind}",
                 f"optimizer.muon_coefficient_type={name.removesuffix(HEADS)}", f"optimizer.muon_num_ns_steps={steps}",
                 f"optimizer.muon_split_heads={str(name.endswith(HEADS)).lower()}",
                 f"training.seed={seed}", f"data.path=[{train_prefix}]", f"data.cache_dir={work_dir / 'data_cache'}",
                 f"logging.output_dir={run_dir}"]
    return validate(load_recipe("tiny-cpu", overrides), 1)


def valid_evaluator(recipe, valid_prefix: str, batches: int, ctx):
    """`evaluate(model)` for `pretrain`: the mean loss over `batches` global batches of the validation split, the
    same batches for every run (fixed seed, recipe's batch shape)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_muon.training.data import MicroBatches, build_train_dataset
    from megatron_muon.training.loop import forward_step, global_mean_loss

    train = recipe.training
    dataset = build_train_dataset(replace(recipe, data=replace(recipe.data, path=[valid_prefix]),
                                          training=replace(train, seed=VALID_SEED, train_iters=batches)),
                                  Path(recipe.data.cache_dir).parent)
    micro = MicroBatches(dataset, train.micro_batch_size, train.global_batch_size, 0, 1, ctx.device)

    def evaluate(model) -> dict[str, float]:
        forward_backward, losses = get_forward_backward_func(), []
        model.eval()
        with torch.no_grad():
            for step in range(batches):
                losses.append(global_mean_loss(forward_backward(
                    forward_step_func=forward_step, data_iterator=micro.for_step(step), model=[model],
                    num_microbatches=micro.num_microbatches, seq_length=recipe.model.seq_length,
                    micro_batch_size=train.micro_batch_size, forward_only=True)))
        model.train()
        return {"valid_loss": sum(losses) / len(losses)}

    return evaluate


def train_variant(recipe, ctx, evaluate) -> dict:
    """One pretrain run (its console lines go to console.txt beside its log); the per-step curve and end numbers."""
    from megatron_muon.training.loop import pretrain
    from megatron_muon.training.report import read_jsonl

    run_dir = Path(recipe.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "console.txt", "w") as console, contextlib.redirect_stdout(console):
        summary = pretrain(recipe, ctx, evaluate=evaluate)
    records = read_jsonl(Path(summary["log"]))
    steps = [r for r in records if r.get("event") == "step"]
    start = next(r for r in records if r.get("event") == "start")
    losses = [r["loss"] for r in steps]
    tail = losses[-max(1, round(FINAL_WINDOW * len(losses))):]
    timed = steps[min(len(steps) - 1, 5):]  # past the first steps' compile and autotune
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"loss": losses, "grad_norm": [r["grad_norm"] for r in steps], "final_train_loss": sum(tail) / len(tail),
            "valid_loss": summary["valid_loss"], "seconds": summary["seconds"],
            "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in timed),
            "optimizer_share": statistics.median(r["optimizer_share"] for r in timed),
            "parameters": start["local_parameters_rank0"], "flops_per_token": start["flops_per_token"],
            "tokens_per_step": start["tokens_per_step"]}


def _same(run: dict, key: dict) -> bool:
    return all(run[k] == key[k] for k in ("kind", "schedule", "steps", "seed"))


def run_benchmark(args: argparse.Namespace, ctx, command: str) -> dict:
    """Every (model, schedule, seed) run in turn, outputs rewritten after each so a cut-short run keeps its numbers;
    returns {'meta', 'rows', 'runs'}. Needs the process group (`init_distributed`) to exist."""
    schedules, seeds, kinds = parse_schedules(args.schedules), parse_seeds(args.seeds), parse_kinds(args.kinds)
    size = "tiny" if args.tiny else "default"
    corpus = stdlib_corpus(SIZES[size]["corpus_stride"])
    data = prepare_corpus(corpus, args.work_dir / "data")
    curves_path = args.out.with_name(args.out.stem + "_curves.json")
    earlier = json.loads(curves_path.read_text()) if args.append and curves_path.is_file() else {"meta": {}, "runs": []}
    previous = earlier["runs"]
    plan = [(kind, schedule, seed) for kind in kinds for schedule in schedules for seed in seeds]
    recipes = {key: variant_recipe(size, key[0], key[1], key[2], data["train"]["prefix"], args.work_dir, args.set)
               for key in plan}
    first = recipes[plan[0]]
    batches = SIZES[size]["valid_batches"]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
            "commands": [*earlier["meta"].get("commands", []), command],
            "device": ctx.device_name if ctx.device.type == "cuda" else f"CPU ({platform.machine()})",
            "versions": {"python": platform.python_version(), **package_versions()},
            "corpus": {k: v for k, v in corpus.items() if not k.endswith("_files")},
            "data": {split: {k: v for k, v in d.items() if k != "prefix"} for split, d in data.items()},
            "seeds": seeds, "schedules": [label(*s) for s in schedules], "kinds": kinds, "size": size,
            "overrides": {kind: [*COMMON, *SIZES[size]["common"], *SIZES[size][kind], *args.set] for kind in kinds},
            "valid_tokens": batches * first.training.global_batch_size * first.model.seq_length,
            "setup": f"{first.training.train_iters} steps of {first.training.global_batch_size} × "
                     f"{first.model.seq_length} tokens, {first.training.precision}, lr {first.optimizer.lr:g} "
                     f"(warmup {first.optimizer.lr_warmup_iters}, {first.optimizer.lr_decay_style} to "
                     f"{first.optimizer.min_lr:g})"}
    evaluate = valid_evaluator(first, data["valid"]["prefix"], batches, ctx)
    keys = [{"kind": k, "schedule": s[0], "steps": s[1], "seed": seed, "recipe": recipes[(k, s, seed)].to_dict()}
            for k, s, seed in plan]
    # --append: runs of the same recipe are reused, runs outside this plan (another --kinds, say) kept
    runs, started = [r for r in previous if not any(_same(r, key) for key in keys)], time.perf_counter()
    for index, ((kind, schedule, seed), key) in enumerate(zip(plan, keys), 1):
        done = next((r for r in previous if _same(r, key) and r["recipe"] == key["recipe"]), None)
        run = done or {**key, **train_variant(recipes[(kind, schedule, seed)], ctx, evaluate)}
        runs.append(run)
        left = (time.perf_counter() - started) / index * (len(plan) - index)
        print(f"[{index}/{len(plan)}] {kind} {label(*schedule)} seed {seed}: train loss {run['final_train_loss']:.4f} "
              f"(last {FINAL_WINDOW:.0%}), validation {run['valid_loss']:.4f}, "
              + ("from --append" if done else f"{run['seconds']:.1f} s ({run['step_ms']:.1f} ms/step)")
              + f"; about {left:.0f} s left", flush=True)
        rows = summarize(runs)
        write_table_and_rows(args.out, table_lines(meta, rows), meta, rows)
        curves_path.write_text(json.dumps({"meta": meta, "runs": runs}))
    plot = plot_curves(args.out.with_name(args.out.stem + "_curves.png"), runs,
                       list(dict.fromkeys(r["kind"] for r in runs)))
    print("\n".join(table_lines(meta, rows)) + f"\n\nwrote {args.out}, {args.out.with_suffix('.json')}, {curves_path}"
          + (f", {plot}" if plot else " (no plot: matplotlib is not installed)"), flush=True)
    return {"meta": meta, "rows": rows, "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                        help=f"comma list of NAME:STEPS (must include simple:5); default {DEFAULT_SCHEDULES}")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma list of gpt, hybrid")
    parser.add_argument("--seeds", default="1,2,3", help="comma list of training seeds (init and data order)")
    parser.add_argument("--tiny", action="store_true", help="the tiny-cpu model, 20 steps, 1/16 of the corpus: CPU")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe value of every run (sizes, steps, lr, ...), repeatable")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ns_schedule_training.md"),
                        help="the table; beside it .json (summary rows), _curves.json (per-step), _curves.png")
    parser.add_argument("--append", action="store_true",
                        help="reuse the runs already in --out's _curves.json with the same recipe (split a long run)")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/ns_schedule_training"),
                        help="datasets, megatron's index cache and each run's JSONL log")
    return parser


def main(argv=None) -> None:
    from megatron_muon.cli.main import quiet_megatron
    from megatron_muon.training.distributed import init_distributed, shutdown_distributed

    args = build_parser().parse_args(argv)
    command = "python " + " ".join([sys.argv[0] if argv is None else "benchmarks/ns_schedule_training.py",
                                    *(sys.argv[1:] if argv is None else argv)])
    # before any process group or dataset
    parse_schedules(args.schedules), parse_seeds(args.seeds), parse_kinds(args.kinds), check_overrides(args.set)
    quiet_megatron()
    ctx = init_distributed(1, 1)
    try:
        run_benchmark(args, ctx, command)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
