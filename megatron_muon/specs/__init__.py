"""Hybrid GDN + attention decoder specs for megatron-core (pattern "GGG*" = 3 GDN : 1 attention, each + MLP).

Python: `build_hybrid_model(config, pattern, vocab_size, max_seq_len, backend="local" | "te")`.
Megatron-LM, GPT path (one layer = mixer + MLP):
    pretrain_gpt.py --spec megatron_muon.specs gdn_hybrid_te ...    (or gdn_hybrid_local)
  `--spec` hands the named object to GPTModel without calling it, so these names are specs, not functions; the
  pattern is "GGG*" unless `--linear-attention-freq N` is given. For another pattern, put
  `my_spec = hybrid_pattern_layer_spec("GG*", "te")` in your own module and pass `--spec your.module my_spec`;
  `keep_gdn_chunk_states=False` there (or in `hybrid_stack_spec`) has the GDN backward recompute its chunk states
  instead of keeping them (less memory, a slower backward: the hybrid-1.5B at 16k on an 80 GB card).
Megatron-LM, HybridModel path (one symbol per layer, MLP separate):
    pretrain_hybrid.py --spec megatron_muon.specs gdn_hybrid_stack_te --hybrid-layer-pattern "G-G-G-*-..."
  (`megatron_hybrid_pattern(num_layers)` writes that pattern string).
"""

from megatron_muon.specs.hybrid import (
    DEFAULT_PATTERN,
    HybridPatternLayer,
    check_pattern,
    hybrid_block_spec,
    hybrid_pattern_layer_spec,
    layer_symbols,
    pattern_from_linear_attention_freq,
)
from megatron_muon.specs.hybrid_stack import LocalNormHybridStack, hybrid_stack_spec, megatron_hybrid_pattern
from megatron_muon.specs.layer_specs import (
    attention_mixer_spec,
    gdn_mixer_spec,
    hybrid_layer_spec,
    with_piecewise_swiglu,
)
from megatron_muon.specs.model import build_hybrid_model

gdn_hybrid_local = hybrid_pattern_layer_spec(DEFAULT_PATTERN, backend="local")
gdn_hybrid_te = hybrid_pattern_layer_spec(DEFAULT_PATTERN, backend="te")
gdn_hybrid_stack_local = hybrid_stack_spec(backend="local")
gdn_hybrid_stack_te = hybrid_stack_spec(backend="te")

__all__ = [
    "DEFAULT_PATTERN",
    "HybridPatternLayer",
    "LocalNormHybridStack",
    "attention_mixer_spec",
    "build_hybrid_model",
    "check_pattern",
    "gdn_hybrid_local",
    "gdn_hybrid_stack_local",
    "gdn_hybrid_stack_te",
    "gdn_hybrid_te",
    "gdn_mixer_spec",
    "hybrid_block_spec",
    "hybrid_layer_spec",
    "hybrid_pattern_layer_spec",
    "hybrid_stack_spec",
    "layer_symbols",
    "megatron_hybrid_pattern",
    "pattern_from_linear_attention_freq",
    "with_piecewise_swiglu",
]
