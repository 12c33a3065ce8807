"""Markdown + JSON output of the end-to-end ladder, and the optional kernel profile of one rung."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

LOSS_PAIRS = (
    ("3", "2", "compiled vs eager, upstream spec"),
    ("4", "4e", "compiled vs eager, our spec"),
    ("4", "3", "our GDN vs megatron-core's GDN, compiled (different initial weights)"),
    ("2", "1", "cuDNN vs megatron-local attention"),
    ("2", "1r", "cuDNN vs megatron-local attention (recomputed)"),
    ("6", "5", "our Muon vs megatron-core Muon"),
)


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def loss_agreement(rows: dict) -> list[str]:
    """Step 1 (identical weights: forward numerics only) and the whole trajectory (training amplifies rounding)."""
    lines = []
    for a, b, what in LOSS_PAIRS:
        la, lb = rows.get(a, {}).get("losses"), rows.get(b, {}).get("losses")
        if la and lb:
            n = min(len(la), len(lb))
            mean_gap = sum(abs(x - y) for x, y in zip(la[:n], lb[:n])) / n
            mean_loss = sum(lb[:n]) / n
            lines.append(f"| {a} vs {b} | {what} | {abs(la[0] - lb[0]) / abs(lb[0]):.1e} "
                         f"| {mean_gap / mean_loss:.1%} | {la[-1]:.4f} / {lb[-1]:.4f} |")
    return lines


def loss_trajectories(rows: dict) -> list[str]:
    return [f"- rung {r['rung']}: " + " ".join(f"{x:.3f}" for x in r["losses"])
            for r in rows.values() if r.get("losses")]


def _clipped_steps(row: dict, warmup: int) -> str:
    """'k/n': how many of the timed steps megatron clipped (their pre-clipping norm above clip_grad)."""
    norms = [norm for norm in row["grad_norms"][warmup:] if norm is not None]
    return f"{sum(norm > row['clip_grad'] for norm in norms)}/{len(norms)}"


def write_report(md_path: Path, json_path: Path, rows: dict, meta: dict) -> None:
    json_path.write_text(json.dumps({"meta": meta, "rows": list(rows.values())}, indent=1))
    base_key = next((k for k in ("1", "1r", "2", "3") if rows.get(k, {}).get("step_ms")), None)  # rung 1 may OOM
    base = rows[base_key]["step_ms"] if base_key else None
    lines = [
        "# End-to-end ladder (hybrid-1.5B, one GPU)", "",
        f"- date {meta['date']}, device {meta['device']}, "
        + ", ".join(f"{k} {meta[k]}" for k in ("torch", "triton", "cudnn", "megatron-core", "fla-core", "tilelang")
                    if k in meta),
        f"- recipe `{meta['recipe']}` {' '.join(meta['overrides'])}; {meta['steps']} steps per rung, "
        f"timing = median of the steps after the first {meta['warmup']}",
        *(f"- command: `{command}`" for command in meta.get("commands") or [meta["command"]]),
        *([f"- Triton autotune choices pinned from a table before the first rung: "
           f"{meta['autotune_table_pinned']}"] if meta.get("autotune_table_pinned") else []),
        *([f"- Transformer Engine's compiled path is off here (its modules run eager under torch.compile, a graph "
           f"break each): {meta['te_compile_disabled']}"] if meta.get("te_compile_disabled") else []),
        "- steps run back to back as in megatron's loop and are timed by CUDA events on the stream; rows measured "
        "before 21b5f9b synchronized at every step boundary, which exposed the next step's CPU prologue (batch "
        "upload, graph guards), and rows before 414e2fd also between the backward and the optimizer step",
        "",
        "| rung | what | ms/step | fwd+bwd ms | optimizer ms | opt share | tokens/s | MFU | all-SDPA MFU "
        f"| speed-up vs rung {base_key or '1'} | breaks | graphs | recompiles | peak GiB | final loss | measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        if "error" in row:
            lines.append(f"| {row['rung']} | {row['label']} | failed: {row['error']} |" + " |" * 12
                         + f" {row.get('measured', '')} |")
            continue
        speedup = f"{base / row['step_ms']:.2f}x" if base else ""
        lines.append(
            f"| {row['rung']} | {row['label']} | {row['step_ms']:.1f} | {row['fwd_bwd_ms']:.1f} "
            f"| {row['optimizer_ms']:.1f} | {row['optimizer_share']:.1%} | {row['tokens_per_s']:,.0f} "
            f"| {_fmt(row.get('mfu'), '.1%')} | {_fmt(row.get('mfu_all_sdpa'), '.1%')} | {speedup} "
            f"| {row.get('graph_breaks', '')} | {row.get('graphs', '')} | {row.get('recompiles', '')} "
            f"| {_fmt(row.get('peak_memory_gib'), '.1f')} | {row['losses'][-1]:.4f} | {row.get('measured', '')} |")
    clipped = [f"rung {row['rung']} {_clipped_steps(row, meta['warmup'])}" for row in rows.values()
               if row.get("grad_norms")]
    if clipped:
        lines += ["", "Timed steps whose grad norm exceeded clip_grad (clipped): " + ", ".join(clipped)]
    outside = [f"rung {row['rung']} {row['outside_allocator_gib']:.1f}" for row in rows.values()
               if row.get("outside_allocator_gib") is not None]
    if outside:
        lines += ["", "GiB of device memory in use outside PyTorch's allocator at the end of each rung (CUDA "
                      "context, kernels, libraries' buffers): " + ", ".join(outside)]
    if "4" in rows and "6" in rows and "step_ms" in rows["4"] and "step_ms" in rows["6"]:
        lines += ["", f"Our Muon step vs the AdamW step on our spec (rung 6 / rung 4): "
                      f"{rows['6']['step_ms'] / rows['4']['step_ms']:.3f}x"]
    agreement = loss_agreement(rows)
    if agreement:
        lines += ["", "Loss agreement (bf16; each rung starts from the recipe seed and sees the same batches; "
                  "rungs with the same spec have identical initial weights):", "",
                  "| rungs | what | step-1 rel. difference | mean abs. difference / mean loss | final losses |",
                  "|---|---|---|---|---|", *agreement,
                  "", "Losses per step (mock data: the loss falls within a few steps and spikes during warm-up, "
                  "so rounding differences grow into visibly different trajectories):", "", *loss_trajectories(rows)]
    md_path.write_text("\n".join(lines) + "\n")


# Kernel-name patterns -> what the time is spent on (first match wins; names as the CUDA profiler reports them).
KERNEL_CATEGORIES = (
    ("GEMM (cuBLAS / CUTLASS)", re.compile(r"nvjet|cutlass|gemm|sm90_xmma|cublas", re.I)),
    ("attention (cuDNN / flash)", re.compile(r"cudnn|flash|fmha|sdpa", re.I)),
    ("GDN chunk kernels (FLA / TileLang)", re.compile(r"chunk_|kernel_kernel|prepare_wy|recompute_w_u|l2norm|"
                                                     r"solve_tril|merge_16x16|chunk_local_cumsum", re.I)),
    ("causal conv1d", re.compile(r"causal_conv1d|_conv_bwd_kernel", re.I)),
    ("Inductor-generated (fused pointwise / reductions)", re.compile(r"^triton_(poi|per|red|tem)_", re.I)),
    ("Muon Newton–Schulz (symmetric products)", re.compile(r"_sym_mm", re.I)),
    ("optimizer / eager elementwise (foreach, copies, adds)", re.compile(
        r"multi_tensor|foreach|elementwise|vectorized|copy|fill|reduce_kernel|adam|muon|momentum|decay_update|"
        r"^add_kernel$",
        re.I)),
)


def kernel_category(name: str) -> str:
    for label, pattern in KERNEL_CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def category_table(kernels: list[tuple[str, float]], steps: int) -> list[str]:
    """Markdown rows: device ms per step and share for each category of (kernel name, total µs)."""
    totals: dict[str, float] = {}
    for name, micros in kernels:
        category = kernel_category(name)
        totals[category] = totals.get(category, 0.0) + micros
    grand = sum(totals.values()) or 1.0
    lines = ["| kernels | ms/step | share |", "|---|---:|---:|"]
    for category, micros in sorted(totals.items(), key=lambda item: -item[1]):
        lines.append(f"| {category} | {micros / steps / 1e3:.1f} | {micros / grand:.1%} |")
    lines.append(f"| all kernels | {grand / steps / 1e3:.1f} | 100% |")
    return lines


def top_kernels_per_category(kernels: list[tuple[str, float]], steps: int, per_category: int = 8) -> list[str]:
    """Markdown rows: the largest kernels of each category, so that a category's total can be traced to its parts."""
    lines = ["| category | kernel | ms/step |", "|---|---|---:|"]
    by_category: dict[str, list[tuple[str, float]]] = {}
    for name, micros in kernels:
        by_category.setdefault(kernel_category(name), []).append((name, micros))
    for category, members in sorted(by_category.items(), key=lambda item: -sum(m for _, m in item[1])):
        for name, micros in sorted(members, key=lambda member: -member[1])[:per_category]:
            lines.append(f"| {category} | `{name[:110]}` | {micros / steps / 1e3:.2f} |")
    return lines


