"""The default GPU path (bf16 NS input stack, Triton Gram/standard NS, fp16 result added in place) against
torch.optim.Muon on shapes that exercise Gram NS, padding and fused splits."""

import copy

import pytest
import torch

from megatron_muon.optimizer import Muon

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [(1154, 256), (1154, 256), (256, 704), (384, 256), (512, 512)]  # gram (long side padded to 1216), standard, square


def _params():
    generator = torch.Generator(device="cuda").manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, device="cuda", generator=generator) * 0.02) for s in SHAPES]


def _run(optimizer, params, steps=10):
    generator = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=generator) * 1e-3
        optimizer.step()


def _gap(ours, theirs, initial):
    gap = torch.stack([(a - b).detach().norm() for a, b in zip(ours, theirs)]).norm()
    moved = torch.stack([(b - c).detach().norm() for b, c in zip(theirs, initial)]).norm()
    return float(gap / moved)


def test_default_gpu_path_matches_torch_muon():
    initial = _params()
    ours, theirs = copy.deepcopy(initial), copy.deepcopy(initial)
    options = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    _run(Muon(ours, **options, scale_mode="original"), ours)
    _run(torch.optim.Muon(theirs, **options), theirs)
    assert _gap(ours, theirs, initial) < 0.03
    exact = copy.deepcopy(initial)
    _run(Muon(exact, **options, scale_mode="original", compute_dtype=torch.float32), exact)
    assert _gap(ours, exact, initial) < 0.01  # the 16-bit fast path stays within 1% of an fp32 iteration


def test_heads_split_gpu_path_matches_an_fp32_iteration_on_the_cpu():
    """Per-head orthogonalization on the GPU path (fused passes over head pieces, Triton NS on 128-row heads) against
    the same optimizer with an fp32 iteration on the CPU."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    qkv = torch.nn.Parameter(torch.randn(4 * (2 * 128 + 128 + 128), 512, device="cuda", generator=generator) * 0.02)
    qkv.is_qkv, qkv.qkv_split_shapes = True, [256, 128, 128]
    cpu = torch.nn.Parameter(qkv.detach().cpu().clone())
    cpu.is_qkv, cpu.qkv_split_shapes = True, [256, 128, 128]
    initial = cpu.detach().clone()
    options = dict(lr=0.02, weight_decay=0.1, split_heads=True)
    gpu_opt = Muon([qkv], **options)
    cpu_opt = Muon([cpu], **options, compute_dtype=torch.float32)
    for step in range(5):
        grad = torch.randn(qkv.shape, generator=torch.Generator().manual_seed(10 + step)) * 1e-3
        qkv.grad, cpu.grad = grad.cuda(), grad.clone()
        gpu_opt.step()
        cpu_opt.step()
    assert _gap([qkv.detach().cpu()], [cpu], [initial]) < 0.01
    assert sorted({b.shape for b in gpu_opt._plan_cache[1].buckets}) == [(128, 512)]
