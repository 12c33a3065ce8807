import pytest

from megatron_muon.kernels.coefficients import COEFFICIENT_SETS, POLAR_EXPRESS, QUINTIC, resolve_coefficients


def test_quintic_repeats_for_every_step():
    assert resolve_coefficients("quintic", 5) == [QUINTIC] * 5


def test_polar_express_is_per_iteration_and_extends_with_last_entry():
    five = resolve_coefficients("polar_express", 5)
    assert five == list(POLAR_EXPRESS[:5])
    assert len({tuple(c) for c in five}) == 5
    ten = resolve_coefficients("POLAR_EXPRESS", 10)
    assert ten[:8] == list(POLAR_EXPRESS) and ten[8:] == [POLAR_EXPRESS[-1]] * 2
    assert POLAR_EXPRESS[-1] == (1.875, -1.25, 0.375)


def test_safety_factor_applied_to_all_but_last():
    a0, b0, c0 = POLAR_EXPRESS[0]
    assert a0 == pytest.approx(8.28721201814563 / 1.01)
    assert b0 == pytest.approx(-23.595886519098837 / 1.01**3)
    assert c0 == pytest.approx(17.300387312530933 / 1.01**5)


def test_single_triple_and_explicit_schedule():
    assert resolve_coefficients((1.0, 2.0, 3.0), 3) == [(1.0, 2.0, 3.0)] * 3
    schedule = [(3, -4, 2), (2, -1.5, 0.5)]
    assert resolve_coefficients(schedule, 3) == [(3.0, -4.0, 2.0), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5)]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="valid names: .*polar_express.*quintic"):
        resolve_coefficients("cubic", 5)
    with pytest.raises(ValueError, match="three numbers"):
        resolve_coefficients([(1.0, 2.0)], 5)
    with pytest.raises(ValueError, match="steps"):
        resolve_coefficients("quintic", 0)
    with pytest.raises(ValueError, match="pass steps=3"):
        resolve_coefficients([(1, 2, 3)] * 3, 2)
    with pytest.raises(ValueError, match="empty"):
        resolve_coefficients([], 2)


def test_every_named_set_resolves():
    for name in COEFFICIENT_SETS:
        assert len(resolve_coefficients(name, 7)) == 7
