"""SwiGLU in pieces compiled by Inductor on the GPU (per-piece kernels, the path the CPU tests cannot lower) against
megatron's eager SwiGLU: values and gradients, fp32 and bf16, an equal-piece and a prime width."""

import pytest
import torch
import torch.nn.functional as F

from megatron_muon.layers.mlp import swiglu_in_pieces

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _megatron_chunk_swiglu(x):
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def _value_and_grad(fn, x, grad):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [5632, 101])
def test_compiled_swiglu_in_pieces_equals_megatron_eager(width, dtype):
    torch._dynamo.reset()
    generator = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(512, 2, 2 * width, device="cuda", generator=generator) * 3).to(dtype)
    grad = torch.randn(512, 2, width, device="cuda", generator=generator).to(dtype)
    compiled = torch.compile(swiglu_in_pieces, fullgraph=True)
    out, dx = _value_and_grad(compiled, x, grad)
    # fp64 ground truth; Inductor computes in fp32 and rounds once, eager bf16 rounds silu(gate) before the product
    exact_out, exact_dx = _value_and_grad(_megatron_chunk_swiglu, x.double(), grad.double())
    ref_out, ref_dx = _value_and_grad(_megatron_chunk_swiglu, x, grad)
    for ours, reference, exact in ((out, ref_out, exact_out), (dx, ref_dx, exact_dx)):
        assert exact.abs().max() > 0
        if dtype == torch.float32:
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
        else:  # no further from the exact values than megatron's eager bf16 SwiGLU, or half a bf16 step at the max
            bound = max((reference.double() - exact).abs().max().item(), 2**-8 * exact.abs().max().item())
            assert (ours.double() - exact).abs().max().item() <= bound
