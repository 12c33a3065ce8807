"""The out-of-memory note: the GDN states it offers to drop are the tensors the op keeps, and it names only levers
the recipe still has."""

import math

from megatron_muon.ops.fla_backend import chunk_states_shape
from megatron_muon.training.memory_hint import kept_gdn_state_bytes, out_of_memory_hint
from megatron_muon.training.recipes import load_recipe


def _kept_by_the_op(batch, seq_len, value_heads, key_dim, value_dim) -> int:
    """bf16 bytes of what the GDN forward returns for its backward with its states kept: w [B, T, HV, K], the per-chunk
    states and v_new [B, T, HV, V] (`ops/gdn.py`'s fake kernel)."""
    states = chunk_states_shape(batch, seq_len, value_heads, key_dim, value_dim)
    shapes = [(batch, seq_len, value_heads, key_dim), states, (batch, seq_len, value_heads, value_dim)]
    return 2 * sum(math.prod(shape) for shape in shapes)


def test_kept_bytes_are_the_ops_kept_tensors_over_this_stages_gdn_layers():
    recipe = load_recipe("hybrid-1.5b-h200")
    m = recipe.model
    per_layer = _kept_by_the_op(1, m.seq_length, m.gdn_num_value_heads, m.gdn_key_head_dim, m.gdn_value_head_dim)
    assert kept_gdn_state_bytes(recipe) == 18 * per_layer  # GGG* over 24 layers
    multinode = load_recipe("hybrid-1.5b-multinode")  # tp2 x pp2: half the heads, half the layers per rank
    assert multinode.parallel.tensor_model_parallel_size == multinode.parallel.pipeline_model_parallel_size == 2
    heads = m.gdn_num_value_heads // 2
    assert kept_gdn_state_bytes(multinode) == 9 * _kept_by_the_op(1, m.seq_length, heads, m.gdn_key_head_dim,
                                                                   m.gdn_value_head_dim)
    tiny = load_recipe("tiny-cpu", ["model.seq_length=100", "training.micro_batch_size=2",
                                    "training.global_batch_size=2"])
    t = tiny.model
    assert kept_gdn_state_bytes(tiny) == 3 * _kept_by_the_op(2, 100, t.gdn_num_value_heads, t.gdn_key_head_dim,
                                                              t.gdn_value_head_dim)  # a partial last chunk
    assert kept_gdn_state_bytes(load_recipe("gpt-7b-h200")) == 0


def test_hint_offers_the_gdn_states_only_where_they_are_kept_and_a_smaller_micro_batch_only_above_one():
    kept = out_of_memory_hint(load_recipe("hybrid-1.5b-h200"))
    assert "--set model.gdn_keep_chunk_states=false" in kept and "9.3 GiB less" in kept
    assert "micro_batch_size" not in kept and "model.seq_length` (now 16384)" in kept
    assert "gdn_keep_chunk_states" not in out_of_memory_hint(load_recipe("hybrid-1.5b-h100"))
    gpt = out_of_memory_hint(load_recipe("gpt-7b-h200"))
    assert "gdn_keep_chunk_states" not in gpt and "expandable_segments:True" in gpt
    batched = out_of_memory_hint(load_recipe("tiny-cpu", ["training.micro_batch_size=4",
                                                          "training.global_batch_size=4"]))
    assert "`training.micro_batch_size` (now 4;" in batched
