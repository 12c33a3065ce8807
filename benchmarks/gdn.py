"""GDN layer forward+backward at a reference workload's size, every implementation in one run (GPU).

Variants, each timed on the same random input [B=1, T, hidden=2048] in bf16 (--sizes hybrid-1.5b, the default: GDN
6 heads, key head dim 256, value head dim 512, conv 4; --sizes qwen3-next: 16 q/k heads and 32 value heads of 128):
  ours eager / ours compiled   megatron_muon.layers.gated_deltanet.GatedDeltaNet (local spec, tp=1) on our custom ops
  fla eager / fla compiled     fla.layers.GatedDeltaNet (flash-linear-attention 0.6; FLA itself hands K = V = 128
                               calls to FlashQLA where flash-qla is installed)
  megatron-core eager          megatron.core.ssm.gated_delta_net.GatedDeltaNet with a local (non-TE) spec
Compiled variants report Dynamo's graph-break count and number of graphs. Ours and megatron-core share the
parameter layout, so ours is also checked against megatron-core's output on the same weights.

    python benchmarks/gdn.py --out benchmarks/results/gdn.md --profile
    python benchmarks/gdn.py --sizes qwen3-next --chunk-op --out benchmarks/results/gdn_chunk_qwen3_next.md
    python benchmarks/gdn.py --device cpu --seq-len 128 --tiny      # smoke run of the script itself (torch backend)

--chunk-op times the chunk op alone instead of the layer: ours (FlashQLA turned off and, where it runs, dispatched to
FlashQLA), FLA's own kernels and FlashQLA called directly, on one input (gdn_chunk_op.py).

--profile adds, for our compiled layer and FLA's eager layer (with --chunk-op: our chunk op, split and fused, and
FlashQLA's), a torch.profiler table of the kernels that take the most time per fwd+bwd step (CPU ops when run on the
CPU), so the report shows where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import graph_replay_ms, package_versions  # noqa: E402
from kernel_profile import host_markdown, kernel_table, profile_markdown, python_table  # noqa: E402
from gdn_chunk_op import (REFERENCE_VARIANT, against_flashqla, chunk_op_inputs, chunk_op_variants,  # noqa: E402
                          make_chunk_step, output_agreement)

REFERENCE = dict(hidden=2048, key_heads=6, value_heads=6, key_dim=256, value_dim=512, conv=4)
QWEN3_NEXT = dict(hidden=2048, key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv=4)
TINY = dict(hidden=64, key_heads=2, value_heads=4, key_dim=16, value_dim=8, conv=4)
SIZES = {"hybrid-1.5b": REFERENCE, "qwen3-next": QWEN3_NEXT, "tiny": TINY}
PROFILED = ("ours compiled", "fla eager", "ours chunk op", "ours chunk op (output terms: fused)",
            "ours chunk op (intra: ours)", "ours chunk op (fused terms, fused grads, intra ours)", REFERENCE_VARIANT)


def timed_ms(fn, device: str, warmup: int, reps: int) -> tuple[float, float, float, float]:
    """(first call ms, median ms of `reps` synchronized calls, mean ms of `reps` back-to-back calls, median host ms
    per call) after `warmup`.

    A synchronized call starts on an idle GPU, so host-side launch time shows whenever the CPU falls behind; inside
    a model the CPU runs ahead of the GPU, which the back-to-back figure (no sync between calls) reproduces. The host
    time is the CPU's time to issue one synchronized call (the launch queue is empty then, so nothing blocks it).
    """
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    first = (time.perf_counter() - start) * 1e3
    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(reps):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            issued = time.perf_counter()
            fn()
            host.append((time.perf_counter() - issued) * 1e3)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            begin_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin_s) * 1e3)
    if device != "cuda":
        return first, statistics.median(times), statistics.mean(times), statistics.median(times)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return first, statistics.median(times), begin.elapsed_time(end) / reps, statistics.median(host)


def init_megatron(device: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if device == "cpu":
        from megatron_muon._cpu import enable_cpu_mode

        enable_cpu_mode()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)


def megatron_config(sizes: dict, device: str):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16
    return TransformerConfig(
        num_layers=1, hidden_size=sizes["hidden"], num_attention_heads=16, ffn_hidden_size=4 * sizes["hidden"],
        linear_num_key_heads=sizes["key_heads"], linear_num_value_heads=sizes["value_heads"],
        linear_key_head_dim=sizes["key_dim"], linear_value_head_dim=sizes["value_dim"],
        linear_conv_kernel_dim=sizes["conv"], normalization="RMSNorm", layernorm_epsilon=1e-6,
        activation_func=F.silu, add_bias_linear=False, bf16=True, params_dtype=dtype, pipeline_dtype=dtype,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=device == "cpu",
    )


def shipped_graph_breaks(layer, x) -> str:
    """Dynamo's graph breaks for the layer exactly as the spec builds it (explain: Dynamo only, no Inductor)."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(x.transpose(0, 1))
    reasons = sorted({r.reason.strip().splitlines()[0][:120] for r in explanation.break_reasons})
    return f"{explanation.graph_break_count} ({'; '.join(reasons) or 'none'})"


