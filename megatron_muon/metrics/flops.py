"""Model FLOPs per token for dense GPT and GDN-hybrid decoders (forward + backward, no recompute).

Conventions (chosen so MFU is comparable across runs and with Megatron-LM's own accounting):
- Only matrix-multiply-like work is counted (2 FLOPs per multiply-add); norms, activations, gates, rotary
  embeddings, softmax and the loss are left out, as in Megatron-LM and the PaLM MFU definition.
- Backward = 2 x forward, so training FLOPs = 3 x forward. Activation recompute is *not* counted: MFU is
  "model" FLOPs utilisation, not hardware FLOPs.
- Causal softmax attention counts half of the T x T score matrix (seq_len / 2 keys per query), like
  Megatron-LM's `num_floating_point_operations`.
- The chunked gated delta rule is counted as its kernels compute it (chunk size C, full C x C tiles):
  K Kᵀ, the triangular solve (C³/3), W and U, the state terms (three K x V products per chunk) and the
  intra-chunk Q Kᵀ and attention-times-values products. See `gdn_recurrence_flops_per_token`.
- Embedding lookups cost nothing; the LM head is one hidden x vocab matmul (tied or not).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FORWARD_BACKWARD_FACTOR = 3  # forward + backward (2 x forward) without recompute

ATTENTION = "*"
GDN = "G"
MLP = "-"
LAYER_SYMBOLS = {ATTENTION: "softmax attention", GDN: "gated deltanet", MLP: "MLP only"}


def linear_flops_per_token(in_features: int, out_features: int) -> int:
    """Forward FLOPs of one dense projection for one token."""
    return 2 * in_features * out_features


def mlp_flops_per_token(hidden_size: int, ffn_hidden_size: int, gated: bool) -> int:
    """Forward FLOPs of the MLP: fc1 (2 x ffn wide when gated, e.g. SwiGLU) then fc2."""
    fc1_out = 2 * ffn_hidden_size if gated else ffn_hidden_size
    return linear_flops_per_token(hidden_size, fc1_out) + linear_flops_per_token(ffn_hidden_size, hidden_size)


def attention_flops_per_token(
    hidden_size: int, num_heads: int, num_query_groups: int, head_dim: int, seq_len: int, causal: bool = True
) -> float:
    """Forward FLOPs of softmax attention (GQA) for one token: QKV, scores, scores x V, output projection."""
    if num_heads % num_query_groups:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_query_groups ({num_query_groups}); "
            "pick a group count that divides the head count."
        )
    q_size = num_heads * head_dim
    kv_size = num_query_groups * head_dim
    qkv = linear_flops_per_token(hidden_size, q_size + 2 * kv_size)
    keys_per_query = seq_len / 2 if causal else seq_len
    scores_and_values = 2 * (2 * q_size * keys_per_query)  # Q Kᵀ and P V, each 2 * q_size per key
    out = linear_flops_per_token(q_size, hidden_size)
    return qkv + scores_and_values + out


def gdn_recurrence_flops_per_token(num_heads: int, key_dim: int, value_dim: int, chunk_size: int) -> float:
    """Forward FLOPs of the chunked gated delta rule for one token, summed over (value) heads.

    Per chunk of C tokens and head (K = key_dim, V = value_dim):
      K Kᵀ 2C²K · (I + A)⁻¹ C³/3 · W = A·K 2C²K · U = A·V 2C²V ·
      V_new = U − W·S 2CKV · S += Kᵀ V_new 2CKV · O = Q·S 2CKV + (Q Kᵀ) V_new 2C²K + 2C²V.
    Divided by C: 6CK + 4CV + C²/3 + 6KV per token.
    """
    c, k, v = chunk_size, key_dim, value_dim
    per_head = 6 * c * k + 4 * c * v + c * c / 3 + 6 * k * v
    return num_heads * per_head


def gdn_flops_per_token(
    hidden_size: int,
    num_key_heads: int,
    num_value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
    conv_kernel: int,
    chunk_size: int,
) -> float:
    """Forward FLOPs of one Gated DeltaNet mixer for one token.

    in_proj makes q, k, v, the output gate z, and per-head beta and alpha; a depthwise causal conv runs over the
    q, k, v channels; the recurrence runs per value head (keys are shared across value heads as in GQA).
    """
    if num_value_heads % num_key_heads:
        raise ValueError(
            f"num_value_heads ({num_value_heads}) must be a multiple of num_key_heads ({num_key_heads}); "
            "pick key heads that divide the value heads."
        )
    qk_size = num_key_heads * key_head_dim
    v_size = num_value_heads * value_head_dim
    in_proj = linear_flops_per_token(hidden_size, 2 * qk_size + 2 * v_size + 2 * num_value_heads)
    conv = 2 * (2 * qk_size + v_size) * conv_kernel
    recurrence = gdn_recurrence_flops_per_token(num_value_heads, key_head_dim, value_head_dim, chunk_size)
    out_proj = linear_flops_per_token(v_size, hidden_size)
    return in_proj + conv + recurrence + out_proj


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder's FLOPs; independent of Megatron so the metrics stay standalone.

    `layer_pattern` has one symbol per layer: '*' softmax attention, 'G' gated deltanet, '-' MLP only.
    With `mlp_in_every_mixer_layer` (our specs: each layer = mixer + MLP) every '*'/'G' layer also carries an
    MLP; without it (Megatron HybridModel style, e.g. "G-G-G-*-") only '-' layers do.
    """

    hidden_size: int
    layer_pattern: str
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    gated_mlp: bool = True
    mlp_in_every_mixer_layer: bool = True
    gdn_num_key_heads: int = 0
    gdn_num_value_heads: int = 0
    gdn_key_head_dim: int = 0
    gdn_value_head_dim: int = 0
    gdn_conv_kernel: int = 4
    gdn_chunk_size: int = 64

    def __post_init__(self):
        unknown = sorted(set(self.layer_pattern) - set(LAYER_SYMBOLS))
        if unknown:
            raise ValueError(
                f"layer_pattern {self.layer_pattern!r} has unknown symbols {unknown}; use "
                + ", ".join(f"'{s}' ({name})" for s, name in LAYER_SYMBOLS.items())
                + "."
            )
        if GDN in self.layer_pattern and min(
            self.gdn_num_key_heads, self.gdn_num_value_heads, self.gdn_key_head_dim, self.gdn_value_head_dim
        ) <= 0:
            raise ValueError("layer_pattern has GDN layers ('G'); set the gdn_* head counts and head dims (> 0).")

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    def all_attention(self) -> "ModelShape":
        """The same model with every mixer softmax attention (for the all-SDPA-equivalent MFU)."""
        return replace(self, layer_pattern=self.layer_pattern.replace(GDN, ATTENTION))


