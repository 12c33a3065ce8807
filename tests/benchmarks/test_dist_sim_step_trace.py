"""dist_sim_step's tracing on CPU (one process playing one rank of two): the per-tensor digests after each backward
and step are taken, two variants of one optimizer compare equal at every point, and `first_difference` names the
first step, phase and tensors where two runs part, and the first non-finite tensor; a variant with another
Newton–Schulz schedule trains to other parameters and is compared with none of them."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from dist_sim_step import first_difference  # noqa: E402


def _row(variant, params_step_1, losses=("0x1p+0",), nonfinite=()):
    return {"variant": variant, "world": 2, "losses": list(losses), "trace": [
        {"step": 0, "stage": "backward", "grads": {"w": "aa"}, "nonfinite": []},
        {"step": 0, "stage": "step", "params": {"w": "bb", "v": "cc"}, "state": {}, "nonfinite": []},
        {"step": 1, "stage": "backward", "grads": {"w": "dd"}, "nonfinite": list(nonfinite)},
        {"step": 1, "stage": "step", "params": params_step_1, "state": {}, "nonfinite": []}]}


def test_first_difference_names_the_step_phase_and_tensors():
    base = _row("ours", {"w": "ee", "v": "ff"})
    lines = first_difference([base, _row("ours-after", {"w": "ee", "v": "ff"}),
                              _row("ours", {"w": "ee", "v": "00"}, losses=("0x1.1p+0",), nonfinite=("grad:w",)),
                              _row("adam", {"w": "11", "v": "22"})])
    text = "\n".join(lines)
    assert "run 2 (ours-after) against run 1 (ours), W = 2: identical at every traced point; same losses" in text
    assert "run 3 (ours) against run 1 (ours), W = 2: first differ at step 1 after the step: 1 tensors, " \
           "e.g. params:v; losses differ" in text
    assert "run 3 (ours): first non-finite at step 1 after the backward: 1 tensors, in order grad:w" in text
    assert "run 4" not in text  # the first AdamW run has nothing of its optimizer to compare with


def test_traced_cpu_run_digests_every_phase(tmp_path):
    out = tmp_path / "trace.md"
    command = [sys.executable, str(REPO / "benchmarks" / "dist_sim_step.py"), "--cpu", "--recipe", "tiny-cpu",
               "--world", "2", "--variants", "ours,ours-after,ours-end-pe4,ours-end-next,ours-end-nancheck", "--steps", "2",
               "--warmup", "1", "--trace", "--digest", "--out", str(out), "--data-dir", str(tmp_path / "data")]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [row["variant"] for row in rows] == ["ours", "ours-after", "ours-end-pe4", "ours-end-next",
                                                "ours-end-nancheck"]
    assert rows[3]["speculation_used"] > 0 and rows[3]["speculation_discarded"] == 0
    # the defaults under megatron's DDP NaN check take the next-step check, and the check itself changes nothing
    assert [row["nonfinite_check"] for row in rows] == ["before_update"] * 3 + ["next_step"] * 2
    assert rows[4]["param_digest"] == rows[3]["param_digest"] and rows[4]["losses"] == rows[3]["losses"]
    assert all("error" not in row for row in rows)
    trace = rows[0]["trace"]
    assert [(point["step"], point["stage"]) for point in trace] == [(0, "backward"), (0, "step"), (1, "backward"),
                                                                     (1, "step")]
    assert trace[0]["grads"] and trace[1]["params"] and not any(point["nonfinite"] for point in trace)
    assert any(name.startswith("muon") and name.endswith(":momentum") for name in trace[1]["state"]), trace[1]
    assert trace[0]["grads"] != trace[2]["grads"]  # digests of different gradients differ
    assert rows[0]["param_digest"] == rows[1]["param_digest"] and rows[0]["losses"] == rows[1]["losses"]
    assert "run 2 (ours-after) against run 1 (ours), W = 2: identical at every traced point" in out.read_text()
    # the 4-step schedule is another computation: its own parameters, and no comparison with the 5-step runs
    assert rows[2]["param_digest"] != rows[0]["param_digest"] and "run 3 (ours-end-pe4) against" not in out.read_text()
