"""Run under TRITON_INTERPRET=1 in a subprocess: the segmented chunk states on our TMA kernels (windows through the
kernels' chunk skips, and the exact form) against the fp64 segmented passes and the sequential recurrences."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops import state_tma  # noqa: E402
from megatron_muon.ops.reference import chunk_state_backward_reference, chunk_state_forward_reference  # noqa: E402
from megatron_muon.ops.state_segments import (  # noqa: E402
    batched_segments_forward,
    plan_segments,
    segmented_state_backward,
    segmented_state_forward,
    windowed_segments_backward,
    windowed_segments_forward,
)


def relative(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def main():
    generator = torch.Generator().manual_seed(0)
    # fp16: Triton 3.6's interpreter reads bf16 through tensor descriptors as raw bits (the GPU test covers bf16)
    batch, seq_len, key_heads, heads, key_dim, value_dim, chunk, segments = 1, 8 * 64, 1, 2, 64, 16, 64, 4
    q, k = (torch.nn.functional.normalize(torch.randn(batch, seq_len, key_heads, key_dim, generator=generator),
                                          dim=-1).half() for _ in range(2))
    w = (torch.randn(batch, seq_len, heads, key_dim, generator=generator) * 0.1).half()
    u, do, dv = ((torch.randn(batch, seq_len, heads, value_dim, generator=generator) * 0.5).half() for _ in range(3))
    # head 0 decays fast (windows of one chunk), head 1 slowly (whole segments, exact through the transitions)
    rates = torch.tensor([0.4, 0.002])
    steps = -torch.rand(batch, seq_len, heads, generator=generator) * rates / torch.log(torch.tensor(2.0))
    g = torch.cat([steps[:, s : s + chunk].cumsum(1) for s in range(0, seq_len, chunk)], 1)
    state = torch.randn(batch, heads, value_dim, key_dim, generator=generator)
    drop = -8.0
    plan = plan_segments(g, seq_len // (segments * chunk), chunk, drop)
    assert plan.exact[0, 1].all() and not plan.exact[0, 0].any(), plan
    k_per_head, q_per_head = (x.repeat_interleave(heads // key_heads, dim=2) for x in (k, q))
    as_fp64 = [t.double() for t in (k_per_head, w, u, g)]
    want = segmented_state_forward(*as_fp64, state.double(), segment_chunks=2, drop_log2=drop)
    sequential = chunk_state_forward_reference(*as_fp64, state.double())
    got = windowed_segments_forward(state_tma, k, w, u, g, state, segments=segments, drop_log2=drop)
    errors = [relative(a, b) for a, b in zip(got, want)]
    assert max(errors) < 1.5e-3, ("windowed forward against the fp64 passes", errors)
    # w here is not the WY form of k, so the dropped weight has no bound: without drops it is the recurrence
    got = windowed_segments_forward(state_tma, k, w, u, g, state, segments=segments, drop_log2=-float("inf"))
    errors = [relative(a, b) for a, b in zip(got, sequential)]
    assert max(errors) < 3e-3, ("windowed forward without drops against the sequential recurrence", errors)
    exact = batched_segments_forward(lambda *a: state_tma.chunk_fwd_h(*a, True), k, w, u, g, state,
                                     segments=segments)
    errors = [relative(a, b) for a, b in zip(exact, sequential)]
    assert max(errors) < 3e-3, ("exact form on the kernels", errors)
    scale = key_dim**-0.5
    as_fp64 = [t.double() for t in (q_per_head, k_per_head, w, g, do, dv)]
    want = segmented_state_backward(*as_fp64, scale, state.double(), segment_chunks=2, drop_log2=drop)
    sequential = chunk_state_backward_reference(*as_fp64, scale, state.double())
    got = windowed_segments_backward(state_tma, q, k, w, g, do, dv, scale, state, segments=segments, drop_log2=drop)
    errors = [relative(a, b) for a, b in zip(got, want)]
    assert max(errors) < 1.5e-3, ("windowed backward against the fp64 passes", errors)
    got = windowed_segments_backward(state_tma, q, k, w, g, do, dv, scale, state, segments=segments,
                                     drop_log2=-float("inf"))
    errors = [relative(a, b) for a, b in zip(got, sequential)]
    assert max(errors) < 3e-3, ("windowed backward without drops against the sequential recurrence", errors)
    print("interpreter ok")


if __name__ == "__main__":
    main()
