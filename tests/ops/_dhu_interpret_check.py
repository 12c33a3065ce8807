"""Run under TRITON_INTERPRET=1 in a subprocess: the TMA backward state kernel on CPU against the fp32 recurrence."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops.dhu_triton import CHUNK, chunk_dhu, qualifies, reference_dhu  # noqa: E402


def chunk_local_log2_gates(batch, seq_len, heads, generator):
    """FLA's gate input: log2 of the per-token decay, summed within each 64-token chunk."""
    step = -torch.rand(batch, seq_len, heads, generator=generator) * 0.2 / torch.log(torch.tensor(2.0))
    gates = torch.empty_like(step)
    for start in range(0, seq_len, CHUNK):
        gates[:, start : start + CHUNK] = step[:, start : start + CHUNK].cumsum(1)
    return gates


def relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def main():
    g = torch.Generator().manual_seed(0)
    # fp16: Triton 3.6's interpreter reads bf16 through tensor descriptors as raw bits (the GPU test covers bf16).
    # 150 tokens: two full chunks and a partial one (TMA zero-fills past the batch element's end)
    for batch, seq_len, heads, key_dim, value_dim, with_dht in [(2, 150, 2, 64, 32, True), (1, 128, 1, 128, 16, False)]:
        def rand(*shape, s=1.0):
            return (torch.randn(*shape, generator=g) * s).half()

        q = torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, key_dim, generator=g), dim=-1).half()
        k = torch.nn.functional.normalize(torch.randn(batch, seq_len, heads, key_dim, generator=g), dim=-1).half()
        w = rand(batch, seq_len, heads, key_dim, s=0.1)
        do, dv = rand(batch, seq_len, heads, value_dim), rand(batch, seq_len, heads, value_dim)
        gates = chunk_local_log2_gates(batch, seq_len, heads, g)
        dht = torch.randn(batch, heads, value_dim, key_dim, generator=g) if with_dht else None
        assert qualifies(q, k, w, do, dv, gates, None, CHUNK)
        scale = key_dim**-0.5
        dh, dh0, dv2 = chunk_dhu(q, k, w, gates, do, dv, scale, dht=dht, want_dh0=True)
        ref_dh, ref_dh0, ref_dv2 = reference_dhu(q, k, w, gates, do, dv, scale, dht=dht)
        errors = relative(dh, ref_dh), relative(dh0, ref_dh0), relative(dv2, ref_dv2)
        # the state is rounded to the input dtype for each product, as in FLA's kernel
        assert max(errors) < 2e-3, errors  # measured ~2.5e-4 (fp16 operands)
        assert dh.shape == ref_dh.shape and dh0.dtype == torch.float32
    assert not qualifies(q, k, w, do, dv, gates, torch.tensor([0, 64]), CHUNK)  # packed sequences stay on FLA
    print("interpreter ok")


if __name__ == "__main__":
    main()
