"""Run under TRITON_INTERPRET=1 in a subprocess: the fused chunk forward on CPU against the fp32 chunk references."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops.chunk_fwd_fused import chunk_fwd_fused, qualifies  # noqa: E402
from megatron_muon.ops.reference import (  # noqa: E402
    chunk_local_dv_reference,
    chunk_output_reference,
    chunk_state_backward_reference,
    chunk_state_forward_reference,
)
from tests.ops._state_tma_interpret_check import chunk_local_log2_gates, relative  # noqa: E402


def main():
    gen = torch.Generator().manual_seed(1)
    # fp16: Triton 3.6's interpreter reads bf16 through tensor descriptors as raw bits (the GPU tests cover bf16).
    # Partial last chunks (150, 100 tokens), key dims 64 / 128 / 256 (one, two, four key slices), GVA (3 value
    # heads on one key head), with and without the states kept and the initial / final states.
    cases = [(2, 150, 2, 2, 64, 32, True, True), (1, 128, 1, 1, 128, 16, False, False),
             (1, 100, 2, 2, 256, 16, True, False), (1, 150, 1, 3, 128, 16, True, True)]
    for batch, seq_len, key_heads, heads, key_dim, value_dim, with_state, store_states in cases:
        def unit_rows():
            x = torch.randn(batch, seq_len, key_heads, key_dim, generator=gen)
            return torch.nn.functional.normalize(x, dim=-1).half()

        q, k = unit_rows(), unit_rows()
        w = (torch.randn(batch, seq_len, heads, key_dim, generator=gen) * 0.1).half()
        u = (torch.randn(batch, seq_len, heads, value_dim, generator=gen) * 0.5).half()
        gates = chunk_local_log2_gates(batch, seq_len, heads, gen)
        state = torch.randn(batch, heads, value_dim, key_dim, generator=gen) if with_state else None
        scale = key_dim**-0.5
        assert qualifies(q, k, w, u, gates, None, 64)
        o, final, h, v_new = chunk_fwd_fused(q, k, w, u, gates, scale, state, output_final_state=True,
                                             store_states=store_states)
        k_per_value_head = k.repeat_interleave(heads // key_heads, dim=2)
        ref_h, ref_v_new, ref_final = chunk_state_forward_reference(k_per_value_head, w, u, gates, state)
        ref_o = chunk_output_reference(q, k, ref_v_new, ref_h, gates, scale)
        # the state and v_new enter the products in fp16, as in the split kernels: measured ~5e-4
        errors = {"o": relative(o, ref_o), "final": relative(final, ref_final)}
        if store_states:
            errors |= {"h": relative(h, ref_h), "v_new": relative(v_new, ref_v_new)}
        else:
            assert h is None and v_new is None
        assert max(errors.values()) < 2e-3, errors
        assert o.dtype == u.dtype and final.dtype == torch.float32
    # the GDN op's forward takes the fused kernel only where the kernel choice asks for it
    from megatron_muon.ops import fla_backend, kernel_choice

    backward_only = kernel_choice.GdnKernels(output_terms="backward")
    for choice, fused in (("fused", True), ("ours", False), ("fla", False), (backward_only, False)):
        kernel_choice.set_gdn_kernels(choice)
        assert fla_backend._on_fused_forward(q, k, w, u, gates, None) == fused, choice
    kernel_choice.set_gdn_kernels("fused")
    assert not fla_backend._on_fused_forward(q, k, w, u, gates, torch.tensor([0, 64, seq_len]))  # packed: split
    # and the backward's state gradients take the local value gradient inside our kernel, with the forward fused or
    # split
    do = torch.randn(batch, seq_len, heads, value_dim, generator=gen).half()
    q_per_value_head = q.repeat_interleave(heads // key_heads, dim=2)
    reference = chunk_state_backward_reference(q_per_value_head, k_per_value_head, w, gates, do,
                                               chunk_local_dv_reference(q, k, gates, do, scale), scale, dht=state)
    for choice in ("fused", backward_only):
        kernel_choice.set_gdn_kernels(choice)
        dh, dh0, du = fla_backend._state_gradients(q, k, w, gates, do, scale, state, state, None, None)
        errors = [relative(a, b) for a, b in zip((dh, dh0, du), reference)]
        assert max(errors) < 2e-3, (choice, errors)
    print("interpreter ok")


if __name__ == "__main__":
    main()
