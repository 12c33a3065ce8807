"""What a run tells its user: a JSONL log (one record per logged step), console lines, and a loss/MFU plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable


class JsonlLog:
    """The run's JSONL file: a start record describing the run, then one per logged step, then an end record (or,
    if the run fails, a failed record with the error and the losses of the steps not logged yet). `append`: a
    resumed run continues the file (a new start record, then its steps) instead of replacing it."""

    def __init__(self, path: Path, append: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a" if append else "w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _fmt(value: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{unit}"


def format_step(record: dict[str, Any], train_iters: int) -> str:
    """One console line per logged step."""
    return (
        f"step {record['step']:>6}/{train_iters} | loss {record['loss']:.4f}"
        + (f" (mean of {record['loss_steps']} steps)" if record.get("loss_steps", 1) > 1 else "")
        + f" | lr {record['lr']:.3e} | "
        f"grad norm {_fmt(record.get('grad_norm'), '.3f')} | {record['tokens_per_s']:,.0f} tok/s | "
        f"MFU {_fmt(record['mfu'], '.1f', 100, '%')} | "
        f"all-SDPA-eq MFU {_fmt(record['mfu_all_sdpa'], '.1f', 100, '%')} | "
        f"opt step {record['optimizer_share'] * 100:.1f}% | mem {record['memory_gib']:.2f} GiB"
        + (f" | max logit {_fmt(record['max_attention_logit'], '.2f')}" if "max_attention_logit" in record else "")
    )


def recheck_mfu(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each logged step: the logged MFU next to FLOPs/token (recomputed from the recipe in the log's header)
    x tokens/s / (peak x GPUs), so anyone can confirm the MFU the run reported."""
    from megatron_muon.metrics import all_attention_flops_per_token, training_flops_per_token
    from megatron_muon.training.config import recipe_from_dict
    from megatron_muon.training.validation import model_shape

    start = records[0]
    shape = model_shape(recipe_from_dict(start["recipe"], where="the log's recipe"))
    flops, all_sdpa = training_flops_per_token(shape), all_attention_flops_per_token(shape)
    peak, gpus = start["peak_tflops_per_gpu"], start["world_size"]
    rows = []
    for record in (r for r in records if r.get("event") == "step"):
        by_hand = flops * record["tokens_per_s"] / (peak * 1e12 * gpus) if peak else None
        by_hand_sdpa = all_sdpa * record["tokens_per_s"] / (peak * 1e12 * gpus) if peak else None
        rows.append({"step": record["step"], "tokens_per_s": record["tokens_per_s"], "mfu_logged": record["mfu"],
                     "mfu_by_hand": by_hand, "mfu_all_sdpa_logged": record["mfu_all_sdpa"],
                     "mfu_all_sdpa_by_hand": by_hand_sdpa, "flops_per_token": flops})
    return rows


def plot_run(records: Iterable[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Loss and MFU (tokens/s when no MFU is known, e.g. on CPU) against the step, as a PNG (None without
    matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.get("event") == "step"]
    xs = [r["step"] for r in steps]
    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(xs, [r["loss"] for r in steps], color="tab:blue")
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    losses = [r["loss"] for r in steps]
    if losses and min(losses) > 0 and max(losses) / min(losses) > 20:
        ax_loss.set_yscale("log")
    ax_loss.grid(alpha=0.3)
    if steps and all(r.get("mfu") is not None for r in steps):
        ax_speed.plot(xs, [100 * r["mfu"] for r in steps], label="MFU", color="tab:green")
        ax_speed.plot(xs, [100 * r["mfu_all_sdpa"] for r in steps], label="all-SDPA-equivalent MFU",
                      color="tab:orange", linestyle="--")
        ax_speed.set(ylabel="MFU (%)", title="model FLOPs utilisation")
        ax_speed.legend()
    else:
        ax_speed.plot(xs, [r["tokens_per_s"] for r in steps], color="tab:green")
        ax_speed.set(ylabel="tokens/s", title="throughput (no peak known: MFU n/a)")
    ax_speed.set(xlabel="step")
    ax_speed.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
