"""The GVA group sum (`ops/group_sum.py`): the Triton kernel under the interpreter, and the torch path, against the
fp64 sum of each query/key head's value heads; the GVA backward's direct launch of FLA's WY kernel against FLA's
wrapper."""

import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_muon.ops.group_sum import group_sum
from tests.interpreter import run_under_interpreter


def test_kernel_under_triton_interpreter():
    run_under_interpreter(Path(__file__).with_name("_group_sum_interpret_check.py"))


@pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                    reason="needs flash-linear-attention (the gdn extra) for FLA's WY backward kernel")
def test_gva_backward_launches_flas_wy_kernel_as_flas_wrapper_does():
    run_under_interpreter(Path(__file__).with_name("_wy_gva_interpret_check.py"))


@pytest.mark.parametrize("group", [1, 2, 3])
def test_torch_path_sums_each_group_of_both_parts(group):
    torch.manual_seed(group)
    x, other = (torch.randn(2, 5, 2 * group, 8, dtype=torch.bfloat16) for _ in range(2))
    want = (x.double() + other.double()).view(2, 5, 2, group, 8).sum(3)
    got = group_sum(x, 2, other)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want.to(torch.bfloat16).double(), rtol=0, atol=0)
    # value head h belongs to query/key head h // group
    x = torch.zeros(1, 1, 2 * group, 4)
    x[0, 0, group] = 1.0
    assert group_sum(x, 2)[0, 0].sum(-1).tolist() == [0.0, 4.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_on_the_gpu_at_qwen3_next_heads():
    """16 q/k heads, 32 value heads of 128, 16k tokens, bf16: the kernel equals the fp64 sum rounded once (ties
    aside: at most one bf16 step)."""
    torch.manual_seed(0)
    x, other = (torch.randn(1, 16384, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want = (x.double() + other.double()).view(1, 16384, 16, 2, 128).sum(3).to(torch.bfloat16)
    torch.testing.assert_close(group_sum(x, 16, other), want, rtol=8e-3, atol=1e-2)
