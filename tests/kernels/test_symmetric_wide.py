"""The Hopper wide-tile symmetric kernel: compiled for sm90 on any machine, its tile count, the dispatch order, and
against torch on the GPU (every row-block parity, with and without C)."""

import pytest
import torch

from megatron_muon.kernels import symmetric, symmetric_wide, symmetric_ws
from megatron_muon.kernels.ops import TorchOps

pytestmark = pytest.mark.skipif(not symmetric_wide.available(), reason="this Triton has no Gluon")

SHARED_MEMORY_LIMIT = 232448  # bytes per block on sm90


@pytest.mark.parametrize("has_c", [False, True])
@pytest.mark.parametrize("tile_k, stages, buffers", [symmetric_wide.layout(), (32, 4, 2)])
def test_compiles_for_sm90(has_c, tile_k, stages, buffers, monkeypatch):
    """Offline compile (no GPU needed) of the default and of the two-buffer layout the benchmark compares: fits
    Hopper's shared memory as `shared_bytes` counts it, uses the widest wgmma (m64n256k16) and gives the consumer
    warpgroups the registers the producer warp does not need."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    monkeypatch.setattr(symmetric_wide, "TILE_K", tile_k)  # the operand descriptors' k-slice
    A = torch.empty(1, 1024, 512, dtype=torch.float16)
    out = torch.empty(1, 1024, 1024, dtype=torch.float16)
    names = ["a_desc", "b_desc", "c_desc", "wide_desc", "half_desc", "tall_desc"]
    signature = {name: mangle_type(d) for name, d in zip(names, symmetric_wide.descriptors(A, A, None, out))}
    signature.update({"M": "i32", "K": "i32", "total": "i32", "per_matrix": "i32", "alpha": "fp32", "beta": "fp32",
                      "HAS_C": "constexpr", "NUM_STAGES": "constexpr", "EPILOGUE_BUFFERS": "constexpr"})
    source = GluonASTSource(symmetric_wide._sym_mm_wide_kernel, signature,
                            {"HAS_C": has_c, "NUM_STAGES": stages, "EPILOGUE_BUFFERS": buffers})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": symmetric_wide.CONSUMER_WARPS})
    expected = symmetric_wide.shared_bytes(tile_k, stages, buffers)
    assert expected <= kernel.metadata.shared <= min(expected + 1024, SHARED_MEMORY_LIMIT)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240" in ptx


@pytest.mark.parametrize("m", [128, 256, 384, 640, 2048])
def test_tiles_per_matrix_counts_every_pair_on_or_below_the_diagonal(m):
    blocks = m // symmetric_wide.ROWS
    pairs = [(i, p) for i in range(blocks) for p in range((blocks + 1) // 2) if 2 * p <= i]
    assert symmetric_wide.tiles_per_matrix(m) == len(pairs)


def test_ready_declines_what_it_cannot_run():
    X = torch.randn(2, 256, 64, dtype=torch.float16)
    assert not symmetric_wide.ready(X, X, None)  # CPU tensors
    if torch.cuda.is_available():
        assert not symmetric_wide.ready(X.cuda()[:, :200], X.cuda()[:, :200], None)  # rows not a multiple of 128
        assert not symmetric_wide.ready(X.cuda().float(), X.cuda().float(), None)  # fp32


def test_a_rejected_wide_kernel_hands_over_to_the_next_kernel(monkeypatch):
    """If this Triton's Gluon rejects the wide kernel, one warning, then the ping-pong kernel for good."""
    calls = []

    def rejected(*args):
        calls.append("wide")
        raise TypeError("warp_specialize() got an unexpected keyword argument")

    def ping_pong(A, B, C=None, alpha=1.0, beta=0.0):
        calls.append("ping-pong")
        return TorchOps.sym_mm(A, B, C, alpha, beta)

    monkeypatch.setattr(symmetric_wide.SWITCH, "why", [])
    monkeypatch.setattr(symmetric_wide, "ready", lambda A, B, C: symmetric_wide.available())
    monkeypatch.setattr(symmetric_wide, "symmetric_matmul_wide", rejected)
    monkeypatch.setattr(symmetric_ws, "ready", lambda A, B, C: True)
    monkeypatch.setattr(symmetric_ws, "symmetric_matmul_ws", ping_pong)
    X = torch.randn(1, symmetric.WIDE_MIN_ROWS, symmetric.WIDE_MIN_INNER)
    with pytest.warns(UserWarning, match="wide-tile Hopper symmetric kernel failed to compile"):
        first = symmetric.TritonOps.sym_mm(X, X)
    second = symmetric.TritonOps.sym_mm(X, X)
    assert calls == ["wide", "ping-pong", "ping-pong"]
    assert torch.equal(first, TorchOps.sym_mm(X, X)) and torch.equal(second, first)
    assert not symmetric_wide.available()


