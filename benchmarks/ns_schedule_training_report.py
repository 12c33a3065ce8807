"""The schedule-training benchmark's summary (mean, spread, difference to simple×5), its markdown table and its
loss-curve plot (benchmarks/ns_schedule_training.py)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

BASELINE = ("simple", 5)
HEADS = "+heads"  # a schedule name's suffix: the same schedule with QKV / GDN in_proj orthogonalized per head
FINAL_WINDOW = 0.1  # the train loss reported: the mean over the last 10% of steps


def label(name: str, steps: int) -> str:
    return f"{name.removesuffix(HEADS)}×{steps}" + (" per head" if name.endswith(HEADS) else "")


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def summarize(runs: list[dict]) -> list[dict]:
    """Per (model, schedule): mean and sample sd over seeds of the final-window train loss and the validation loss,
    and the difference to the baseline's mean, also in units of σ = √((sd² + sd_baseline²)/2), with the per-seed
    (paired: same init and data) differences."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["kind"], run["schedule"], run["steps"]), []).append(run)
    rows = []
    for (kind, name, steps), members in groups.items():
        base = {r["seed"]: r for r in groups.get((kind, *BASELINE), [])}
        row = {"kind": kind, "schedule": name, "steps": steps, "seeds": [r["seed"] for r in members],
               "step_ms": statistics.median(r["step_ms"] for r in members),
               "optimizer_share": statistics.median(r["optimizer_share"] for r in members)}
        for key in ("final_train_loss", "valid_loss"):
            mean, sd = _mean_sd([r[key] for r in members])
            base_mean, base_sd = _mean_sd([r[key] for r in base.values()]) if base else (math.nan, math.nan)
            sigma = math.sqrt((sd ** 2 + base_sd ** 2) / 2)
            delta = mean - base_mean
            row[key] = {"mean": mean, "sd": sd, "min": min(r[key] for r in members),
                        "max": max(r[key] for r in members), "delta": delta,
                        "delta_sigma": delta / sigma if sigma > 0 else math.nan,
                        "paired_deltas": [r[key] - base[r["seed"]][key] for r in members if r["seed"] in base]}
        rows.append(row)
    return rows


def _delta_text(stat: dict, is_baseline: bool) -> str:
    if is_baseline:
        return "— (the unit)"
    sigma = "n/a σ" if math.isnan(stat["delta_sigma"]) else f"{stat['delta_sigma']:+.1f}σ"
    return f"{stat['delta']:+.4f} ({sigma})"


def table_lines(meta: dict, rows: list[dict]) -> list[str]:
    setup = meta["setup"]
    lines = ["# Newton–Schulz schedules in training: loss against the 5-step default", "",
             f"- {meta['date']}; {meta['device']}; " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- command: `{meta['command']}`",
             f"- text: the Python {meta['corpus']['python']} standard library's .py files (fingerprint "
             f"{meta['corpus']['fingerprint']}), byte tokens: train {meta['data']['train']['tokens']:,} tokens in "
             f"{meta['data']['train']['documents']} files, validation {meta['data']['valid']['tokens']:,} in "
             f"{meta['data']['valid']['documents']} other files",
             f"- runs: {setup}; seeds {', '.join(map(str, meta['seeds']))} (per seed every schedule starts from the "
             "same weights and reads the same batches)",
             f"- train loss: mean of the last {FINAL_WINDOW:.0%} of steps; validation loss: "
             f"{meta['valid_tokens']:,} tokens of the validation split after the last step; mean ± sample sd over "
             "seeds; Δ: mean minus simple×5's mean, in units of σ = √((sd² + sd_simple×5²)/2); per-seed "
             "(paired) differences, same init and batches: min … max over seeds. The data order follows the seed, so "
             "the train loss's sd over seeds holds how hard each seed's last batches are; judge by the validation "
             "loss (one fixed set) and the paired differences", "",
             "| model | schedule | train loss | validation loss | Δ train | Δ validation | paired Δ train | "
             "paired Δ validation | step ms | optimizer share |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = (r["schedule"], r["steps"]) == BASELINE
        train, valid = r["final_train_loss"], r["valid_loss"]

        def spread(stat):
            return f"{stat['mean']:.4f}" + ("" if math.isnan(stat["sd"]) else f" ± {stat['sd']:.4f}")

        def paired(stat):
            deltas = stat["paired_deltas"]
            return "—" if base or not deltas else f"{min(deltas):+.4f} … {max(deltas):+.4f}"

        lines.append(f"| {r['kind']} | {label(r['schedule'], r['steps'])} | {spread(train)} | {spread(valid)} | "
                     f"{_delta_text(train, base)} | {_delta_text(valid, base)} | {paired(train)} | {paired(valid)} | "
                     f"{r['step_ms']:.1f} | {r['optimizer_share']:.0%} |")
    return lines


def plot_curves(path: Path, runs: list[dict], kinds: list[str]) -> Path | None:
    """Mean train loss over seeds per schedule (top) and each seed's difference to simple×5 on the same batches
    (bottom: thin per seed, bold their mean), smoothed over 5% of the steps; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values: list[float]) -> list[float]:
        width = max(1, len(values) // 20)
        return [statistics.fmean(values[max(0, i - width + 1): i + 1]) for i in range(len(values))]

    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 7), squeeze=False)
    for column, kind in enumerate(kinds):
        mine = [r for r in runs if r["kind"] == kind]
        base = {r["seed"]: r["loss"] for r in mine if (r["schedule"], r["steps"]) == BASELINE}
        for schedule in dict.fromkeys((r["schedule"], r["steps"]) for r in mine):
            group = [r for r in mine if (r["schedule"], r["steps"]) == schedule]
            (line,) = axes[0][column].plot(smooth([statistics.fmean(v) for v in zip(*(r["loss"] for r in group))]),
                                           label=label(*schedule))
            diffs = [[a - b for a, b in zip(r["loss"], base[r["seed"]])] for r in group if r["seed"] in base]
            if diffs and schedule != BASELINE:  # thin: each seed's paired difference; bold: their mean
                for diff in diffs:
                    axes[1][column].plot(smooth(diff), color=line.get_color(), alpha=0.3, linewidth=0.8)
                axes[1][column].plot(smooth([statistics.fmean(v) for v in zip(*diffs)]), color=line.get_color(),
                                     label=label(*schedule))
        axes[1][column].axhline(0, color="black", linewidth=0.8)
        axes[0][column].set(title=f"{kind}: train loss (mean over seeds)", xlabel="step", ylabel="loss", yscale="log")
        axes[1][column].set(title=f"{kind}: minus simple×5 (same seed)", xlabel="step", ylabel="Δ loss")
        for ax in axes[:, column]:
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
