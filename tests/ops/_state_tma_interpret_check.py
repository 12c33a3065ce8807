"""Run under TRITON_INTERPRET=1 in a subprocess: the TMA chunk-state kernels on CPU against the fp32 recurrences."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops.reference import (  # noqa: E402
    chunk_local_dv_reference,
    chunk_state_backward_reference,
    chunk_state_forward_reference,
)
from megatron_muon.ops.state_tma import CHUNK, chunk_dhu, chunk_fwd_h, qualifies  # noqa: E402


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
    # fp16: Triton 3.6's interpreter reads bf16 through tensor descriptors as raw bits (the GPU tests cover bf16).
    # 150 tokens: two full chunks and a partial one (TMA zero-fills past each batch element's end).
    # key dims 64, 128 and 256: one, two and four 64-column key slices of the state
    # key heads below the value heads: GVA, value head h reads key head h // group
    for batch, seq_len, key_heads, heads, key_dim, value_dim, with_states in [(2, 150, 2, 2, 64, 32, True),
                                                                             (1, 128, 1, 1, 128, 16, False),
                                                                             (1, 100, 2, 2, 256, 16, True),
                                                                             (1, 150, 1, 3, 128, 16, True)]:
        def unit_rows(rows_heads):
            x = torch.randn(batch, seq_len, rows_heads, key_dim, generator=g)
            return torch.nn.functional.normalize(x, dim=-1).half()

        def values(s=1.0):
            return (torch.randn(batch, seq_len, heads, value_dim, generator=g) * s).half()

        q, k = unit_rows(key_heads), unit_rows(key_heads)
        w = (torch.randn(batch, seq_len, heads, key_dim, generator=g) * 0.1).half()
        u, do, dv = values(0.5), values(), values()
        gates = chunk_local_log2_gates(batch, seq_len, heads, g)
        state = torch.randn(batch, heads, value_dim, key_dim, generator=g) if with_states else None
        assert qualifies([q, k, w], [do, dv, u], gates, None, CHUNK)
        scale = key_dim**-0.5
        q_per_value_head, k_per_value_head = (x.repeat_interleave(heads // key_heads, dim=2) for x in (q, k))
        # the state is rounded to the input dtype for each product, as in FLA's kernels: measured ~2.5e-4 (fp16)
        forward = chunk_fwd_h(k, w, u, gates, initial_state=state, output_final_state=True)
        reference = chunk_state_forward_reference(k_per_value_head, w, u, gates, state)
        errors = [relative(a, b) for a, b in zip(forward, reference)]
        assert max(errors) < 2e-3, ("forward", errors)
        backward = chunk_dhu(q, k, w, gates, do, dv, scale, dht=state, want_dh0=True)
        reference = chunk_state_backward_reference(q_per_value_head, k_per_value_head, w, gates, do, dv, scale,
                                                   dht=state)
        errors = [relative(a, b) for a, b in zip(backward, reference)]
        assert max(errors) < 2e-3, ("backward", errors)
        assert backward[1].dtype == forward[2].dtype == torch.float32
        # dv None: the kernel adds the chunks' own value gradient (FLA's chunk_bwd_dv_local) itself
        local_dv = chunk_local_dv_reference(q, k, gates, do, scale)
        backward = chunk_dhu(q, k, w, gates, do, None, scale, dht=state, want_dh0=True)
        reference = chunk_state_backward_reference(q_per_value_head, k_per_value_head, w, gates, do, local_dv, scale,
                                                   dht=state)
        errors = [relative(a, b) for a, b in zip(backward, reference)]
        assert max(errors) < 2e-3, ("backward with the local value gradient", errors)
    assert not qualifies([q, k, w], [do, dv], gates, torch.tensor([0, 64]), CHUNK)  # packed sequences stay on FLA
    two_heads = torch.zeros(1, 64, 2, 64).half()
    assert not qualifies([two_heads], [torch.zeros(1, 64, 3, 16).half()], torch.zeros(1, 64, 3), None, CHUNK)
    print("interpreter ok")


if __name__ == "__main__":
    main()
