"""`python -m megatron_muon.launch script.py ...` runs a Megatron-LM-style script with the plugin registered."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _launch(tmp_path, *extra, launch_flags=(), env_extra=None, ranks=1):
    """The stand-in script through the launcher in CPU mode, as one process or under torchrun with `ranks`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), STANDIN_REPORT=str(report), OMP_NUM_THREADS="1")
    launch = ["-m", "megatron_muon.launch", "--cpu-mode", *launch_flags, str(STANDIN), *TINY_MEGATRON_ARGS, *extra]
    if ranks == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        command = [sys.executable, *launch]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
                   str(free_port()), *launch]
    env.update(env_extra or {})
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300 * ranks)
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
                                    "muon_model_copy": 0, "main_grad_add_params": 0,
                                    "first_grad_overwrite_chunks": 0}, report


def test_the_launchers_split_heads_flag_orthogonalizes_qkv_per_head(tmp_path):
    """`--muon-split-heads` before the script: Megatron-LM has no such argument, the plugin's default carries it.
    kv-channels 16, 2 query groups of 2 heads: per head every QKV matrix is 16 × 64; per section q would be 64 × 64
    and k, v 32 × 64."""
    report = _launch(tmp_path, "--optimizer", "muon", launch_flags=("--muon-split-heads",))
    shapes = [tuple(shape) for shape in report["muon_bucket_shapes"]]
    assert (16, 64) in shapes and (32, 64) not in shapes, shapes
    assert sum(report["losses"][-4:]) < sum(report["losses"][:4])


def test_the_fast_paths_train_through_megatron_lm_as_megatrons_own_passes(tmp_path):
    """Under the Triton interpreter the plugin's passes run on CPU. Through Megatron-LM's own training loop, bf16
    Muon (AdamW for the rest) with every step clipped: the one-pass AdamW and the clip inside Muon's momentum pass
    follow megatron's own passes: the same losses until the two AdamW passes' fp32 roundings put a master weight on
    different sides of a bf16 rounding boundary. Which step that is depends on the machine: on one, the third step's
    first micro-batch differed by 2.5e-5 relative while its second kept its loss bit for bit."""
    extra = ("--optimizer", "muon", "--bf16", "--clip-grad", "0.05")
    interpreter = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    ours = _launch(tmp_path / "fast", *extra, env_extra=interpreter)
    reference = _launch(tmp_path / "megatron", *extra, launch_flags=("--no-fast-paths",), env_extra=interpreter)
    assert ours["fast_paths"]["one_pass_adamw"] == 1 and ours["fast_paths"]["muon_clip_in_momentum"] == 1, ours
    assert ours["fast_paths"]["muon_model_copy"] == 1, ours
    assert reference["fast_paths"] is None
    assert ours["losses"][:4] == pytest.approx(reference["losses"][:4], rel=1e-6, abs=0)
    assert ours["losses"][:8] == pytest.approx(reference["losses"][:8], rel=1e-4, abs=0)
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-3, abs=0)
    assert sum(ours["losses"][-4:]) < sum(ours["losses"][:4])


def test_the_owner_engine_through_megatron_lm_trusts_its_default_nan_check(tmp_path):
    """`--optimizer muon --use-distributed-optimizer` through Megatron-LM's config-container path (pretrain_gpt.py's):
    DDP in the owner layout, the owner engine with AdamW beside it. Megatron-LM's default
    `--check-for-nan-in-loss-and-grad` has DDP stop a NaN gradient in the backward, so the engine's `auto` check moves
    to the next step; without megatron's check the engine reads the norm before the update."""
    extra = ("--optimizer", "muon", "--use-distributed-optimizer", "--overlap-grad-reduce")
    checked = _launch(tmp_path / "checked", *extra)
    unchecked = _launch(tmp_path / "unchecked", *extra, "--no-check-for-nan-in-loss-and-grad")
    assert (checked["ddp_check_for_nan_in_grad"], checked["nonfinite_checks"]) == (True, ["next_step"]), checked
    assert (unchecked["ddp_check_for_nan_in_grad"], unchecked["nonfinite_checks"]) == (False, ["before_update"])
    for report in (checked, unchecked):
        assert report["optimizer_classes"] == ["megatron_muon.optimizer.wave_muon.WaveMuon",
                                               "torch.optim.adamw.AdamW"], report
        assert sum(report["losses"][-4:]) < sum(report["losses"][:4]), report["losses"]


def test_the_owner_engine_through_megatron_lm_at_dp2_trains_like_plain_muon(tmp_path):
    """Two data-parallel ranks (torchrun, gloo): the owner engine through pretrain_gpt.py's config-container path
    gives rank 0 the losses of plain Muon (every rank orthogonalizing every matrix) within fp32 reduction-order
    rounding (measured 7e-6 relative)."""
    owner = _launch(tmp_path / "owner", "--optimizer", "muon", "--use-distributed-optimizer", "--overlap-grad-reduce",
                    ranks=2)
    plain = _launch(tmp_path / "plain", "--optimizer", "muon", "--overlap-grad-reduce", ranks=2)
    assert owner["optimizer_classes"] == ["megatron_muon.optimizer.wave_muon.WaveMuon", "torch.optim.adamw.AdamW"]
    assert plain["optimizer_classes"][0] == "megatron_muon.optimizer.muon.Muon", plain
    assert len(owner["losses"]) == len(plain["losses"]) == 8
    assert owner["losses"] == pytest.approx(plain["losses"], rel=1e-4, abs=0)
    assert sum(owner["losses"][-4:]) < sum(owner["losses"][:4]), owner["losses"]


def test_no_fast_paths_leaves_megatrons_optimizer_as_built(tmp_path):
    report = _launch(tmp_path, "--optimizer", "adam", launch_flags=("--no-fast-paths",))
    assert report["fast_paths"] is None and report["optimizer_classes"] == ["torch.optim.adamw.AdamW"], report


def test_launch_rejects_a_missing_script(tmp_path, capsys):
    assert launch_main([str(tmp_path / "pretrain_gpt.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert launch_main([]) == 2


def test_the_fast_paths_hook_also_reaches_a_megatron_training_module_imported_before_it():
    """Patched Megatron-LM scripts import megatron.training.training before they can call the plugin: the hook must
    replace the name that module already bound, not only megatron-core's."""
    code = (
        "import megatron.core.optimizer as core, megatron.training.training as training\n"
        "from megatron_muon.megatron.fast_paths import install_after_every_optimizer_build\n"
        "original = core.get_megatron_optimizer\n"
        "install_after_every_optimizer_build(); install_after_every_optimizer_build()\n"
        "assert training.get_megatron_optimizer is core.get_megatron_optimizer is not original\n"
        "assert core.get_megatron_optimizer.__wrapped__ is original  # installed once\n"
        "print('hooked')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "hooked" in result.stdout, result.stderr[-3000:]
