"""Speculation replayed from CUDA graphs (`WaveMuon.speculate(..., graphed=True)`) against the eager speculation:
the same parameters bit for bit, over steps that capture, replay, change the learning rate (no recapture) and
swap a gradient tensor (eager again, then a new capture)."""

import contextlib
import copy

import pytest
import torch

from megatron_muon.optimizer.wave_muon import WaveMuon

SHAPES = [(512, 256), (512, 256), (256, 704), (3 * 128, 256), (64, 64)]


def _params(device):
    generator = torch.Generator(device=device).manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, device=device, generator=generator) * 0.02) for s in SHAPES]


def _train(params, graphed: bool, steps: int, swap_at: int | None = None):
    device = params[0].device
    engine = WaveMuon(params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    for index, param in enumerate(params):
        engine.wave_of[id(param)] = index % 2
    grads = [torch.zeros_like(p) for p in params]
    generator = torch.Generator(device=device).manual_seed(1)
    stream = torch.cuda.Stream() if device.type == "cuda" else None
    for step in range(steps):
        if step == swap_at:
            grads[0] = torch.zeros_like(params[0])  # another gradient tensor: that wave cannot replay its graph
        for param, grad in zip(params, grads):
            grad.copy_(torch.randn(grad.shape, device=device, generator=generator) * 1e-3)
            param.grad = grad
        for group in engine.param_groups:
            group["lr"] = 0.02 * (1 - step / (2 * steps))  # a schedule: lr is not part of what a graph bakes in
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for wave in (1, 0):
                engine.speculate(wave, lambda p: p.grad, graphed=graphed)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        engine.speculation_valid = True
        engine.step()
    return engine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_gives_the_eager_speculations_parameters_bit_for_bit():
    initial = _params("cuda")
    eager, graphed = copy.deepcopy(initial), copy.deepcopy(initial)
    reference = _train(eager, graphed=False, steps=7, swap_at=4)
    engine = _train(graphed, graphed=True, steps=7, swap_at=4)
    torch.cuda.synchronize()
    for ours, theirs in zip(graphed, eager):
        assert torch.equal(ours, theirs)
    assert engine.graphs.disabled is None
    # wave 0 (holds the swapped gradient): eager, capture, replay, replay, eager, capture, replay; wave 1: eager,
    # capture, then five replays
    assert (engine.graphs.captures, engine.graphs.replays) == (3, 3 + 5)
    assert engine.speculation_used == reference.speculation_used > 0 and engine.speculation_discarded == 0
    assert engine.orthogonalized_matrices == reference.orthogonalized_matrices


def test_on_cpu_graphed_speculation_runs_eagerly_with_the_same_result():
    initial = _params("cpu")
    eager, graphed = copy.deepcopy(initial), copy.deepcopy(initial)
    _train(eager, graphed=False, steps=3)
    engine = _train(graphed, graphed=True, steps=3)
    for ours, theirs in zip(graphed, eager):
        assert torch.equal(ours, theirs)
    assert engine.graphs.captures == engine.graphs.replays == 0
