"""Run under TRITON_INTERPRET=1 in a subprocess: FLA's Triton `chunk_bwd_kernel_dqkwg` against the autograd
reference (fp16: the interpreter multiplies bf16 tiles as raw bits)."""

import torch

from tests.interpreter import below_autotuning, patch_for_numpy_2_5

patch_for_numpy_2_5()

import fla.ops.common.chunk_o as chunk_o  # noqa: E402

from megatron_muon.ops.reference import chunk_output_grads_reference  # noqa: E402
from tests.ops._state_tma_interpret_check import chunk_local_log2_gates, relative  # noqa: E402


def check(heads: int, value_heads: int, gen):
    batch, seq_len, key_dim, value_dim = 1, 128, 64, 64

    def rows(dim, s=1.0, n=value_heads):
        return (torch.randn(batch, seq_len, n, dim, generator=gen) * s).half()

    q, k = rows(key_dim, n=heads), rows(key_dim, n=heads)
    w, v_new, do, dv = rows(key_dim, 0.1), rows(value_dim), rows(value_dim), rows(value_dim)
    h, dh = (torch.randn(batch, 2, value_heads, value_dim, key_dim, generator=gen).half() for _ in range(2))
    g = chunk_local_log2_gates(batch, seq_len, value_heads, gen)
    dq, dk, dw = (torch.empty_like(w) for _ in range(3))  # per value head, as FLA's wrapper allocates them
    dg = torch.empty(1, batch, seq_len, value_heads)
    kernel = below_autotuning(chunk_o.chunk_bwd_kernel_dqkwg)
    kernel[(2, batch * value_heads)](
        q=q, k=k, v=v_new, g=g, g_gamma=None, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg,
        cu_seqlens=None, chunk_indices=None, scale=0.125, B=batch, T=seq_len, H=heads, HV=value_heads, K=key_dim,
        V=value_dim, BT=64, BK=64, BV=64, USE_G=True, USE_G_GAMMA=False, USE_DW=True, STATE_V_FIRST=True,
        IS_VARLEN=False,
    )
    # FLA's wrapper sums dq and dk over each group of value heads
    dq, dk = (t.view(batch, seq_len, heads, value_heads // heads, key_dim).sum(3) for t in (dq, dk))
    want = chunk_output_grads_reference(q, k, v_new, w, g, h, do, dh, dv, 0.125)
    errors = [relative(a, b) for a, b in zip((dq, dk, dw, dg[0]), want)]
    assert max(errors) < 2e-3, errors  # measured ~3e-4


def main():
    gen = torch.Generator().manual_seed(2)
    for heads, value_heads in ((2, 2), (1, 2)):  # one value head per query/key head, and GVA
        check(heads, value_heads, gen)
    print("interpreter ok")


if __name__ == "__main__":
    main()
