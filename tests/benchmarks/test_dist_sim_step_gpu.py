"""The owner engine inside megatron's backward on one GPU (fake process group, one rank of two): Newton–Schulz
replayed from CUDA graphs trains to the same parameters, bit for bit, as an eager speculation run, and the graphs
were captured and replayed, not silently turned off. Two eager runs of the same step can differ bit-wise (some
kernel on the path reorders its sums: benchmarks/results/dist_sim_step_determinism.md), so the graphed run sits
between two eager ones and must equal one of them."""

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_graph_replayed_newton_schulz_trains_like_eager_speculation(tmp_path):
    from dist_sim_step import main

    out = tmp_path / "dist_sim_step.md"
    small = ["model.num_layers=4", "model.seq_length=2048", "model.vocab_size=4096", "optimizer.clip_grad=0.0",
             "training.torch_compile=false"]  # the reference shapes (our GDN kernels), four layers
    main(["--recipe", "hybrid-1.5b-h200", "--world", "2", "--variants", "ours,ours-graphs,ours", "--steps", "6",
          "--warmup", "1", "--digest", *[arg for item in small for arg in ("--set", item)], "--out", str(out)])
    runs = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert all("error" not in row for row in runs), runs
    eager_digests = {row["param_digest"] for row in runs if row["variant"] == "ours"}
    rows = {row["variant"]: row for row in runs}
    assert rows["ours-graphs"]["graphs"]["disabled"] is None
    assert rows["ours-graphs"]["graphs"]["captures"] > 0 and rows["ours-graphs"]["graphs"]["replays"] > 0
    assert rows["ours-graphs"]["speculation_used"] == rows["ours"]["speculation_used"] > 0
    assert rows["ours-graphs"]["param_digest"] in eager_digests
