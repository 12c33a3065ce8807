"""`python -m megatron_muon.launch script.py ...` runs a Megatron-LM-style script with the plugin registered."""

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_muon.launch import main as launch_main
from megatron_muon.training.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).with_name("standin_pretrain_gpt.py")
TINY_MEGATRON_ARGS = [
    "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "8", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--mock-data",
    "--vocab-size", "256", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
    "--no-rope-fusion", "--no-persist-layer-norm", "--log-interval", "4", "--eval-iters", "0",
    "--eval-interval", "1000", "--distributed-backend", "gloo", "--use-cpu-initialization", "--num-workers", "0",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
]


def _launch(tmp_path, *extra, launch_flags=()):
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), STANDIN_REPORT=str(report), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "megatron_muon.launch", "--cpu-mode", *launch_flags, str(STANDIN), *TINY_MEGATRON_ARGS, *extra]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    return json.loads(report.read_text())


def test_optimizer_muon_through_megatron_lm_runs_ours_on_the_gdn_hybrid_spec(tmp_path):
    report = _launch(tmp_path, "--optimizer", "muon", "--muon-extra-scale-factor", "0.2",
                     "--spec", "megatron_muon.specs", "gdn_hybrid_local")
    assert report["optimizer_name"] == "muon"
    assert any(name == "megatron_muon.optimizer.muon.Muon" for name in report["optimizer_classes"]), report
    assert report["mixers"] == ["GatedDeltaNet", "GatedDeltaNet", "GatedDeltaNet", "SelfAttention"], report
    losses = report["losses"]
    assert len(losses) == 8 * 2 and sum(losses[-4:]) < sum(losses[:4])  # 2 micro-batches per step
    # the fast paths were offered to what megatron built; on CPU none of them applies
    assert report["fast_paths"] == {"fused_adam_groups": 0, "one_pass_adamw": 0, "muon_clip_in_momentum": 0,
                                    "main_grad_add_params": 0}, report


def test_no_fast_paths_leaves_megatrons_optimizer_as_built(tmp_path):
    report = _launch(tmp_path, "--optimizer", "adam", launch_flags=("--no-fast-paths",))
    assert report["fast_paths"] is None and report["optimizer_classes"] == ["torch.optim.adamw.AdamW"], report


def test_launch_rejects_a_missing_script(tmp_path, capsys):
    assert launch_main([str(tmp_path / "pretrain_gpt.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert launch_main([]) == 2
