"""Run under TRITON_INTERPRET=1 in a subprocess: the Triton kernels (symmetric products, the NS input pass, the
main_grad accumulation, the clipping scale) on CPU against torch."""

import itertools

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.kernels import orthogonalize  # noqa: E402
from megatron_muon.kernels.ops import TorchOps  # noqa: E402
from megatron_muon.kernels.scaled_copy import scaled_copy  # noqa: E402
from megatron_muon.kernels.newton_schulz import _cast  # noqa: E402
from megatron_muon.kernels.symmetric import _INTERPRET_CONFIG, TritonOps, symmetric_matmul  # noqa: E402
from megatron_muon.optimizer.clip_scale import BLOCK, scale_in_place  # noqa: E402
from megatron_muon.kernels.grad_accumulate import _triton_add  # noqa: E402


def _assert_mirrored(out):
    """Off-diagonal tiles are stored with their mirror, so those entries must equal their transposes exactly. A
    diagonal tile's two halves are separate entries of one dot product, and the interpreter's dot is numpy's BLAS,
    which need not sum every entry in the same order (numpy 2.5.5's does not for a transposed operand): there the
    halves may differ in the last bit. The GPU test asserts exact symmetry on the hardware."""
    tile = torch.arange(out.size(-1)) // _INTERPRET_CONFIG["BLOCK"]
    off_diagonal = tile[:, None] != tile[None, :]
    assert torch.equal(out[:, off_diagonal], out.mT[:, off_diagonal])
    torch.testing.assert_close(out, out.mT, rtol=1e-3, atol=1e-5)


def main():
    g = torch.Generator().manual_seed(0)
    # (1, 16, 16) and (2, 32, 48) divide the 16×16 tiles (the unmasked EVEN path); the others need masks.
    # tma=True: A and B through 3-D TMA descriptors (edges zero-filled per batch element); False: pointer loads.
    # "persistent": TMA, with 3 programs looping over every tile of the batch (diagonal mirrors stored past M).
    styles = (False, True, "persistent")
    for (batch, m, k), style in itertools.product([(2, 40, 72), (1, 16, 16), (2, 32, 48), (3, 33, 5)], styles):
        X = torch.randn(batch, m, k, generator=g).half()
        tma, persistent = style is not False, style == "persistent"
        if tma and (k % 8 or m % 8):  # TMA needs 16-byte row strides (the inputs' and the [b, m, m] result's)
            continue
        out = symmetric_matmul(X, X, tma=tma, persistent=persistent)
        _assert_mirrored(out)
        torch.testing.assert_close(out.float(), TorchOps.sym_mm(X, X).float(), rtol=2e-3, atol=2e-3 * k**0.5)
        R = (TorchOps.sym_mm(X, X).float() / k).half()
        out = symmetric_matmul(R, R.clone(), R, alpha=2.0, beta=-3.0, tma=tma, persistent=persistent)
        _assert_mirrored(out)
        torch.testing.assert_close(out.float(), TorchOps.sym_mm(R, R, R, 2.0, -3.0).float(), rtol=2e-3, atol=2e-3)
    # the NS input pass: any source strides (a transposed view here), zero padding, bit-equal to torch
    sources = [(torch.randn(2, 70, 20, generator=g).mT, 128), (torch.randn(3, 20, 64, generator=g).bfloat16(), 64)]
    for source, width in sources:
        norm = torch.linalg.vector_norm(source, dim=(-2, -1), keepdim=True, dtype=torch.float32)
        fast = scaled_copy(source, norm, torch.full((source.size(0), 20, width), 7.0, dtype=torch.float16))
        assert torch.equal(fast, TorchOps.scaled_copy(source, norm, torch.empty_like(fast)))
    # orthogonalize's result cast (a unit norm): bit-equal to torch's cast, from a sliced transposed fp16 view. fp32
    # only: the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even (the GPU test covers bf16).
    result = torch.randn(2, 80, 24, generator=g).mul(3).half().mT[:, :, :70]
    assert torch.equal(_cast(result, torch.float32, TritonOps), result.float())
    G = torch.randn(2, 24, 80, generator=g)
    for method in ("standard", "gram"):
        fast = orthogonalize(G, method=method, backend="triton")
        torch.testing.assert_close(fast, orthogonalize(G, method=method, backend="torch"), rtol=0, atol=2e-2)
    # megatron's main_grad accumulation: fp32 += bf16/fp16 (or = for a step's first gradient) over a partial last
    # block, bit-equal to torch's add and cast
    add = _triton_add()
    for numel, dtype in [(5000, torch.bfloat16), (4096, torch.float16)]:
        main, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g).to(dtype)
        expected = main + grad.float()
        add[(-(-numel // 4096),)](main, grad, numel, BLOCK=4096, ACCUMULATE=True)
        assert torch.equal(main, expected)
        add[(-(-numel // 4096),)](main, grad, numel, BLOCK=4096, ACCUMULATE=False)  # a step's first gradient
        assert torch.equal(main, grad.float())
    # gradient clipping's scale: views of two buffers (gaps between views untouched), bit-equal to torch's multiply
    for factor in (0.37, 1.0, float("nan")):
        buffers = [torch.randn(3 * BLOCK + 100, generator=g), torch.randn(700, generator=g)]
        views = [buffers[0][5 : BLOCK + 9], buffers[0][BLOCK + 20 :], buffers[1][:300], buffers[1][310:]]
        expected = [b.clone() for b in buffers]
        torch._foreach_mul_([expected[0][5 : BLOCK + 9], expected[0][BLOCK + 20 :], expected[1][:300],
                             expected[1][310:]], torch.tensor(factor))
        assert scale_in_place(views, torch.tensor([factor]))
        for got, want in zip(buffers, expected):
            assert torch.equal(got, want) or (got.isnan() == want.isnan()).all() and torch.equal(
                got.nan_to_num(), want.nan_to_num()), factor
    assert not scale_in_place([torch.randn(4, 6, generator=g).mT], torch.tensor([0.5]))  # not contiguous
    assert not scale_in_place([torch.randn(8, generator=g).half()], torch.tensor([0.5]))  # not fp32
    shared = torch.randn(100, generator=g)
    before = shared.clone()
    assert not scale_in_place([shared[:60], shared[50:]], torch.tensor([0.5]))  # overlapping views
    assert torch.equal(shared, before)  # declined before touching anything
    print("interpreter ok")


if __name__ == "__main__":
    main()
