"""Run under TRITON_INTERPRET=1 in a subprocess: the GDN chunk op's forward and backward (`fla_backend.gdn_forward`,
`gdn_backward`, what the custom op calls) with our kernels throughout, on CPU, against the token-by-token recurrence
in fp64 and its autograd: the one-kernel chunk-parallel forward, the Triton fused forward (state and output), the
Triton state-gradient kernel with the local value gradient and the one-kernel chunk-parallel backward, then the
one-pass backward (`ops/chunk_bwd_onepass.py`) in place of the last two; no FLA."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops import chunk_bwd_onepass, fla_backend, kernel_choice  # noqa: E402
from megatron_muon.ops.reference import naive_recurrent_gated_delta_rule  # noqa: E402
from tests.ops._state_tma_interpret_check import relative  # noqa: E402


def recurrence_reference(q, k, v, g, beta, h0, do, dht, scale):
    """[o, final state, dq, dk, dv, dg, dβ, dh0] of the token-by-token recurrence in fp64, for the loss
    Σ o·do + Σ final·dht."""
    leaves = [t.double().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o, final = naive_recurrent_gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5],
                                                output_final_state=True)
    loss = (o * do.double()).sum() + (final * dht.double()).sum()
    return [o, final, *torch.autograd.grad(loss, leaves)]


def op_inputs(gen, batch, seq_len, heads, value_heads, key_dim, value_dim, decay):
    """q, k (unit rows), v, g (per-token log decays down to -`decay`, a number or one per value head), β, h0, do,
    dht; fp16 where the kernels read them (the interpreter's bf16 dots are raw bits)."""

    def unit_rows():
        x = torch.randn(batch, seq_len, heads, key_dim, generator=gen)
        return torch.nn.functional.normalize(x, dim=-1).half()

    q, k = unit_rows(), unit_rows()
    v = torch.randn(batch, seq_len, value_heads, value_dim, generator=gen).half()
    g = -torch.rand(batch, seq_len, value_heads, generator=gen) * decay
    beta = torch.rand(batch, seq_len, value_heads, generator=gen)
    h0 = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen) * 0.1
    do = torch.randn(batch, seq_len, value_heads, value_dim, generator=gen).half()
    dht = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, h0, do, dht


def main():
    for output_grads in ("fused", "one-pass"):
        check(kernel_choice.GdnKernels("triton", output_grads, "fused", "ours"))
    print("interpreter ok")


def check(kernels):
    kernel_choice.set_gdn_kernels(kernels)
    onepass_calls = []
    run_onepass = chunk_bwd_onepass.chunk_bwd_onepass
    chunk_bwd_onepass.chunk_bwd_onepass = lambda *a, **kw: onepass_calls.append(1) or run_onepass(*a, **kw)
    gen = torch.Generator().manual_seed(7)
    # 150 tokens: two full chunks and a partial one; dense heads, then GVA (two value heads per query/key head) with
    # the chunk states kept and recomputed; an initial state and a gradient of the final state
    for heads, value_heads, keep_states in ((2, 2, True), (1, 2, True), (1, 2, False)):
        batch, seq_len, key_dim, value_dim = 1, 150, 64, 64
        scale = key_dim**-0.5

        q, k, v, g, beta, h0, do, dht = op_inputs(gen, batch, seq_len, heads, value_heads, key_dim, value_dim, 0.2)

        o, final, g_cumsum, a_inverse, w, h, v_new = fla_backend.gdn_forward(q, k, v, g, beta, scale, h0, True, None,
                                                                             keep_states)
        assert (h.numel() > 0) == keep_states  # without: the backward recomputes w, u, h and v_new
        grads = fla_backend.gdn_backward(q, k, v, g, beta, g_cumsum, a_inverse, w, h, v_new, scale, h0, None, do,
                                         dht)

        want_o, want_final, *want_grads = recurrence_reference(q, k, v, g, beta, h0, do, dht, scale)
        assert o.dtype == v.dtype and final.dtype == torch.float32
        assert [t.shape for t in grads] == [t.shape for t in (q, k, v, g, beta, h0)]
        assert [t.dtype for t in grads] == [t.dtype for t in (q, k, v, g, beta, h0)]
        # fp16 tensors (w, u, h, v_new, the inverse, every gradient) between fp32-accumulating kernels
        errors = {"o": relative(o, want_o), "final": relative(final, want_final)}
        errors |= {name: relative(a, b) for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads,
                                                              want_grads)}
        shown = {name: f"{e:.1e}" for name, e in errors.items()}
        print(f"{kernels.output_grads}: heads {heads}/{value_heads}, states kept {keep_states}:", shown)
        assert max(errors.values()) < 3e-3, errors
    chunk_bwd_onepass.chunk_bwd_onepass = run_onepass
    assert len(onepass_calls) == (3 if kernels.output_grads == "one-pass" else 0), onepass_calls  # it did run


if __name__ == "__main__":
    main()
