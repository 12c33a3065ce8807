"""Run under TRITON_INTERPRET=1 in a subprocess: the one-kernel chunk-parallel forward (gate cumsum, WY inverse, w
and u) on CPU against the fp64 references."""

import math

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops.chunk_fwd_intra import CHUNK, chunk_fwd_intra, qualifies  # noqa: E402
from megatron_muon.ops.reference import chunk_wy_inverse_reference, chunk_wy_reference  # noqa: E402
from tests.ops._state_tma_interpret_check import relative  # noqa: E402


def chunk_local_log2_cumsum(g):
    """FLA's `chunk_local_cumsum(g, scale=1/ln 2)` in fp64: the per-token log decay summed within each chunk."""
    g = g.double()
    return torch.cat([g[:, i : i + CHUNK].cumsum(1) for i in range(0, g.shape[1], CHUNK)], 1) / math.log(2)


def main():
    gen = torch.Generator().manual_seed(11)
    # fp16: the interpreter multiplies bf16 tiles as raw bits. 150 and 100 tokens: full chunks and a partial one;
    # key dims 64, 96 and 128, value dims 32, 64 and 96; the third case's decay is strong (a padding row's gap would
    # overflow exp2), slow in the others (the blocks 48 rows apart then weigh in the inverse); the last three are GVA
    # (value head h reads key head h // 2 or h // 4)
    cases = [(2, 150, 2, 2, 64, 64, 0.1), (1, 128, 1, 1, 128, 32, 0.1), (1, 150, 2, 2, 64, 64, 40.0),
             (1, 150, 2, 4, 64, 64, 0.1), (1, 100, 1, 4, 128, 32, 0.1), (1, 100, 1, 2, 96, 96, 0.1)]
    for batch, seq_len, heads, value_heads, key_dim, value_dim, decay in cases:
        # keys sharing a direction (cosines around 0.5), so the inverse's higher-order terms are large enough to see
        shared = torch.randn(1, 1, heads, key_dim, generator=gen)
        k = torch.randn(batch, seq_len, heads, key_dim, generator=gen) + shared
        k = torch.nn.functional.normalize(k, dim=-1).half()
        v = torch.randn(batch, seq_len, value_heads, value_dim, generator=gen).half()
        g = -torch.rand(batch, seq_len, value_heads, generator=gen) * 0.2 * decay  # per-token log decay
        beta = torch.rand(batch, seq_len, value_heads, generator=gen)
        assert qualifies(k, v, g, beta, None, CHUNK)
        g_cumsum, w, u, a_inverse = chunk_fwd_intra(k, v, g, beta)
        want_g = chunk_local_log2_cumsum(g)
        want_a = chunk_wy_inverse_reference(k.double(), want_g, beta.double(), value_heads=value_heads)
        want_w, want_u = chunk_wy_reference(k.double(), v.double(), want_g, beta.double())
        assert g_cumsum.dtype == torch.float32 and a_inverse.dtype == w.dtype == u.dtype == torch.float16
        assert a_inverse.shape == (batch, seq_len, value_heads, CHUNK) and w.shape == (*v.shape[:3], key_dim)
        identity = torch.eye(CHUNK, dtype=torch.float64).repeat(-(-seq_len // CHUNK), 1)[:seq_len, None, :]
        errors = {"g": relative(g_cumsum, want_g), "A - I": relative(a_inverse - identity, want_a - identity),
                  "w": relative(w, want_w), "u": relative(u, want_u)}
        print({name: f"{e:.1e}" for name, e in errors.items()})
        # fp16 A, w and u (FLA stores them in the inputs' dtype): 2e-4 to 4e-4 measured
        assert max(errors.values()) < 1e-3, errors
        assert torch.isfinite(a_inverse).all() and torch.isfinite(w).all()
    assert not qualifies(k, v, g, beta, torch.tensor([0, 64]), CHUNK)
    print("interpreter ok")


if __name__ == "__main__":
    main()
