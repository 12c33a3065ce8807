"""Transformer Engine's pieces against ours, one at a time, in one run on one GPU: the A/Bs behind which one the
specs and fast paths use when TE is installed.

Pieces, at the hybrid-1.5B's sizes (16k tokens, hidden 2048, 16 heads / 4 groups of 128, fc1 2048 -> 11264), bf16,
forward + backward (the optimizer rows: one step over fp32 masters with bf16 model copies):
  attention         our SDPA module pinned to cuDNN (K/V repeated per query head) | TE's fused attention
  rmsnorm           megatron's torch norm (our local spec's), eager and compiled | TE's RMSNorm
  norm + fc1        torch norm + ColumnParallelLinear, eager and compiled | TE's LayerNormColumnParallelLinear
  wgrad into fp32   ColumnParallelLinear, then the weight gradient added to main_grad | TE with the accumulation
                    fused into its weight-gradient GEMM (gradient_accumulation_fusion)
  adamw             torch's fused AdamW + clip multiply + model copy (megatron's three passes) | TE's FusedAdam and
                    the same passes | our one pass over either
Times are CUDA-event medians of synchronized calls after warm-up; ratios are TE's time over ours (< 1: TE faster).

    python benchmarks/te_pieces.py --out benchmarks/results/te_pieces.md
    python benchmarks/te_pieces.py --device cpu --tiny --out /tmp/te_pieces.md     # smoke run (ours only, no TE)
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_env import emit_markdown, package_versions  # noqa: E402
from gdn import init_megatron, timed_ms  # noqa: E402

REFERENCE = dict(tokens=16384, hidden=2048, heads=16, groups=4, head_dim=128, ffn=5632, adam_params=256 * 2**20)
TINY = dict(tokens=64, hidden=64, heads=4, groups=2, head_dim=16, ffn=96, adam_params=4096)


def piece_config(sizes: dict, device: str, accumulate: bool = False):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=sizes["hidden"], ffn_hidden_size=sizes["ffn"], num_attention_heads=sizes["heads"],
        num_query_groups=sizes["groups"], kv_channels=sizes["head_dim"], normalization="RMSNorm",
        layernorm_epsilon=1e-6, activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, gradient_accumulation_fusion=accumulate,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=device == "cpu",
    )


def fwd_bwd(module_call, inputs, grad_out):
    """A callable running forward and backward of `module_call(*inputs)` against `grad_out`."""
    def run():
        for tensor in inputs:
            if tensor is not None:
                tensor.grad = None
        out = module_call(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_out)
    return run


def attention_cases(sizes, device, te: bool):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_muon.layers.attention import SDPADotProductAttention

    config = piece_config(sizes, device)
    s, h, g, d = sizes["tokens"], sizes["heads"], sizes["groups"], sizes["head_dim"]
    def make(heads):
        return torch.randn(s, 1, heads, d, device=device, dtype=torch.bfloat16, requires_grad=True)

    inputs = (make(h), make(g), make(g), None)
    grad_out = torch.randn(s, 1, h * d, device=device, dtype=torch.bfloat16)
    ours = SDPADotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    cases = {"ours: SDPA on cuDNN": fwd_bwd(ours, inputs, grad_out)}
    if te:
        import os

        from megatron.core.transformer.enums import AttnBackend

        from megatron_muon.layers.attention import TE_FUSED_ATTENTION_ENV, TEFusedDotProductAttention

        os.environ.update(TE_FUSED_ATTENTION_ENV)  # what megatron's model exports for attention_backend=fused
        fused = piece_config(sizes, device)
        fused.attention_backend = AttnBackend.fused
        theirs = TEFusedDotProductAttention(fused, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                            attention_type="self")
        def call_theirs(*args):  # megatron's TE attention takes the mask type per call
            return theirs(*args, attn_mask_type=AttnMaskType.causal)

        cases["TE: fused attention"] = fwd_bwd(call_theirs, inputs, grad_out)
    return cases


def norm_cases(sizes, device, te: bool, compiled: bool):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = piece_config(sizes, device)
    x = torch.randn(sizes["tokens"], 1, sizes["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn_like(x)
    ours = WrappedTorchNorm(config, sizes["hidden"], eps=1e-6).to(device)
    cases = {"ours: torch norm, eager": fwd_bwd(ours, (x,), grad_out)}
    if compiled:
        cases["ours: torch norm, compiled"] = fwd_bwd(torch.compile(ours), (x,), grad_out)
    if te:
        from megatron.core.extensions.transformer_engine import TENorm

        cases["TE: RMSNorm"] = fwd_bwd(TENorm(config, sizes["hidden"], eps=1e-6), (x,), grad_out)
    return cases


def norm_linear_cases(sizes, device, te: bool, compiled: bool):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = piece_config(sizes, device)
    hidden, out_features = sizes["hidden"], 2 * sizes["ffn"]
    x = torch.randn(sizes["tokens"], 1, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(sizes["tokens"], 1, out_features, device=device, dtype=torch.bfloat16)
    norm = WrappedTorchNorm(config, hidden, eps=1e-6).to(device)
    linear = ColumnParallelLinear(hidden, out_features, config=config, init_method=config.init_method, bias=False,
                                  gather_output=False).to(device)
    ours = torch.nn.Sequential(norm, linear)
    cases = {"ours: norm + linear, eager": fwd_bwd(ours, (x,), grad_out)}
    if compiled:
        cases["ours: norm + linear, compiled"] = fwd_bwd(torch.compile(ours), (x,), grad_out)
    if te:
        from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

        theirs = TELayerNormColumnParallelLinear(hidden, out_features, config=config, init_method=config.init_method,
                                                 gather_output=False, bias=False, skip_bias_add=True, is_expert=False)
        cases["TE: LayerNormLinear"] = fwd_bwd(theirs, (x,), grad_out)
    return cases


def wgrad_cases(sizes, device, te: bool):
    """The weight gradient reaching an fp32 main_grad: ours adds it after the GEMM (megatron's hook does
    main_grad += grad), TE writes it there from the GEMM."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    hidden, out_features = sizes["hidden"], 2 * sizes["ffn"]
    x = torch.randn(sizes["tokens"], 1, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(sizes["tokens"], 1, out_features, device=device, dtype=torch.bfloat16)

    def with_main_grad(module):
        weight = module.weight
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=device)
        return weight

    config = piece_config(sizes, device)
    ours = ColumnParallelLinear(hidden, out_features, config=config, init_method=config.init_method, bias=False,
                                gather_output=False).to(device)
    weight = with_main_grad(ours)

    def ours_step():
        fwd_bwd(ours, (x,), grad_out)()
        weight.main_grad.add_(weight.grad)
        weight.grad = None

    cases = {"ours: GEMM, then main_grad += grad": ours_step}
    if te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        fused_config = piece_config(sizes, device, accumulate=True)
        theirs = TEColumnParallelLinear(hidden, out_features, config=fused_config, init_method=config.init_method,
                                        gather_output=False, bias=False, skip_bias_add=True, is_expert=False)
        with_main_grad(theirs)
        cases["TE: accumulation fused into the GEMM"] = fwd_bwd(theirs, (x,), grad_out)
    return cases


