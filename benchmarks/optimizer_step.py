"""Optimizer step time on a model's parameter shapes (hybrid-1.5B, or the 7B-class GPT): our Muon vs fused AdamW,
torch.optim.Muon and megatron-core's TensorParallelMuon, all measured in one run on one GPU.

Setup as Megatron trains in bf16: fp32 master weights with fp32 gradients (random, never zeros). Fused AdamW
covers all parameters; the Muon variants cover the matrices, and the "+ AdamW rest" rows add the fused AdamW step
over embeddings, output layer and norms that a Muon training step also runs.

    python benchmarks/optimizer_step.py --out benchmarks/results/optimizer_step.md
    python benchmarks/optimizer_step.py --scale 32 --repeats 2   # CPU smoke test of the script itself
    python benchmarks/optimizer_step.py --only-ours ...          # skip the slow baselines (quick re-measure)
    python benchmarks/optimizer_step.py --shapes gpt-7b --only-ours ...   # the 7B-class GPT's matrices instead
    python benchmarks/optimizer_step.py --shapes gpt-7b --layers 16 ...   # its first 16 layers (an 80 GB card)

The parameters' starting values are kept on the host between variants, so the 7B-class set (6.7B fp32 parameters and
gradients, fused AdamW's two states) fits one H200.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_env import emit_markdown, graph_replay_ms, timed  # benchmarks/ is the script's directory
from kernel_profile import kernel_table, profile_markdown
from symmetric_kernel import parse_wide

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_muon.metrics.mfu import peak_tflops  # noqa: E402
from megatron_muon.optimizer import Muon, fused_elementwise  # noqa: E402

# (name, rows, cols, fused sections per group or None, count) per shape set, with (vocab, hidden, layers) and the GDN
# in_proj's rows per head (q, k per key head; v, z per value head; beta, alpha whole).
# hybrid-1.5b: hidden 2048, 24 layers "GGG*", SwiGLU 5632, 16 heads / 4 KV groups of 128, GDN 6 heads (key 256,
# value 512). gpt-7b (examples/recipes/gpt-7b-h200.yaml, Llama-2-7B shapes): hidden 4096, 32 layers, SwiGLU 11008,
# 32 heads of 128 without grouping.
SHAPE_SETS = {
    "hybrid-1.5b": dict(matrices=[
        ("gdn in_proj", 9228, 2048, (1536, 1536, 3072, 3072, 6, 6), 18),
        ("gdn out_proj", 2048, 3072, None, 18),
        ("attn qkv", 3072, 2048, (512, 128, 128), 6),
        ("attn proj", 2048, 2048, None, 6),
        ("fc1", 11264, 2048, None, 24),
        ("fc2", 2048, 5632, None, 24),
    ], vocab=32000, hidden=2048, layers=24, qkv_sections=[512, 128, 128]),
    "gpt-7b": dict(matrices=[
        ("attn qkv", 12288, 4096, (128, 128, 128), 32),
        ("attn proj", 4096, 4096, None, 32),
        ("fc1", 22016, 4096, None, 32),
        ("fc2", 4096, 11008, None, 32),
    ], vocab=32000, hidden=4096, layers=32, qkv_sections=[128, 128, 128]),
}
GDN_HEAD_ROWS = (256, 256, 512, 512, 0, 0)
HEADS = "ours (auto, MegaBatch, heads split)"
GRAPHED = "ours (auto, MegaBatch, fused splits, CUDA graph)"
FOUR_STEPS = "ours (auto, MegaBatch, fused splits, CUDA graph, polar_express×4)"
HEADS_GRAPHED = "ours (auto, MegaBatch, heads split, CUDA graph)"
HEADS_FOUR_STEPS = "ours (auto, MegaBatch, heads split, CUDA graph, polar_express×4)"
NS_NORMS = "ours (auto, MegaBatch, fused splits, CUDA graph, NS reduces the stacks' norms)"
# megatron's configuration turns the finite check off: its mixed-precision wrapper skips non-finite steps itself
AS_MEGATRON = "ours (auto, MegaBatch, fused splits, CUDA graph, finite check off: megatron's setting)"
PROFILED = (GRAPHED, AS_MEGATRON, FOUR_STEPS, HEADS_FOUR_STEPS)  # the CUDA-graph rows: kernel time without host gaps


def layer_counts(shapes: str, layers: int | None) -> list[int]:
    """How many of each shape set's matrices the first `layers` layers hold (all of them for None); every layer kind
    repeats evenly, so `layers` must keep each count whole."""
    shape_set = SHAPE_SETS[shapes]
    total = shape_set["layers"]
    if layers is None:
        return [count for *_, count in shape_set["matrices"]]
    counts = [count * layers / total for *_, count in shape_set["matrices"]]
    if not 0 < layers <= total or any(c != int(c) for c in counts):
        valid = [n for n in range(1, total + 1) if all(count * n % total == 0 for *_, count in shape_set["matrices"])]
        raise ValueError(f"--layers {layers}: the {shapes} set's layer kinds divide evenly into {valid} of its "
                         f"{total} layers; pass one of those.")
    return [int(c) for c in counts]


def reference_params(device, scale: int, shapes: str = "hybrid-1.5b", layers: int | None = None):
    """Matrices (with megatron's fused-projection tags) and the non-matrix rest, fp32 with random fp32 grads; with
    `layers`, the matrices and norms of the first `layers` layers, the embeddings and output layer whole."""
    generator = torch.Generator(device=device).manual_seed(0)
    shape_set = SHAPE_SETS[shapes]

    def param(rows, cols):
        p = torch.nn.Parameter(torch.randn(rows, cols, device=device, generator=generator) * 0.02)
        p.grad = torch.randn(rows, cols, device=device, generator=generator) * 1e-3
        return p

    matrices = []
    for (_, rows, cols, sections, _), count in zip(shape_set["matrices"], layer_counts(shapes, layers)):
        for _ in range(count):
            p = param(rows // scale, cols // scale)
            if sections is not None:
                p.is_qkv, p.qkv_split_shapes = True, [max(1, s // scale) for s in sections]
                if sum(p.qkv_split_shapes) * (p.shape[0] // sum(p.qkv_split_shapes)) != p.shape[0]:
                    p.is_qkv = False
                heads = GDN_HEAD_ROWS if len(sections) == len(GDN_HEAD_ROWS) else None  # QKV: megatron's rule
                if heads is not None and all(h % scale == 0 for h in heads):
                    p.muon_head_rows = tuple(h // scale for h in heads)
            matrices.append(p)
    vocab, hidden = shape_set["vocab"] // scale, shape_set["hidden"] // scale
    rest = [param(vocab, hidden), param(vocab, hidden)]
    rest += [param(1, hidden) for _ in range(2 * (layers or shape_set["layers"]) + 1)]
    return matrices, rest


BREAKDOWN_ROWS = {
    "step": "step",
    "ns": "Newton–Schulz (batched calls alone)",
    "stacking": "building the NS stacks (fused: momentum EMA + Nesterov blend; unfused: Nesterov blend)",
    "rest": "rest (finite check, weight decay, updates; unfused also the foreach momentum EMA)",
    "elementwise": "everything but Newton–Schulz",
}


@torch.no_grad()
def breakdown(optimizer: Muon, device, warmup: int, repeats: int) -> dict[str, float]:
    """Where our step's time goes: the batched Newton–Schulz calls alone, building the stacked NS inputs alone,
    and the rest of the step. With the fused elementwise passes the momentum EMA moves from the rest into the
    stacking, and the weight decay into the updates; "everything but Newton–Schulz" compares across both."""
    optimizer.step()  # builds the plan and the momentum buffers
    plan, stack_all = _stack_builder(optimizer, device)
    stacks = stack_all()
    ns_all = lambda: [optimizer._orthogonalize_bucket(b, s, True, n)  # noqa: E731
                      for b, (s, n) in zip(plan.buckets, stacks)]
    total = timed(optimizer.step, device, warmup, repeats)
    ns = timed(ns_all, device, warmup, repeats)
    stacking = timed(stack_all, device, warmup, repeats)
    return {"step": total, "ns": ns, "stacking": stacking, "rest": total - ns - stacking, "elementwise": total - ns}


def _stack_builder(optimizer: Muon, device):
    """The step's plan, and a callable that builds every bucket's stacked NS input as the step does (with the
    norms the momentum passes summed, or None)."""
    plan = optimizer._plan_cache[1]
    fused = fused_elementwise.use_fused(optimizer.fused_elementwise, device)
    grads = [p.grad for p in plan.params]
    sources = optimizer._momentum_sources(plan.params, grads, plan.group_of, fused, factor=None)
    return plan, lambda: [optimizer._stack_updates(b, plan, sources, None) for b in plan.buckets]


def replayed_ms(call, device, warmup: int, repeats: int) -> float | None:
    """Median milliseconds of `call` replayed from a CUDA graph (device time without host gaps); None off CUDA."""
    if device.type != "cuda":
        return None
    for _ in range(warmup):
        call()
    return graph_replay_ms(call, repeats)


@torch.no_grad()
def ns_per_stack(optimizer: Muon, device, warmup: int, repeats: int) -> list[tuple[str, str, float, float | None, int]]:
    """(stack [count, rows, cols], NS method, ms, ms from a CUDA graph, FLOPs as executed) for each batched
    orthogonalize call of a step, each timed alone: which stacks the Newton–Schulz time goes to, with and without
    the host's launches, and how close each runs to the GPU's peak."""
    from megatron_muon.kernels.flops import flops
    from megatron_muon.kernels.newton_schulz import choose_method

    plan, stack_all = _stack_builder(optimizer, device)
    rows = []
    for bucket, (stacked, norms) in zip(plan.buckets, stack_all()):
        call = lambda: optimizer._orthogonalize_bucket(bucket, stacked, True, norms)  # noqa: E731
        ms = timed(call, device, warmup, repeats)
        group = optimizer.param_groups[bucket.group_index]
        method = group["method"]
        count, m, n = stacked.shape if stacked.dim() == 3 else (1, *stacked.shape)
        executed = flops(m, n, method, group["ns_steps"], count, coefficients=group["coefficients"], symmetric=True)
        if method == "auto":
            method = f"auto: {choose_method(m, n)}"
        rows.append((" × ".join(map(str, stacked.shape)), method, ms, replayed_ms(call, device, warmup, repeats),
                     executed))
    return sorted(rows, key=lambda row: -row[2])


def _tflops(flop: int, ms: float | None) -> str:
    return "-" if not ms else f"{flop / ms / 1e9:.0f}"


def floor_lines(stacks, adamw_ms: float, matrix_params: int, all_params: int, peak: float | None) -> list[str]:
    """The step's floor in units of fused AdamW: Newton–Schulz's executed FLOPs at the GPU's dense fp16 peak plus
    the bytes no Muon step can avoid (read the gradient, read and write momentum and master: 20 per matrix
    parameter) at the bandwidth fused AdamW reaches here (its 28 bytes per parameter over its measured time)."""
    if not peak:
        return []
    ns_flop = sum(row[4] for row in stacks)
    ns_floor = ns_flop / (peak * 1e9)
    bandwidth = 28 * all_params / (adamw_ms * 1e-3)
    bytes_floor = 20 * matrix_params / bandwidth * 1e3
    measured = [row[3] for row in stacks]
    lines = ["", f"Floor of the default step (no schedule change): Newton–Schulz executes {ns_flop / 1e12:.2f} TFLOP "
             f"(symmetric products at half), {ns_floor:.2f} ms at the dense fp16 peak ({peak:.0f} TFLOP/s); the "
             f"bytes every Muon step moves (20 per matrix parameter) take {bytes_floor:.2f} ms at fused AdamW's "
             f"{bandwidth / 1e12:.2f} TB/s here. Floor {ns_floor + bytes_floor:.2f} ms = "
             f"{(ns_floor + bytes_floor) / adamw_ms:.2f}× fused AdamW"]
    if None not in measured:
        rate = ns_flop / sum(measured) / 1e9
        lines[-1] += (f"; at the {rate:.0f} TFLOP/s the stacks reach from a CUDA graph "
                      f"({rate / peak:.0%} of peak), {(ns_flop / (rate * 1e9) + bytes_floor) / adamw_ms:.2f}×.")
    else:
        lines[-1] += "."
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


class _PerPieceMuon(Muon):
    """Ours with one launch per piece for the fused elementwise passes (no `fused_pieces`): the same-run A/B."""

    def step(self, closure=None):
        from megatron_muon.optimizer import fused_pieces

        saved = fused_pieces.momentum_into_slots_, fused_pieces.decay_and_update_pieces_
        fused_pieces.momentum_into_slots_ = fused_pieces.decay_and_update_pieces_ = lambda *a, **k: False
        try:
            return super().step(closure)
        finally:
            fused_pieces.momentum_into_slots_, fused_pieces.decay_and_update_pieces_ = saved


class _NSNormsMuon(Muon):
    """Ours with Newton–Schulz reducing each stack's norm itself instead of taking the momentum pass's sums: the
    same-run A/B of that fusion."""

    def _norm_partials(self, bucket, pieces, slots):
        return None


LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                 "cudaMemcpyAsync", "cudaMemsetAsync")


@torch.no_grad()
def host_cost(optimizer, device, warmup: int, repeats: int) -> tuple[float, float]:
    """(CPU ms the host spends in `step()`, launches per step: kernels, graphs, copies), after warm-up: what a
    CUDA graph of the step saves the host, whether or not the GPU waits for it."""
    for _ in range(warmup):
        optimizer.step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        optimizer.step()
        times.append((time.perf_counter() - begin) * 1e3)
    if device.type != "cuda":
        return statistics.median(times), float("nan")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        optimizer.step()
        torch.cuda.synchronize()
    launches = sum(1 for event in profile.events() if event.name in LAUNCH_EVENTS)
    return statistics.median(times), float(launches)


def make_variants(has_cuda: bool, qkv_sections: list[int]):
    """name -> (which params, optimizer factory)."""
    fused = dict(fused=True) if has_cuda else dict(foreach=True)
    variants = {
        "fused AdamW, all params": ("all", lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, **fused)),
        "fused AdamW, non-matrix rest": ("rest", lambda ps: torch.optim.AdamW(ps, lr=1e-4, **fused)),
        "torch.optim.Muon": ("matrices", lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1)),
        "ours (auto, MegaBatch, fused splits)": ("matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral")),
        "ours (auto, MegaBatch, no splits)": (
            "matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", split_fused=False)),
        "ours (standard NS, MegaBatch, fused splits)": (
            "matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", method="standard")),
        "ours (auto, one NS per matrix, fused splits)": (
            "matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", batched=False)),
        "ours (auto, MegaBatch, fused splits, finite check off)": (
            "matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", check_finite=False)),
        "ours (auto, MegaBatch, fused splits, fused elementwise off)": (
            "matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", fused_elementwise=False)),
        "ours (auto, MegaBatch, fused splits, one launch per piece)": (
            "matrices", lambda ps: _PerPieceMuon(ps, lr=0.02, scale_mode="spectral")),
        GRAPHED: ("matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", graph_newton_schulz=True)),
        NS_NORMS: ("matrices", lambda ps: _NSNormsMuon(ps, lr=0.02, scale_mode="spectral", graph_newton_schulz=True)),
        AS_MEGATRON: ("matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", graph_newton_schulz=True,
                                                  check_finite=False)),
        HEADS: ("matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", split_heads=True)),
        FOUR_STEPS: ("matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", ns_steps=4,
                                                 coefficients="polar_express", graph_newton_schulz=True)),
        HEADS_GRAPHED: ("matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", split_heads=True,
                                                    graph_newton_schulz=True)),
        HEADS_FOUR_STEPS: ("matrices", lambda ps: Muon(ps, lr=0.02, scale_mode="spectral", split_heads=True, ns_steps=4,
                                                       coefficients="polar_express", graph_newton_schulz=True)),
    }
    try:
        from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS, TensorParallelMuon

        if HAVE_EMERGING_OPTIMIZERS:
            variants["megatron TensorParallelMuon (split_qkv)"] = ("matrices", lambda ps: TensorParallelMuon(
                ps, lr=0.02, split_qkv=True, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                qkv_split_shapes=qkv_sections, coefficient_type="simple", scale_mode="spectral"))
    except Exception as err:  # megatron-core is optional on the benchmark machine
        print(f"megatron-core TensorParallelMuon unavailable: {err!r}")
    return variants


# --symmetric-kernels: the Hopper kernels (modules of megatron_muon.kernels) each choice leaves in the dispatch
SYMMETRIC_KERNELS = {"all": ("symmetric_wide", "symmetric_ws"), "ping-pong": ("symmetric_ws", ), "triton": ()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension (CPU smoke tests)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="markdown result file")
    parser.add_argument("--only-ours", action="store_true", help="fused AdamW and our default Muon only")
    parser.add_argument("--shapes", choices=tuple(SHAPE_SETS), default="hybrid-1.5b", help="the model's matrices")
    parser.add_argument("--layers", type=int, default=None,
                        help="only the first N layers' matrices and norms (a model too big for the card's memory)")
    parser.add_argument("--profile", action="store_true",
                        help=f"add kernel tables of the steps {', '.join(PROFILED)} (where timed) to the report")
    parser.add_argument("--symmetric-kernels", choices=tuple(SYMMETRIC_KERNELS), default="all",
                        help="the Hopper symmetric kernels Newton–Schulz may use (an ablation; 'all' is the default)")
    parser.add_argument("--wide-layout", type=parse_wide, default=None, metavar="KSLICExSTAGES[xBUFFERS]",
                        help="the wide kernel's k-slice, ring depth and epilogue buffers (default: the kernel's own)")
    args = parser.parse_args()
    from megatron_muon.kernels import symmetric, symmetric_wide

    if args.wide_layout is not None:
        symmetric_wide.set_layout(*args.wide_layout)

    symmetric.HOPPER_KERNELS = tuple(k for k in symmetric.HOPPER_KERNELS
                                     if k[0].__name__.rsplit(".", 1)[-1] in SYMMETRIC_KERNELS[args.symmetric_kernels])

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        matrices, rest = reference_params(device, args.scale, args.shapes, args.layers)
    except ValueError as error:
        parser.error(str(error))
    groups = {"all": matrices + rest, "rest": rest, "matrices": matrices}
    snapshot = [p.detach().to("cpu", copy=True) for p in matrices + rest]

    def restore() -> None:
        """Every variant starts from the same parameter values."""
        for p, saved in zip(matrices + rest, snapshot):
            p.data.copy_(saved)

    numel = {k: sum(p.numel() for p in v) for k, v in groups.items()}
    print(f"{len(matrices)} matrices, {numel['matrices'] / 1e9:.3f}B; all params {numel['all'] / 1e9:.3f}B", flush=True)

    results = {}
    variants = make_variants(device.type == "cuda", [max(1, s // args.scale) for s in
                                                     SHAPE_SETS[args.shapes]["qkv_sections"]])
    if args.only_ours:
        keep = ("fused AdamW, all params", "fused AdamW, non-matrix rest", "ours (auto, MegaBatch, fused splits)",
                "ours (auto, MegaBatch, fused splits, fused elementwise off)",
                "ours (auto, MegaBatch, fused splits, one launch per piece)", GRAPHED, NS_NORMS, AS_MEGATRON, HEADS,
                FOUR_STEPS, HEADS_GRAPHED, HEADS_FOUR_STEPS)
        variants = {k: v for k, v in variants.items() if k in keep}
    for name, (which, factory) in variants.items():
        restore()
        optimizer = factory(groups[which])
        results[name] = timed(optimizer.step, device, args.warmup, args.repeats)
        print(f"{name:58s} {results[name]:9.2f} ms", flush=True)
        del optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()

    profiles = []
    for name in PROFILED if args.profile else ():
        if name in results:
            restore()
            optimizer = variants[name][1](groups[variants[name][0]])
            for _ in range(args.warmup + 1):  # the graphed variants capture on a later step
                optimizer.step()
            rows, _ = kernel_table(optimizer.step, device.type)
            profiles += profile_markdown(name, rows, results[name], top=15, unit="optimizer step")
            del optimizer

    host = {}
    for name in ("ours (auto, MegaBatch, fused splits)", GRAPHED):
        restore()
        host[name] = host_cost(variants[name][1](matrices), device, args.warmup + 2, args.repeats)
        print(f"host, {name:52s} {host[name][0]:8.2f} CPU ms {host[name][1]:7.0f} launches", flush=True)

    parts = {}
    for setting in ("auto", False):  # "auto": fused elementwise passes where Triton runs (CUDA)
        restore()
        optimizer = Muon(matrices, lr=0.02, scale_mode="spectral", fused_elementwise=setting)
        parts[setting] = breakdown(optimizer, device, args.warmup, args.repeats)
        if setting == "auto":
            stacks = ns_per_stack(optimizer, device, args.warmup, args.repeats)
        del optimizer
        for key, ms in parts[setting].items():
            print(f"breakdown, fused elementwise {setting}: {BREAKDOWN_ROWS[key][:40]:40s} {ms:9.2f} ms", flush=True)

    restore()
    optimizer = Muon(matrices, lr=0.02, scale_mode="spectral", split_heads=True)
    optimizer.step()  # builds the plan
    head_stacks = ns_per_stack(optimizer, device, args.warmup, args.repeats)
    del optimizer

    adamw = results["fused AdamW, all params"]
    rest_ms = results["fused AdamW, non-matrix rest"]
    rows = [(name, ms, ms / adamw) for name, ms in results.items()]
    for name, ms in results.items():
        if name.startswith(("ours", "torch.optim.Muon", "megatron")):
            rows.append((f"{name} + AdamW rest", ms + rest_ms, (ms + rest_ms) / adamw))
    table = ["| optimizer step | ms | × fused AdamW (all params) |", "|---|---:|---:|"]
    table += [f"| {name} | {ms:.2f} | {ratio:.2f} |" for name, ms, ratio in rows]
    fused_on = fused_elementwise.use_fused("auto", device)
    table += ["", "Breakdown of ours (auto, MegaBatch, fused splits), each part timed alone; fused elementwise "
              f"'auto' is {'on (Triton)' if fused_on else 'off here (no Triton GPU)'}:", "",
              "| part | fused elementwise: auto, ms | off, ms |", "|---|---:|---:|"]
    table += [f"| {label} | {parts['auto'][key]:.2f} | {parts[False][key]:.2f} |"
              for key, label in BREAKDOWN_ROWS.items()]
    table += ["", "Host side of a step (CPU time in `step()` after a synchronize; launches counted by the profiler: "
              "kernels, graph launches, copies):", "", "| optimizer step | CPU ms | launches |", "|---|---:|---:|"]
    table += [f"| {name} | {cpu_ms:.2f} | {launches:.0f} |" for name, (cpu_ms, launches) in host.items()]
    for title, rows_of in (("", stacks), (f", {HEADS}", head_stacks)):
        table += ["", f"Newton–Schulz per stack{title} (each batched call of one step timed alone, slowest first; "
                  "'from a CUDA graph': the same call replayed, the GPU's time without host gaps;"
                  " TFLOP/s: executed FLOPs (symmetric products at half) over the graphed time):",
                  "", "| stack (count × rows × cols) | method | ms | from a CUDA graph, ms | TFLOP/s |",
                  "|---|---|---:|---:|---:|"]
        table += [f"| {shape} | {method} | {ms:.2f} | {_ms(graph_ms)} | {_tflops(flop, graph_ms)} |"
                  for shape, method, ms, graph_ms, flop in rows_of]
        graphed = [row[3] for row in rows_of]
        graphed_sum = None if None in graphed else sum(graphed)
        table += [f"| all stacks, summed | | {sum(row[2] for row in rows_of):.2f} | {_ms(graphed_sum)} | "
                  f"{_tflops(sum(row[4] for row in rows_of), graphed_sum)} |"]
    peak = peak_tflops(torch.cuda.get_device_name(), "fp16") if device.type == "cuda" else None
    table += floor_lines(stacks, adamw, numel["matrices"], numel["all"], peak)
    table += profiles
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "CPU"
    import triton

    header = [
        f"# Optimizer step on the {args.shapes} shape set",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- device: {gpu}; torch {torch.__version__}, Triton {triton.__version__}",
        f"- command: `python {' '.join(sys.argv)}`",
        "- Hopper symmetric kernels: {}; the wide one's k-slices of {}, {} stages, {} epilogue buffer(s)".format(
            args.symmetric_kernels, *symmetric_wide.layout()),
        *([f"- the first {args.layers} of the model's {SHAPE_SETS[args.shapes]['layers']} layers (their matrices "
           "and norms) with the whole embedding and output layer: the ratios weigh the embeddings' AdamW more than "
           "the whole model does"] if args.layers else []),
        f"- {len(matrices)} matrices ({numel['matrices'] / 1e9:.3f}B params, scale 1/{args.scale}), "
        f"all params {numel['all'] / 1e9:.3f}B; fp32 master weights and gradients; "
        f"median of {args.repeats} after {args.warmup} warm-up steps",
        "- ours: 5 steps of megatron's `simple` schedule (3.4445, -4.775, 2.0315) unless the row names another, "
        "nesterov, spectral scale; fused QKV / GDN in_proj split per section as megatron tags them; "
        "torch.optim.Muon: the same coefficients, unsplit",
        "",
    ]
    emit_markdown(header + table, args.out)


if __name__ == "__main__":
    main()
