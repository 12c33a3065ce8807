"""FLA's chunk-state kernels for the GDN layer at the hybrid-1.5B shape (16k tokens, 6 heads, key 256, value 512):
the backward state-gradient kernel (`chunk_gated_delta_rule_bwd_dhu`) and the forward state kernel, timed with FLA's
own autotuned config and then with each (value block, warps) pair pinned; outputs compared with FLA's default.
Then our two state kernels (`megatron_muon.ops.state_tma`: TMA-streamed, software-pipelined tiles) for each of
their tiles, against FLA's defaults in the same run.
Each row also gives the rate at which the kernel streams the chunks' key-side tiles (q, k, w backward; k, w forward)
from L2: every (head, value block) program reads all of them for every chunk, so the traffic grows as the value
block shrinks.

    python benchmarks/fla_state_kernels.py   # a GPU with FLA; prints the lines of results/fla_state_kernels.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # megatron_muon from this checkout

from bench_env import gdn_chunk_inputs  # noqa: E402

B, T, H, K, V = 1, 16384, 6, 256, 512
KEY = ["H", "HV", "K", "V", "BT", "STATE_V_FIRST"]
CHUNK = 64


def tile_traffic_tb_per_s(block_v: int, tiles: int, ms: float) -> float:
    """TB/s of key-side tiles ([CHUNK, K] bf16, `tiles` per chunk) read by the H·V/block_v programs of a call."""
    programs, chunks = H * V // block_v, T // CHUNK
    return programs * chunks * tiles * CHUNK * K * 2 / (ms * 1e-3) / 1e12


def rewrap(heuristics, configs):
    """FLA's kernel (heuristics(autotune(jit))) re-autotuned over `configs` only."""
    import triton

    return triton.heuristics(heuristics.values)(triton.autotune(configs=configs, key=KEY)(heuristics.fn.fn))


def main() -> None:
    import triton
    from fla.ops.common import chunk_delta_h as m
    from triton.testing import do_bench

    q, k, w, u, do, dv, g = gdn_chunk_inputs(B, T, H, K, V)

    def bwd():
        return m.chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=None, dht=None, do=do, dv=dv, scale=K**-0.5,
                                                state_v_first=True, chunk_size=64)

    def fwd():
        return m.chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=None, output_final_state=False,
                                              chunk_size=64, state_v_first=True)

    def largest_difference(outputs, references):
        return max((a.float() - b.float()).abs().max().item() for a, b in zip(outputs, references) if a is not None)

    ref_b, ref_f = bwd(), fwd()
    t_b, t_f = do_bench(bwd, rep=300), do_bench(fwd, rep=300)
    original_b = m.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64
    original_f = m.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    print(f"FLA default: bwd_dhu {t_b:.3f} ms  fwd_h {t_f:.3f} ms  best bwd {original_b.fn.best_config} "
          f"fwd {original_f.fn.best_config}")
    for bv in (16, 32, 64):
        for warps in (2, 4, 8):
            configs = [triton.Config({"BV": bv}, num_warps=warps, num_stages=s) for s in (2, 3, 4)]
            try:
                m.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 = rewrap(original_b, configs)
                m.chunk_gated_delta_rule_fwd_kernel_h_blockdim64 = rewrap(original_f, configs)
                err_b, err_f = largest_difference(bwd(), ref_b), largest_difference(fwd(), ref_f)
                tb, tf = do_bench(bwd, rep=200), do_bench(fwd, rep=200)
                stages = m.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64.fn.best_config.num_stages
                print(f"BV={bv} warps={warps}: bwd {tb:.3f} ms ({stages} st, q/k/w "
                      f"{tile_traffic_tb_per_s(bv, 3, tb):.1f} TB/s) err {err_b:.3g} | fwd {tf:.3f} ms "
                      f"(k/w {tile_traffic_tb_per_s(bv, 2, tf):.1f} TB/s) err {err_f:.3g}", flush=True)
            except Exception as error:  # a config the compiler rejects is a row, not the end of the table
                print(f"BV={bv} warps={warps}: failed {type(error).__name__}: {str(error)[:200]}", flush=True)
            finally:
                m.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 = original_b
                m.chunk_gated_delta_rule_fwd_kernel_h_blockdim64 = original_f
    ours_lines(q, k, w, u, g, do, dv, (t_b, t_f), (ref_b, ref_f))


def ours_lines(q, k, w, u, g, do, dv, fla_ms, fla_outputs) -> None:
    """Our TMA state kernels per tile: time, ratio to FLA's default, largest difference from FLA's outputs."""
    from triton.testing import do_bench

    from megatron_muon.ops import state_tma

    kernels = {
        "bwd": (state_tma.BACKWARD_CONFIGS, lambda c: state_tma.chunk_dhu(q, k, w, g, do, dv, K**-0.5, config=c), 3),
        "fwd": (state_tma.FORWARD_CONFIGS, lambda c: state_tma.chunk_fwd_h(k, w, u, g, config=c), 2),
    }
    for (name, (configs, call, tiles)), reference_ms, reference in zip(kernels.items(), fla_ms, fla_outputs):
        for config in configs:
            label = f"ours {name} BV={config[0]} warps={config[1]} stages={config[2]}"
            try:
                outputs = call(config)
                err = max((a.float() - b.float()).abs().max().item()
                          for a, b in zip(outputs, reference) if a is not None and b is not None)
                ms = do_bench(lambda: call(config), rep=300)
                print(f"{label}: {ms:.3f} ms = {ms / reference_ms:.3f}x FLA's default "
                      f"({tile_traffic_tb_per_s(config[0], tiles, ms):.1f} TB/s) err {err:.3g}", flush=True)
            except Exception as error:  # a tile the compiler rejects is a row, not the end of the table
                print(f"{label}: failed {type(error).__name__}: {str(error)[:160]}", flush=True)

if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("fla_state_kernels.py times CUDA kernels; run it on a GPU machine with FLA installed")
    main()