def flops_breakdown_per_token(shape: ModelShape) -> dict[str, float]:
    """Training FLOPs per token (forward + backward) split by component; the values sum to the total."""
    attention = attention_flops_per_token(
        shape.hidden_size, shape.num_attention_heads, shape.num_query_groups, shape.kv_channels, shape.seq_length
    )
    mlp = mlp_flops_per_token(shape.hidden_size, shape.ffn_hidden_size, shape.gated_mlp)
    n_attention = shape.layer_pattern.count(ATTENTION)
    n_gdn = shape.layer_pattern.count(GDN)
    n_mlp = shape.layer_pattern.count(MLP) + (n_attention + n_gdn if shape.mlp_in_every_mixer_layer else 0)
    gdn = 0.0
    if n_gdn:
        gdn = gdn_flops_per_token(
            shape.hidden_size,
            shape.gdn_num_key_heads,
            shape.gdn_num_value_heads,
            shape.gdn_key_head_dim,
            shape.gdn_value_head_dim,
            shape.gdn_conv_kernel,
            shape.gdn_chunk_size,
        )
    forward = {
        "attention": n_attention * attention,
        "gdn": n_gdn * gdn,
        "mlp": n_mlp * mlp,
        "lm_head": linear_flops_per_token(shape.hidden_size, shape.vocab_size),
    }
    return {name: FORWARD_BACKWARD_FACTOR * value for name, value in forward.items()}


def training_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token (forward + backward, no recompute)."""
    return sum(flops_breakdown_per_token(shape).values())


def all_attention_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token of the same model with every mixer softmax attention."""
    return training_flops_per_token(shape.all_attention())


def parameter_count(shape: ModelShape) -> int:
    """Weights of the model's matrices and embeddings (input embedding and output layer untied; norms, biases and
    conv kernels left out): what sizes the optimizer state and gradient buffers."""
    h = shape.hidden_size
    q, kv = shape.num_attention_heads * shape.kv_channels, shape.num_query_groups * shape.kv_channels
    attention = h * (q + 2 * kv) + q * h
    key = shape.gdn_num_key_heads * shape.gdn_key_head_dim
    value = shape.gdn_num_value_heads * shape.gdn_value_head_dim
    gdn = h * (2 * key + 2 * value + 2 * shape.gdn_num_value_heads) + value * h
    mlp = h * shape.ffn_hidden_size * (3 if shape.gated_mlp else 2)
    n_attention, n_gdn = shape.layer_pattern.count(ATTENTION), shape.layer_pattern.count(GDN)
    n_mlp = shape.layer_pattern.count(MLP) + (n_attention + n_gdn if shape.mlp_in_every_mixer_layer else 0)
    return n_attention * attention + n_gdn * gdn + n_mlp * mlp + 2 * shape.vocab_size * h
