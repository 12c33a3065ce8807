"""StepTimer: per-step times read in one go, split at the end of the forward/backward."""

import time

import pytest
import torch

from megatron_muon.training.step_timer import StepTimer


def _timed_steps(timer, durations):
    for forward_backward_s, optimizer_s in durations:
        timer.start_step()
        time.sleep(forward_backward_s)
        timer.end_forward_backward()
        time.sleep(optimizer_s)


def test_cpu_steps_are_split_at_the_end_of_the_forward_backward():
    timer = StepTimer(on_gpu=False)
    durations = [(0.02, 0.01), (0.01, 0.03)]
    _timed_steps(timer, durations)
    times = timer.read()
    assert len(times) == 2
    for (step_s, optimizer_s), (forward_backward_s, expected_optimizer_s) in zip(times, durations):
        assert step_s >= forward_backward_s + expected_optimizer_s
        assert expected_optimizer_s <= optimizer_s < step_s
    assert timer.read() == []  # read clears the window


def test_misuse_is_caught():
    timer = StepTimer(on_gpu=False)
    with pytest.raises(AssertionError, match="start_step"):
        timer.end_forward_backward()
    timer.start_step()
    with pytest.raises(AssertionError, match="end_forward_backward"):
        timer.start_step()
    with pytest.raises(AssertionError, match="inside a step"):
        timer.read()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_steps_follow_the_stream_not_the_cpu():
    """Kernels queued without a sync: each step's time is its GPU work, however fast the CPU queued it."""
    timer = StepTimer(on_gpu=True)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # cuBLAS initialized and the clocks up before the timed steps
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for matmuls in (1, 8):
        timer.start_step()
        for _ in range(matmuls):
            a = (a @ a).clamp_(-1, 1)
        timer.end_forward_backward()
        a = (a @ a).clamp_(-1, 1)
    queued_s = time.perf_counter() - start
    (short_s, short_opt_s), (long_s, long_opt_s) = timer.read()
    assert long_s > 3 * short_s  # 9 products against 2
    assert short_opt_s < short_s and long_opt_s < long_s / 3
    assert long_s + short_s > queued_s  # the GPU took longer than the CPU needed to queue it
