"""GDN's chunk output gradients at a reference layer shape (16k tokens; hybrid-1.5B: 6 heads, key 256, value 512;
qwen3-next: 16 q/k heads and 32 value heads of 128, GVA): FLA's `chunk_bwd_dqkwg` (TileLang on Hopper, as FLA
dispatches it) against ours (`megatron_muon.ops.dqkwg`), autotuned and with each tile pinned, in the same run; each
row gives the largest difference from FLA's outputs and the rate at which the call moves its bytes (every input and
output once, TB/s).

    python benchmarks/dqkwg.py --out benchmarks/results/dqkwg.md     # a GPU with FLA (and TileLang on Hopper)
    python benchmarks/dqkwg.py --sizes qwen3-next --out benchmarks/results/dqkwg_qwen3_next.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_muon from this checkout

from bench_env import gdn_chunk_inputs, package_versions  # noqa: E402

B, T = 1, 16384
SIZES = {"hybrid-1.5b": (6, 6, 256, 512), "qwen3-next": (16, 32, 128, 128)}  # q/k heads, value heads, K, V


def chunk_inputs(heads, value_heads, key_dim, value_dim):
    """q, k, v_new, w, g, h, do, dh, dv with realistic states from FLA's chunk-state kernels (GVA included)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h

    q, k, w, u, do, dv, g = gdn_chunk_inputs(B, T, heads, key_dim, value_dim, value_heads=value_heads)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, chunk_size=64, state_v_first=True)
    dh, _, dv2 = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=None, dht=None, do=do, dv=dv,
                                                scale=key_dim**-0.5, chunk_size=64, state_v_first=True)
    return q, k, v_new, w, g, h, do, dh, dv2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", choices=tuple(SIZES), default="hybrid-1.5b")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dqkwg.md"))
    args = parser.parse_args()
    H, HV, K, V = SIZES[args.sizes]
    if not torch.cuda.is_available():
        raise SystemExit("dqkwg.py times CUDA kernels; run it on a GPU machine with FLA installed")
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg
    from triton.testing import do_bench

    from megatron_muon.ops import dqkwg

    inputs = q, k, v_new, w, g, h, do, dh, dv = chunk_inputs(H, HV, K, V)
    scale = K**-0.5
    moved = sum(t.numel() * t.element_size() for t in inputs) + (2 * q.numel() + w.numel()) * 2 + g.numel() * 4

    def fla():
        return chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=scale,
                               state_v_first=True, chunk_size=64)

    reference = fla()
    fla_ms = do_bench(fla, rep=300)
    rows = [f"| FLA (`chunk_bwd_dqkwg`) | {fla_ms:.3f} | 1.000 | {moved / fla_ms / 1e9:.2f} | 0 |"]
    for config in [None, *dqkwg.CONFIGS]:
        label = "ours, autotuned" if config is None else f"ours {config}"
        try:
            outputs = dqkwg.chunk_dqkwg(*inputs, scale, config=config)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(outputs, reference))
            ms = do_bench(lambda: dqkwg.chunk_dqkwg(*inputs, scale, config=config), rep=300)
            rows.append(f"| {label} | {ms:.3f} | {ms / fla_ms:.3f} | {moved / ms / 1e9:.2f} | {err:.3g} |")
        except Exception as error:  # a tile the compiler rejects is a row, not the end of the table
            rows.append(f"| {label} | failed: {type(error).__name__}: {str(error)[:100]} | | | |")
        print(rows[-1], flush=True)
    best = dqkwg._dqkwg_tuned.best_config
    lines = [
        f"# GDN chunk output gradients (dq, dk, dw, dg) at the {args.sizes} layer shape",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M')}, {torch.cuda.get_device_name()}; "
        + ", ".join(f"{name} {version}" for name, version in package_versions().items()),
        f"- command: `python benchmarks/dqkwg.py --sizes {args.sizes} --out {args.out}`",
        f"- shape: batch {B}, {T} tokens, {H} q/k heads, {HV} value heads, key {K}, value {V}, chunk 64, states "
        "value-first; medians of "
        "triton.testing.do_bench; TB/s = every input and output once over the time; err = largest absolute "
        "difference from FLA's outputs",
        f"- the autotuner chose {best}",
        "",
        "| kernel | ms | × FLA | TB/s | err |",
        "|---|---:|---:|---:|---:|",
        *rows,
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
