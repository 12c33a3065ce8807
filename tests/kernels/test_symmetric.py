"""Triton symmetric kernels against the torch backend: on CPU through the interpreter, and on the GPU."""

from pathlib import Path

import pytest
import torch

from megatron_muon.kernels import orthogonalize
from megatron_muon.kernels.ops import TorchOps
from tests.interpreter import run_under_interpreter

triton = pytest.importorskip("triton", reason="Triton is not installed")



def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))



def test_kernel_under_triton_interpreter():
    run_under_interpreter(Path(__file__).with_name("_interpret_check.py"))


def _close_to_torch(out, expected, inner):
    """fp16 outputs: both sides round once; accumulation order differs. Scale tolerance by the output size."""
    scale = expected.float().abs().amax().item() + 1e-6
    err = (out.float() - expected.float()).abs().amax().item()
    assert err <= 4e-3 * scale, (err, scale, inner)


@gpu_test
@pytest.mark.parametrize("batch,m,k", [(1, 256, 64), (3, 300, 1000), (2, 1000, 300), (1, 1024, 4096)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("tma", [False, True, "persistent", None], ids=["pointer-loads", "tma", "persistent",
                                                                          "autotuned"])
def test_symmetric_matmul_matches_torch(batch, m, k, dtype, with_c, tma):
    from megatron_muon.kernels.symmetric import symmetric_matmul, tma_ready

    persistent = tma == "persistent"
    tma = True if persistent else tma
    torch.manual_seed(m + k)
    X = (torch.randn(batch, m, k, device="cuda") / k**0.5).to(dtype)
    A = TorchOps.sym_mm(X, X) if with_c else X
    if tma and not tma_ready(A, A.new_empty(batch, m, m)):  # rows of 300 fp16 values are not 16-byte multiples
        with pytest.raises(ValueError, match="tma=None"):
            symmetric_matmul(A, A, tma=True, persistent=persistent)
        return
    if with_c:
        out = symmetric_matmul(A, A, A, alpha=2.0315, beta=-4.775, tma=tma, persistent=persistent)
        expected = TorchOps.sym_mm(A, A, A, alpha=2.0315, beta=-4.775)
    else:
        out = symmetric_matmul(X, X, alpha=0.5, tma=tma, persistent=persistent)
        expected = TorchOps.sym_mm(X, X, alpha=0.5)
    assert torch.equal(out, out.mT)
    _close_to_torch(out, expected, k)


@gpu_test
@pytest.mark.parametrize("tma", [False, True, "persistent"], ids=["pointer-loads", "tma", "persistent"])
def test_int64_offsets_past_2_pow_31(tma):
    from megatron_muon.kernels.symmetric import symmetric_matmul

    persistent = tma == "persistent"
    tma = True if persistent else tma
    # A: 10 x 512 x 524288 fp16 = 2.7e9 elements, so the last batch element starts past 2**31.
    A = torch.empty(10, 512, 524288, device="cuda", dtype=torch.float16).normal_(0, 1 / 724)
    assert (A.size(0) - 1) * A.stride(0) >= 2**31  # int32 offsets end at 2**31 - 1
    out = symmetric_matmul(A, A, tma=tma, persistent=persistent)
    for i in (0, 5, 9):
        _close_to_torch(out[i], A[i] @ A[i].T, A.size(-1))
    del A, out
    # C and Out: 513 x 2048 x 2048 fp16, so the output offsets pass 2**31 too.
    R = torch.empty(513, 2048, 2048, device="cuda", dtype=torch.float16).normal_(0, 1 / 45)
    R = (R + R.mT) * 0.5
    out = symmetric_matmul(R, R, R, alpha=2.0, beta=-1.0, tma=tma, persistent=persistent)
    assert (R.size(0) - 1) * R.stride(0) >= 2**31
    for i in (0, 256, 512):
        _close_to_torch(out[i], 2.0 * R[i] @ R[i] - R[i], 2048)
    del R, out
    torch.cuda.empty_cache()


@gpu_test
@pytest.mark.parametrize("shape", [(3, 512, 1536), (1280, 320), (1024, 4608), (2, 768, 768), (2, 1536, 2048)])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_orthogonalize_triton_equals_torch_backend(shape, method):
    torch.manual_seed(sum(shape))
    G = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    fast = orthogonalize(G, method=method, backend="triton").float()
    slow = orthogonalize(G, method=method, backend="torch").float()
    relative = ((fast - slow).norm() / slow.norm()).item()
    assert relative < 2e-2, relative
