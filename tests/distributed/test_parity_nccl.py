"""dist_muon on NCCL, one GPU per rank: the parity runner's fp64 and fp32 runs on every layout two and four GPUs
hold end where the one-GPU run ends (fp64 within 1e-6, fp32 within the layout tolerance) after 20 steps, and a
checkpoint saved at (tp2, dp2) resumes at (tp1, dp4), (tp4, dp1) and on one GPU where the uninterrupted run ends.

The gloo tests cover the algorithm on CPU; this is what they cannot see: CUDA-only collectives (NCCL reduces CUDA
tensors only) and GPU kernels on every rank. Run on a machine with two or more GPUs: `pytest -m multigpu`.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_muon.testing import parity

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL, one per rank)")]


def _parity(*args: str, ranks: int) -> subprocess.CompletedProcess:
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(ranks))),
                   "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(parity.command(ranks) + list(args), cwd=REPO_ROOT, env=environment, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


FOUR_GPU_LAYOUTS = ("1,1,4", "2,1,2", "2,2,1", "4,1,1", "1,2,2")
needs_four = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs (NCCL, one per rank)")


def _compare(directory: Path, reference: str) -> str:
    compared = subprocess.run([*parity.command(), "compare", str(directory), "--reference", reference],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    print(compared.stdout)  # the table is the result: `pytest -s` keeps it
    assert compared.returncode == 0, compared.stdout + compared.stderr
    return compared.stdout


# fp32 on the GPU: the hybrid's FLA chunk kernels multiply fp32 inputs in TF32, and 20 Muon steps amplify that
# rounding across layouts to ~1e-2 (measured 7e-3..1.7e-2 on four H200s), beyond the layout tolerance; the hybrid's
# layout exactness is its fp64 check (the torch GDN ops, no TF32).
PRECISIONS = {"gpt": ("fp64", "fp32"), "hybrid": ("fp64",)}


@needs_four
@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_four_gpu_layouts_match_the_one_gpu_run(tmp_path, model):
    common = ("--model", model, "--precision", *PRECISIONS[model], "--optimizer", "dist_muon", "--out", str(tmp_path))
    _parity("run", "--layout", "1,1,1", *common, ranks=1)
    _parity("run", "--layout", *FOUR_GPU_LAYOUTS, *common, ranks=4)
    assert _compare(tmp_path, "1,1,1").count(" ok ") == len(PRECISIONS[model]) * len(FOUR_GPU_LAYOUTS)


@needs_four
def test_checkpoint_from_tp2_dp2_resumes_on_other_layouts(tmp_path):
    common = ("--model", "gpt", "hybrid", "--precision", "fp64", "--optimizer", "dist_muon", "--out", str(tmp_path))
    checkpoint = str(tmp_path / "ckpt")
    _parity("run", "--layout", "2,1,2", *common, "--save-at", "10", "--checkpoint", checkpoint, ranks=4)
    _parity("run", "--layout", "2,1,2", "1,1,4", "4,1,1", *common, "--resume", checkpoint, ranks=4)
    _parity("run", "--layout", "1,1,1", *common, "--resume", checkpoint, ranks=1)
    table = _compare(tmp_path, "2,1,2")
    assert table.count(" ok ") == 2 * 4
    for line in table.splitlines():  # fp64 at the saving layout: the resumed run is the uninterrupted one, exactly
        if "fp64_dist_muon_tp2pp1dp2_resumed" in line:
            assert " 0.000e+00    0.000e+00 " in line, line


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_two_gpu_layouts_match_the_one_gpu_run(tmp_path, precision):
    common = ("--model", "gpt", "--precision", precision, "--optimizer", "dist_muon", "--out", str(tmp_path))
    _parity("run", "--layout", "1,1,1", *common, ranks=1)
    _parity("run", "--layout", "1,1,2", "2,1,1", "1,2,1", *common, ranks=2)
    compared = subprocess.run([*parity.command(), "compare", str(tmp_path)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert compared.stdout.count(" ok ") == 3, compared.stdout
