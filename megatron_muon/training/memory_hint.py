"""What a recipe can change when a training step runs out of device memory, the cheapest change first.

The loop attaches this to the out-of-memory error as a note, so the traceback names the keys to set."""

from __future__ import annotations

from megatron_muon.metrics.flops import GDN
from megatron_muon.training.config import Recipe
from megatron_muon.training.validation import full_layer_pattern


def kept_gdn_state_bytes(recipe: Recipe) -> int:
    """Bytes the GDN layers of one pipeline stage keep from each micro-batch's forward for its backward when
    `model.gdn_keep_chunk_states` is on: w, the per-chunk states h and the corrected values (bf16), the amount
    `chunk_gated_delta_rule` names. Zero for a model without GDN layers."""
    model, parallel = recipe.model, recipe.parallel
    gdn_layers = full_layer_pattern(recipe).count(GDN)
    if gdn_layers == 0:
        return 0
    stage_layers = -(-gdn_layers // parallel.pipeline_model_parallel_size)
    heads = model.gdn_num_value_heads // parallel.tensor_model_parallel_size
    chunks = -(-model.seq_length // model.gdn_chunk_size)
    key, value, tokens = model.gdn_key_head_dim, model.gdn_value_head_dim, model.seq_length
    per_layer = 2 * recipe.training.micro_batch_size * heads * (chunks * key * value + tokens * (key + value))
    return stage_layers * per_layer


def out_of_memory_hint(recipe: Recipe) -> str:
    """The recipe's levers on device memory, as `--set` keys with their current values."""
    train, parallel = recipe.training, recipe.parallel
    lines = [f"Out of device memory while training recipe '{recipe.name}'. What can change, cheapest first:"]
    kept = kept_gdn_state_bytes(recipe)
    if kept and recipe.model.gdn_keep_chunk_states:
        lines.append(
            f"- `--set model.gdn_keep_chunk_states=false`: each GDN layer's backward recomputes its chunk states "
            f"instead of keeping them from the forward ({kept / 2**30:.1f} GiB less per micro-batch in flight on "
            "this rank, for a slightly slower backward; recipe `hybrid-1.5b-h100` does this)."
        )
    lines += [
        "- `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the environment, where the error reports much memory "
        "reserved by PyTorch but unallocated (fragmentation).",
        *([f"- a smaller `training.micro_batch_size` (now {train.micro_batch_size}; `training.global_batch_size` "
           "stays, with more micro-batches per step)."] if train.micro_batch_size > 1 else []),
        f"- a shorter `model.seq_length` (now {recipe.model.seq_length}).",
        f"- more ranks per model copy: `parallel.tensor_model_parallel_size` (now "
        f"{parallel.tensor_model_parallel_size}) or `parallel.pipeline_model_parallel_size` (now "
        f"{parallel.pipeline_model_parallel_size}); or `parallel.use_distributed_optimizer=true` (now "
        f"{str(parallel.use_distributed_optimizer).lower()}) to shard the optimizer state over data-parallel ranks.",
    ]
    return "\n".join(lines)
