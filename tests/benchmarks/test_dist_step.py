"""The data-parallel step benchmark on two CPU ranks (gloo): variants build and train, the report holds each one's
per-rank Newton–Schulz time, and the owner plan changes where matrices go but not what training computes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_muon.testing.pool import free_port

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from dist_step import VARIANTS, NumelCost, spread  # noqa: E402


def test_numel_cost_balances_elements_only():
    assert NumelCost().launch_cost((3, 4)) == 0.0 and NumelCost().matrix_cost((3, 4)) == 12.0
    assert spread([1.0, 3.0]) == 1.5 and spread([]) is None
    assert {"adam", "ours", "ours-greedy", "ours-numel", "ours-no-overlap", "upstream"} <= set(VARIANTS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode run; the GPU machine runs it on NCCL")
def test_two_rank_variants_train_and_report_the_load_spread(tmp_path):
    out = tmp_path / "dist_step.md"
    # megatron-core's layer-wise all-gather needs NCCL (uneven sizes), so `upstream` runs on GPUs only.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(REPO / "benchmarks" / "dist_step.py"), "--recipe", "tiny-cpu",
               "--set", "training.precision=bf16", "--variants", "adam,ours,ours-numel", "--steps", "4",
               "--warmup", "1", "--out", str(out), "--data-dir", str(tmp_path / "data")]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["variant"]: row for row in report["rows"]}
    assert report["meta"]["world"] == 2 and report["meta"]["backend"] == "gloo"
    assert all("error" not in row for row in rows.values()), [row.get("error") for row in rows.values()]
    assert rows["adam"]["plan"] is None and all(r["ns_ms"] == 0 for r in rows["adam"]["ranks"])
    for key in ("ours", "ours-numel"):
        assert len(rows[key]["ranks"]) == 2 and all(r["ns_ms"] > 0 for r in rows[key]["ranks"])
    assert rows["ours"]["plan"]["method"] in ("milp", "greedy") and rows["ours"]["plan"]["matrices"] > 0
    # the numel plan is a different assignment (its costs are elements), yet every matrix is updated the same way
    assert rows["ours-numel"]["plan"]["predicted_makespan"] > 1000 > rows["ours"]["plan"]["predicted_makespan"]
    assert rows["ours-numel"]["losses"] == rows["ours"]["losses"]
    assert rows["ours"]["losses"][-1] < rows["ours"]["losses"][0]
    table = out.read_text()
    assert "| ours: our muon + distributed optimizer" in table and "× AdamW step" in table
