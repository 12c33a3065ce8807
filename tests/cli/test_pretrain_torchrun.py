"""`megatron-muon pretrain` end to end under torchrun on 2 gloo ranks: 30 steps with Muon and with AdamW."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.training.distributed import free_port
from megatron_muon.training.report import read_jsonl, recheck_mfu

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "training.train_iters=30", "training.micro_batch_size=2", "training.global_batch_size=4",
    "model.seq_length=64", "optimizer.lr_warmup_iters=3", "logging.log_interval=10",
]


def _torchrun(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "megatron_muon.cli", "pretrain", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "optimizer, layout, lr",
    [("muon", "parallel.tensor_model_parallel_size=1", "5e-3"), ("adam", "parallel.tensor_model_parallel_size=2", "3e-3"),
     ("muon", "parallel.use_distributed_optimizer=true", "5e-3")],  # owner engine + megatron's DistributedOptimizer
)
def test_pretrain_30_steps_on_two_ranks(tmp_path, optimizer, layout, lr):
    out = tmp_path / "run"
    sets = [f"--set={item}" for item in TINY + [layout, f"optimizer.name={optimizer}", f"optimizer.lr={lr}",
                                                 "metrics.peak_tflops=1.0"]]
    result = _torchrun(["--recipe", "tiny-cpu", "--output-dir", str(out), *sets], tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_jsonl(out / "train_log.jsonl")
    start, steps, end = records[0], [r for r in records if r["event"] == "step"], records[-1]
    assert start["world_size"] == 2 and start["recipe"]["optimizer"]["name"] == optimizer
    matrix_optimizer = "megatron_muon.optimizer.muon.Muon" if optimizer == "muon" else "torch.optim.adam"
    if "use_distributed_optimizer" in layout:
        matrix_optimizer = "megatron_muon.optimizer.wave_muon.WaveMuon"
    assert any(name.startswith(matrix_optimizer) for name in start["optimizer_classes"]), start["optimizer_classes"]
    assert [r["step"] for r in steps] == [10, 20, 30] and end["event"] == "end"
    memory = [r["memory"] for r in records if r["event"] == "memory"]  # one record, after the first step
    assert len(memory) == 1 and set(memory[0]) == {"optimizer_state_bytes", "param_bytes", "grad_bytes", "peak_bytes"}
    assert all(len(values) == 2 for values in memory[0].values()) and memory[0]["peak_bytes"] == [None, None]
    assert all(b > 0 for b in memory[0]["optimizer_state_bytes"] + memory[0]["grad_bytes"])
    assert "memory, busiest rank" in result.stdout
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"], [r["loss"] for r in steps]
    for r in steps:
        # The logged MFU is FLOPs/token x tokens/s / (peak x GPUs), with the 1 TFLOP/s peak given above.
        expected = start["flops_per_token"] * r["tokens_per_s"] / (1e12 * 2)
        assert r["mfu"] == pytest.approx(expected, rel=1e-9)
        all_sdpa = start["all_sdpa_flops_per_token"] * r["tokens_per_s"] / (1e12 * 2)
        assert r["mfu_all_sdpa"] == pytest.approx(all_sdpa, rel=1e-9)
        assert 0 < r["optimizer_share"] < 1 and r["memory_gib"] > 0
    for row in recheck_mfu(records):  # `megatron-muon report`: FLOPs/token recomputed from the logged recipe
        assert row["mfu_by_hand"] == pytest.approx(row["mfu_logged"], rel=1e-9)
    assert (out / "loss_mfu.png").stat().st_size > 10_000
    assert "done: loss" in result.stdout
