"""Every method and dtype against the fp64 reference iteration, on fresh random inputs."""

import pytest
import torch

from megatron_muon.kernels import choose_method, orthogonalize
from megatron_muon.kernels.reference import newton_schulz_reference

# The six reference shapes scaled down by 32 (in_proj, out_proj, qkv, proj, fc1, fc2), square, very rectangular
# both ways, and stacked batches.
SHAPES = [
    (288, 64), (64, 96), (96, 64), (64, 64), (352, 64), (64, 176),
    (16, 512), (512, 16), (3, 48, 160), (2, 40, 40), (20, 150),
]  # fmt: skip
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# Worst observed over 6 seeds x SHAPES x DTYPES on CPU, then doubled: (relative Frobenius, spectral-norm) error of
# the output against the fp64 iteration on the same (dtype-rounded) input. Gram NS carries the error of iterating on
# X·Xᵀ in fp16 (see DEFAULT_RESTARTS); standard NS iterates on X itself in fp16.
TOLERANCE = {
    ("standard", "simple"): (0.006, 0.015),
    ("standard", "polar_express"): (0.007, 0.025),
    ("gram", "simple"): (0.03, 0.1),
    ("gram", "polar_express"): (0.07, 0.3),
}


def _fresh(shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _errors(Y, reference):
    diff = Y.double() - reference
    relative = (diff.norm() / reference.norm()).item()
    spectral = torch.linalg.matrix_norm(diff, ord=2).max().item()
    return relative, spectral


@pytest.mark.parametrize("coefficients", ["simple", "polar_express"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", ["standard", "gram", "auto"])
def test_matches_fp64_iteration(method, dtype, coefficients):
    for seed, shape in enumerate(SHAPES):
        G = _fresh(shape, dtype, seed + 100 * DTYPES.index(dtype))
        Y = orthogonalize(G, coefficients=coefficients, method=method)
        assert Y.shape == G.shape and Y.dtype == dtype
        m, n = shape[-2:]
        used = choose_method(m, n) if method == "auto" else method
        rel_tol, spec_tol = TOLERANCE[(used, coefficients)]
        relative, spectral = _errors(Y, newton_schulz_reference(G, coefficients=coefficients))
        assert relative <= rel_tol and spectral <= spec_tol, (shape, used, relative, spectral)


def test_batch_equals_per_matrix():
    G = _fresh((4, 32, 80), torch.float32, 1)
    for method in ["standard", "gram"]:
        batched = orthogonalize(G, method=method)
        for i in range(G.size(0)):
            torch.testing.assert_close(batched[i], orthogonalize(G[i], method=method), rtol=0, atol=2e-3)


def test_transpose_symmetry_and_steps():
    G = _fresh((80, 24), torch.float32, 2)
    for method in ["standard", "gram"]:
        # Q·X against Xᵀ·Q: the torch backend's Q is symmetric only up to fp16 rounding
        torch.testing.assert_close(
            orthogonalize(G, method=method), orthogonalize(G.T, method=method).T, rtol=0, atol=2e-3
        )
    for steps in [1, 3, 8]:
        ref = newton_schulz_reference(G, steps=steps, coefficients="polar_express")
        got = orthogonalize(G, steps=steps, coefficients="polar_express", method="gram", restarts=(2, 4, 6))
        assert _errors(got, ref)[0] < 0.07, steps


def test_explicit_schedule_and_compute_dtype():
    G = _fresh((32, 96), torch.float32, 3)
    schedule = [(3.4445, -4.7750, 2.0315), (2.0, -1.5, 0.5)]
    ref = newton_schulz_reference(G, steps=4, coefficients=schedule)
    for method in ["standard", "gram"]:
        got = orthogonalize(G, steps=4, coefficients=schedule, method=method, compute_dtype=torch.float32)
        assert _errors(got, ref)[1] < 1e-4


def test_zero_and_empty_inputs():
    assert torch.equal(orthogonalize(torch.zeros(8, 24)), torch.zeros(8, 24))
    assert orthogonalize(torch.zeros(0, 5, 7)).shape == (0, 5, 7)
    assert torch.isfinite(orthogonalize(torch.zeros(3, 16, 48), method="gram")).all()


def test_auto_rule():
    assert choose_method(2048, 2048) == "standard"
    assert choose_method(9228, 2048) == "gram" and choose_method(2048, 11264) == "gram"
    assert choose_method(2048, 3072) == "gram" and choose_method(2048, 2560) == "gram"
    assert choose_method(2048, 2304) == "standard" and choose_method(2048, 1536) == "gram"
    assert choose_method(1024, 2048) == "standard" and choose_method(1024, 2816) == "gram"


def test_user_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="reshape"):
        orthogonalize(torch.randn(2, 3, 4, 5))
    with pytest.raises(TypeError, match="floating-point"):
        orthogonalize(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="valid"):
        orthogonalize(torch.randn(4, 4), method="svd")
    with pytest.raises(ValueError, match="valid names"):
        orthogonalize(torch.randn(4, 4), coefficients="cubic")
    with pytest.raises(ValueError, match="backend"):
        orthogonalize(torch.randn(4, 4), backend="cuda")


@pytest.mark.parametrize("shape", [(2, 12, 40), (2, 40, 12), (70, 20)])  # 70 and 40 pad to 128 / 64 columns
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_out_dtype_is_the_unwidened_result(shape, method):
    from megatron_muon.kernels.newton_schulz import work_dtype

    G = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    narrow = orthogonalize(G, method=method, out_dtype=work_dtype(G, method))
    assert narrow.dtype == torch.float16 and narrow.shape == G.shape
    assert torch.equal(narrow.to(G.dtype), orthogonalize(G, method=method))
    assert orthogonalize(G[..., :0, :], out_dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize("shape", [(3, 48, 160), (3, 160, 48), (40, 40)])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_a_given_frobenius_norm_is_the_one_used(shape, method):
    """Handing orthogonalize the norm it would compute gives the same bits; handing it another scale changes the
    input it iterates on as that scale says (the result of NS depends on the scale only through convergence)."""
    G = _fresh(shape, torch.bfloat16, seed=11)
    own = torch.linalg.vector_norm(G.float(), dim=(-2, -1)).reshape(-1)
    expected = orthogonalize(G, method=method)
    assert torch.equal(orthogonalize(G, method=method, frobenius_norm=own), expected)
    assert not torch.equal(orthogonalize(G, method=method, frobenius_norm=own * 4), expected)


def test_a_frobenius_norm_of_the_wrong_shape_or_dtype_names_the_fix():
    G = torch.randn(3, 16, 32)
    with pytest.raises(ValueError, match="one fp32 value per matrix.*omit it"):
        orthogonalize(G, frobenius_norm=torch.ones(2))
    with pytest.raises(ValueError, match="one fp32 value per matrix"):
        orthogonalize(G, frobenius_norm=torch.ones(3, dtype=torch.float64))
