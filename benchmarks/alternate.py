"""Same-machine A/B of source trees: run one benchmark script from each tree in turn, several rounds, and table the
medians of every row the scripts report.

Single runs of a whole optimizer step spread by 2-5 ms between runs on one machine, as much as the changes being
compared. Alternating the trees round by round spreads drift (clocks, temperature) over all of them. Each run is a
fresh process with the tree first on `PYTHONPATH`, so every tree is imported and autotuned on its own.

    python benchmarks/alternate.py --trees main=/tmp/main new=/tmp/new --rounds 3 --out /tmp/ab.md \\
        --per "fused AdamW, all params" -- benchmarks/optimizer_step.py --only-ours

The script path and its arguments follow `--`; the script must accept `--out FILE` and write markdown tables
(every script in `benchmarks/` does). A row's label is its cells before the first number; its value is that number.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_env import emit_markdown  # benchmarks/ is the script's directory

NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")


def parse_tree(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--trees takes NAME=PATH entries, got {text!r}")
    root = Path(path).resolve()
    if not root.is_dir():
        raise argparse.ArgumentTypeError(f"tree {name!r}: {root} is not a directory")
    return name, root


def table_rows(markdown: str) -> dict[str, float]:
    """label -> first number, for every markdown table row that has a number (header and rule rows have none)."""
    rows = {}
    for line in markdown.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for index, cell in enumerate(cells):
            if NUMBER.match(cell.replace(",", "")):
                label = " / ".join(cells[:index])
                if label:
                    rows.setdefault(label, float(cell.replace(",", "")))
                break
    return rows


def run_once(root: Path, script: str, script_args: list[str], out: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(root / script), *script_args, "--out", str(out)]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed in {root} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return table_rows(out.read_text())


def per_unit(runs: dict[str, list[dict[str, float]]], unit: str) -> dict[str, list[dict[str, float]]]:
    """Every row over the `unit` row of the same run: a ratio each process measures against its own baseline, so
    that a baseline which moves between processes moves both sides of it."""
    if not any(unit in run for tree_runs in runs.values() for run in tree_runs):
        labels = sorted({label for tree_runs in runs.values() for run in tree_runs for label in run})
        raise SystemExit(f"--per {unit!r} names no row the script reported; its rows: {labels}")
    return {name: [{label: value / run[unit] for label, value in run.items()} for run in tree_runs if run.get(unit)]
            for name, tree_runs in runs.items()}


def summarize(names: list[str], runs: dict[str, list[dict[str, float]]], digits: int = 2) -> list[str]:
    """One row per label: each tree's median (min-max), and each tree's median over the first tree's."""
    labels = list(dict.fromkeys(label for name in names for run in runs[name] for label in run))
    header = ["row", *(f"{name}: median (min–max)" for name in names), *(f"{name} / {names[0]}" for name in names[1:])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in labels:
        medians, cells = {}, []
        for name in names:
            values = [run[label] for run in runs[name] if label in run]
            if values:
                medians[name] = statistics.median(values)
                cells.append(f"{medians[name]:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})")
            else:
                cells.append("")
        base = medians.get(names[0])
        ratios = [f"{medians[name] / base:.3f}" if base and name in medians else "" for name in names[1:]]
        lines.append("| " + " | ".join([label, *cells, *ratios]) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: alternate.py --trees A=PATH B=PATH [--rounds N] [--out FILE] -- SCRIPT [ARGS...]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=parse_tree, required=True, help="NAME=PATH, the first is the base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="markdown result file (printed either way)")
    parser.add_argument("--per", default=None, metavar="ROW",
                        help="also table every row over this row of the same run (e.g. 'fused AdamW, all params')")
    args = parser.parse_args(argv[:split])
    script, *script_args = argv[split + 1:] or [""]
    if not script:
        raise SystemExit("name the benchmark script after --")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    names = [name for name, _ in args.trees]
    if len(set(names)) != len(names):
        raise SystemExit(f"tree names must differ, got {names}")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, root in args.trees:
                out = Path(scratch) / f"{name}_{round_index}.md"
                runs[name].append(run_once(root, script, script_args, out))
                if args.per is not None and round_index == 0:
                    per_unit({name: runs[name]}, args.per)  # a misspelt row stops here, not after every round
                print(f"round {round_index + 1}/{args.rounds}: {name} done", flush=True)
    lines = [f"# Alternating A/B: `{' '.join([script, *script_args])}`", "",
             f"- {args.rounds} rounds, trees in this order each round: "
             + ", ".join(f"{name} = `{root}`" for name, root in args.trees),
             f"- command: `python benchmarks/alternate.py {' '.join(argv)}`", "", *summarize(names, runs)]
    if args.per is not None:
        lines += ["", f"Each row over \"{args.per}\" of the same run (the ratio each process measured):", "",
                  *summarize(names, per_unit(runs, args.per), digits=3)]
    emit_markdown(lines, args.out)


if __name__ == "__main__":
    main()
