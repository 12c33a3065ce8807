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


def _train(params, graphed: bool, steps: int, swap_at: int | None = None, waves=(1, 0)):
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
            for wave in waves:  # (None,): every parameter at once, batched by shape
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_of_the_batched_speculation_is_bit_exact():
    """speculate(None): all waves in one graph (the owner engine's `backward_end` start with graphs)."""
    initial = _params("cuda")
    eager, graphed = copy.deepcopy(initial), copy.deepcopy(initial)
    reference = _train(eager, graphed=False, steps=7, swap_at=4, waves=(None,))
    engine = _train(graphed, graphed=True, steps=7, swap_at=4, waves=(None,))
    torch.cuda.synchronize()
    for ours, theirs in zip(graphed, eager):
        assert torch.equal(ours, theirs)
    assert engine.graphs.disabled is None
    assert (engine.graphs.captures, engine.graphs.replays) == (2, 3)  # eager, capture, 2 replays, eager, capture, 1
    assert engine.speculation_used == reference.speculation_used > 0 and engine.speculation_discarded == 0


@pytest.mark.parametrize("waves", [(1, 0), (None,)], ids=["per wave", "batched"])
def test_on_cpu_graphed_speculation_runs_eagerly_with_the_same_result(waves):
    initial = _params("cpu")
    eager, graphed = copy.deepcopy(initial), copy.deepcopy(initial)
    _train(eager, graphed=False, steps=3, waves=waves)
    engine = _train(graphed, graphed=True, steps=3, waves=waves)
    for ours, theirs in zip(graphed, eager):
        assert torch.equal(ours, theirs)
    assert engine.graphs.captures == engine.graphs.replays == 0
    assert engine.speculation_used > 0 and engine.speculation_discarded == 0


def test_batched_and_per_wave_speculation_do_not_mix_on_the_same_gradients():
    params = _params("cpu")
    engine = WaveMuon(params, lr=0.02)
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    engine.speculate(None, lambda p: p.grad)
    with pytest.raises(ValueError, match="discard_speculation"):
        engine.speculate(0, lambda p: p.grad)
    engine.discard_speculation()
    assert engine.speculate(0, lambda p: p.grad) > 0
