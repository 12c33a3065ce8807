"""The fused elementwise passes (momentum + Nesterov into the NS stack; weight decay + update) against the torch
sequence they replace: on CPU through the Triton interpreter, and on the GPU."""

import itertools
from pathlib import Path

import pytest
import torch

from megatron_muon.optimizer import Muon, fused_elementwise, muon_math
from megatron_muon.optimizer.routing import MatrixLayout, piece_views
from tests.interpreter import run_under_interpreter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))


def test_settings_are_checked():
    params = [torch.nn.Parameter(torch.randn(8, 4))]
    with pytest.raises(ValueError, match="fused_elementwise must be one of"):
        Muon(params, fused_elementwise="yes")
    assert fused_elementwise.use_fused(False, torch.device("cpu")) is False
    if not fused_elementwise.supported(torch.device("cpu")):
        assert fused_elementwise.use_fused("auto", torch.device("cpu")) is False
        with pytest.raises(ValueError, match="fused_elementwise=True needs"):
            fused_elementwise.use_fused(True, torch.device("cpu"))


def test_passes_under_triton_interpreter():
    """Dtype mixes, strided and 4-D fused-QKV piece views, nesterov on/off, both lerp branches, decay on/off,
    uncovered fallbacks, and Muon / WaveMuon steps with the fused path forced on vs off (see the script)."""
    pytest.importorskip("triton", reason="the interpreter comes with Triton")
    run_under_interpreter(Path(__file__).with_name("_fused_interpret_check.py"))


# ---- GPU: the compiled kernels against torch's CUDA kernels ----


def _pieces(dtype, generator, scale=1.0):
    """A 4-D fused-QKV piece (2 experts, 4 groups) and every other row of a matrix whose width is no power of 2."""
    qkv = (torch.randn(2 * 4 * 96, 2048, device="cuda", generator=generator) * scale).to(dtype)
    yield qkv, lambda t: piece_views(t, MatrixLayout(num_experts=2, split_sections=(64, 16, 16)))[0]
    rows = (torch.randn(300, 1400, device="cuda", generator=generator) * scale).to(dtype)
    yield rows, lambda t: t[::2]


F32, BF16, F16 = DTYPES
# (grad, momentum buffer, NS stack slot, nesterov): the mixes training meets (the interpreter test covers all).
MOMENTUM_MIXES = [
    (F32, F32, BF16, True), (F32, F32, BF16, False), (F32, BF16, BF16, True), (F32, F32, F32, True),
    (BF16, BF16, BF16, True), (BF16, F32, BF16, True), (F16, F16, F16, True), (F16, F32, F16, False),
]


@gpu_test
@pytest.mark.parametrize("grad_dtype,buffer_dtype,slot_dtype,nesterov", MOMENTUM_MIXES)
def test_momentum_into_slot_matches_torch_on_gpu(grad_dtype, buffer_dtype, slot_dtype, nesterov):
    generator = torch.Generator(device="cuda").manual_seed(0)
    for (grad_base, view), (buffer_base, _) in zip(_pieces(grad_dtype, generator), _pieces(buffer_dtype, generator)):
        grad, expected_base = view(grad_base), buffer_base.clone()
        slot, expected_slot = (torch.empty(grad.shape, dtype=slot_dtype, device="cuda") for _ in range(2))
        muon_math.momentum_buffers_update_([grad], [view(expected_base)], 0.95)
        muon_math.nesterov_into_(grad, view(expected_base), expected_slot, 0.95, nesterov)
        fused_elementwise.momentum_into_slot_(grad, view(buffer_base), slot, momentum=0.95, nesterov=nesterov)
        assert torch.equal(buffer_base, expected_base)  # untouched rows included
        assert torch.equal(slot, expected_slot)


