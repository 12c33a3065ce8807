"""Run under TRITON_INTERPRET=1 in a subprocess: the GDN custom ops on the FLA-backend path with our kernels
throughout (no FLA needed), on CPU: opcheck of both ops with the chunk states kept (the fake kernels' shapes, dtypes
and strides against the real outputs, autograd registration), and the public `chunk_gated_delta_rule` compiled with
fullgraph against eager and against the fp64 token-by-token recurrence, outputs and all gradients."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops import gdn, kernel_choice  # noqa: E402
from tests.ops._gdn_chunk_op_interpret_check import recurrence_reference  # noqa: E402
from tests.ops._state_tma_interpret_check import relative  # noqa: E402


def inputs(gen, heads=1, value_heads=2, seq_len=100, key_dim=64, value_dim=64):
    q, k = (torch.nn.functional.normalize(torch.randn(1, seq_len, heads, key_dim, generator=gen), dim=-1).half()
            for _ in range(2))  # fp16: the interpreter's bf16 dots are raw bits
    v = torch.randn(1, seq_len, value_heads, value_dim, generator=gen).half()
    g = -torch.rand(1, seq_len, value_heads, generator=gen) * 0.2
    beta = torch.rand(1, seq_len, value_heads, generator=gen)
    h0 = torch.randn(1, value_heads, key_dim, value_dim, generator=gen) * 0.1
    return q, k, v, g, beta, h0


def main():
    gdn.backend_for = lambda tensor: "fla-triton"  # the CUDA path's kernels, here run by the interpreter
    kernel_choice.set_gdn_kernels(kernel_choice.GdnKernels("triton", "fused", "fused", "ours"))
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, h0 = inputs(gen)
    scale = q.shape[-1] ** -0.5

    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    args = (*leaves[:5], scale, leaves[5], True, None, True)
    torch.library.opcheck(gdn.gdn_chunk_fwd, args)
    o, ht, *private = gdn.gdn_chunk_fwd(q, k, v, g, beta, scale, h0, True, None, True)
    assert all(t.numel() for t in private), [t.shape for t in private]  # w, h and v_new kept
    torch.library.opcheck(gdn.gdn_chunk_bwd, (q, k, v, g, beta, *private, scale, h0, None, torch.randn_like(o),
                                              torch.randn_like(ht)))

    do, dht = torch.randn_like(v), torch.randn(h0.shape, generator=gen)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
        out, final = fn(*leaves)
        ((out.float() * do.float()).sum() + (final * dht).sum()).backward()
        return [out, final, *(leaf.grad for leaf in leaves)]

    def op(q, k, v, g, beta, h0):
        return gdn.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                          keep_states_for_backward=True)

    eager = run(op)
    torch._dynamo.reset()
    compiled = run(torch.compile(op, fullgraph=True, backend="aot_eager"))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    want = recurrence_reference(q, k, v, g, beta, h0, do, dht, scale)
    errors = [relative(a, b) for a, b in zip(eager, want)]
    print("o final dq dk dv dg dbeta dh0", [f"{e:.1e}" for e in errors])
    assert max(errors) < 3e-3, errors
    print("interpreter ok")


if __name__ == "__main__":
    main()
