"""The one coefficient table: megatron-core's names with megatron-core's numbers and continuation rules, so a name
means the same iterations in `orthogonalize`, `Muon` and `--muon-coefficient-type`."""

import pytest
import torch

from megatron_muon.kernels import orthogonalize
from megatron_muon.kernels.coefficients import COEFFICIENT_SETS, DEFAULT_COEFFICIENTS, SIMPLE, resolve_coefficients
from megatron_muon.kernels.reference import newton_schulz_reference
from megatron_muon.megatron.muon_config import megatron_coefficient_schedule


def _megatron_names() -> set[str]:
    from megatron.core.optimizer.emerging_optimizers import get_supported_coefficient_types

    return set(get_supported_coefficient_types()) - {"custom"}


def test_the_table_holds_exactly_the_names_megatron_core_accepts():
    assert set(COEFFICIENT_SETS) == _megatron_names()


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
def test_every_name_gives_megatron_cores_iterations_at_every_step_count(name):
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    mode = "repeat_last" if name in ("polar_express", "cans", "deepseekv4") else "cycle"  # as muon_utils decides
    for steps in range(1, 13):
        expected = list(muon_utils.get_coefficient_iterator(steps, muon_utils._COEFFICIENT_SETS[name], mode=mode))
        assert resolve_coefficients(name, steps) == [tuple(c) for c in expected], steps
        assert megatron_coefficient_schedule(name, steps) == resolve_coefficients(name, steps)


@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
def test_orthogonalize_by_name_matches_megatron_cores_newton_schulz(name):
    """The numbers as each side runs them: emerging-optimizers' fp32 iteration against our fp64 reference and our
    fp32 `orthogonalize`, same name, 6 steps (cycled and held schedules both past their length for some names)."""
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    generator = torch.Generator().manual_seed(len(name))
    G = torch.randn(24, 40, generator=generator)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        theirs = newton_schulz(G, steps=6, coefficient_type=name).double()
    finally:
        torch.set_float32_matmul_precision(previous)
    reference = newton_schulz_reference(G.double(), steps=6, coefficients=name)
    ours = orthogonalize(G, steps=6, coefficients=name, method="standard", compute_dtype=torch.float32).double()
    assert (theirs - reference).abs().max() < 1e-4
    assert (ours - reference).abs().max() < 1e-4


def test_simple_is_torch_optim_muons_schedule_and_the_plain_default():
    assert DEFAULT_COEFFICIENTS == "simple" and SIMPLE == (3.4445, -4.7750, 2.0315)
    assert resolve_coefficients("simple", 5) == [SIMPLE] * 5
    assert resolve_coefficients("quintic", 5)[0] != SIMPLE  # megatron's "quintic" is another schedule


def test_held_schedules_extend_with_their_last_entry_and_cycled_ones_restart():
    ten = resolve_coefficients("POLAR_EXPRESS", 10)
    assert ten[7:] == [(1.875, -1.25, 0.375)] * 3 and len({tuple(c) for c in ten[:5]}) == 5
    seven = resolve_coefficients("quintic", 7)
    assert seven[5:] == seven[:2]


def test_single_triple_and_explicit_schedule():
    assert resolve_coefficients((1.0, 2.0, 3.0), 3) == [(1.0, 2.0, 3.0)] * 3
    schedule = [(3, -4, 2), (2, -1.5, 0.5)]
    assert resolve_coefficients(schedule, 3) == [(3.0, -4.0, 2.0), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5)]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="valid names .*polar_express.*quintic.*simple"):
        resolve_coefficients("cubic", 5)
    with pytest.raises(ValueError, match="three numbers"):
        resolve_coefficients([(1.0, 2.0)], 5)
    with pytest.raises(ValueError, match="steps"):
        resolve_coefficients("simple", 0)
    with pytest.raises(ValueError, match="pass steps=3"):
        resolve_coefficients([(1, 2, 3)] * 3, 2)
    with pytest.raises(ValueError, match="empty"):
        resolve_coefficients([], 2)
    with pytest.raises(ValueError, match="unknown muon_coefficient_type 'fancy'; valid choices"):
        megatron_coefficient_schedule("fancy", 5)


def test_the_aol_schedule_warns_where_it_is_chosen():
    from megatron_muon.optimizer import Muon

    with pytest.warns(UserWarning, match="AOL-rescaled.*reversed"):
        megatron_coefficient_schedule("aol", 4)
    with pytest.warns(UserWarning, match="AOL-rescaled"):
        Muon([torch.nn.Parameter(torch.randn(4, 8))], lr=0.01, coefficients="aol", ns_steps=4)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        megatron_coefficient_schedule("polar_express", 4)