def adamw_cases(sizes, device, te: bool):
    """One AdamW step over fp32 masters (a few large tensors) with a clip factor and bf16 model copies."""
    from megatron_muon.optimizer.one_pass_adamw import OnePassAdamW

    count = 8
    numel = sizes["adam_params"] // count
    factor = torch.tensor([0.5], device=device)

    def setup():
        masters = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
        for master in masters:
            master.grad = torch.randn_like(master)
        return masters, [m.detach().bfloat16() for m in masters]

    def three_passes(optimizer, masters, models):
        def run():
            torch._foreach_mul_([m.grad for m in masters], factor.reshape(()))
            optimizer.step()
            torch._foreach_copy_(models, masters)
        return run

    def one_pass(inner, masters, models, group_step):
        engine = OnePassAdamW(inner, {id(m): c for m, c in zip(masters, models)}, group_step=group_step)

        def run():
            engine.pending = factor
            assert engine.run()
        return run

    options = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    masters, models = setup()
    cases = {"megatron's passes over torch's fused AdamW": three_passes(
        torch.optim.AdamW(masters, fused=device == "cuda", **options), masters, models)}
    if device == "cuda":
        masters, models = setup()
        cases["ours: one pass (torch's state layout)"] = one_pass(torch.optim.AdamW(masters, **options), masters,
                                                                  models, False)
    if te:
        from transformer_engine.pytorch.optimizers import FusedAdam

        masters, models = setup()
        cases["megatron's passes over TE's FusedAdam"] = three_passes(FusedAdam(masters, **options), masters, models)
        masters, models = setup()
        cases["ours: one pass (TE's state layout)"] = one_pass(FusedAdam(masters, **options), masters, models, True)
    return cases