@pytest.mark.parametrize("rows, inner", [(symmetric.WIDE_MIN_ROWS, symmetric.WIDE_MIN_INNER - 64),
                                         (symmetric.WIDE_MIN_ROWS - 512, symmetric.WIDE_MIN_INNER),
                                         (symmetric.WIDE_MIN_ROWS, symmetric.WIDE_MIN_INNER)])
def test_wide_tiles_only_where_they_won(monkeypatch, rows, inner):
    """Short main loops (fewer rows or a shorter inner dimension) go to the ping-pong kernel."""
    calls = []
    monkeypatch.setattr(symmetric_wide, "ready", lambda A, B, C: True)
    monkeypatch.setattr(symmetric_wide, "symmetric_matmul_wide", lambda *args: calls.append("wide") or args[0])
    monkeypatch.setattr(symmetric_ws, "ready", lambda A, B, C: True)
    monkeypatch.setattr(symmetric_ws, "symmetric_matmul_ws", lambda *args: calls.append("ping-pong") or args[0])
    X = torch.empty(1, rows, inner)
    symmetric.TritonOps.sym_mm(X, X)
    wide = rows >= symmetric.WIDE_MIN_ROWS and inner >= symmetric.WIDE_MIN_INNER
    assert calls == ["wide" if wide else "ping-pong"]


def gpu_test(fn):
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return pytest.mark.gpu(pytest.mark.skipif(not hopper, reason="needs an sm90 GPU")(fn))


@gpu_test
@pytest.mark.parametrize("batch,m,k,with_c,dtype", [
    (1, 128, 64, False, torch.float16),  # one row block: the pair's second half lies past the matrix
    (2, 256, 512, False, torch.float16),  # the ring wraps; the diagonal pair of row 1 is stored whole
    (3, 384, 1000, True, torch.float16),  # odd row blocks; k not a multiple of the k-slice
    (3, 1024, 4096, True, torch.float16),
    (5, 640, 2048, True, torch.bfloat16),
    (5, 2048, 2048, True, torch.bfloat16),
    (300, 256, 256, False, torch.bfloat16),  # more tiles than programs
])
def test_matches_torch(batch, m, k, with_c, dtype):
    torch.manual_seed(m + k)
    X = (torch.randn(batch, m, k, device="cuda") / k**0.5).to(dtype)
    C = TorchOps.sym_mm(X[..., :m].contiguous(), X[..., :m].contiguous()) if with_c else None
    A = C if with_c else X
    out = symmetric_wide.symmetric_matmul_wide(A, A, C, alpha=2.0315, beta=-4.775 if with_c else 0.0)
    expected = TorchOps.sym_mm(A, A, C, alpha=2.0315, beta=-4.775 if with_c else 0.0)
    assert torch.equal(out, out.mT)
    # both sides round once to the output dtype after summing in a different order, so entries may differ by one
    # unit in the last place: 2⁻⁷ relative for bf16 (the largest entries are near the scale), 2⁻¹⁰ for fp16
    scale = expected.float().abs().amax().item()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    error = (out.float() - expected.float()).abs().amax().item()
    assert error <= (ulp + 2e-3) * scale, (error, scale)


@gpu_test
def test_commuting_factors():
    """A·Bᵀ, A ≠ B, with a symmetric product (polynomials of one symmetric matrix), as Gram Newton–Schulz has."""
    torch.manual_seed(0)
    R = torch.randn(4, 512, 512, device="cuda", dtype=torch.float64) / 512**0.5
    R = (R + R.mT) / 2
    P, Q = (R @ R - R).half(), (3 * R - 2 * R @ R).half()
    out = symmetric_wide.symmetric_matmul_wide(P, Q)
    expected = P.float() @ Q.float().mT  # symmetric up to rounding: the kernel mirrors its lower blocks
    assert (out.float() - expected).abs().amax().item() <= 4e-3 * expected.abs().amax().item()


@gpu_test
def test_offsets_past_2_pow_31():
    """513 × 2048 × 2048 fp16: the output's last elements lie past 2³¹ (TMA addresses in 64 bits)."""
    R = torch.empty(513, 2048, 2048, device="cuda", dtype=torch.float16).normal_(0, 1 / 45)
    R = (R + R.mT) * 0.5
    out = symmetric_wide.symmetric_matmul_wide(R, R, R, alpha=2.0, beta=-1.0)
    for i in (0, 256, 512):
        expected = (2.0 * R[i].float() @ R[i].float() - R[i].float())
        assert (out[i].float() - expected).abs().amax().item() <= 4e-3 * expected.abs().amax().item()
