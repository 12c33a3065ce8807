"""dist_muon on NCCL, one GPU per rank: the parity runner's fp64 and fp32 runs on every layout two GPUs hold end
where the one-GPU run ends (fp64 within 1e-6, fp32 within the layout tolerance) after 20 steps.

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


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_two_gpu_layouts_match_the_one_gpu_run(tmp_path, precision):
    common = ("--model", "gpt", "--precision", precision, "--optimizer", "dist_muon", "--out", str(tmp_path))
    _parity("run", "--layout", "1,1,1", *common, ranks=1)
    _parity("run", "--layout", "1,1,2", "2,1,1", "1,2,1", *common, ranks=2)
    compared = subprocess.run([*parity.command(), "compare", str(tmp_path)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert compared.stdout.count(" ok ") == 3, compared.stdout
