"""The pure per-step math shared by the single-rank and distributed Muon."""

import math

import pytest
import torch

from megatron_muon.kernels import orthogonalize
from megatron_muon.optimizer import muon_math


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("spectral", math.sqrt(96)),
        ("shape_scaling", math.sqrt(96 / 32)),
        ("original", math.sqrt(96 / 32)),
        ("unit_rms_norm", math.sqrt(96 / 32)),
        ("match_rms_adamw", 0.2 * math.sqrt(96)),
        ("none", 1.0),
    ],
)
def test_lr_scale_tall_matrix(mode, expected):
    assert muon_math.lr_scale((96, 32), mode) == pytest.approx(expected)


def test_lr_scale_wide_matrix_differs_between_modes():
    assert muon_math.lr_scale((32, 96), "original") == 1.0
    assert muon_math.lr_scale((32, 96), "unit_rms_norm") == pytest.approx(math.sqrt(32 / 96))
    with pytest.raises(ValueError, match="valid choices"):
        muon_math.lr_scale((4, 4), "adam_like")


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_update_matches_the_formula(nesterov):
    torch.manual_seed(0)
    grads = [torch.randn(5, 7), torch.randn(3, 2)]
    buffers = [torch.randn(5, 7), torch.randn(3, 2)]
    expected_bufs = [0.9 * b + 0.1 * g for g, b in zip(grads, buffers)]
    expected = [g + 0.9 * (eb - g) if nesterov else eb for g, eb in zip(grads, expected_bufs)]
    updates = muon_math.momentum_update_(grads, buffers, 0.9, nesterov)
    for got, want, buf, want_buf in zip(updates, expected, buffers, expected_bufs):
        torch.testing.assert_close(buf, want_buf, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_momentum_update_with_narrow_buffers_returns_grad_dtype():
    grads = [torch.randn(4, 4)]
    buffers = [torch.zeros(4, 4, dtype=torch.bfloat16)]
    updates = muon_math.momentum_update_(grads, buffers, 0.5, True)
    assert buffers[0].dtype == torch.bfloat16 and updates[0].dtype == torch.float32
    torch.testing.assert_close(updates[0], 0.75 * grads[0], rtol=1e-2, atol=1e-2)


def test_weight_decay_modes():
    params = [torch.ones(2, 2)]
    muon_math.apply_weight_decay_(params, lr=0.1, weight_decay=0.5, mode="decoupled")
    torch.testing.assert_close(params[0], torch.full((2, 2), 0.95))
    muon_math.apply_weight_decay_(params, lr=0.1, weight_decay=0.5, mode="independent")
    torch.testing.assert_close(params[0], torch.full((2, 2), 0.475))
    grads = muon_math.l2_regularized([torch.zeros(2, 2)], [torch.ones(2, 2)], 0.5)
    torch.testing.assert_close(grads[0], torch.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="valid choices"):
        muon_math.apply_weight_decay_(params, lr=0.1, weight_decay=0.5, mode="adamw")


def test_fused_split_merge_round_trip_and_layout():
    sections = [4, 2, 2]  # q, k, v rows per query group
    groups = 3
    fused = torch.randn(2, groups * sum(sections), 5)
    parts = muon_math.split_fused(fused, sections)
    assert [tuple(p.shape) for p in parts] == [(2, 12, 5), (2, 6, 5), (2, 6, 5)]
    # Group g's k rows sit at g*8 + 4 .. g*8 + 6 of the fused weight.
    torch.testing.assert_close(parts[1][:, 2:4], fused[:, 12:14])
    torch.testing.assert_close(muon_math.merge_fused(parts, sections), fused, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not a multiple"):
        muon_math.split_fused(torch.randn(10, 5), sections)


def test_orthogonalize_fused_equals_orthogonalizing_each_part():
    torch.manual_seed(1)
    sections = [6, 3, 3]
    fused = torch.randn(2 * 12, 16)
    kwargs = dict(ns_steps=5, coefficients="simple", method="standard")
    got = muon_math.orthogonalize_fused(fused, sections, **kwargs)
    parts = muon_math.split_fused(fused, sections)
    expected = muon_math.merge_fused([orthogonalize(p, 5, "simple", "standard") for p in parts], sections)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(got, orthogonalize(fused, 5, "simple", "standard"), atol=1e-2)


def test_scaled_orthogonal_update_is_scale_times_orthogonal_update():
    torch.manual_seed(2)
    stack = torch.randn(3, 8, 24)
    kwargs = dict(ns_steps=5, coefficients="simple", method="standard")
    ortho = muon_math.orthogonal_update(stack, **kwargs)
    scaled = muon_math.scaled_orthogonal_update(stack, scale_mode="spectral", extra_scale=2.0, **kwargs)
    torch.testing.assert_close(scaled, ortho * (2.0 * math.sqrt(24)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_momentum_equals_momentum_update_bitwise(nesterov, buffer_dtype):
    """EMA + blend straight into a stack slot == momentum_update_ then a copy (same rounding), in fp32 and bf16 slots."""
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(6, 10, generator=generator), torch.randn(6, 10, generator=generator)]
    start = [torch.randn(6, 10, generator=generator).to(buffer_dtype) for _ in grads]
    want_bufs = [b.clone() for b in start]
    want = muon_math.momentum_update_(grads, want_bufs, 0.9, nesterov)
    bufs = [b.clone() for b in start]
    muon_math.momentum_buffers_update_(grads, bufs, 0.9)
    for slot_dtype in (torch.float32, torch.bfloat16):
        stack = torch.empty(2, 6, 10, dtype=slot_dtype)
        for i, (g, b) in enumerate(zip(grads, bufs)):
            muon_math.nesterov_into_(g, b, stack[i], 0.9, nesterov)
        for got, expected in zip(stack, want):
            assert torch.equal(got, expected.to(slot_dtype))
    for got, expected in zip(bufs, want_bufs):
        assert torch.equal(got, expected)


def test_narrow_updates_add_like_widened_copies():
    generator = torch.Generator().manual_seed(8)
    targets = [torch.randn(5, 7, generator=generator), torch.randn(3, 7, generator=generator)[:, :4]]
    updates = [torch.randn(t.shape, generator=generator).half() for t in targets]
    widened = [t.clone() for t in targets]
    muon_math.apply_updates_(widened, [u.float() for u in updates], lr=0.1, scale=2.0)
    muon_math.apply_updates_(targets, updates, lr=0.1, scale=2.0)
    for got, expected in zip(targets, widened):
        assert torch.equal(got, expected)
    assert muon_math.stack_dtype(torch.float32, None) == torch.bfloat16
    assert muon_math.stack_dtype(torch.float32, torch.float32) == torch.float32
    assert muon_math.stack_dtype(torch.float16, None) == torch.float16
