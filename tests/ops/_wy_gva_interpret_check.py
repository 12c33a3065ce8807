"""Run under TRITON_INTERPRET=1 in a subprocess, with FLA installed: the GVA backward's direct launch of FLA's WY
kernel (`fla_backend._wy_backward_per_value_head`, dk left per value head) equals FLA's own `prepare_wy_repr_bwd`
once `group_sum` sums dk over each group, the output-gradient part of dk included."""

import torch

from tests.interpreter import below_autotuning, patch_for_numpy_2_5

patch_for_numpy_2_5()

import fla.ops.gated_delta_rule.wy_fast as wy_fast  # noqa: E402

from megatron_muon.ops import fla_backend  # noqa: E402
from megatron_muon.ops.group_sum import group_sum  # noqa: E402
from tests.ops._state_tma_interpret_check import chunk_local_log2_gates  # noqa: E402


class _OneConfig:
    """FLA's autotuned kernel without its autotuner (which times configs on a GPU): heuristics filled in, one
    config, the same keyword launch."""

    def __init__(self, kernel):
        self.kernel = below_autotuning(kernel)

    def __getitem__(self, grid):
        def launch(**kwargs):
            flags = dict(USE_G=kwargs["g"] is not None, IS_VARLEN=kwargs["cu_seqlens"] is not None)
            self.kernel[grid](**kwargs, **flags, num_warps=4, num_stages=1)
        return launch


def main():
    wy_fast.prepare_wy_repr_bwd_kernel = _OneConfig(wy_fast.prepare_wy_repr_bwd_kernel)
    gen = torch.Generator().manual_seed(0)
    batch, seq_len, heads, value_heads, key_dim, value_dim, chunk = 1, 150, 2, 4, 32, 32, 64

    def rows(n, dim, s=1.0):  # fp16: the interpreter multiplies bf16 tiles as raw bits
        return (torch.randn(batch, seq_len, n, dim, generator=gen) * s).half()

    k = torch.nn.functional.normalize(rows(heads, key_dim).float(), dim=-1).half()
    v, dw, du = rows(value_heads, value_dim), rows(value_heads, key_dim), rows(value_heads, value_dim)
    beta = torch.rand(batch, seq_len, value_heads, generator=gen).half()
    g = chunk_local_log2_gates(batch, seq_len, value_heads, gen)
    a_inverse = (torch.randn(batch, seq_len, value_heads, chunk, generator=gen) * 0.1).half()
    dk_output_part = rows(value_heads, key_dim)  # dqkwg's dk, per value head

    dk2, dv, dbeta, dg = fla_backend._wy_backward_per_value_head(k, v, beta, g, a_inverse, dw, du)
    want = wy_fast.prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=a_inverse, dw=dw, du=du)
    assert dk2.shape == (batch, seq_len, value_heads, key_dim)
    for name, got, expected in (("dv", dv, want[1]), ("dbeta", dbeta, want[2]), ("dg", dg, want[3])):
        assert torch.equal(got, expected), name
    assert torch.equal(group_sum(dk2, heads), want[0])  # FLA sums its fp16 dk over the group in fp32 as well
    summed = group_sum(dk_output_part, heads, dk2)
    reference = dk_output_part.double().view(batch, seq_len, heads, 2, key_dim).sum(3) + want[0].double()
    torch.testing.assert_close(summed.double(), reference, rtol=2e-3, atol=2e-3)
    print("interpreter ok")


if __name__ == "__main__":
    main()