PIECES = {
    "attention": lambda sizes, device, te, compiled: attention_cases(sizes, device, te),
    "rmsnorm": norm_cases,
    "norm + fc1": norm_linear_cases,
    "wgrad into fp32": lambda sizes, device, te, compiled: wgrad_cases(sizes, device, te),
    "adamw": lambda sizes, device, te, compiled: adamw_cases(sizes, device, te),
}


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (smoke runs)")
    parser.add_argument("--pieces", default=",".join(PIECES), help=f"comma list of {list(PIECES)}")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled variants of ours")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--revision", default="", help="the code revision to record")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    pieces = [p.strip() for p in args.pieces.split(",") if p.strip()]
    unknown = [p for p in pieces if p not in PIECES]
    if unknown:
        raise ValueError(f"unknown pieces {unknown}; valid: {list(PIECES)}")
    sizes = TINY if args.tiny else REFERENCE
    from megatron_muon.training.te_cudnn import transformer_engine_usable

    te = args.device == "cuda" and transformer_engine_usable()
    compiled = not args.no_compile and args.device == "cuda"
    init_megatron(args.device)

    rows = []
    for piece in pieces:
        try:
            cases = PIECES[piece](sizes, args.device, te, compiled)
        except Exception as error:  # noqa: BLE001 - one failing piece must not hide the others
            traceback.print_exc()
            rows.append((piece, "failed", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"))
            continue
        times = {}
        for name, run in cases.items():
            try:
                times[name] = timed_ms(run, args.device, args.warmup, args.reps)[1]
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                rows.append((piece, name, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"))
        fastest_ours = min((ms for name, ms in times.items() if name.startswith("ours")), default=None)
        for name, ms in times.items():
            ratio = f"{ms / fastest_ours:.2f}" if fastest_ours else ""
            rows.append((piece, name, f"{ms:.3f} | {ratio}"))
            print(f"{piece:16s} {name:48s} {ms:9.3f} ms", flush=True)
        del cases
        if args.device == "cuda":
            torch.cuda.empty_cache()

    versions = ", ".join(f"{k} {v}" for k, v in package_versions().items())
    te_version = "not installed"
    if te:
        import transformer_engine

        te_version = transformer_engine.__version__
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    command = "python benchmarks/te_pieces.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Transformer Engine's pieces against ours", "",
             f"- device {device_name}; {versions}; Transformer Engine {te_version}; revision {args.revision or '-'}",
             f"- command: `{command}`",
             f"- sizes: {sizes}; median of {args.reps} synchronized calls after {args.warmup} warm-up calls", "",
             "| piece | variant | ms | × our fastest |", "|---|---|---:|---:|"]
    for piece, name, cell in rows:
        lines.append(f"| {piece} | {name} | {cell} |" if "|" in cell else f"| {piece} | {name} | {cell} | |")
    return emit_markdown(lines, args.out)


if __name__ == "__main__":
    main()
