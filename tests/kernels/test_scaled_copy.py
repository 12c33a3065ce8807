"""The NS input pass (X / ‖X‖_F, cast, zero padding) in Triton against torch's division on the GPU (within one fp16
step: ours divides with IEEE rounding, torch's CUDA division not always). On CPU the kernel runs under the Triton
interpreter (tests/kernels/_interpret_check.py), where both divide exactly and the results are equal bit for bit."""

import pytest
import torch

from megatron_muon.kernels import orthogonalize
from megatron_muon.kernels.ops import TorchOps

pytest.importorskip("triton", reason="Triton is not installed")


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))


def _norm(X):
    return torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)


@gpu_test
@pytest.mark.parametrize("rows,cols", [(9228, 2048), (2048, 5632), (300, 70), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_scaled_copy_equals_torch_division(rows, cols, dtype):
    from megatron_muon.kernels.scaled_copy import scaled_copy

    torch.manual_seed(rows + cols)
    G = torch.randn(3, rows, cols, device="cuda", dtype=dtype)
    X = G.mT if rows > cols else G  # tall stacks arrive as transposed views
    width = -(-X.size(-1) // 64) * 64
    fast = scaled_copy(X, _norm(X), torch.full((3, X.size(1), width), 7.0, device="cuda", dtype=torch.float16))
    expected = TorchOps.scaled_copy(X, _norm(X), torch.empty_like(fast))
    # torch's CUDA division is not always correctly rounded (ours is): at most one fp16 step apart, rarely
    torch.testing.assert_close(fast.float(), expected.float(), rtol=2**-10, atol=2**-24)
    assert (fast != expected).float().mean() < 1e-3
    assert not fast[..., X.size(-1):].any()


@gpu_test
def test_scaled_copy_offsets_past_2_pow_31():
    from megatron_muon.kernels.scaled_copy import scaled_copy

    X = torch.randn(2, 1024, 1 << 20, device="cuda", dtype=torch.bfloat16)  # 2³¹ elements in all
    X[1, -1, -1] = 3.0
    out = scaled_copy(X, _norm(X), torch.empty(X.shape, device="cuda", dtype=torch.float16))
    expected = (X[1, -1].float() / _norm(X)[1].reshape(1)).half()
    torch.testing.assert_close(out[1, -1].float(), expected.float(), rtol=2**-10, atol=2**-24)
    assert out[1, -1, -1] == expected[-1]


@gpu_test
def test_orthogonalize_same_with_either_input_pass():
    from megatron_muon.kernels.symmetric import TritonOps

    G = torch.randn(4, 1100, 300, device="cuda", dtype=torch.bfloat16)
    fast = orthogonalize(G, method="gram")
    triton_pass = TritonOps.scaled_copy
    TritonOps.scaled_copy = staticmethod(TorchOps.scaled_copy)
    try:
        torch.testing.assert_close(fast, orthogonalize(G, method="gram"), rtol=0, atol=2e-2)
    finally:
        TritonOps.scaled_copy = triton_pass


@gpu_test
def test_result_cast_equals_torch_cast():
    """orthogonalize's last pass (the input pass's kernel with a unit norm) rounds exactly as `.to()` does."""
    from megatron_muon.kernels.newton_schulz import _cast
    from megatron_muon.kernels.symmetric import TritonOps

    result = (torch.randn(3, 2100, 600, device="cuda") * 4).half().mT[:, :550, :]  # sliced, transposed
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(_cast(result, dtype, TritonOps), result.to(dtype))


def test_scaled_copy_rejects_mismatched_shapes():
    from megatron_muon.kernels.scaled_copy import scaled_copy

    X = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="out must be"):
        scaled_copy(X, _norm(X), torch.empty(2, 4, 6))
    with pytest.raises(ValueError, match="one fp32 value per batch"):
        scaled_copy(X, _norm(X).double(), torch.empty(2, 4, 8))
