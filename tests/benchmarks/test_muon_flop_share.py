"""The NS FLOP-share bound: the pieces it counts are the owner engine's, its busiest rank is a valid LPT schedule,
and its share follows from the two FLOP counts."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from muon_flop_share import busiest_rank_flops  # noqa: E402


@pytest.mark.parametrize("world", [1, 3, 8, 40])
def test_the_busiest_rank_is_between_the_even_split_and_one_piece_more(world):
    costs = [97, 3, 50, 50, 12, 88, 1, 64, 64, 7, 33]
    busiest = busiest_rank_flops(costs, world)
    assert max(sum(costs) / world, max(costs)) <= busiest <= sum(costs) / world + max(costs)
    assert busiest_rank_flops(costs, 1) == sum(costs) and busiest_rank_flops(costs, len(costs)) == max(costs)


def test_the_7b_counts_llama_shapes_split_as_megatron_tags_them(tmp_path):
    out = tmp_path / "share.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "muon_flop_share.py"), "--recipes", "gpt-7b-h200", "--world",
                    "8", "--sequences", "1", "--out", str(out)], check=True, cwd=BENCHMARKS.parent, timeout=600)
    row = next(line for line in out.read_text().splitlines() if line.startswith("| gpt-7b-h200 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # q, k, v (QKV split per section) and the output projection: 4 × 4096², plus fc1 (gate+up) and fc2, 32 layers
    assert cells[3] == str(32 * 6)
    from megatron_muon.kernels.flops import flops

    total = 32 * (4 * flops(4096, 4096, "auto") + flops(22016, 4096, "auto") + flops(4096, 11008, "auto"))
    assert float(cells[4]) == pytest.approx(total / 1e12, abs=0.05)
    share = float(cells[5]) / float(cells[6])
    assert float(cells[7].rstrip("%")) == pytest.approx(100 * share, abs=0.06)


def test_per_head_rows_count_one_matrix_per_head(tmp_path):
    out = tmp_path / "share.md"
    subprocess.run([sys.executable, str(BENCHMARKS / "muon_flop_share.py"), "--recipes", "gpt-7b-h200", "--world",
                    "8", "--sequences", "1", "--split-heads", "--out", str(out)], check=True, cwd=BENCHMARKS.parent,
                   timeout=600)
    row = next(line for line in out.read_text().splitlines() if line.startswith("| gpt-7b-h200 (per head) |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 32 heads of 128 in each of q, k and v (32 query groups), the output projection and the MLP whole, 32 layers
    assert cells[3] == str(32 * (3 * 32 + 3))
    from megatron_muon.kernels.flops import flops

    heads = 3 * 32 * flops(128, 4096, "auto")
    total = 32 * (heads + flops(4096, 4096, "auto") + flops(22016, 4096, "auto") + flops(4096, 11008, "auto"))
    assert float(cells[4]) == pytest.approx(total / 1e12, abs=0.05)
