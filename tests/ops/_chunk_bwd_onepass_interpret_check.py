"""Run under TRITON_INTERPRET=1 in a subprocess: the one-pass chunk backward on CPU against the fp64 references of
the split path it replaces (the chunks' own value gradient, the state-gradient recurrence, the output gradients, the
WY backward and FLA's reverse cumsum of dg)."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops.chunk_bwd_onepass import CHUNK, chunk_bwd_onepass, qualifies, segment_ends  # noqa: E402
from megatron_muon.ops.reference import (  # noqa: E402
    chunk_local_dv_reference,
    chunk_state_backward_reference,
    chunk_wy_inverse_reference,
)
from tests.ops._chunk_bwd_fused_interpret_check import expected  # noqa: E402
from tests.ops._state_tma_interpret_check import chunk_local_log2_gates, relative  # noqa: E402


def split_path(q, k, v, v_new, w, beta, g, h, do, dht, scale):
    """(dq, dk, dv, dβ, dg, dh0) in fp64: the state gradients from the references, then the output and WY gradients."""
    groups = v.shape[2] // q.shape[2]
    q64, k64, w64, do64, g64 = (t.double() for t in (q, k, w, do, g))
    dv_local = chunk_local_dv_reference(q64, k64, g64, do64, scale)
    q_rep, k_rep = (t.repeat_interleave(groups, dim=2) for t in (q64, k64))
    dh, dh0, du = chunk_state_backward_reference(q_rep, k_rep, w64, g64, do64, dv_local, scale,
                                                 dht=None if dht is None else dht.double())
    return (*expected(q, k, v, v_new, beta, g, h, do, dh, du, scale), dh0)


def segment_checks(gen, dtype):
    """Sequences cut into segments of whole chunks side by side, each from the recurrence's state gradient at its
    end (rounded to fp16 as the split path stores it): the same gradients as one pass, dh0 from the first segment."""
    for batch, segments, value_heads, with_dht in ((1, 4, 2, True), (2, 2, 4, False)):
        seq_len, heads, dim = 256, 2, 64
        q, k = (torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, dim, generator=gen), dim=-1).to(dtype)
                for _ in range(2))
        v, v_new, do = (torch.randn(batch, seq_len, value_heads, dim, generator=gen).to(dtype) for _ in range(3))
        w = (torch.randn(batch, seq_len, value_heads, dim, generator=gen) * 0.1).to(dtype)
        beta = torch.rand(batch, seq_len, value_heads, generator=gen)
        h = (torch.randn(batch, seq_len // CHUNK, value_heads, dim, dim, generator=gen) * 0.5).to(dtype)
        dht = torch.randn(batch, value_heads, dim, dim, generator=gen) if with_dht else None
        g = chunk_local_log2_gates(batch, seq_len, value_heads, gen)
        a_inverse = chunk_wy_inverse_reference(k, g, beta, value_heads=value_heads).to(dtype)
        scale = dim**-0.5
        q64, k64 = (t.double().repeat_interleave(value_heads // heads, dim=2) for t in (q, k))
        dv_local = chunk_local_dv_reference(q.double(), k.double(), g.double(), do.double(), scale)
        dh, _, _ = chunk_state_backward_reference(q64, k64, w.double(), g.double(), do.double(), dv_local, scale,
                                                  dht=None if dht is None else dht.double())
        ends = segment_ends(dh.to(dtype), dht, segments)
        got = chunk_bwd_onepass(q, k, v, v_new, w, beta, g, a_inverse, h, do, scale, want_dh0=True, ends=ends)
        want = split_path(q, k, v, v_new, w, beta, g, h, do, dht, scale)
        errors = [relative(a, b) for a, b in zip(got, want)]
        print(f"{segments} segments: errors dq dk dv dbeta dg dh0", [f"{e:.1e}" for e in errors])
        assert [t.shape for t in got] == [t.shape for t in want]
        assert max(errors) < 3e-3, errors


def main():
    gen = torch.Generator().manual_seed(5)
    # fp16 only: Triton 3.6's interpreter multiplies bf16 tiles as raw bits in tl.dot (the GPU tests cover bf16).
    # 150 and 100 tokens: full chunks and a partial one; key and value dims 64 and 128; the third case's decay is
    # strong (a padding row's gate gap would overflow exp2); the last two are GVA (two and four value heads per
    # query/key head); with and without the final state's gradient.
    dtype = torch.float16
    cases = [(2, 150, 2, 2, 64, 64, 1.0, True), (1, 128, 1, 1, 128, 128, 1.0, False),
             (1, 150, 2, 2, 64, 128, 40.0, True), (1, 150, 2, 4, 128, 64, 1.0, True),
             (1, 100, 1, 4, 64, 64, 1.0, False)]
    for batch, seq_len, heads, value_heads, key_dim, value_dim, decay, with_dht in cases:
        def rows(dim, s=1.0, n=value_heads):
            return (torch.randn(batch, seq_len, n, dim, generator=gen) * s).to(dtype)

        q = torch.nn.functional.normalize(rows(key_dim, n=heads).float(), dim=-1).to(dtype)
        k = torch.nn.functional.normalize(rows(key_dim, n=heads).float(), dim=-1).to(dtype)
        v, v_new, do, w = rows(value_dim), rows(value_dim, 0.5), rows(value_dim), rows(key_dim, 0.1)
        beta = torch.rand(batch, seq_len, value_heads, generator=gen)
        chunks = -(-seq_len // CHUNK)
        h = (torch.randn(batch, chunks, value_heads, value_dim, key_dim, generator=gen) * 0.5).to(dtype)
        dht = torch.randn(batch, value_heads, value_dim, key_dim, generator=gen) if with_dht else None
        g = chunk_local_log2_gates(batch, seq_len, value_heads, gen) * decay
        a_inverse = chunk_wy_inverse_reference(k, g, beta, value_heads=value_heads).to(dtype)
        inputs = (q, k, v, v_new, w, beta, g, a_inverse, h, do)
        assert qualifies(*inputs, None, CHUNK)
        scale = key_dim**-0.5
        got = chunk_bwd_onepass(*inputs, scale, dht=dht, want_dh0=True)
        want = split_path(q, k, v, v_new, w, beta, g, h, do, dht, scale)
        assert all(torch.isfinite(t).all() for t in got), [torch.isfinite(t).all().item() for t in got]
        assert [t.shape for t in got] == [q.shape, k.shape, v.shape, beta.shape, g.shape, want[5].shape]
        assert got[4].dtype == got[5].dtype == torch.float32 and got[0].dtype == dtype
        # fp16 products with fp32 accumulation, dh and du rounded to fp16 as operands, as the split path stores them
        errors = [relative(a, b) for a, b in zip(got, want)]
        print("errors dq dk dv dbeta dg dh0", [f"{e:.1e}" for e in errors])
        assert max(errors) < 3e-3, errors
    segment_checks(gen, dtype)
    assert not qualifies(*inputs, torch.tensor([0, 64]), CHUNK)
    wide = torch.zeros(1, 64, 1, 256, dtype=dtype)  # a [V, K] state of 256 columns does not fit a program
    assert not qualifies(wide, wide, *(t[:, :64, :1] for t in (v, v_new)), wide, *(t[:, :64, :1] for t in
                         (beta, g, a_inverse)), torch.zeros(1, 1, 1, value_dim, 256, dtype=dtype), do[:, :64, :1],
                         None, CHUNK)
    print("interpreter ok")


if __name__ == "__main__":
    main()
