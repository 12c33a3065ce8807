"""Run under TRITON_INTERPRET=1 in a subprocess: the GDN op's backward (`fla_backend.gdn_backward`) with our kernels
throughout (the Triton state-gradient kernel with the local value gradient, then the one-kernel chunk-parallel
backward) on CPU, against the autograd of the token-by-token recurrence in fp64. The forward's kept tensors (the
inverse, w, u, the states h and v_new) come from the fp64 references and our forward state kernel."""

import math

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops import fla_backend, kernel_choice, state_tma  # noqa: E402
from megatron_muon.ops.reference import (  # noqa: E402
    chunk_wy_inverse_reference,
    chunk_wy_reference,
    naive_recurrent_gated_delta_rule,
)
from tests.ops._state_tma_interpret_check import relative  # noqa: E402

CHUNK = 64


def main():
    kernel_choice.set_gdn_kernels(kernel_choice.GdnKernels("triton", "fused", "backward"))
    gen = torch.Generator().manual_seed(7)
    # 150 tokens: two full chunks and a partial one; dense heads, then GVA (two value heads per query/key head)
    for heads, value_heads in ((2, 2), (1, 2)):
        batch, seq_len, key_dim, value_dim = 1, 150, 64, 64
        scale = key_dim**-0.5

        def unit_rows():
            x = torch.randn(batch, seq_len, heads, key_dim, generator=gen)
            return torch.nn.functional.normalize(x, dim=-1).half()  # fp16: the interpreter's bf16 dots are raw bits

        q, k = unit_rows(), unit_rows()
        v = torch.randn(batch, seq_len, value_heads, value_dim, generator=gen).half()
        g = -torch.rand(batch, seq_len, value_heads, generator=gen) * 0.2  # per-token log decay
        beta = torch.rand(batch, seq_len, value_heads, generator=gen)
        do = torch.randn(batch, seq_len, value_heads, value_dim, generator=gen).half()

        g_cumsum = torch.cat([g[:, i : i + CHUNK].cumsum(1) for i in range(0, seq_len, CHUNK)], 1) / math.log(2)
        a_inverse = chunk_wy_inverse_reference(k, g_cumsum, beta, value_heads=value_heads).half()
        w, u = (t.half() for t in chunk_wy_reference(k, v, g_cumsum, beta))
        h, v_new, _ = state_tma.chunk_fwd_h(k, w, u, g_cumsum)
        dq, dk, dv, dg, dbeta, _ = fla_backend.gdn_backward(q, k, v, g, beta, g_cumsum, a_inverse, w, h, v_new, scale,
                                                            None, None, do, None)

        leaves = [t.double().requires_grad_() for t in (q, k, v, g, beta)]
        o, _ = naive_recurrent_gated_delta_rule(*leaves, scale=scale)
        want = torch.autograd.grad((o * do.double()).sum(), leaves)
        got = dq, dk, dv, dg, dbeta
        assert [t.shape for t in got] == [t.shape for t in (q, k, v, g, beta)]
        assert [t.dtype for t in got] == [t.dtype for t in (q, k, v, g, beta)]
        # fp16 tensors (h, v_new, the inverse, every gradient) between fp32-accumulating kernels
        errors = [relative(a, b) for a, b in zip(got, want)]
        print(f"heads {heads}/{value_heads}: dq dk dv dg dbeta", [f"{e:.1e}" for e in errors])
        assert max(errors) < 3e-3, errors  # measured 3e-4 to 5e-4
    print("interpreter ok")


if __name__ == "__main__":
    main()
