"""Run under TRITON_INTERPRET=1 in a subprocess, with FLA installed: the one-kernel backward equals what it replaces,
run as kernels too (our dqkwg, FLA's WY backward with dk per value head and `group_sum`, FLA's dense wrapper
without GVA, the adds and the reverse cumsum)."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

import fla.ops.gated_delta_rule.wy_fast as wy_fast  # noqa: E402

from megatron_muon.ops import chunk_bwd_fused, dqkwg, fla_backend  # noqa: E402
from megatron_muon.ops.group_sum import group_sum  # noqa: E402
from megatron_muon.ops.reference import chunk_wy_inverse_reference  # noqa: E402
from tests.ops._chunk_bwd_fused_interpret_check import reverse_chunk_cumsum  # noqa: E402
from tests.ops._state_tma_interpret_check import chunk_local_log2_gates, relative  # noqa: E402
from tests.ops._wy_gva_interpret_check import _OneConfig  # noqa: E402


def main():
    wy_fast.prepare_wy_repr_bwd_kernel = _OneConfig(wy_fast.prepare_wy_repr_bwd_kernel)
    gen = torch.Generator().manual_seed(5)
    for heads, value_heads in ((2, 2), (1, 2)):  # dense, then GVA
        batch, seq_len, key_dim, value_dim = 1, 150, 64, 64

        def rows(n, dim, s=1.0):  # fp16: the interpreter multiplies bf16 tiles as raw bits
            return (torch.randn(batch, seq_len, n, dim, generator=gen) * s).half()

        q = torch.nn.functional.normalize(rows(heads, key_dim).float(), dim=-1).half()
        k = torch.nn.functional.normalize(rows(heads, key_dim).float(), dim=-1).half()
        v, v_new, do, du = (rows(value_heads, value_dim) for _ in range(4))
        w = rows(value_heads, key_dim)  # not read
        beta = torch.rand(batch, seq_len, value_heads, generator=gen)
        g = chunk_local_log2_gates(batch, seq_len, value_heads, gen)
        a_inverse = chunk_wy_inverse_reference(k, g, beta, value_heads=value_heads).half()
        h, dh = (torch.randn(batch, 3, value_heads, value_dim, key_dim, generator=gen).half() for _ in range(2))
        scale = key_dim**-0.5

        dq, dk, dw, dg = dqkwg.chunk_dqkwg(q, k, v_new, w, g, h, do, dh, du, scale,
                                           dk_per_value_head=value_heads != heads)
        if value_heads != heads:
            dk2, dv, dbeta, dg2 = fla_backend._wy_backward_per_value_head(k, v, beta, g, a_inverse, dw, du)
            dk = group_sum(dk, heads, dk2)
        else:
            dk2, dv, dbeta, dg2 = wy_fast.prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=a_inverse, dw=dw, du=du)
            dk = dk + dk2
        split = dq, dk, dv, dbeta, reverse_chunk_cumsum(dg + dg2)
        fused = chunk_bwd_fused.chunk_bwd_fused(q, k, v, v_new, beta, g, a_inverse, h, do, dh, du, scale)
        # the same products; the fused kernel rounds dk once where the two kernels round each part
        errors = [relative(a, b) for a, b in zip(fused, split)]
        print("fused vs two kernels dq dk dv dbeta dg", [f"{e:.1e}" for e in errors])
        assert max(errors) < 2e-3, errors
    print("interpreter ok")


if __name__ == "__main__":
    main()
