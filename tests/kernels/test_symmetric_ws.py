"""The Hopper warp-specialized symmetric kernel: compiled for sm90 on any machine (its shared memory, registers and
instructions), and against torch on the GPU."""

import pytest
import torch

from megatron_muon.kernels import symmetric_ws
from megatron_muon.kernels.ops import TorchOps

pytestmark = pytest.mark.skipif(not symmetric_ws.available(), reason="this Triton has no Gluon")

SHARED_MEMORY_LIMIT = 232448  # bytes per block on sm90


@pytest.mark.parametrize("has_c", [False, True])
def test_compiles_for_sm90(has_c):
    """Offline compile (no GPU needed): fits Hopper's shared memory, uses 64×128 wgmma and hands registers between
    the partitions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    operand, tile = symmetric_ws._layouts(torch.float16)
    rows = torch.empty(512, 1024, dtype=torch.float16)
    a_desc = mangle_type(TensorDescriptor.from_tensor(rows, [symmetric_ws.TILE, symmetric_ws.TILE_K], operand))
    o_desc = mangle_type(TensorDescriptor.from_tensor(rows[:, :256], [symmetric_ws.TILE, symmetric_ws.TILE], tile))
    signature = {"a_desc": a_desc, "b_desc": a_desc, "c_desc": o_desc, "o_desc": o_desc, "M": "i32", "K": "i32",
                 "total": "i32", "per_matrix": "i32", "alpha": "fp32", "beta": "fp32", "HAS_C": "constexpr",
                 "NUM_STAGES": "constexpr", "REGISTERS": "constexpr"}
    constants = {"HAS_C": has_c, "NUM_STAGES": symmetric_ws.STAGES, "REGISTERS": symmetric_ws.CONSUMER_REGISTERS}
    source = GluonASTSource(symmetric_ws._sym_mm_ws_kernel, signature, constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.metadata.shared <= SHARED_MEMORY_LIMIT
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{symmetric_ws.CONSUMER_REGISTERS}" in ptx


def test_ready_declines_what_it_cannot_run():
    X = torch.randn(2, 256, 64, dtype=torch.float16)
    assert not symmetric_ws.ready(X, X, None)  # CPU tensors
    if torch.cuda.is_available():
        assert not symmetric_ws.ready(X.cuda()[:, :200], X.cuda()[:, :200], None)  # rows not a tile multiple
        assert not symmetric_ws.ready(X.cuda().float(), X.cuda().float(), None)  # fp32


def test_a_gluon_front_end_it_does_not_match_hands_over_to_the_triton_kernel(monkeypatch):
    """If this Triton's Gluon rejects the kernel (an API change), one warning, then the Triton kernel for good."""
    from megatron_muon.kernels import symmetric

    calls = []

    def rejected(*args):
        calls.append("warp-specialized")
        raise TypeError("warp_specialize() got an unexpected keyword argument")

    def triton_kernel(A, B, C=None, alpha=1.0, beta=0.0):
        calls.append("triton")
        return TorchOps.sym_mm(A, B, C, alpha, beta)

    monkeypatch.setattr(symmetric_ws.SWITCH, "why", [])
    monkeypatch.setattr(symmetric_ws, "ready", lambda A, B, C: symmetric_ws.available())
    monkeypatch.setattr(symmetric_ws, "symmetric_matmul_ws", rejected)
    monkeypatch.setattr(symmetric, "symmetric_matmul", triton_kernel)
    X = torch.randn(2, symmetric.MIN_TRITON_ROWS, 64)
    with pytest.warns(UserWarning, match="failed to compile"):
        first = symmetric.TritonOps.sym_mm(X, X)
    second = symmetric.TritonOps.sym_mm(X, X)
    assert calls == ["warp-specialized", "triton", "triton"]
    assert torch.equal(first, TorchOps.sym_mm(X, X)) and torch.equal(second, first)
    assert not symmetric_ws.available()


def gpu_test(fn):
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return pytest.mark.gpu(pytest.mark.skipif(not hopper, reason="needs an sm90 GPU")(fn))


@gpu_test
@pytest.mark.parametrize("batch,m,k,with_c,dtype", [
    (1, 128, 64, False, torch.float16),  # one tile, one k-step
    (2, 256, 512, False, torch.float16),  # both consumers, the ring wraps
    (3, 1024, 4096, True, torch.float16),
    (7, 384, 1000, True, torch.float16),  # k not a multiple of the k-slice
    (5, 2048, 2048, True, torch.bfloat16),
    (200, 256, 256, False, torch.bfloat16),  # more tiles than programs
])
def test_matches_torch(batch, m, k, with_c, dtype):
    torch.manual_seed(m + k)
    X = (torch.randn(batch, m, k, device="cuda") / k**0.5).to(dtype)
    C = TorchOps.sym_mm(X[..., :m].contiguous(), X[..., :m].contiguous()) if with_c else None
    A = C if with_c else X
    out = symmetric_ws.symmetric_matmul_ws(A, A, C, alpha=2.0315, beta=-4.775 if with_c else 0.0)
    expected = TorchOps.sym_mm(A, A, C, alpha=2.0315, beta=-4.775 if with_c else 0.0)
    assert torch.equal(out, out.mT)
    # both sides round once to the output dtype after summing in a different order, so entries may differ by one
    # unit in the last place: 2⁻⁷ relative for bf16 (the largest entries are near the scale), 2⁻¹⁰ for fp16
    scale = expected.float().abs().amax().item()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    error = (out.float() - expected.float()).abs().amax().item()
    assert error <= (ulp + 2e-3) * scale, (error, scale)


@gpu_test
def test_offsets_past_2_pow_31():
    """513 × 2048 × 2048 fp16: the output's last elements lie past 2³¹ (TMA addresses in 64 bits)."""
    R = torch.empty(513, 2048, 2048, device="cuda", dtype=torch.float16).normal_(0, 1 / 45)
    R = (R + R.mT) * 0.5
    out = symmetric_ws.symmetric_matmul_ws(R, R, R, alpha=2.0, beta=-1.0)
    for i in (0, 256, 512):
        expected = (2.0 * R[i].float() @ R[i].float() - R[i].float())
        assert (out[i].float() - expected).abs().amax().item() <= 4e-3 * expected.abs().amax().item()
