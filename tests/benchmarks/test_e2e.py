"""The end-to-end ladder script: rung parsing, the upstream spec's wiring, and a short CPU run of our spec."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from e2e_rungs import DEFAULT_RUNGS, parse_rungs  # noqa: E402


def test_parse_rungs():
    assert [r.key for r in parse_rungs("all")] == list(DEFAULT_RUNGS)
    assert [r.key for r in parse_rungs("4, 6")] == ["4", "6"]
    with pytest.raises(ValueError, match="choose from"):
        parse_rungs("4,7")


def test_an_upstream_rung_that_fla_would_stop_is_reported_without_building(monkeypatch):
    """megatron-core's GDN calls FLA directly: where FLA refuses its own backward (Hopper, Triton < 3.7.1, no
    TileLang) the rung says so at once instead of after building the model and a forward."""
    from argparse import Namespace
    from types import SimpleNamespace

    import e2e

    from megatron_muon.training.recipes import load_recipe

    monkeypatch.setattr(e2e, "fla_own_backward_refusal", lambda: "FLA refuses here: pip install tilelang==0.1.15")
    monkeypatch.setattr(e2e, "build_rung", lambda *a, **k: pytest.fail("an upstream rung FLA refuses was built"))
    ctx = SimpleNamespace(device=torch.device("cuda"))
    rows = [e2e.run_rung(load_recipe("tiny-cpu", []), rung, ctx, Namespace(revision="abc"), None)
            for rung in parse_rungs("1te,3")]
    assert all(row["error"].startswith("not run: FLA refuses here") for row in rows), rows
    assert rows[0]["measured"].endswith("abc")


def test_only_the_te_rungs_build_our_spec_on_transformer_engine():
    """A machine with TE installed must not turn the local rungs into TE ones (the spec's `auto` would)."""
    from e2e import rung_recipe

    from megatron_muon.training.recipes import load_recipe

    base = load_recipe("tiny-cpu", [])
    backends = {r.key: rung_recipe(base, r).model.spec_backend for r in parse_rungs("4e,4,6,4te-e,4te,1te,3te")}
    assert backends == {"4e": "local", "4": "local", "6": "local", "4te-e": "te", "4te": "te", "1te": "local",
                        "3te": "local"}
    compiled = {r.key: rung_recipe(base, r).training.torch_compile for r in parse_rungs("4te-e,4te,1te,1tm,3te")}
    assert compiled == {"4te-e": False, "4te": True, "1te": False, "1tm": False, "3te": True}


def test_rungs_run_their_own_gdn_kernels_else_the_recipes_and_the_build_keeps_them():
    """A recipe naming GDN kernels (the Qwen3-Next one: "fused") sets rung 4's; a rung naming its own wins over it.
    The built recipe names none, so building the model does not reset the rung's choice."""
    from e2e import rung_recipe
    from e2e_rungs import rung_gdn_kernels

    from megatron_muon.ops.kernel_choice import PRESETS, GdnKernels
    from megatron_muon.training.recipes import load_recipe

    qwen3 = load_recipe("qwen3-next-1.5b-h200", [])
    assert qwen3.model.gdn_kernels == "fused"
    hybrid = load_recipe("hybrid-1.5b-h200", [])
    assert hybrid.model.gdn_kernels is None
    on_qwen3 = {r.key: rung_gdn_kernels(r, qwen3.model.gdn_kernels) for r in parse_rungs("4,4f,4i")}
    assert on_qwen3 == {"4": PRESETS["fused"], "4f": PRESETS["fla"], "4i": GdnKernels(intra="ours")}
    on_hybrid = {r.key: rung_gdn_kernels(r, hybrid.model.gdn_kernels) for r in parse_rungs("4,4f,4i")}
    assert on_hybrid == {"4": GdnKernels(), "4f": PRESETS["fla"], "4i": GdnKernels(intra="ours")}
    assert all(rung_recipe(qwen3, r).model.gdn_kernels is None for r in parse_rungs("4,4i"))


def test_only_rung_6g_replays_muons_newton_schulz_from_graphs():
    from e2e import rung_recipe

    from megatron_muon.training.recipes import load_recipe

    base = load_recipe("tiny-cpu", [])
    graphs = {r.key: rung_recipe(base, r).optimizer.muon_graph_newton_schulz for r in parse_rungs("6,6g,4")}
    assert graphs == {"6": False, "6g": True, "4": False}


def test_profiled_rungs_must_be_run():
    from e2e import main

    with pytest.raises(SystemExit, match="add them to --rungs"):
        main(["--rungs", "4", "--profile-rung", "4,6"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode run; the GPU runs the real ladder")
def test_cpu_ladder_compiled_equals_eager_over_20_steps(tmp_path):
    """On the tiny recipe (fp32, CPU): our spec trains, the compiled model (inductor) follows the eager run's loss for
    20 steps, and the report names each rung; the upstream rung fails only for the stated reason (megatron-core's GDN
    needs FLA, absent on CPU) without hiding the others."""
    out = tmp_path / "e2e.md"
    # A child process: the script starts its own process group and CPU mode, which must not leak into pytest.
    subprocess.run([sys.executable, str(BENCHMARKS / "e2e.py"), "--recipe", "tiny-cpu", "--rungs", "1,4e,4",
                    "--steps", "20", "--warmup", "2", "--out", str(out), "--data-dir", str(tmp_path / "data")],
                   check=True, cwd=BENCHMARKS.parent, timeout=600)
    rows = {r["rung"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"1", "4e", "4"}
    losses = rows["4e"]["losses"]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.5 * losses[0]
    # fp32: compiled and eager differ by rounding only (measured identical to 4 decimals); a wrong fusion or a
    # stale graph shows up as a different trajectory within a few steps.
    torch.testing.assert_close(torch.tensor(rows["4"]["losses"]), torch.tensor(losses), rtol=1e-4, atol=0)
    assert rows["4"]["compiled"] and rows["4"]["recompiles"] == 0
    assert rows["4"]["gdn_kernels"] == "ours"
    assert rows["4e"]["step_ms"] > 0 and 0 < rows["4e"]["optimizer_share"] < 1
    norms = rows["4e"]["grad_norms"]
    assert len(norms) == 20 and all(n > 0 and n == n for n in norms) and rows["4e"]["clip_grad"] > 0
    try:
        import fla  # noqa: F401
    except ImportError:
        assert "FLA is not installed" in rows["1"]["error"]
    text = out.read_text()
    assert "our spec + fused AdamW, eager" in text and "| 1 |" in text
    assert "rung 4e " in text.split("exceeded clip_grad (clipped): ")[1]


def test_report_states_memory_outside_the_allocator_for_failed_rungs_too(tmp_path):
    """A rung that ran out of memory keeps the one number that says how much of the card PyTorch could not use."""
    from e2e_report import write_report

    ran = {"rung": "4e", "label": "eager", "step_ms": 10.0, "fwd_bwd_ms": 9.0, "optimizer_ms": 1.0,
           "optimizer_share": 0.1, "tokens_per_s": 1e5, "losses": [2.0, 1.0], "grad_norms": [3.0, 0.5],
           "clip_grad": 1.0, "outside_allocator_gib": 1.25}
    failed = {"rung": "4", "label": "compiled", "error": "OutOfMemoryError: CUDA out of memory",
              "outside_allocator_gib": 7.04}
    out = tmp_path / "e2e.md"
    meta = {"date": "2026-12-05", "device": "GPU", "recipe": "tiny-cpu", "overrides": [], "steps": 2, "warmup": 1,
            "command": "python benchmarks/e2e.py"}
    write_report(out, out.with_suffix(".json"), {"4e": ran, "4": failed}, meta)
    line = next(line for line in out.read_text().splitlines() if "outside PyTorch's allocator" in line)
    assert line.endswith("rung 4e 1.2, rung 4 7.0")


def test_profile_categories_sum_to_all_kernels():
    from e2e_report import category_table, kernel_category

    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "GEMM (cuBLAS / CUTLASS)"
    assert kernel_category("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64").startswith("GDN chunk")
    assert kernel_category("triton_poi_fused_cat_silu_0").startswith("Inductor")
    assert kernel_category("_sym_mm_kernel").startswith("Muon")
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop").startswith("attention")
    assert kernel_category("_momentum_kernel").startswith("optimizer")
    assert kernel_category("_scaled_copy_kernel").startswith("optimizer")
    assert kernel_category("some_unknown_kernel") == "other"
    rows = category_table([("nvjet_a", 3000.0), ("triton_poi_b", 1000.0), ("x", 1000.0)], steps=2)
    assert rows[2] == "| GEMM (cuBLAS / CUTLASS) | 1.5 | 60.0% |"
    assert rows[-1] == "| all kernels | 2.5 | 100% |"


def test_top_kernels_listed_per_category_largest_first():
    from e2e_report import top_kernels_per_category

    kernels = [("nvjet_small", 1000.0), ("nvjet_big", 3000.0), ("triton_poi_b", 2000.0), ("x", 500.0)]
    rows = top_kernels_per_category(kernels, steps=2, per_category=1)
    assert rows[2:] == ["| GEMM (cuBLAS / CUTLASS) | `nvjet_big` | 1.50 |",
                        "| Inductor-generated (fused pointwise / reductions) | `triton_poi_b` | 1.00 |",
                        "| other | `x` | 0.25 |"]


def test_idle_gaps_merge_overlapping_kernels_and_rank_gaps():
    from e2e_report import idle_gaps

    # a [0, 10) overlaps b [5, 20); gap 20 -> 50 (30 µs) before c; gap 60 -> 70 (10 µs) before d
    intervals = [(50.0, 60.0, "c"), (0.0, 10.0, "a"), (5.0, 20.0, "b"), (70.0, 1070.0, "d")]
    # the CPU: a step-long range, an op over most of the first gap, a short op that covers too little of it
    cpu = [(0.0, 2000.0, "step"), (18.0, 45.0, "aten::item"), (21.0, 24.0, "cudaLaunchKernel")]
    lines = idle_gaps(intervals, steps=1, largest=2, cpu_events=cpu)
    assert lines[0].startswith("GPU busy 1.0 ms/step, idle between kernels 0.0 ms/step (2 gaps")
    assert lines[4] == "| 0.03 | `b` | `c` | `aten::item` |"
    assert lines[5] == "| 0.01 | `c` | `d` | `step` |"
    assert idle_gaps(intervals, steps=1, largest=1)[4] == "| 0.03 | `b` | `c` | `-` |"
    assert idle_gaps([], steps=1) == []


def test_compile_stats_names_recompiles_and_compile_phases():
    from torch._dynamo.utils import counters, guard_failures

    from e2e import compile_stats
    from tests.specs.test_compile import _dynamo_enabled

    with _dynamo_enabled():
        counters.clear()
        guard_failures.clear()
        double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        double(torch.randn(3))
        double(torch.randn(3, 2))  # another rank: a guard fails and the function is traced again
        stats = compile_stats()
    assert stats["graph_breaks"] == 0 and stats["recompiles"] == 1, stats
    assert len(stats["recompile_reasons"]) == 1 and "tensor" in stats["recompile_reasons"][0], stats
    assert stats["compile_phases_s"] and all(v >= 0 for v in stats["compile_phases_s"].values()), stats
    assert "_compile.compile_inner" in stats["compile_phases_s"], stats
