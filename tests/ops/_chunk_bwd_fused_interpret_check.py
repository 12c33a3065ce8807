"""Run under TRITON_INTERPRET=1 in a subprocess: the one-kernel chunk-parallel backward on CPU against the fp64
references of the two kernels it replaces (output gradients, WY backward) and FLA's reverse cumsum of dg."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops.chunk_bwd_fused import CHUNK, chunk_bwd_fused, qualifies  # noqa: E402
from megatron_muon.ops.reference import (  # noqa: E402
    chunk_output_grads_reference,
    chunk_wy_backward_reference,
    chunk_wy_inverse_reference,
)
from tests.ops._state_tma_interpret_check import chunk_local_log2_gates, relative  # noqa: E402


def reverse_chunk_cumsum(x, chunk=CHUNK):
    """FLA's `chunk_local_cumsum(x, reverse=True)`: within each chunk, the sum from each row to the chunk's end."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], chunk):
        rows = slice(start, start + chunk)
        out[:, rows] = x[:, rows].flip(1).cumsum(1).flip(1)
    return out


def expected(q, k, v, v_new, beta, g, h, do, dh, du, scale):
    """(dq, dk, dv, dβ, dg) in fp64 from the two references, as the two-kernel backward adds them up."""
    w = torch.zeros(*v.shape[:3], k.shape[-1], dtype=k.dtype)  # w's value does not enter its gradients
    dq, dk_out, dw, dg_out = chunk_output_grads_reference(*(t.double() for t in (q, k, v_new, w, g, h, do, dh, du)),
                                                          scale)
    dk_wy, dv, dbeta, dg_wy = chunk_wy_backward_reference(*(t.double() for t in (k, v, g, beta)), dw, du.double())
    return dq, dk_out + dk_wy, dv, dbeta, reverse_chunk_cumsum(dg_out + dg_wy)


def main():
    gen = torch.Generator().manual_seed(3)
    # fp16 only: Triton 3.6's interpreter multiplies bf16 tiles as raw bits in tl.dot (the GPU tests cover bf16).
    # 150 and 100 tokens: full chunks and a partial one; key dims 64, 128 and 256: one, two and four key blocks;
    # value dims 64 and 128: two and four value blocks of 32. The third case's decay is strong (a padding row's gate
    # gap would overflow exp2); the fourth and last are GVA (two value heads per query/key head, Qwen3-Next's
    # grouping, and four).
    dtype = torch.float16
    cases = [(2, 150, 2, 2, 64, 64, 1.0), (1, 128, 1, 1, 128, 128, 1.0), (1, 150, 2, 2, 64, 64, 40.0),
             (1, 150, 2, 4, 64, 64, 1.0), (1, 100, 1, 1, 256, 64, 1.0), (1, 100, 1, 4, 128, 64, 1.0)]
    for batch, seq_len, heads, value_heads, key_dim, value_dim, decay in cases:
        def rows(dim, s=1.0, n=value_heads):
            return (torch.randn(batch, seq_len, n, dim, generator=gen) * s).to(dtype)

        q = torch.nn.functional.normalize(rows(key_dim, n=heads).float(), dim=-1).to(dtype)
        k = torch.nn.functional.normalize(rows(key_dim, n=heads).float(), dim=-1).to(dtype)
        v, v_new, do, du = rows(value_dim), rows(value_dim, 0.5), rows(value_dim), rows(value_dim)
        beta = torch.rand(batch, seq_len, value_heads, generator=gen)
        chunks = -(-seq_len // CHUNK)
        h, dh = (torch.randn(batch, chunks, value_heads, value_dim, key_dim, generator=gen).to(dtype)
                 for _ in range(2))
        g = chunk_local_log2_gates(batch, seq_len, value_heads, gen) * decay
        a_inverse = chunk_wy_inverse_reference(k, g, beta, value_heads=value_heads).to(dtype)
        inputs = (q, k, v, v_new, beta, g, a_inverse, h, do, dh, du)
        assert qualifies(*inputs, None, CHUNK)
        scale = key_dim**-0.5
        got = chunk_bwd_fused(*inputs, scale)
        want = expected(q, k, v, v_new, beta, g, h, do, dh, du, scale)
        assert all(torch.isfinite(t).all() for t in got), [torch.isfinite(t).all().item() for t in got]
        assert [t.shape for t in got] == [q.shape, k.shape, v.shape, beta.shape, g.shape]
        assert got[4].dtype == torch.float32 and got[0].dtype == dtype
        # fp16 products with fp32 accumulation, as in the kernels it replaces (each ~3e-4 against fp64)
        errors = [relative(a, b) for a, b in zip(got, want)]
        print("errors dq dk dv dbeta dg", [f"{e:.1e}" for e in errors])
        assert max(errors) < 3e-3, errors
    assert not qualifies(*inputs, torch.tensor([0, 64]), CHUNK)
    three = q[:, :, :1].expand(-1, -1, 3, -1).contiguous()  # 3 query/key heads do not divide 4 value heads
    assert not qualifies(three, three, *inputs[2:], None, CHUNK)
    print("interpreter ok")


if __name__ == "__main__":
    main()