@gpu_test
@pytest.mark.parametrize("target_dtype,update_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_decay_and_update_matches_torch_on_gpu(target_dtype, update_dtype):
    generator = torch.Generator(device="cuda").manual_seed(1)
    for target_base, view in _pieces(target_dtype, generator):
        update = torch.randn(view(target_base).shape, device="cuda", generator=generator).to(update_dtype)
        expected_base = target_base.clone()
        view(expected_base).mul_(0.998)
        muon_math.apply_updates_([view(expected_base)], [update], lr=0.02, scale=2.5)
        fused_elementwise.decay_and_update_(view(target_base), update, decay=0.998, alpha=-0.02 * 2.5)
        if target_dtype == torch.float32:
            assert torch.equal(target_base, expected_base)
        else:  # same math as torch's CUDA kernels; the spec allows one rounding of the 16-bit dtype
            ulp = torch.finfo(target_dtype).eps * expected_base.float().abs()
            assert bool(((target_base.float() - expected_base.float()).abs() <= ulp).all())


@gpu_test
@pytest.mark.parametrize("momentum_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("weight_decay_mode", ["decoupled", "independent", "l2"])
def test_muon_fused_equals_torch_path_on_gpu(momentum_dtype, weight_decay_mode, monkeypatch):
    """Bit for bit with NS reducing each stack's norm itself; with the norms the momentum passes summed (fp32 in
    another order), within one fp16 rounding of NS's input."""
    def params():
        generator = torch.Generator(device="cuda").manual_seed(2)
        plain = torch.nn.Parameter(torch.randn(1154, 256, device="cuda", generator=generator) * 0.02)
        qkv = torch.nn.Parameter(torch.randn(4 * 48, 256, device="cuda", generator=generator) * 0.02)
        qkv.is_qkv, qkv.qkv_split_shapes = True, [32, 8, 8]
        return [plain, qkv]

    def run(fused):
        ps = params()
        optimizer = Muon(ps, lr=0.02, weight_decay=0.1, weight_decay_mode=weight_decay_mode,
                         momentum_dtype=momentum_dtype, fused_elementwise=fused)
        generator = torch.Generator(device="cuda").manual_seed(3)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, device="cuda", generator=generator) * 1e-3
            optimizer.step()
        return ps, [optimizer.state[p]["momentum_buffer"] for p in ps]

    summed_params, _ = run(True)
    torch_params, torch_buffers = run(False)
    monkeypatch.setattr(Muon, "_norm_partials", lambda *args: None)
    fused_params, fused_buffers = run(True)
    for a, b in zip(fused_params + fused_buffers, torch_params + torch_buffers):
        assert torch.equal(a, b)
    start = params()
    for a, b, s in zip(summed_params, torch_params, start):
        assert float((a - b).detach().norm()) <= 1e-3 * float((b - s).detach().norm())


@gpu_test
@pytest.mark.parametrize("weight_decay_mode", ["decoupled", "l2"])
def test_clipped_speculation_equals_the_clipped_step_on_gpu(weight_decay_mode):
    """The owner engine's backward-end speculation under clipping (`WaveMuon.speculate(grad_factor=...)`), then
    megatron's in-place clip: the compiled kernels give the plain fused step on the clipped gradients bit for bit."""
    from tests.optimizer._fused_interpret_check import clipped_wave_run

    factor = torch.tensor([0.37], device="cuda")
    results = []
    for speculate in (False, True):
        generator = torch.Generator(device="cuda").manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(shape, device="cuda", generator=generator) * 0.02)
                  for shape in ((1154, 256), (256, 512), (256, 512))]
        engine = clipped_wave_run(params, lambda p: torch.randn(p.shape, device="cuda", generator=generator) * 1e-3,
                                  factor, weight_decay_mode, speculate, fused=True)
        results.append((params, engine))
    (plain, _), (ahead, engine) = results
    assert engine.speculation_used > 0 and engine.speculation_discarded == 0
    assert all(torch.equal(a, b) for a, b in zip(plain, ahead))


@gpu_test
def test_one_launch_per_bucket_equals_per_piece_on_gpu():
    """fused_pieces on the GPU: separate allocations, evenly spaced slots / updates, same bits as per piece."""
    from megatron_muon.optimizer import fused_pieces

    generator = torch.Generator(device="cuda").manual_seed(4)
    grads = [torch.randn(3, 40, 257, device="cuda", generator=generator)[:, 4:30] for _ in range(5)]
    buffers = [torch.randn(3, 40, 257, device="cuda", generator=generator)[:, 4:30] for _ in range(5)]
    expected_buffers = [b.clone() for b in buffers]
    stacked, expected = (torch.empty(5, 3, 26, 257, device="cuda", dtype=BF16) for _ in range(2))
    for grad, buffer, slot in zip(grads, expected_buffers, expected):
        fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.95, nesterov=True)
    assert fused_pieces.momentum_into_slots_(grads, buffers, list(stacked), momentum=0.95, nesterov=True)
    assert torch.equal(stacked, expected) and all(torch.equal(a, b) for a, b in zip(buffers, expected_buffers))
    expected_targets = [g.clone() for g in grads]
    for target, update in zip(expected_targets, expected):
        fused_elementwise.decay_and_update_(target, update, decay=0.998, alpha=-0.05)
    assert fused_pieces.decay_and_update_pieces_(grads, list(stacked), decay=0.998, alpha=-0.05)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_targets))


@gpu_test
def test_norm_partials_add_up_to_each_slots_norm_on_gpu():
    """On the GPU the momentum passes' partial sums of squares give each slot's Frobenius norm (fp32 sums in another
    order than torch's reduction), for pieces in one launch and for one piece, and the slots are the ones the
    passes store without the sums; masked tails (width 1400) add nothing."""
    from megatron_muon.optimizer import fused_pieces

    generator = torch.Generator(device="cuda").manual_seed(5)
    grads = [torch.randn(300, 1400, device="cuda", generator=generator) * 1e-3 for _ in range(4)]
    buffers = [torch.randn(300, 1400, device="cuda", generator=generator) * 1e-3 for _ in range(4)]
    plain_buffers = [b.clone() for b in buffers]
    stacked, plain = (torch.empty(4, 300, 1400, device="cuda", dtype=BF16) for _ in range(2))
    programs = fused_elementwise.norm_programs(stacked[0])
    partials = torch.full((4, programs), float("nan"), device="cuda")
    assert fused_pieces.momentum_into_slots_(grads, buffers, list(stacked), momentum=0.95, nesterov=True,
                                             norm_partials=partials)
    for grad, buffer, slot in zip(grads, plain_buffers, plain):
        fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.95, nesterov=True)
    assert torch.equal(stacked, plain)
    own = torch.linalg.vector_norm(stacked, dim=(1, 2), dtype=torch.float32)
    torch.testing.assert_close(partials.sum(dim=1).sqrt(), own, rtol=2e-6, atol=0)
    single, slot = torch.full((programs, ), float("nan"), device="cuda"), torch.empty_like(plain[0])
    assert fused_elementwise.momentum_into_slot_(grads[0], plain_buffers[0].clone(), slot, momentum=0.95,
                                                 nesterov=True, norm_partials=single)
    own = torch.linalg.vector_norm(slot, dtype=torch.float32)
    torch.testing.assert_close(single.sum().sqrt(), own, rtol=2e-6, atol=0)