def idle_gaps(intervals: list[tuple[float, float, str]], steps: int, largest: int = 10,
              cpu_events: list[tuple[float, float, str]] = ()) -> list[str]:
    """Markdown lines: how long the GPU sits idle between kernels (start, end in µs, name), per step, and the
    largest gaps with the kernels on either side and what the CPU was doing meanwhile (`cpu_busy_during`), so that
    idle time can be traced to the code that causes it."""
    if not intervals:
        return []
    ordered = sorted(intervals)
    gaps, busy, (_, reach, last_name) = [], 0.0, ordered[0]
    start_of_busy = ordered[0][0]
    for begin, end, name in ordered[1:]:
        if begin > reach:
            gaps.append((reach, begin, last_name, name))
            busy += reach - start_of_busy
            start_of_busy = begin
        if end >= reach:
            reach, last_name = end, name
    busy += reach - start_of_busy
    idle = reach - ordered[0][0] - busy
    lines = [f"GPU busy {busy / steps / 1e3:.1f} ms/step, idle between kernels {idle / steps / 1e3:.1f} ms/step "
             f"({len(gaps)} gaps over {steps} steps).", "",
             "| gap ms | after kernel | before kernel | CPU meanwhile |", "|---:|---|---|---|"]
    for start, end, before, after in sorted(gaps, key=lambda gap: gap[0] - gap[1])[:largest]:
        lines.append(f"| {(end - start) / 1e3:.2f} | `{before[:70]}` | `{after[:70]}` | "
                     f"`{cpu_busy_during(start, end, cpu_events)[:70]}` |")
    return lines


