"""Run under TRITON_INTERPRET=1 in a subprocess: the chunk output-gradient kernel on CPU against the autograd
reference."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops.dqkwg import CHUNK, chunk_dqkwg, qualifies  # noqa: E402
from megatron_muon.ops.group_sum import group_sum  # noqa: E402
from megatron_muon.ops.reference import chunk_output_grads_reference  # noqa: E402
from tests.ops._state_tma_interpret_check import chunk_local_log2_gates, relative  # noqa: E402


def main():
    gen = torch.Generator().manual_seed(1)
    # 150 tokens: two full chunks and a partial one; key dims 64 and 128: one and two key blocks of 64.
    # fp16 only: Triton 3.6's interpreter multiplies bf16 tiles as raw bits in tl.dot (the GPU tests cover bf16).
    dtype = torch.float16
    # the last case's decay is strong (gates fall by ~11 per token, as a trained A_log can make them): within its
    # partial last chunk the gates reach below -128 (log2), where a gap to a padding row overflows exp2
    # the GVA case has two value heads per query/key head (Qwen3-Next's grouping)
    cases = [(2, 150, 2, 2, 64, 128, 1.0), (1, 128, 1, 1, 128, 256, 1.0), (1, 150, 2, 2, 64, 128, 40.0),
             (1, 150, 2, 4, 64, 128, 1.0)]
    for batch, seq_len, heads, value_heads, key_dim, value_dim, decay in cases:
        def rows(dim, s=1.0, n=value_heads):
            return (torch.randn(batch, seq_len, n, dim, generator=gen) * s).to(dtype)

        q = torch.nn.functional.normalize(rows(key_dim, n=heads).float(), dim=-1).to(dtype)
        k = torch.nn.functional.normalize(rows(key_dim, n=heads).float(), dim=-1).to(dtype)
        w, v_new, do, dv = rows(key_dim, 0.1), rows(value_dim, 0.5), rows(value_dim), rows(value_dim)
        chunks = -(-seq_len // CHUNK)
        h, dh = (torch.randn(batch, chunks, value_heads, value_dim, key_dim, generator=gen).to(dtype)
                 for _ in range(2))
        gates = chunk_local_log2_gates(batch, seq_len, value_heads, gen) * decay
        assert qualifies(q, k, v_new, w, gates, h, do, dh, dv, None, CHUNK)
        scale = key_dim**-0.5
        got = chunk_dqkwg(q, k, v_new, w, gates, h, do, dh, dv, scale)
        want = chunk_output_grads_reference(q, k, v_new, w, gates, h, do, dh, dv, scale)
        # fp16 products with fp32 accumulation, as in FLA's kernel: measured ~3e-4
        assert all(torch.isfinite(t).all() for t in got), [torch.isfinite(t).all().item() for t in got]
        errors = [relative(a, b) for a, b in zip(got, want)]
        assert max(errors) < 2e-3, errors
        assert got[3].dtype == torch.float32 and got[0].dtype == dtype
        assert got[0].shape == q.shape and got[2].shape == w.shape and got[3].shape == gates.shape
        print("errors", [f"{e:.1e}" for e in errors])
        if value_heads != heads:  # dk left per value head sums (group_sum) to the default's dk
            per_head = chunk_dqkwg(q, k, v_new, w, gates, h, do, dh, dv, scale, dk_per_value_head=True)
            assert per_head[1].shape == w.shape
            assert torch.equal(group_sum(per_head[1], heads), got[1])
            assert all(torch.equal(a, b) for a, b in zip((per_head[0], *per_head[2:]), (got[0], *got[2:])))
    assert not qualifies(q, k, v_new, w, gates, h, do, dh, dv, torch.tensor([0, 64]), CHUNK)
    three = torch.cat([q, q[:, :, :1]], dim=2)  # 3 query/key heads do not divide 4 value heads
    assert not qualifies(three, three, v_new, w, gates, h, do, dh, dv, None, CHUNK)
    print("interpreter ok")


if __name__ == "__main__":
    main()
