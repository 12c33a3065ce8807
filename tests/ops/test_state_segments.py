"""The segmented chunk-state algorithm (`ops/state_segments.py`) against the sequential fp64 recurrences: exact where
every segment runs whole, within the dropped weight 2^drop_log2 of the state norm where windows are taken, on
fresh random GDN inputs (unit-norm keys, sigmoid β, log-sigmoid gates), with an initial state and a partial last
chunk."""

import math
from pathlib import Path

import pytest
import torch

from megatron_muon.ops.reference import (
    chunk_state_backward_reference,
    chunk_state_forward_reference,
    chunk_wy_reference,
)
from megatron_muon.ops.state_segments import (
    batched_segments_backward,
    batched_segments_forward,
    plan_segments,
    segment_count,
    segmented_state_backward,
    segmented_state_forward,
)
from tests.interpreter import run_under_interpreter
from tests.ops.helpers import gdn_inputs

CHUNK = 16  # small chunks keep the fp64 loops quick; the algorithm does not depend on the chunk size


def _inputs(seq_len, gate_scale, seed, heads=2, key_dim=8, value_dim=6):
    q, k, v, g, beta, _ = gdn_inputs(1, seq_len, heads, heads, key_dim, value_dim, dtype=torch.float64,
                                     gate_scale=gate_scale, seed=seed)
    g = g.to(torch.float64) / math.log(2)  # log2 gates
    g = torch.cat([g[:, s : s + CHUNK].cumsum(1) for s in range(0, seq_len, CHUNK)], 1)  # chunk-local cumsum
    w, u = chunk_wy_reference(k, v, g, beta.to(torch.float64), chunk=CHUNK)
    generator = torch.Generator().manual_seed(seed + 1)
    state = torch.randn(1, heads, value_dim, key_dim, generator=generator, dtype=torch.float64)
    do, dv = (torch.randn(1, seq_len, heads, value_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    return q, k, w, u, g, state, do, dv


def _forward_both(segment_chunks, drop_log2, seq_len, gate_scale, seed):
    q, k, w, u, g, state, do, dv = _inputs(seq_len, gate_scale, seed)
    ours = segmented_state_forward(k, w, u, g, state, segment_chunks=segment_chunks, chunk=CHUNK,
                                   drop_log2=drop_log2)
    return ours, chunk_state_forward_reference(k, w, u, g, state, chunk=CHUNK)


def _backward_both(segment_chunks, drop_log2, seq_len, gate_scale, seed):
    q, k, w, u, g, state, do, dv = _inputs(seq_len, gate_scale, seed)
    ours = segmented_state_backward(q, k, w, g, do, dv, 0.3, state, segment_chunks=segment_chunks, chunk=CHUNK,
                                    drop_log2=drop_log2)
    return ours, chunk_state_backward_reference(q, k, w, g, do, dv, 0.3, state, chunk=CHUNK)


@pytest.mark.parametrize("segment_chunks", [1, 3, 4, 20])
@pytest.mark.parametrize("seed", [0, 1])
def test_whole_segments_give_the_sequential_states_exactly(segment_chunks, seed):
    seq_len = 10 * CHUNK + 5  # a partial last chunk
    for ours, reference in (_forward_both(segment_chunks, -math.inf, seq_len, 1.0, seed),
                            _backward_both(segment_chunks, -math.inf, seq_len, 1.0, seed)):
        for got, expected in zip(ours, reference):
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_weak_decay_keeps_every_segment_whole_and_exact():
    seq_len = 12 * CHUNK
    q, k, w, u, g, *_ = _inputs(seq_len, 1e-4, seed=3)
    plan = plan_segments(g, 3, CHUNK)
    assert bool(plan.exact.all())
    assert plan.window.tolist() == [[[3, 3, 3, 3]] * 2]
    for ours, reference in (_forward_both(3, -24.0, seq_len, 1e-4, 3), _backward_both(3, -24.0, seq_len, 1e-4, 3)):
        for got, expected in zip(ours, reference):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("drop_log2", [-8.0, -16.0])
def test_windows_drop_at_most_their_decay_times_the_state_norm(drop_log2):
    seq_len = 16 * CHUNK + 7
    g = _inputs(seq_len, 0.5, seed=5)[4]
    for reverse in (False, True):
        plan = plan_segments(g, 4, CHUNK, drop_log2, reverse=reverse)
        assert not bool(plan.exact.all()) and bool((plan.window < 4).any())  # the approximation is really taken
    for index, (ours, reference) in enumerate((_forward_both(4, drop_log2, seq_len, 0.5, 5),
                                               _backward_both(4, drop_log2, seq_len, 0.5, 5))):
        states, expected_states = ours[0], reference[0]
        largest = expected_states.flatten(-2).norm(dim=-1).max()
        error = (states - expected_states).flatten(-2).norm(dim=-1).max()
        assert error > 0  # something was dropped
        assert error <= 2.0 ** drop_log2 * largest, (index, float(error), float(largest))


def test_the_plan_counts_chunks_from_the_side_next_to_the_neighbour():
    chunk = 4
    per_chunk = torch.tensor([-1.0, -2.0, -4.0, -8.0, -0.5, -0.5])  # total log2 gate of each chunk
    g = torch.zeros(1, 6 * chunk, 1)
    g[0, chunk - 1 :: chunk, 0] = per_chunk  # only a chunk's last row matters to the plan
    forward = plan_segments(g, 4, chunk, drop_log2=-10.0)
    # segment 0 from its end: -8, -12 (< -10): 2 chunks; segment 1 (2 chunks): -1 never reaches: whole, exact
    assert forward.window.tolist() == [[[2, 2]]] and forward.exact.tolist() == [[[False, True]]]
    backward = plan_segments(g, 4, chunk, drop_log2=-10.0, reverse=True)
    # segment 0 from its start: -1, -3, -7, -15: 4 chunks, reached on the last one
    assert backward.window.tolist() == [[[4, 2]]] and backward.exact.tolist() == [[[False, True]]]
    with pytest.raises(ValueError, match="segment_chunks"):
        plan_segments(g, 0, chunk)


@pytest.mark.parametrize("segments", [1, 2, 4])
def test_segments_as_batch_rows_of_a_sequential_recurrence_give_its_states(segments):
    """The exact form that runs on the existing kernels: here on the fp64 references as the sequential recurrence,
    two batch rows, with initial states."""
    seq_len = 8 * CHUNK
    rows = [_inputs(seq_len, 1.0, seed) for seed in (7, 8)]
    q, k, w, u, g, state, do, dv = (torch.cat(parts) for parts in zip(*rows))
    state = state.to(torch.float32).to(torch.float64)  # the form folds states through fp32, as the kernels keep them

    def forward(k, w, u, g, initial_state):
        return chunk_state_forward_reference(k, w, u, g, None if initial_state is None else initial_state.double(),
                                             chunk=CHUNK)

    def backward(q, k, w, g, do, dv, scale, dht):
        return chunk_state_backward_reference(q, k, w, g, do, dv, scale, None if dht is None else dht.double(),
                                              chunk=CHUNK)

    ours = batched_segments_forward(forward, k, w, u, g, state, segments=segments, chunk=CHUNK)
    for got, expected in zip(ours, chunk_state_forward_reference(k, w, u, g, state, chunk=CHUNK)):
        assert got.shape == expected.shape
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    ours = batched_segments_backward(backward, q, k, w, g, do, dv, 0.3, state, segments=segments, chunk=CHUNK)
    for got, expected in zip(ours, chunk_state_backward_reference(q, k, w, g, do, dv, 0.3, state, chunk=CHUNK)):
        assert got.shape == expected.shape
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="divides 8 chunks"):
        batched_segments_forward(forward, k, w, u, g, state, segments=3, chunk=CHUNK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm90 for our state kernels)")
def test_segments_on_our_state_kernels_give_the_sequential_kernels_states():
    """The exact form on our Triton state kernels (GVA: 2 key heads, 4 value heads) against the same kernels over
    the whole sequence, bf16 inputs, fp32 carried states."""
    from megatron_muon.ops import state_tma
    from tests.ops.helpers import assert_ratio, chunk_kernel_inputs

    if not state_tma.qualifies([torch.empty(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)],
                               [torch.empty(1, 64, 4, 128, device="cuda", dtype=torch.bfloat16)],
                               torch.empty(1, 64, 4, device="cuda"), None, 64):
        pytest.skip("our state kernels need an sm90 GPU")
    torch.manual_seed(0)
    q, k, w, u, do, dv, g, state = chunk_kernel_inputs(1, 1024, 2, 4, 64, 128)

    def forward(k, w, u, g, initial_state):
        return state_tma.chunk_fwd_h(k, w, u, g, initial_state, True)

    def backward(q, k, w, g, do, dv, scale, dht):
        return state_tma.chunk_dhu(q, k, w, g, do, dv, scale, dht, True)

    expected = forward(k, w, u, g, state)
    got = batched_segments_forward(forward, k, w, u, g, state, segments=4)
    for name, ref, ours in zip(("h", "v_new", "final state"), expected, got):
        assert_ratio(name, ref, ours, 2e-2)
    expected = backward(q, k, w, g, do, dv, 0.125, state)
    got = batched_segments_backward(backward, q, k, w, g, do, dv, 0.125, state, segments=4)
    for name, ref, ours in zip(("dh", "dh0", "dv2"), expected, got):
        assert_ratio(name, ref, ours, 2e-2)


def test_windows_on_our_kernels_under_triton_interpreter():
    """The windowed passes through the TMA kernels' chunk skips (one fast- and one slow-decaying head) against the
    fp64 passes, and without drops against the sequential recurrences; the exact form on the same kernels."""
    pytest.importorskip("triton", reason="the interpreter comes with Triton")
    run_under_interpreter(Path(__file__).with_name("_state_segments_interpret_check.py"))


def test_the_gdn_op_with_its_states_in_segments_under_triton_interpreter():
    """`states: segments` in the chunk op (fused forward, state gradients with the local dv, one-kernel backward,
    kept and recomputed states, GVA): o, the final state and every gradient against the fp64 recurrence."""
    pytest.importorskip("triton", reason="the interpreter comes with Triton")
    run_under_interpreter(Path(__file__).with_name("_gdn_segments_op_interpret_check.py"))


def test_segment_count_cuts_whole_chunks_only():
    assert segment_count(16384) == 4
    assert segment_count(3 * 128) == 2  # 6 chunks: four do not divide them, two do
    assert segment_count(64 * 5) == 1 and segment_count(150) == 1
    assert segment_count(16384, most=8) == 8
