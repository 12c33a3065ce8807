"""The optimizer-step benchmark runs end to end on CPU at a reduced scale, breakdown, per-stack NS and the
profiles included."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_optimizer_step_benchmark_smoke(tmp_path):
    out = tmp_path / "optimizer_step.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "optimizer_step.py"), "--scale", "64", "--warmup", "0",
                    "--repeats", "1", "--only-ours", "--profile", "--wide-layout", "64x3", "--out", str(out)],
                   check=True, cwd=BENCHMARKS.parent, timeout=300)
    text = out.read_text()
    assert "| ours (auto, MegaBatch, fused splits) |" in text
    assert "the wide one's k-slices of 64, 3 stages, 1 epilogue buffer(s)" in text  # the layout the run used
    assert "| building the NS stacks" in text and "| Newton–Schulz (batched calls alone) |" in text
    assert "| 24 × 176 × 32 | auto: gram |" in text  # fc1 (11264 × 2048 / 64) as one stack of 24
    assert text.count("| all stacks, summed |") == 2  # the default's stacks and the per-head variant's
    assert "Newton–Schulz per stack, ours (auto, MegaBatch, heads split)" in text
    assert text.count("| ours (auto, MegaBatch, fused splits, CUDA graph) |") == 2  # step table and host table
    assert "| ours (auto, MegaBatch, heads split) |" in text  # GDN in_proj tagged with its head rows
    assert "| ours (auto, MegaBatch, fused splits, CUDA graph, polar_express×4) |" in text
    assert "| ours (auto, MegaBatch, fused splits, CUDA graph, NS reduces the stacks' norms) |" in text  # the A/B
    assert "| ours (auto, MegaBatch, heads split, CUDA graph, polar_express×4) |" in text
    for name in ("fused splits, CUDA graph", "fused splits, CUDA graph, polar_express×4",
                 "heads split, CUDA graph, polar_express×4"):  # each graphed row's kernel table
        assert f"### Where the time goes: ours (auto, MegaBatch, {name}) (top 15 of" in text


def test_optimizer_step_benchmark_refuses_a_wide_layout_that_does_not_fit():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "optimizer_step.py"), "--wide-layout", "64x4x2"],
                            cwd=BENCHMARKS.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "shorten the ring or the k-slice" in result.stderr


def test_shape_sets_match_their_recipes():
    """Full-size parameter counts of each shape set equal the model's (hybrid-1.5B 1.478B, Llama-2-7B's 6.738B)."""
    sys.path.insert(0, str(BENCHMARKS))
    from optimizer_step import SHAPE_SETS

    def count(shape_set):
        matrices = sum(rows * cols * n for _, rows, cols, _, n in shape_set["matrices"])
        rest = 2 * shape_set["vocab"] * shape_set["hidden"] + (2 * shape_set["layers"] + 1) * shape_set["hidden"]
        return matrices, matrices + rest

    assert round(count(SHAPE_SETS["hybrid-1.5b"])[1] / 1e6) == 1478
    matrices, total = count(SHAPE_SETS["gpt-7b"])
    assert round(total / 1e6) == 6738 and round(matrices / 1e6) == 6476
    for shape_set in SHAPE_SETS.values():  # fused QKV rows are whole groups of megatron's sections
        for name, rows, _, sections, _ in shape_set["matrices"]:
            assert sections is None or rows % sum(sections) == 0, name


def test_first_layers_hold_their_share_of_each_matrix_kind_and_the_whole_embeddings():
    import pytest
    import torch

    sys.path.insert(0, str(BENCHMARKS))
    from optimizer_step import layer_counts, reference_params

    assert layer_counts("gpt-7b", 16) == [16, 16, 16, 16]
    assert layer_counts("hybrid-1.5b", 8) == [6, 6, 2, 2, 8, 8]  # GGG* twice: 6 GDN, 2 attention, 8 MLPs
    assert layer_counts("hybrid-1.5b", None) == [18, 18, 6, 6, 24, 24]
    with pytest.raises(ValueError, match=r"divide evenly into \[4, 8, 12, 16, 20, 24\]"):
        layer_counts("hybrid-1.5b", 6)
    with pytest.raises(ValueError, match="pass one of those"):
        layer_counts("gpt-7b", 33)
    matrices, rest = reference_params(torch.device("cpu"), 64, "gpt-7b", layers=2)
    assert len(matrices) == 8 and [tuple(p.shape) for p in matrices[:2]] == [(192, 64), (192, 64)]
    assert len(rest) == 2 + 2 * 2 + 1 and tuple(rest[0].shape) == (500, 64)  # embeddings whole, 2 norms per layer


def test_floor_counts_newton_schulz_at_peak_and_the_unavoidable_bytes_at_adamws_bandwidth():
    sys.path.insert(0, str(BENCHMARKS))
    from optimizer_step import floor_lines

    # 2 stacks, 989 GFLOP in all = 1 ms at 989 TFLOP/s; AdamW moves 28 B x 1e9 params in 10 ms (2.8 TB/s), so the
    # 20 B x 0.5e9 matrix params take 10e9 / 2.8e12 s = 3.571 ms; floor 4.571 ms = 0.457 x AdamW.
    stacks = [("2 × 8 × 16", "auto: gram", 9.0, 2.0, 600 * 10**9), ("1 × 8 × 8", "standard", 3.0, 1.0, 389 * 10**9)]
    line = floor_lines(stacks, 10.0, 500_000_000, 1_000_000_000, 989.0)[-1]
    assert "0.99 TFLOP" in line and "1.00 ms at the dense fp16 peak (989 TFLOP/s)" in line
    assert "3.57 ms at fused AdamW's 2.80 TB/s" in line and "Floor 4.57 ms = 0.46× fused AdamW" in line
    # the graphed stacks ran 3 ms in all: 330 TFLOP/s, 33% of peak, (3 + 3.571) / 10 = 0.66x
    assert "at the 330 TFLOP/s the stacks reach from a CUDA graph (33% of peak), 0.66×." in line
    assert floor_lines(stacks, 10.0, 1, 1, None) == []  # no known peak (CPU): no floor
    stacks[1] = stacks[1][:3] + (None, stacks[1][4])
    assert floor_lines(stacks, 10.0, 500_000_000, 1_000_000_000, 989.0)[-1].endswith("fused AdamW.")
