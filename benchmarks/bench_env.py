"""Versions of the packages a benchmark result depends on, written next to every number; shared inputs and timing."""

from __future__ import annotations

import gc
import itertools
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("triton", "megatron-core", "fla-core", "tilelang", "flash-qla")


def package_versions() -> dict[str, str]:
    found = {"torch": torch.__version__}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    if torch.cuda.is_available():
        found["cudnn"] = str(torch.backends.cudnn.version())
    return found


# The hybrid-1.5B's Megatron-fused matrix shapes (DESIGN.md's reference set)
REFERENCE_SHAPES = ((9228, 2048), (2048, 3072), (3072, 2048), (2048, 2048), (11264, 2048), (2048, 5632))


def views_of_one_buffer(total: int, device, gap: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    """The reference shapes, cycled, as views of one random buffer (as megatron's DDP lays out gradients), `gap`
    elements apart, until the next would pass `total` elements (gaps included)."""
    shapes, used = [], 0
    for rows, cols in itertools.cycle(REFERENCE_SHAPES):
        if used + rows * cols > total:
            break
        shapes.append((rows, cols))
        used += rows * cols + gap
    buffer = torch.randn(used, device=device) * scale
    views, offset = [], 0
    for rows, cols in shapes:
        views.append(buffer[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols + gap
    return views


def gpu_result_header(title: str, script: str, argv: list[str], details: str) -> list[str]:
    """The first lines of a GPU kernel result: title, date and device, versions, the command, what was timed."""
    import datetime

    versions = ", ".join(f"{k} {v}" for k, v in package_versions().items())
    return [
        f"# {title}", "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; device: {torch.cuda.get_device_name()}",
        f"- {versions}",
        f"- command: `python benchmarks/{script} {' '.join(argv)}`",
        f"- {details}",
    ]


def emit_markdown(lines: list[str], out=None) -> str:
    """Print a result and, when `out` is given, write it there (parents created)."""
    from pathlib import Path

    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return text


def gdn_chunk_inputs(batch: int, seq_len: int, heads: int, key_dim: int, value_dim: int, seed: int = 0,
                     value_heads: int | None = None):
    """GDN chunk-kernel inputs on the GPU, as FLA's kernels see them: q, k (unit rows, `heads`), w, u, do, dv (bf16,
    `value_heads`, default `heads`) and g (FLA's chunk-local cumulative log2 gate, fp32, `value_heads`)."""
    import torch.nn.functional as F
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    torch.manual_seed(seed)
    q = F.normalize(torch.randn(batch, seq_len, heads, key_dim, device="cuda"), dim=-1).bfloat16()
    k = F.normalize(torch.randn(batch, seq_len, heads, key_dim, device="cuda"), dim=-1).bfloat16()
    value_heads = value_heads or heads
    w = (torch.randn(batch, seq_len, value_heads, key_dim, device="cuda") * 0.05).bfloat16()
    u, do, dv = (torch.randn(batch, seq_len, value_heads, value_dim, device="cuda").bfloat16() for _ in range(3))
    g = chunk_local_cumsum(-torch.rand(batch, seq_len, value_heads, device="cuda") * 0.1, chunk_size=64,
                           scale=RCP_LN2)
    return q, k, w, u, do, dv, g


def write_table_and_rows(path, lines: list[str], meta: dict, rows: list[dict]) -> None:
    """The markdown table at `path` and, beside it (.json), the metadata and raw rows it was drawn from."""
    import json
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def free_memory() -> None:
    """Drops what the previous run left on the device and resets the peak counters before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()


def memory_outside_allocator_gib() -> float | None:
    """GiB the device holds beyond PyTorch's caching allocator (CUDA context, loaded kernels, libraries' own buffers
    such as NCCL's): what a recipe's peak must leave free. Device-wide, so meaningful with one process per GPU."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


def git_revision() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def graph_replay_ms(call, repeats: int) -> float:
    """Median milliseconds of `call` captured once in a CUDA graph and replayed: its kernels' time on the GPU
    without the host's launch gaps. `call` must be warm (compiled, autotuned); raises what capture raises (a host
    sync, a kernel launched on another stream)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return timed(graph.replay, torch.device("cuda"), 1, repeats)


def timed(call, device, warmup: int, repeats: int) -> float:
    """Median milliseconds of `call()` after warm-up (CUDA events on GPU, the wall clock on CPU)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            call()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)