def cpu_busy_during(start: float, end: float, cpu_events: list[tuple[float, float, str]]) -> str:
    """The narrowest CPU-side event (operator, runtime call or annotated range) covering at least half of the
    interval: the most specific thing the CPU was doing while the GPU waited; '-' when nothing covers it."""
    covering = [(e - b, name) for b, e, name in cpu_events if min(e, end) - max(b, start) >= 0.5 * (end - start)]
    return min(covering)[1] if covering else "-"


RANGE_PREFIXES = ("Optimizer.", "muon.", "owner.", "ProfilerStep")


def named_ranges(averages, steps: int, prefixes: tuple[str, ...] = RANGE_PREFIXES) -> list[str]:
    """The optimizers' named ranges (`record_function`): CPU time inside each against the GPU span of its
    kernels, per step. A range whose CPU time exceeds its GPU span is bound by launching, not by its kernels."""
    from torch.autograd import DeviceType

    cpu, gpu, calls = {}, {}, {}
    for event in averages:
        if not event.key.startswith(prefixes):
            continue
        if event.device_type == DeviceType.CPU:
            cpu[event.key] = cpu.get(event.key, 0.0) + event.cpu_time_total
            calls[event.key] = calls.get(event.key, 0) + event.count
        elif getattr(event, "is_user_annotation", False):
            gpu[event.key] = gpu.get(event.key, 0.0) + event.device_time_total
    if not cpu:
        return []
    lines = ["| named range | calls/step | CPU ms/step | GPU span ms/step |", "|---|---:|---:|---:|"]
    for name in sorted(cpu, key=lambda n: -cpu[n])[:40]:
        span = f"{gpu[name] / 1e3 / steps:.2f}" if name in gpu else "-"
        lines.append(f"| `{name[:90]}` | {calls[name] / steps:.0f} | {cpu[name] / 1e3 / steps:.2f} | {span} |")
    return lines


def write_profile(path: Path, rung, run_steps, top: int = 80, steps: int = 2) -> None:
    """Kernel time of `steps` training steps of `rung`: per category, then the top operators and kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        run_steps()
    averages = prof.key_averages()
    sort_key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    table = averages.table(sort_by=sort_key, row_limit=top, max_name_column_width=90)
    def is_kernel(event) -> bool:  # GPU-side user annotations (`Optimizer.step#AdamW.step`) span counted kernels
        return on_gpu and event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)

    kernels = [(event.key, event.self_device_time_total) for event in averages if is_kernel(event)]
    intervals, cpu_events = [], []
    for event in prof.events() if on_gpu else ():
        span = (event.time_range.start, event.time_range.end, event.name)
        if is_kernel(event):
            intervals.append(span)
        elif event.device_type == DeviceType.CPU:
            cpu_events.append(span)
    summary = [*category_table(kernels, steps), "", *idle_gaps(intervals, steps, cpu_events=cpu_events), "",
               *named_ranges(averages, steps), "",
               *top_kernels_per_category(kernels, steps)] if kernels else ["(no GPU kernels: CPU run)"]
    # Operator rows (aten::mm, our custom ops) and the kernels they launch are both listed; the table's footer
    # ("Self CUDA time total") counts each kernel once.
    path.with_suffix(".kernels.json").write_text(json.dumps(  # full names, for diffs between profiles
        {"steps": steps, "kernels_ms": {name: total / 1e3 / steps for name, total in sorted(kernels)}}, indent=0))
    path.write_text(f"# Kernel profile: rung {rung.key} ({rung.label}), {steps} steps\n\n"
                    + "\n".join(summary) + f"\n\n```\n{table}\n```\n")
