"""Dense SwiGLU MLP forward+backward at the reference workload's size: megatron's MLP against ours (SwiGLU in pieces,
megatron_muon.layers.mlp.PiecewiseSwiGLUMLP), all compiled in the same run on the same GPU.

Variants, each on the same random input [T, B=1, hidden=2048] in bf16 with ffn 5632 (hybrid-1.5B's MLP), tp=1,
local linears (ColumnParallelLinear fc1, RowParallelLinear fc2), the same weights:
  megatron fused     megatron's MLP with bias_activation_fusion (bias_swiglu_impl: what our recipes set on GPU)
  megatron chunk     megatron's MLP without it (torch.chunk, silu(gate) * up)
  ours               PiecewiseSwiGLUMLP: the gate and up halves cut into >= 9 pieces each
Each runs under torch.compile (and eagerly with --eager). With --profile the report adds a per-kernel table of
every compiled variant; the SwiGLU-backward kernel of megatron's variants is the `..._cat_...` Triton kernel.

    python benchmarks/mlp.py --profile --out benchmarks/results/mlp.md
    python benchmarks/mlp.py --device cpu --tiny --backend aot_eager --out /tmp/mlp.md     # smoke run of the script
"""

from __future__ import annotations

import argparse
import datetime
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import emit_markdown, package_versions  # noqa: E402
from gdn import compile_stats, init_megatron, timed_ms  # noqa: E402
from kernel_profile import kernel_table, profile_markdown  # noqa: E402

REFERENCE = dict(hidden=2048, ffn=5632)
TINY = dict(hidden=64, ffn=101)
VARIANTS = ("megatron fused", "megatron chunk", "ours")


def mlp_config(sizes: dict, device: str, fused: bool):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16
    return TransformerConfig(
        num_layers=1, hidden_size=sizes["hidden"], ffn_hidden_size=sizes["ffn"], num_attention_heads=16,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=fused, add_bias_linear=False,
        bf16=True, params_dtype=dtype, pipeline_dtype=dtype, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=device == "cpu",
    )


def build_mlp(variant: str, sizes: dict, device: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLP

    from megatron_muon.layers.mlp import PiecewiseSwiGLUMLP
    from megatron_muon.specs.layer_specs import mlp_builder

    config = mlp_config(sizes, device, fused=variant == "megatron fused")
    builder = mlp_builder("local")  # our spec's MLP: local linears, PiecewiseSwiGLUMLP
    cls = PiecewiseSwiGLUMLP if variant == "ours" else MLP
    mlp = cls.as_mlp_submodule(builder.keywords["submodules"], config,
                               ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False)
    return mlp.to(device=device, dtype=torch.bfloat16)


def fwd_bwd(mlp, x, grad):
    def step():
        out, _ = mlp(x)
        out.backward(grad)

    return step


def run(name, mlp, x, grad, device, args, compiled: bool, profiles: dict | None):
    row = dict(name=name + (" compiled" if compiled else " eager"))
    try:
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        step = fwd_bwd(torch.compile(mlp, backend=args.backend) if compiled else mlp, x, grad)
        row["first_ms"], row["ms"], row["stream_ms"], _ = timed_ms(step, device, args.warmup, args.reps)
        if compiled:
            row["breaks"], row["graphs"] = compile_stats()
        if profiles is not None and compiled:
            profiles[row["name"]] = profile_markdown(row["name"], kernel_table(step, device)[0], row["ms"],
                                                     args.profile_top)
    except Exception as error:  # one broken variant must not hide the others
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        traceback.print_exc()
    print(f"{row['name']:28s} {row}", flush=True)
    return row


def agreement(mlps: dict, x, grad) -> str:
    """Relative differences of the variants' outputs and input gradients, same weights, eager (bf16 rounding: the
    fused SwiGLU rounds once where the unfused ones round silu(gate) before the product)."""
    outputs = {}
    for name, mlp in mlps.items():
        inputs = x.detach().clone().requires_grad_(True)
        out, _ = mlp(inputs)
        out.backward(grad)
        outputs[name] = (out.detach().float(), inputs.grad.float())
    pairs = [("ours", "megatron chunk"), ("ours", "megatron fused"), ("megatron chunk", "megatron fused")]
    return "; ".join(
        f"{a} vs {b}: output {relative(outputs[a][0], outputs[b][0]):.1e}, input grad "
        f"{relative(outputs[a][1], outputs[b][1]):.1e}" for a, b in pairs)


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm())


def report(rows, meta, args) -> list[str]:
    baseline = next((r for r in rows if r["name"] == "megatron fused compiled" and "ms" in r), None)
    lines = [
        f"# Dense SwiGLU MLP forward+backward (T={args.seq_len}, B=1, bf16, tp=1)", "",
        f"- date: {meta['date']}", f"- device: {meta['device']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"- sizes: {meta['sizes']}; compile backend: {args.backend}", f"- command: `{meta['command']}`",
        f"- timing: median of {args.reps} calls after {args.warmup} warm-up calls (CUDA events, synchronized after "
        "each call); 'back-to-back': mean of the same number of calls without a sync in between",
        f"- agreement (eager, same weights, relative norm): {meta['agreement']}", "",
        "| variant | fwd+bwd ms | vs megatron fused compiled | back-to-back ms | graph breaks | graphs "
        "| first call ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{baseline['ms'] / r['ms']:.3f}x" if baseline else "n/a"
        lines.append(f"| {r['name']} | {r['ms']:.3f} | {ratio} | {r['stream_ms']:.3f} | {r.get('breaks', '-')} | "
                     f"{r.get('graphs', '-')} | {r['first_ms']:.0f} |")
    for table in (meta.get("profiles") or {}).values():
        lines += table
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (script smoke test)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager for a CPU smoke run)")
    parser.add_argument("--eager", action="store_true", help="also time every variant eagerly")
    parser.add_argument("--profile", action="store_true", help="add a top-kernel table per compiled variant")
    parser.add_argument("--profile-top", type=int, default=12, help="kernels listed per profile table")
    parser.add_argument("--out", default="benchmarks/results/mlp.md")
    args = parser.parse_args()
    sizes, device = (TINY if args.tiny else REFERENCE), args.device
    init_megatron(device)
    mlps = {name: build_mlp(name, sizes, device) for name in VARIANTS}
    for name in VARIANTS[1:]:
        mlps[name].load_state_dict(mlps[VARIANTS[0]].state_dict())
    torch.manual_seed(0)
    x = torch.randn(args.seq_len, 1, sizes["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), versions=package_versions(),
                sizes=sizes, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                command="python " + " ".join(sys.argv), agreement=agreement(mlps, x, grad))
    meta["profiles"] = profiles = {} if args.profile else None
    rows = []
    for name in VARIANTS:
        rows.append(run(name, mlps[name], x, grad, device, args, compiled=True, profiles=profiles))
        if args.eager:
            rows.append(run(name, mlps[name], x, grad, device, args, compiled=False, profiles=None))
        write_text(report(rows, meta, args), args.out)  # a run cut short still leaves the variants it finished
    emit_markdown(report(rows, meta, args), args.out)


def write_text(lines: list[str], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
