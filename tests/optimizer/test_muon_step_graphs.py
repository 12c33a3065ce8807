"""The Muon step's stacks and Newton–Schulz replayed from a CUDA graph (`Muon(graph_newton_schulz=True)`) against
the eager step: the same parameters and momentum bit for bit, over steps that capture, replay, change the learning
rate (no recapture), take a pending clip factor (another graph) and swap a gradient tensor (eager, then a capture)."""

import copy

import pytest
import torch

from megatron_muon.optimizer.muon import Muon

SHAPES = [(512, 256), (512, 256), (256, 704), (3 * 128, 256), (64, 64)]


def _params(device):
    generator = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, device=device, generator=generator) * 0.02) for s in SHAPES]
    params[3].is_qkv, params[3].qkv_split_shapes = True, [64, 32, 32]  # a fused QKV split in sections
    return params


def _train(params, graphed: bool, steps: int, swap_at: int | None = None, factor_from: int | None = None):
    device = params[0].device
    optimizer = Muon(params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, graph_newton_schulz=graphed)
    grads = [torch.zeros_like(p) for p in params]
    generator = torch.Generator(device=device).manual_seed(1)
    for step in range(steps):
        if step == swap_at:
            grads[0] = torch.zeros_like(params[0])  # another gradient tensor: the graph cannot replay
        for param, grad in zip(params, grads):
            grad.copy_(torch.randn(grad.shape, device=device, generator=generator) * 1e-3)
            param.grad = grad
        for group in optimizer.param_groups:
            group["lr"] = 0.02 * (1 - step / (2 * steps))  # a schedule: lr is not part of what the graph bakes in
        if factor_from is not None and step >= factor_from:  # megatron's deferred clip: a new tensor each step
            optimizer.pending_grad_factor = torch.tensor([0.5 + 0.05 * step], device=device)
        optimizer.step()
    return optimizer


def _momenta(optimizer):
    return [optimizer.state[p]["momentum_buffer"] for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_gives_the_eager_steps_parameters_bit_for_bit():
    initial = _params("cuda")
    eager, graphed = copy.deepcopy(initial), copy.deepcopy(initial)
    reference = _train(eager, graphed=False, steps=9, swap_at=6, factor_from=3)
    optimizer = _train(graphed, graphed=True, steps=9, swap_at=6, factor_from=3)
    torch.cuda.synchronize()
    for ours, theirs in zip(graphed, eager):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(_momenta(optimizer), _momenta(reference)):
        assert torch.equal(ours, theirs)
    graphs = optimizer.step_graphs.graphs
    assert graphs.disabled is None
    # no factor: eager, capture, replay; factor: eager, capture, replay; swapped gradient: eager, capture, replay
    assert (graphs.captures, graphs.replays) == (3, 3)
    assert optimizer.orthogonalized_matrices == reference.orthogonalized_matrices


def test_on_cpu_the_flag_runs_eagerly_with_the_same_result():
    initial = _params("cpu")
    eager, graphed = copy.deepcopy(initial), copy.deepcopy(initial)
    _train(eager, graphed=False, steps=3, factor_from=1)
    optimizer = _train(graphed, graphed=True, steps=3, factor_from=1)
    for ours, theirs in zip(graphed, eager):
        assert torch.equal(ours, theirs)
    assert optimizer.step_graphs.graphs.captures == 0


def test_the_graph_key_follows_tensors_and_baked_settings_not_the_learning_rate():
    params = _params("cpu")
    optimizer = Muon(params, lr=0.02, graph_newton_schulz=True)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    plan = optimizer._plan_cache[1]
    grads = [p.grad for p in plan.params]

    def key(factor=None):
        sources = optimizer._momentum_sources(plan.params, grads, plan.group_of, True, None)
        return optimizer.step_graphs.key(optimizer, plan, sources, factor)

    base = key()
    assert key() == base
    optimizer.param_groups[0]["lr"] = 0.5
    optimizer.param_groups[0]["weight_decay"] = 0.3
    assert key() == base  # the eager updates read these
    assert key(torch.ones(1)) != base  # the factor pass is another kernel variant
    optimizer.param_groups[0]["momentum"] = 0.9
    assert key() != base
    optimizer.param_groups[0]["momentum"] = 0.95
    assert key() == base
    grads[0] = grads[0].clone()
    assert key() != base
