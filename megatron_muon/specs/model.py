"""`build_hybrid_model`: a megatron-core GPTModel whose decoder follows a hybrid pattern.

Why GPTModel and not HybridModel (both exist in megatron-core 0.19.2): in GPTModel each TransformerLayer holds a
mixer *and* its MLP, which is exactly our layer; its block takes per-layer specs with per-stage slicing (PP, VPP,
custom layouts), RoPE, MTP and tied embeddings work as for any GPT, and its final norm comes from the spec, so the
local backend runs without Transformer Engine. HybridModel treats every MLP as a separate layer and hard-codes
TE's final norm. Both paths are available: see `specs.hybrid_stack` for HybridModel.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.transformer.enums import AttnBackend

from megatron_muon.layers.attention import TE_INSTALL_HINT
from megatron_muon.layers.gdn_config import gdn_shape_from_config
from megatron_muon.specs.hybrid import DEFAULT_PATTERN, hybrid_block_spec, layer_symbols, resolve_pattern
from megatron_muon.specs.layer_specs import GDN_SYMBOL, check_backend


def build_hybrid_model(
    config,
    pattern: str = DEFAULT_PATTERN,
    vocab_size: int = 32000,
    max_seq_len: int = 4096,
    backend: str = "local",
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    pg_collection=None,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = False,
    keep_gdn_chunk_states: bool = True,
    **gpt_kwargs,
):
    """Build this rank's pipeline stage of a hybrid GPTModel (GDN + attention layers, each followed by an MLP).

    `config` is a megatron TransformerConfig with the `linear_*` GDN sizes set; megatron's parallel state must be
    initialized. `pattern` repeats over `config.num_layers` ("GGG*" = 3 GDN : 1 attention). backend="te" pins
    attention to TE's fused (cuDNN) backend and needs Transformer Engine; "local" needs only torch (SDPA cuDNN on
    GPU, math on CPU). `keep_gdn_chunk_states=False` has every GDN layer's backward recompute its chunk states
    instead of keeping them from the forward: less activation memory for a slower backward.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    check_backend(backend)
    if backend == "te" and not HAVE_TE:
        raise ImportError(TE_INSTALL_HINT)
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "build_hybrid_model needs megatron's parallel state: call "
            "megatron.core.parallel_state.initialize_model_parallel(...) first."
        )
    symbols = layer_symbols(resolve_pattern(config, pattern), config.num_layers)
    if GDN_SYMBOL in symbols:
        gdn_shape_from_config(config, parallel_state.get_tensor_model_parallel_world_size(),
                              parallel_state.get_context_parallel_world_size())
    if backend == "te" and config.attention_backend == AttnBackend.auto:
        config.attention_backend = AttnBackend.fused  # set before GPTModel exports it to TE's environment
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    block_spec = hybrid_block_spec(config, pattern, backend, vp_stage=vp_stage, pp_rank=pp_rank,
                                   keep_gdn_chunk_states=keep_gdn_chunk_states)
    if pg_collection is not None:
        gpt_kwargs["pg_collection"] = pg_collection
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        vp_stage=vp_stage,
        **gpt_kwargs,
    )
