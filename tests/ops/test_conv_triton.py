"""The causal conv's Triton backward against the pure-torch conv: on CPU through the interpreter, and on the GPU."""

from pathlib import Path

import pytest
import torch

from megatron_muon.ops import conv_triton
from megatron_muon.ops.conv import _torch_backward, _torch_forward, causal_conv1d
from tests.interpreter import run_under_interpreter


def test_backward_under_triton_interpreter():
    """Strided inputs, partial tiles, batches, bias on/off, fewer tokens than taps, and what the kernels decline."""
    pytest.importorskip("triton", reason="the interpreter comes with Triton")
    run_under_interpreter(Path(__file__).with_name("_conv_interpret_check.py"))


def test_cpu_tensors_do_not_qualify_without_the_interpreter():
    x = torch.randn(1, 8, 4)
    assert conv_triton.qualifies(x, torch.randn(4, 4), x, None, None) == conv_triton._INTERPRETING


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_bias", [False, True])
def test_gdn_shaped_conv_matches_torch_on_gpu(with_bias):
    """The hybrid-1.5B's conv input (a slice of the 64-row-padded in_proj output) in bf16, through the custom op's
    autograd; the reference computes in fp32 from the same bf16 inputs, so only the final rounding differs."""
    torch.manual_seed(0)
    seq, channels, width = 4096, 6144, 4
    projected = torch.randn(1, seq, 9280, device="cuda", dtype=torch.bfloat16)
    x = projected[..., :channels].detach().requires_grad_()
    weight = (torch.randn(channels, width, device="cuda") * 0.5).bfloat16().requires_grad_()
    bias = torch.randn(channels, device="cuda").bfloat16().requires_grad_() if with_bias else None
    assert conv_triton.qualifies(x, weight, x, None, None)
    y = causal_conv1d(x, weight, bias, None)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(y, _torch_forward(x, weight, bias, None, None), rtol=1.6e-2, atol=1e-2)
    detached_bias = None if bias is None else bias.detach()
    dx, dweight, dbias = _torch_backward(x.detach(), weight.detach(), detached_bias, None, None, dy)
    torch.testing.assert_close(x.grad, dx, rtol=1.6e-2, atol=1e-2)
    # dweight sums 4096 products per tap: compare relative to its scale (bf16 result)
    for got, want in [(weight.grad, dweight)] + ([(bias.grad, dbias)] if with_bias else []):
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
