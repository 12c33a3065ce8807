"""The multi-GPU parity runner, on CPU/gloo: torchrun launches, run files, and a comparison that can fail.

The runner is what validates dist_muon on NCCL at 4 and 8 GPUs, so its own plumbing (launch, gathering every tp
shard and pipeline stage to rank 0, the comparison and its exit code) is checked here on layouts a CPU can run.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_muon.testing import parity

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


def _environment() -> dict:
    # No GPU even where one exists: these launches test the gloo path with two ranks on one machine.
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def _parity(*args: str, ranks: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(parity.command(ranks) + list(args), cwd=REPO_ROOT, env=_environment(), capture_output=True, text=True,
                          timeout=300)


def _run(directory: Path, *layouts: str, ranks: int | None = None, precision: str = "fp32",
         model: str = "gpt") -> subprocess.CompletedProcess:
    result = _parity("run", "--layout", *layouts, "--model", model, "--precision", precision, "--optimizer",
                     "dist_muon", "--steps", str(STEPS), "--global-microbatches", "4", "--out", str(directory),
                     ranks=ranks)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def run_directory(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("parity")
    _run(directory, "1,1,1")  # a lone process: the runner makes its own 1-rank group
    launched = _run(directory, "1,1,2", "2,1,1", ranks=2)
    assert launched.stdout.count(f"step   {STEPS}/{STEPS}") == 2, launched.stdout  # progress from rank 0 only
    return directory


def test_run_files_hold_full_parameters_losses_and_layout(run_directory):
    files = sorted(path.name for path in run_directory.glob("*.pt"))
    assert files == [f"gpt_fp32_dist_muon_tp{tp}pp1dp{dp}.pt" for tp, dp in ((1, 1), (1, 2), (2, 1))]
    reference = torch.load(run_directory / "gpt_fp32_dist_muon_tp1pp1dp1.pt", weights_only=True)
    sharded = torch.load(run_directory / "gpt_fp32_dist_muon_tp2pp1dp1.pt", weights_only=True)
    assert sharded["layout"] == {"tp": 2, "pp": 1, "dp": 1} and sharded["world_size"] == 2
    assert sharded["backend"] == "gloo" and sharded["device"] == "cpu"
    assert len(sharded["losses"]) == STEPS and sharded["losses"][-1] < sharded["losses"][0]
    # tp-gathered: every parameter has the single-process run's full shape
    assert {n: t.shape for n, t in sharded["params"].items()} == {n: t.shape for n, t in reference["params"].items()}
    assert all(t.dtype == torch.float32 for t in sharded["params"].values())


def test_compare_passes_for_layouts_that_track_the_reference(run_directory):
    result = _parity("compare", str(run_directory), "--reference", "1,1,1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 of 2 runs match the reference" in result.stdout


def test_compare_fails_on_a_corrupted_run(run_directory, tmp_path, capsys):
    for path in run_directory.glob("*.pt"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    corrupted = tmp_path / "gpt_fp32_dist_muon_tp2pp1dp1.pt"
    record = torch.load(corrupted, weights_only=True)
    name = sorted(record["params"])[0]
    record["params"][name] = record["params"][name] + 1e-2 * record["params"][name].abs().max()
    torch.save(record, corrupted)
    assert parity.main(["compare", str(tmp_path), "--reference", "1,1,1"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(corrupted.name))
    assert "FAIL" in row and name in row

    (tmp_path / "gpt_fp32_dist_muon_tp1pp1dp2.pt").write_bytes(b"not a run file")
    assert parity.main(["compare", str(tmp_path), "--reference", "1,1,1"]) == 1
    assert "unreadable" in capsys.readouterr().out


def test_run_refuses_a_layout_that_does_not_fit_the_launch(tmp_path, monkeypatch, capsys):
    for variable in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(variable, raising=False)
    assert parity.main(["run", "--layout", "2,1,1", "--out", str(tmp_path)]) == 2
    assert "needs 2 ranks but the launch has 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert not torch.distributed.is_initialized()


def test_compare_reports_a_missing_reference(run_directory, capsys):
    assert parity.main(["compare", str(run_directory), "--reference", "1,2,1"]) == 1
    assert "no gpt fp32 run at reference layout 1,2,1" in capsys.readouterr().out


def initial_full_parameters(rank, world_size, tp: int, pp: int, model: str):
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_muon_setup, full_parameters

    init_model_parallel(tp=tp, pp=pp)
    model_, _ = build_muon_setup("dist_muon", "fp32", model, config_overrides=parity.TP_READY_SIZES[model])
    return {"params": full_parameters(model_)}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_hybrid_starts_identical_and_gathers_whole_on_every_layout(rank_pool_1, rank_pool_2, tp, pp):
    """The runner's premise for the hybrid: every layout starts from the same full weights, and gathering GDN's
    sectioned in_proj/conv (each of q|k|v|... split across tp on its own) restores them exactly."""
    from megatron_muon.testing.training import merged_params

    reference = rank_pool_1.run(initial_full_parameters, 1, 1, "hybrid")[0]["params"]
    gathered = merged_params(rank_pool_2.run(initial_full_parameters, tp, pp, "hybrid"))
    assert gathered.keys() == reference.keys()
    assert any("in_proj" in name for name in reference) and any("conv1d" in name for name in reference)
    for name, tensor in reference.items():
        assert torch.equal(gathered[name], tensor), name


def test_compare_same_layout_pairs_each_run_with_the_muon_run_of_its_layout(run_directory, tmp_path, capsys):
    source = torch.load(run_directory / "gpt_fp32_dist_muon_tp2pp1dp1.pt", weights_only=True)
    torch.save(source, tmp_path / "gpt_fp32_dist_muon_tp2pp1dp1.pt")
    torch.save({**source, "optimizer": "muon"}, tmp_path / "gpt_fp32_muon_tp2pp1dp1.pt")
    assert parity.main(["compare", str(tmp_path), "--reference", "same"]) == 0
    assert "1 of 1 runs match" in capsys.readouterr().out
    (tmp_path / "gpt_fp32_dist_muon_tp1pp1dp2.pt").write_bytes((run_directory / "gpt_fp32_dist_muon_tp1pp1dp2.pt")
                                                                .read_bytes())
    assert parity.main(["compare", str(tmp_path), "--reference", "same"]) == 1  # no muon run at (1, 1, 2)


def test_compare_holds_fp64_runs_to_1e_6(run_directory, tmp_path, capsys):
    """fp64 runs are compared at 1e-6 by default: an error the fp32 bound (2e-3) lets through fails them."""
    for path in run_directory.glob("gpt_fp32_dist_muon_tp[12]pp1dp1.pt"):
        record = torch.load(path, weights_only=True)
        record.update(precision="fp64", params={n: t.double() for n, t in record["params"].items()})
        torch.save(record, tmp_path / path.name.replace("fp32", "fp64"))
    sharded = tmp_path / "gpt_fp64_dist_muon_tp2pp1dp1.pt"
    record = torch.load(sharded, weights_only=True)
    reference = torch.load(tmp_path / "gpt_fp64_dist_muon_tp1pp1dp1.pt", weights_only=True)
    record["params"] = {n: t.clone() for n, t in reference["params"].items()}
    record["losses"] = list(reference["losses"])
    name = sorted(record["params"])[0]
    record["params"][name] += 1e-5 * record["params"][name].abs().max()
    torch.save(record, sharded)
    assert parity.main(["compare", str(tmp_path), "--reference", "1,1,1"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(sharded.name))
    assert "FAIL" in row and "1.0e-06" in row and name in row
    assert parity.main(["compare", str(tmp_path), "--reference", "1,1,1", "--rtol", "2e-3"]) == 0


@pytest.mark.slow
def test_fp64_hybrid_runs_match_across_layouts_to_1e_6(tmp_path):
    """The runner end to end in fp64: a tp=2 launch of the hybrid ends within 1e-6 of the lone process."""
    _run(tmp_path, "1,1,1", precision="fp64", model="hybrid")
    _run(tmp_path, "2,1,1", ranks=2, precision="fp64", model="hybrid")
    record = torch.load(tmp_path / "hybrid_fp64_dist_muon_tp2pp1dp1.pt", weights_only=True)
    assert all(t.dtype == torch.float64 for t in record["params"].values())
    result = _parity("compare", str(tmp_path), "--reference", "1,1,1")
    assert result.returncode == 0 and "1 of 1 runs match" in result.stdout, result.stdout + result.stderr


def test_checkpoint_saved_on_one_layout_resumes_on_others(tmp_path):
    """`--save-at` on (tp2, dp1), `--resume` on (tp1, dp2), (tp1, pp2) and alone: the resumed runs end where the
    uninterrupted run ends (bit-exact on the saving layout, within fp32 layout rounding elsewhere), and the comparison
    sees only the steps after the save. fp32: megatron's fully-reshardable DistributedOptimizer format stores the
    AdamW state in fp32 buffers, which would round fp64 runs."""
    checkpoint = tmp_path / "ckpt"
    saving = ("--model", "gpt", "--precision", "fp32", "--optimizer", "dist_muon", "--steps", str(STEPS),
              "--global-microbatches", "4", "--out", str(tmp_path))
    result = _parity("run", "--layout", "2,1,1", *saving, "--save-at", "3", "--checkpoint", str(checkpoint), ranks=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (checkpoint / "gpt_fp32_dist_muon" / parity.SAVED_STEP_FILE).read_text().strip() == "3"
    for ranks, layouts in ((2, ("2,1,1", "1,1,2", "1,2,1")), (None, ("1,1,1",))):
        result = _parity("run", "--layout", *layouts, *saving, "--resume", str(checkpoint), ranks=ranks)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert result.stdout.count("resumed after step 3") == len(layouts)
        assert f"step   {STEPS}/{STEPS}" in result.stdout and "step   3/" not in result.stdout
    resumed = torch.load(tmp_path / "gpt_fp32_dist_muon_tp1pp2dp1_resumed.pt", weights_only=True)
    assert resumed["first_step"] == 3 and len(resumed["losses"]) == STEPS - 3
    compared = _parity("compare", str(tmp_path), "--reference", "2,1,1", "--rtol", "2e-3")
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "4 of 4 runs match the reference" in compared.stdout
    same_layout = next(line for line in compared.stdout.splitlines()
                       if line.startswith("gpt_fp32_dist_muon_tp2pp1dp1_"))
    assert " 0.000e+00    0.000e+00 " in same_layout, same_layout

    # a resume from a directory without a parity checkpoint fails before training
    missing = _parity("run", "--layout", "1,1,1", *saving, "--resume", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "holds no parity checkpoint" in missing.stderr


def test_save_at_needs_a_checkpoint_directory_and_one_layout(tmp_path, capsys):
    assert parity.main(["run", "--layout", "1,1,1", "--save-at", "2", "--out", str(tmp_path)]) == 2
    assert "--save-at K and --checkpoint DIR go together" in capsys.readouterr().err
    assert parity.main(["run", "--layout", "1,1,1", "--steps", "4", "--save-at", "4", "--checkpoint",
                        str(tmp_path / "c"), "--out", str(tmp_path)]) == 2
    assert "0 < K < --steps (4)" in capsys.readouterr().err