def build_ours(config):
    """Our GDN from the local spec. megatron-core 0.19.2's RowParallelLinear.forward passes tp_group=None, which
    makes it call warnings.warn on every step (a Dynamo graph break); the timed layer uses a subclass that passes
    its own group (same math; tp=1 here), and the report lists the shipped spec's breaks separately."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.spec_utils import build_module

    from megatron_muon.specs import gdn_mixer_spec

    class RowParallelLinearPassingGroup(RowParallelLinear):
        def _forward_impl(self, *args, **kwargs):
            if kwargs.get("tp_group") is None:
                kwargs["tp_group"] = self.tp_group
            return super()._forward_impl(*args, **kwargs)

    layer = build_module(gdn_mixer_spec("local"), config=config, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    shipped = layer.out_proj.__class__
    if shipped is RowParallelLinear:
        layer.out_proj.__class__ = RowParallelLinearPassingGroup
    return layer, shipped


def build_megatron_core(config):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.gated_delta_net.common import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    submodules = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                         out_proj=RowParallelLinear)
    return GatedDeltaNet(config, submodules, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())  # caller moves it to the GPU


def build_fla(sizes: dict, device: str):
    from fla.layers import GatedDeltaNet

    layer = GatedDeltaNet(hidden_size=sizes["hidden"], expand_v=sizes["value_dim"] / sizes["key_dim"],
                          head_dim=sizes["key_dim"], num_heads=sizes["key_heads"],
                          num_v_heads=sizes["value_heads"], conv_size=sizes["conv"], norm_eps=1e-6, layer_idx=0)
    return layer.to(device=device, dtype=torch.bfloat16)


def fwd_bwd(layer, x, grad, sbh: bool):
    """One forward+backward; megatron modules take [s, b, h] and return (out, bias), FLA takes [b, s, h]."""

    def step():
        out = layer(x.transpose(0, 1), None)[0] if sbh else layer(x)[0]  # megatron mixers take attention_mask
        out = out.transpose(0, 1) if sbh else out
        out.backward(grad)

    return step


def compile_stats():
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def run_variant(name, make_step, device, args, compiled=False, profiles=None):
    row = dict(name=name)
    try:
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        step = make_step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        row["first_ms"], row["ms"], row["stream_ms"], row["host_ms"] = timed_ms(step, device, args.warmup, args.reps)
        if device == "cuda":
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - baseline) / 2**20
            row.update(_graph_replay(step, args.reps))
        if compiled:
            row["breaks"], row["graphs"] = compile_stats()
        if profiles is not None and name in PROFILED:
            kernels, host = kernel_table(step, device)
            profiles[name] = profile_markdown(name, kernels, row["ms"], args.profile_top)
            if host:
                profiles[name] += host_markdown(host, row.get("host_ms"))
            profiles[name] += python_table(step, device)
            print("\n".join(profiles[name]), flush=True)  # in the log too, should a time limit cut the run
    except Exception as error:  # one broken baseline must not hide the others
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        traceback.print_exc()
    print(f"{name:28s} {row}", flush=True)
    return row


def _graph_replay(step, reps: int) -> dict:
    """{"graph_ms": the step's kernels alone, replayed from a CUDA graph} or {"graph_error": why it could not be
    captured}: a call whose host time exceeds its kernels' time is timed by the host, this column by the kernels."""
    try:
        return {"graph_ms": graph_replay_ms(step, reps)}
    except Exception as error:  # a path that syncs or launches off the stream: the other columns still stand
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return {"graph_error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:120]}


def compare_to_megatron_core(ours, reference, x) -> str:
    """Relative error of our output vs megatron-core's on the same weights (same parameter names and layout)."""
    missing = ours.load_state_dict(reference.state_dict(), strict=False)
    with torch.no_grad():
        a = ours(x.transpose(0, 1), None)[0].float()
        b = reference(x.transpose(0, 1), None)[0].float()
    error = ((a - b).norm() / b.norm()).item()
    return f"{error:.2e} (missing keys {list(missing.missing_keys)})"


def _kernels_ms(row: dict) -> str:
    return f"{row['graph_ms']:.2f}" if "graph_ms" in row else "-"


def write_report(path, rows, meta, args, echo=True):
    fla_times = [r["ms"] for r in rows if r["name"].startswith("fla ") and "ms" in r]
    best_fla = min(fla_times) if fla_times else None
    fla_stream = [r["stream_ms"] for r in rows if r["name"].startswith("fla ") and "stream_ms" in r]
    best_fla_stream = min(fla_stream) if fla_stream else None
    what = "chunk op" if args.chunk_op else "layer"
    lines = [
        f"# GDN {what} forward+backward (B=1, T={args.seq_len}, bf16)", "",
        f"- date: {meta['date']}", f"- device: {meta['device']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"- our GDN backend: {meta['backend']}", f"- sizes: {meta['sizes']}",
        f"- command: `{meta['command']}`", f"- timing: median of {args.reps} calls after {args.warmup} warm-up calls "
        "(CUDA events, synchronized after each call); 'back-to-back': mean of the same number of calls issued without "
        "a sync in between (the CPU runs ahead, as inside a model); 'host ms': the CPU's time to issue one call; "
        "'first call' includes compilation, autotuning and JIT; 'kernels ms': one call captured in a CUDA graph and "
        "replayed (the GPU's time for its kernels, no host gaps; '-' where capture failed, the reason below)",
        f"- {meta.get('agreement_of', 'ours vs megatron-core output on the same weights')}: rel. error "
        f"{meta.get('agreement', 'n/a')}",
        *([] if args.chunk_op else [
            "- 'ours' times the local spec's GDN with out_proj's RowParallelLinear passing its own tp group; the spec "
            f"as shipped has graph breaks: {meta.get('shipped_breaks', 'same layer, see the table')}"]), "",
        "- peak MiB: memory allocated above the inputs and parameters during the timed steps (activations kept "
        "for backward and temporaries)", "",
        "| variant | fwd+bwd ms | vs faster FLA | back-to-back ms | vs faster FLA | host ms | kernels ms | "
        "graph breaks | graphs | first call ms | peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | | | | |")
            continue
        ratio = f"{best_fla / r['ms']:.3f}x" if best_fla else "n/a"
        stream_ratio = f"{best_fla_stream / r['stream_ms']:.3f}x" if best_fla_stream else "n/a"
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "-"
        lines.append(f"| {r['name']} | {r['ms']:.2f} | {ratio} | {r['stream_ms']:.2f} | {stream_ratio} | "
                     f"{r.get('host_ms', float('nan')):.2f} | {_kernels_ms(r)} | {r.get('breaks', '-')} | "
                     f"{r.get('graphs', '-')} | {r['first_ms']:.0f} | {peak} |")
    ours = next((r for r in rows if r["name"] == "ours compiled" and "ms" in r), None)
    if ours and best_fla:
        speedup = best_fla / ours["ms"]
        verdict = "met" if speedup >= 1.15 and ours.get("breaks") == 0 else "NOT met"
        lines += ["", f"Target (compiled ours >= 1.15x the faster FLA variant, 0 graph breaks): {verdict} "
                      f"({speedup:.3f}x, {ours.get('breaks')} graph breaks); back-to-back: "
                      f"{best_fla_stream / ours['stream_ms']:.3f}x."]
    failed_captures = [f"{r['name']}: {r['graph_error']}" for r in rows if "graph_error" in r]
    if failed_captures:
        lines += ["", "Not captured in a CUDA graph (no kernels-only time): " + "; ".join(failed_captures)]
    if args.chunk_op:
        lines += against_flashqla(rows)
    for name in PROFILED:
        lines += (meta.get("profiles") or {}).get(name, [])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", choices=tuple(SIZES), default="hybrid-1.5b", help="GDN head counts and dims")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (script smoke test; same as --sizes tiny)")
    parser.add_argument("--chunk-op", action="store_true", help="time the chunk op alone instead of the layer")
    parser.add_argument("--skip", default="", help="comma-separated variant prefixes to skip: ours eager, ours "
                        "compiled, ours recompute, fla eager, fla compiled, megatron; with --chunk-op: FlashQLA, "
                        "ours chunk op, fla chunk op")
    parser.add_argument("--out", default="benchmarks/results/gdn.md")
    parser.add_argument("--profile", action="store_true",
                        help=f"add top-kernel tables for {' and '.join(PROFILED)} to the report")
    parser.add_argument("--profile-top", type=int, default=20, help="kernels listed per profile table")
    args = parser.parse_args()
    sizes = TINY if args.tiny else SIZES[args.sizes]
    device = args.device
    if not args.chunk_op:
        init_megatron(device)
    from megatron_muon.ops import flashqla_enabled, selected_backend

    skip = [s.strip() for s in args.skip.split(",") if s.strip()]

    def wanted(variant: str) -> bool:
        return not any(variant.startswith(prefix) for prefix in skip)
    torch.manual_seed(0)
    x = torch.randn(1, args.seq_len, sizes["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    config = megatron_config(sizes, device)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), versions=package_versions(),
                sizes=sizes, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                command="python " + shlex.join(sys.argv))
    meta["backend"] = (f"{selected_backend()}, FlashQLA {'on' if flashqla_enabled() else 'off'}" if device == "cuda"
                       else "torch (cpu)")
    meta["profiles"] = profiles = {} if args.profile else None
    rows = []

    def record(row):  # rewrite the report after every variant so a run cut short still leaves its numbers
        rows.append(row)
        write_report(args.out, rows, meta, args, echo=False)

    if args.chunk_op:
        inputs = chunk_op_inputs(sizes, args.seq_len, device)
        variants = [v for v in chunk_op_variants(inputs, device) if wanted(v[0])]
        for name, forward, setup in variants:
            record(run_variant(name, make_chunk_step(forward, setup, inputs), device, args, profiles=profiles))
        meta["agreement_of"], meta["agreement"] = "outputs o on the same input", output_agreement(variants, inputs)
        write_report(args.out, rows, meta, args)
        return

    ours, shipped_out_proj = build_ours(config)
    if shipped_out_proj is not type(ours.out_proj):
        shipped = build_ours(config)[0]
        shipped.out_proj.__class__ = shipped_out_proj
        meta["shipped_breaks"] = shipped_graph_breaks(shipped, x)
        del shipped
    if wanted("ours eager"):
        record(run_variant("ours eager", lambda: fwd_bwd(ours, x, grad, True), device, args))
    if wanted("ours compiled"):
        record(run_variant("ours compiled", lambda: fwd_bwd(torch.compile(ours), x, grad, True), device, args,
                           compiled=True, profiles=profiles))
    if wanted("fla eager") or wanted("fla compiled"):
        fla = None

        def make_fla(compiled):
            nonlocal fla
            fla = fla or build_fla(sizes, device)
            return fwd_bwd(torch.compile(fla) if compiled else fla, x, grad, False)

        if wanted("fla eager"):
            record(run_variant("fla eager", lambda: make_fla(False), device, args, profiles=profiles))
        if wanted("fla compiled"):
            record(run_variant("fla compiled", lambda: make_fla(True), device, args, compiled=True))
    if wanted("ours recompute"):  # chunk states recomputed: the memory-saving setting, after the baselines

        def make_ours_recomputing():
            ours.keep_chunk_states = False
            return fwd_bwd(torch.compile(ours), x, grad, True)

        record(run_variant("ours compiled, chunk states recomputed", make_ours_recomputing, device, args,
                           compiled=True))
        ours.keep_chunk_states = True
    if wanted("megatron-core"):
        reference = None

        def make_megatron():
            nonlocal reference
            reference = build_megatron_core(config).to(x.device)  # its torch RMSNorm is built on the CPU
            return fwd_bwd(reference, x, grad, True)

        record(run_variant("megatron-core eager (local)", make_megatron, device, args))
        if reference is not None:
            try:
                meta["agreement"] = compare_to_megatron_core(ours, reference, x.detach())
            except Exception as error:
                meta["agreement"] = f"failed: {type(error).__name__}: {error}"[:200]
    write_report(args.out, rows, meta, args)


if __name__ == "__main__":
    main()
