import pytest

from megatron_muon.kernels import flops


def test_standard_counts_three_gemms_per_step():
    m, n = 64, 256  # per step: X·Xᵀ 2m²n, A² 2m³, B·X 2m²n
    assert flops(m, n, "standard", steps=5) == 5 * (4 * m * m * n + 2 * m**3)
    assert flops(n, m, "standard", steps=5, batch=3) == 3 * flops(m, n, "standard", steps=5)
    assert flops(m, n, "standard", symmetric=True) == 5 * (m * m * n + m**3 + 2 * m * m * n)


def test_gram_counts_by_hand():
    s, big = 8, 32
    sq, xq = 2 * s**3, 2 * s * s * big
    # no restart, 3 steps: R; i0: Z + R-update(2); i1: Z + R-update(2) + Q; i2: Z + Q; final Q·X
    assert flops(s, big, "gram", steps=3, restarts=()) == xq + 3 * sq + 4 * sq + 2 * sq + xq
    # restart before 1: R; i0: Z; restart Q·X + R; i1: Z + R-update; i2: Z + Q; final Q·X
    assert flops(s, big, "gram", steps=3, restarts=(1,)) == xq + sq + 2 * xq + 3 * sq + 2 * sq + xq


def test_gram_is_cheaper_at_large_aspect_and_auto_follows_the_rule():
    assert flops(2048, 8192, "gram", symmetric=True) < 0.75 * flops(2048, 8192, "standard", symmetric=True)
    assert flops(2048, 2048, "auto") == flops(2048, 2048, "standard")
    assert flops(9228, 2048, "auto") == flops(9228, 2048, "gram")


def test_default_restarts_follow_the_coefficients():
    s, big = 8, 32
    sq, xq = 2 * s**3, 2 * s * s * big
    # quintic, 5 steps, restart before 3: R; i0: Z+2; i1: Z+2+Q; i2: Z+Q; restart; i3: Z+2; i4: Z+Q; final Q·X
    assert flops(s, big, "gram") == xq + 3 * sq + 4 * sq + 2 * sq + 2 * xq + 3 * sq + 2 * sq + xq
    assert flops(s, big, "gram", coefficients="polar_express") == flops(s, big, "gram", restarts=(2, 4))


def test_bad_arguments():
    with pytest.raises(ValueError, match="valid"):
        flops(4, 4, "svd")
    with pytest.raises(ValueError, match="steps"):
        flops(4, 4, "standard", steps=0)
