"""Foreach replacements of megatron's TE/Apex-less multi-tensor fallbacks compute what megatron's do."""

import pytest
import torch
from megatron.core import utils

from megatron_muon.megatron.tensor_fallbacks import (
    foreach_l2_norm,
    foreach_scale,
    foreach_scale_tensor,
    install_foreach_fallbacks,
)


def _tensors(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in [(7, 5), (3,), (64, 33), (1,), (2, 2, 9)]]


def test_l2_norm_matches_the_exact_global_norm():
    tensors = _tensors()
    flag = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = foreach_l2_norm(2048, flag, [tensors[:2], tensors[2:]], False)
    expected = torch.cat([t.double().flatten() for t in tensors]).norm()
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), expected.reshape(1), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="per_tensor"):
        foreach_l2_norm(2048, flag, [tensors], True)


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("in_place", [True, False])
def test_scale_matches_megatrons_fallback(scale, in_place):
    sources = _tensors()
    expected_targets = [s.clone() for s in sources] if in_place else [torch.empty_like(s, dtype=torch.bfloat16)
                                                                       for s in sources]
    ours_targets = [t.clone() for t in expected_targets]
    flag = torch.zeros(1, dtype=torch.int)
    utils.local_multi_tensor_scale(2048, flag, [expected_targets if in_place else sources, expected_targets], scale)
    foreach_scale(2048, flag, [ours_targets if in_place else sources, ours_targets], scale)
    for ours, expected in zip(ours_targets, expected_targets):
        assert torch.equal(ours, expected)


def test_install_replaces_only_megatrons_local_fallbacks():
    import megatron.core.optimizer.clip_grads as clip_grads

    install_foreach_fallbacks()
    assert install_foreach_fallbacks() == []  # idempotent: nothing left to replace
    if clip_grads.multi_tensor_applier is utils.local_multi_tensor_applier:  # no TE/Apex here
        assert clip_grads.l2_norm_impl is foreach_l2_norm and clip_grads.multi_tensor_scale_impl is foreach_scale
        assert clip_grads.multi_tensor_scale_tensor_impl is foreach_scale_tensor
    else:  # TE or Apex kernels stay
        assert clip_grads.l2_norm_impl is not foreach_l2_norm


def test_tensor_scale_matches_the_float_scale():
    sources = _tensors()
    ours, expected = [s.clone() for s in sources], [s.clone() for s in sources]
    flag = torch.zeros(1, dtype=torch.int)
    foreach_scale(2048, flag, [expected, expected], 0.37)
    foreach_scale_tensor(2048, flag, [ours, ours], torch.tensor([0.37]))
    for got, want in zip(ours, expected):
        assert torch.equal(got, want)


def _clip_through_megatron(rank, world_size, max_norm):
    """megatron's own grad-norm and clipping functions, after install: the norm stays a tensor (no host read)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(1, 1)
    install_foreach_fallbacks()
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in _tensors()]
    for param, grad in zip(params, _tensors()):
        param.grad = grad
    norm = get_grad_norm_fp32([p.grad for p in params], grad_stats_parallel_group=torch.distributed.group.WORLD)
    clip_grad_by_total_norm_fp32(params, max_norm, norm)
    return {"norm": norm, "grads": [p.grad for p in params]}


@pytest.mark.parametrize("max_norm", [1.0, 1e6])
def test_megatron_clipping_stays_on_the_device_and_clips_as_before(rank_pool_1, max_norm):
    import megatron.core.optimizer.clip_grads as clip_grads

    result = rank_pool_1.run(_clip_through_megatron, max_norm)[0]
    grads = _tensors()
    norm = torch.cat([g.double().flatten() for g in grads]).norm()
    if clip_grads.multi_tensor_applier is utils.local_multi_tensor_applier:  # no TE/Apex: ours is in charge
        assert isinstance(result["norm"], torch.Tensor)
    torch.testing.assert_close(torch.as_tensor(result["norm"]).double().reshape(()), norm, rtol=1e-6, atol=0)
    factor = min(1.0, max_norm / (norm.item() + 1e-6))
    for got, grad in zip(result["grads"], grads):
        torch.testing.assert_close(got, grad * factor, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("factor", [0.37, 1.0])
def test_clip_scale_on_the_gpu_equals_torchs_multiply(factor):
    """Views of one grad buffer (as megatron's DDP lays them out, with gaps) and a separate tensor."""
    buffer = torch.randn(3_000_011, device="cuda")
    other = torch.randn(5000, device="cuda")
    spans = [(0, 1_000_000), (1_000_003, 2_999_000), (2_999_100, 3_000_011)]
    expected = buffer.clone(), other.clone()
    torch._foreach_mul_([expected[0][a:b] for a, b in spans] + [expected[1]], torch.tensor(factor, device="cuda"))
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    views = [buffer[a:b] for a, b in spans] + [other]
    foreach_scale_tensor(2048, flag, [views, views], torch.tensor([factor], device="cuda"))
    assert torch.equal(buffer, expected[0]) and torch.equal(other, expected[1])
