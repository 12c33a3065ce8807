"""Run under TRITON_INTERPRET=1 in a subprocess: the GDN chunk op (`fla_backend.gdn_forward`, `gdn_backward`) with
its chunk states in segments (`states: segments`: windows where the gate has decayed, exact transitions elsewhere)
on our Triton kernels, against the fp64 token-by-token recurrence and its autograd; no FLA."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops import fla_backend, kernel_choice, state_segments  # noqa: E402
from tests.ops._gdn_chunk_op_interpret_check import op_inputs, recurrence_reference  # noqa: E402
from tests.ops._state_tma_interpret_check import relative  # noqa: E402


def main():
    kernel_choice.set_gdn_kernels(kernel_choice.GdnKernels("segments", "fused", "fused", "ours"))
    calls = []
    for name in ("windowed_chunk_forward", "windowed_segments_backward"):  # count the segmented passes
        original = getattr(state_segments, name)
        setattr(state_segments, name, lambda *a, _f=original, _n=name, **kw: calls.append((_n, kw["segments"]))
                or _f(*a, **kw))
    gen = torch.Generator().manual_seed(11)
    # 256 tokens: four segments of one chunk; per-token log decays up to -1 (windows of one chunk, transitions
    # dropped) on the first value head and up to -0.002 (whole segments, exact transitions) on the others; GVA;
    # states kept and recomputed; an initial state and a gradient of the final state
    for heads, value_heads, keep_states in ((2, 2, True), (1, 2, False)):
        batch, seq_len, key_dim, value_dim = 1, 256, 64, 64
        scale = key_dim**-0.5

        rates = torch.tensor([1.0] + [0.002] * (value_heads - 1))
        q, k, v, g, beta, h0, do, dht = op_inputs(gen, batch, seq_len, heads, value_heads, key_dim, value_dim, rates)

        o, final, g_cumsum, a_inverse, w, h, v_new = fla_backend.gdn_forward(q, k, v, g, beta, scale, h0, True, None,
                                                                             keep_states)
        plan = state_segments.plan_segments(g_cumsum, 1)
        assert not plan.exact[0, 0].any() and plan.exact[0, 1:].all(), plan  # both kinds of segment are taken
        grads = fla_backend.gdn_backward(q, k, v, g, beta, g_cumsum, a_inverse, w, h, v_new, scale, h0, None, do,
                                         dht)
        want_o, want_final, *want_grads = recurrence_reference(q, k, v, g, beta, h0, do, dht, scale)
        errors = {"o": relative(o, want_o), "final": relative(final, want_final)}
        errors |= {name: relative(a, b) for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads,
                                                              want_grads)}
        print(f"heads {heads}/{value_heads}, states kept {keep_states}:", {n: f"{e:.1e}" for n, e in errors.items()})
        assert max(errors.values()) < 3e-3, errors
    assert set(calls) == {("windowed_chunk_forward", 4), ("windowed_segments_backward", 4)}, calls
    print("interpreter ok")


if __name__ == "__main__":
    main()
