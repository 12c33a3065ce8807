"""FLOPs/token and MFU against hand counts and against torch's FlopCounterMode on real modules."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron_muon.metrics import (
    MfuCalculator,
    ModelShape,
    attention_flops_per_token,
    flops_breakdown_per_token,
    gdn_flops_per_token,
    gdn_recurrence_flops_per_token,
    mfu,
    mlp_flops_per_token,
    peak_tflops,
    training_flops_per_token,
)

# The reference workload "hybrid-1.5B" of DESIGN.md.
HYBRID_1P5B = ModelShape(
    hidden_size=2048,
    layer_pattern="GGG*" * 6,
    ffn_hidden_size=5632,
    vocab_size=32000,
    seq_length=16384,
    num_attention_heads=16,
    num_query_groups=4,
    kv_channels=128,
    gdn_num_key_heads=6,
    gdn_num_value_heads=6,
    gdn_key_head_dim=256,
    gdn_value_head_dim=512,
    gdn_conv_kernel=4,
    gdn_chunk_size=64,
)


def _counted_train_flops(fn, *inputs):
    """FLOPs torch counts for forward + backward of fn (inputs require grad so input grads are counted too)."""
    with FlopCounterMode(display=False) as counter:
        fn(*inputs).sum().backward()
    return counter.get_total_flops()


def test_mlp_matches_flop_counter_swiglu_and_plain():
    torch.manual_seed(0)
    tokens, hidden, ffn = 5, 12, 20
    x = torch.randn(tokens, hidden, requires_grad=True)
    fc1_gated, fc1 = torch.randn(2 * ffn, hidden, requires_grad=True), torch.randn(ffn, hidden, requires_grad=True)
    fc2 = torch.randn(hidden, ffn, requires_grad=True)

    def swiglu(x):
        gate, up = F.linear(x, fc1_gated).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, fc2)

    counted_gated = _counted_train_flops(swiglu, x)
    counted_plain = _counted_train_flops(lambda x: F.linear(F.gelu(F.linear(x, fc1)), fc2), x)
    assert 3 * tokens * mlp_flops_per_token(hidden, ffn, gated=True) == counted_gated
    assert 3 * tokens * mlp_flops_per_token(hidden, ffn, gated=False) == counted_plain
    # hand count: SwiGLU fc1 is 2*ffn wide: 2*h*2f + 2*f*h = 6*h*f forward
    assert mlp_flops_per_token(hidden, ffn, gated=True) == 6 * hidden * ffn


def test_attention_matches_flop_counter_without_mask_and_halves_scores_when_causal():
    torch.manual_seed(0)
    seq, hidden, heads, groups, head_dim = 8, 16, 4, 2, 6
    x = torch.randn(1, seq, hidden, requires_grad=True)
    w_qkv = torch.randn((heads + 2 * groups) * head_dim, hidden, requires_grad=True)
    w_out = torch.randn(hidden, heads * head_dim, requires_grad=True)

    def attention(x):
        q, k, v = F.linear(x, w_qkv).split([heads * head_dim, groups * head_dim, groups * head_dim], dim=-1)
        q = q.view(1, seq, heads, head_dim).transpose(1, 2)
        k = k.view(1, seq, groups, head_dim).transpose(1, 2).repeat_interleave(heads // groups, dim=1)
        v = v.view(1, seq, groups, head_dim).transpose(1, 2).repeat_interleave(heads // groups, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        out = scores.softmax(-1) @ v
        return F.linear(out.transpose(1, 2).reshape(1, seq, heads * head_dim), w_out)

    counted = _counted_train_flops(attention, x)
    full = attention_flops_per_token(hidden, heads, groups, head_dim, seq, causal=False)
    causal = attention_flops_per_token(hidden, heads, groups, head_dim, seq, causal=True)
    assert 3 * seq * full == counted
    scores_full = 2 * 2 * heads * head_dim * seq  # QKᵀ and PV per token, all keys
    assert full - causal == scores_full / 2


def _enumerated_chunked_delta_rule_flops(seq, heads, key_dim, value_dim, chunk):
    """Walk the chunked algorithm chunk by chunk and add up 2*m*k*n for every product it performs."""
    total = 0.0
    for _ in range(seq // chunk):
        products = [
            (chunk, key_dim, chunk),  # A = (beta K) Kᵀ
            (chunk, key_dim, chunk),  # W = T (beta K)  [T is C x C, so m=C, inner=C, n=K: same count]
            (chunk, chunk, value_dim),  # U = T (beta V)
            (chunk, key_dim, value_dim),  # W S
            (key_dim, chunk, value_dim),  # Kᵀ V_new (state update)
            (chunk, key_dim, value_dim),  # Q S
            (chunk, key_dim, chunk),  # Q Kᵀ
            (chunk, chunk, value_dim),  # (Q Kᵀ) V_new
        ]
        total += sum(2 * m * k * n for m, k, n in products)
        total += chunk**3 / 3  # unit lower-triangular inverse
    return heads * total / seq


def test_gdn_recurrence_matches_chunk_walk():
    for heads, key_dim, value_dim, chunk in [(1, 2, 3, 4), (6, 256, 512, 64), (3, 16, 32, 16)]:
        expected = _enumerated_chunked_delta_rule_flops(4 * chunk, heads, key_dim, value_dim, chunk)
        assert gdn_recurrence_flops_per_token(heads, key_dim, value_dim, chunk) == pytest.approx(expected, rel=1e-12)


def test_gdn_layer_hand_count_reference_workload():
    # in_proj 9228 x 2048 and out_proj 2048 x 3072 (DESIGN.md); conv over q,k,v = 1536+1536+3072 channels, width 4.
    recurrence = 6 * (6 * 64 * 256 + 4 * 64 * 512 + 64 * 64 / 3 + 6 * 256 * 512)
    expected = 2 * 9228 * 2048 + 2 * 2048 * 3072 + 2 * 6144 * 4 + recurrence
    assert gdn_flops_per_token(2048, 6, 6, 256, 512, 4, 64) == pytest.approx(expected, rel=1e-12)


def test_reference_workload_linear_part_is_six_times_matrix_params():
    """6 x (matrix params) + attention scores + recurrence + conv = total; checks the layer bookkeeping."""
    matrix_params = 18 * (9228 * 2048 + 2048 * 3072) + 6 * (3072 * 2048 + 2048 * 2048)
    matrix_params += 24 * (11264 * 2048 + 2048 * 5632)
    assert matrix_params == pytest.approx(1.35e9, rel=0.01)  # DESIGN.md: 96 matrices, 1.35B params
    lm_head = 2048 * 32000
    scores = 6 * 2 * 2 * 2048 * 16384 / 2
    recurrence = 18 * gdn_recurrence_flops_per_token(6, 256, 512, 64)
    conv = 18 * 2 * 6144 * 4
    expected = 6 * (matrix_params + lm_head) + 3 * (scores + recurrence + conv)
    assert training_flops_per_token(HYBRID_1P5B) == pytest.approx(expected, rel=1e-12)
    parts = flops_breakdown_per_token(HYBRID_1P5B)
    assert sum(parts.values()) == pytest.approx(training_flops_per_token(HYBRID_1P5B), rel=1e-12)
    assert parts["lm_head"] == 6 * lm_head


def test_all_attention_equivalent_replaces_every_gdn_layer():
    dense = HYBRID_1P5B.all_attention()
    assert dense.layer_pattern == "*" * 24
    attention = attention_flops_per_token(2048, 16, 4, 128, 16384)
    mlp = mlp_flops_per_token(2048, 5632, gated=True)
    expected = 3 * (24 * (attention + mlp) + 2 * 2048 * 32000)
    assert training_flops_per_token(dense) == pytest.approx(expected, rel=1e-12)
    # At 16k the hybrid is cheaper per token than its all-attention twin.
    assert training_flops_per_token(HYBRID_1P5B) < training_flops_per_token(dense)


def test_megatron_style_pattern_counts_mlp_layers_only_where_marked():
    shape = ModelShape(
        hidden_size=8, layer_pattern="*-*-", ffn_hidden_size=16, vocab_size=10, seq_length=4,
        num_attention_heads=2, num_query_groups=1, kv_channels=4, mlp_in_every_mixer_layer=False,
    )
    expected = 3 * (
        2 * attention_flops_per_token(8, 2, 1, 4, 4) + 2 * mlp_flops_per_token(8, 16, True) + 2 * 8 * 10
    )
    assert training_flops_per_token(shape) == pytest.approx(expected, rel=1e-12)


def test_mfu_and_peak_table():
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA B200") == 2250.0
    assert peak_tflops("cpu") is None
    # 1e9 FLOPs/token at 494.5e3 tokens/s on one 989 TFLOP/s GPU is exactly half the peak.
    assert mfu(1e9, 494.5e3, 989.0) == pytest.approx(0.5, rel=1e-12)
    assert mfu(1e9, 989e3, 989.0, num_gpus=2) == pytest.approx(0.5, rel=1e-12)
    calc = MfuCalculator.for_model(HYBRID_1P5B, 989.0)
    got = calc(20000.0)
    assert got["mfu"] == pytest.approx(training_flops_per_token(HYBRID_1P5B) * 20000.0 / 989e12, rel=1e-12)
    assert got["mfu_all_sdpa"] > got["mfu"]
    assert MfuCalculator.for_model(HYBRID_1P5B, None)(1.0) == {"mfu": None, "mfu_all_sdpa": None}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layer_pattern="GGX*"), "unknown symbols"),
        (dict(gdn_num_key_heads=0), "gdn_"),
    ],
)
def test_bad_shapes_raise_with_the_fix(kwargs, message):
    base = dict(
        hidden_size=8, layer_pattern="G*", ffn_hidden_size=16, vocab_size=10, seq_length=4, num_attention_heads=2,
        num_query_groups=1, kv_channels=4, gdn_num_key_heads=1, gdn_num_value_heads=1, gdn_key_head_dim=4,
        gdn_value_head_dim=4,
    )
    with pytest.raises(ValueError, match=message):
        ModelShape(**{**base, **kwargs})
    with pytest.raises(ValueError, match="multiple"):
        attention_flops_per_token(8, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="precision"):
        peak_tflops("H200", "int4")
