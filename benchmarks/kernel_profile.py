"""Kernel and host profiles of a benchmark step: the GPU kernels' time per step, each op's and launch call's self
CPU time, and the Python functions' self time (for a call that waits on its host)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

PROFILE_STEPS = 3


def kernel_table(step, device: str, steps: int = PROFILE_STEPS) -> tuple[list, list]:
    """(kernels, host): rows of (name, calls per step, ms per step), slowest first, over `steps` profiled steps.
    Kernels: every GPU kernel (CPU op on the CPU); host (GPU only, else empty): each op's and launch call's self CPU
    time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    totals, cpu = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if device == "cuda" and event.device_type != DeviceType.CUDA:
            cpu[event.name][0] += 1
            cpu[event.name][1] += event.self_cpu_time_total
            continue
        micros = event.time_range.elapsed_us() if device == "cuda" else event.self_cpu_time_total
        totals[event.name][0] += 1
        totals[event.name][1] += micros

    def per_step(table):
        rows = [(name, calls / steps, micros / steps / 1e3) for name, (calls, micros) in table.items()]
        return sorted(rows, key=lambda row: -row[2])

    return per_step(totals), per_step(cpu)


def host_markdown(rows, host_ms: float | None, top: int = 8) -> list[str]:
    """The CPU side of a profile: the ops and launch calls with the most self CPU time per step."""
    total = sum(row[2] for row in rows)
    lines = ["", f"Host side: {total:.2f} ms of self CPU time in profiled ops and launch calls per step"
             + (f" (issuing one unprofiled call takes {host_ms:.2f} ms; the rest is Python between them)"
                if host_ms else "") + ":", "", "| CPU op or call | calls/step | CPU ms/step |", "|---|---:|---:|"]
    lines += [f"| `{op[:100]}` | {calls:g} | {ms:.3f} |" for op, calls, ms in rows[:top]]
    return lines


def python_table(step, device: str, steps: int = PROFILE_STEPS, top: int = 12) -> list[str]:
    """The Python functions with the most self time per step (cProfile over `steps` steps issued back to back):
    where a host-bound call spends the time the torch profiler books as an op's self CPU time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    if device == "cuda":
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, primitive calls, self s, total s, ...)
    # torch's custom-op dispatch calls the op's implementation through Dynamo's disable wrapper, which hides the
    # nesting from cProfile: `backend_impl` is booked the implementation's whole time as its own (time counted twice)
    kept = {key: entry for key, entry in stats.items()
            if not (key[2] == "backend_impl" and key[0].endswith("custom_ops.py"))}
    rows = sorted(kept.items(), key=lambda item: -item[1][2])[:top]
    total = sum(entry[2] for entry in kept.values()) / steps * 1e3
    note = (" (torch's custom-op `backend_impl` left out: cProfile books it the op implementation's whole time again, "
            "as its own)") if len(kept) < len(stats) else ""
    lines = ["", f"Python side: {total:.2f} ms of self time per step under cProfile{note} (which slows Python itself; "
                 "read the shares):", "", "| function | calls/step | self ms/step | cumulative ms/step |",
             "|---|---:|---:|---:|"]
    for (path, line, function), (_, calls, self_s, cumulative_s, _) in rows:
        where = function if path == "~" else f"{'/'.join(Path(path).parts[-2:])}:{line} {function}"
        lines.append(f"| `{where[:100]}` | {calls / steps:g} | {self_s / steps * 1e3:.3f} | "
                     f"{cumulative_s / steps * 1e3:.3f} |")
    return lines


def profile_markdown(name: str, rows, step_ms: float | None, top: int, unit: str = "fwd+bwd step") -> list[str]:
    total = sum(row[2] for row in rows)
    lines = ["", f"### Where the time goes: {name} (top {top} of {len(rows)} kernels, per {unit}, "
                 f"{PROFILE_STEPS} profiled steps)", "",
             f"Sum of all kernel times {total:.2f} ms per step"
             + (f"; timed step {step_ms:.2f} ms (the difference is time the GPU waits)." if step_ms else "."), "",
             "| kernel | calls/step | ms/step | share |", "|---|---:|---:|---:|"]
    for kernel, calls, ms in rows[:top]:
        label = kernel.replace("|", "\\|")
        label = label if len(label) <= 110 else label[:107] + "..."
        lines.append(f"| `{label}` | {calls:g} | {ms:.3f} | {ms / total:.1%} |")
    return lines
