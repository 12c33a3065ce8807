"""GDN's chunk output gradients at the hybrid-1.5B layer shape (16k tokens, 6 heads, key 256, value 512): FLA's
`chunk_bwd_dqkwg` (TileLang on Hopper, as FLA dispatches it) against ours (`megatron_muon.ops.dqkwg`), autotuned
and with each tile pinned, in the same run; each row gives the largest difference from FLA's outputs and the rate
at which the call moves its bytes (every input and output once, TB/s).

    python benchmarks/dqkwg.py --out benchmarks/results/dqkwg.md     # a GPU with FLA (and TileLang on Hopper)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_muon from this checkout

from bench_env import gdn_chunk_inputs, package_versions  # noqa: E402

B, T, H, K, V = 1, 16384, 6, 256, 512


def hybrid_inputs():
    """q, k, v_new, w, g, h, do, dh, dv with realistic states from our chunk-state kernels."""
    from megatron_muon.ops import state_tma

    q, k, w, u, do, dv, g = gdn_chunk_inputs(B, T, H, K, V)
    h, v_new, _ = state_tma.chunk_fwd_h(k, w, u, g)
    dh, _, dv2 = state_tma.chunk_dhu(q, k, w, g, do, dv, K**-0.5)
    return q, k, v_new, w, g, h, do, dh, dv2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dqkwg.md"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dqkwg.py times CUDA kernels; run it on a GPU machine with FLA installed")
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg
    from triton.testing import do_bench

    from megatron_muon.ops import dqkwg

    inputs = q, k, v_new, w, g, h, do, dh, dv = hybrid_inputs()
    scale = K**-0.5
    moved = sum(t.numel() * t.element_size() for t in inputs) + 3 * q.numel() * 2 + g.numel() * 4

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
        "# GDN chunk output gradients (dq, dk, dw, dg) at the hybrid-1.5B layer shape",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M')}, {torch.cuda.get_device_name()}; "
        + ", ".join(f"{name} {version}" for name, version in package_versions().items()),
        f"- command: `python benchmarks/dqkwg.py --out {args.out}`",
        f"- shape: batch {B}, {T} tokens, {H} heads, key {K}, value {V}, chunk 64, states value-first; medians of "
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
