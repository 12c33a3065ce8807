"""Hybrid decoder specs from a layer pattern such as "GGG*" (G = Gated DeltaNet, * = softmax attention).

The pattern repeats over the model's layers; every layer is mixer + MLP. Two ways in:
- `hybrid_block_spec(config, pattern, backend)`: a TransformerBlockSubmodules holding this pipeline stage's layers
  (what `build_hybrid_model` uses, and what a GPTModel accepts as `transformer_layer_spec`).
- `hybrid_pattern_layer_spec(pattern, backend)`: one ModuleSpec that megatron fans out to every layer, each one
  picking its type from its global layer number. This is the form `--spec <module> <name>` needs, because
  Megatron-LM's `import_module` hands the named object itself to GPTModel without calling it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from megatron_muon.layers.attention import TE_INSTALL_HINT
from megatron_muon.specs.layer_specs import (
    ATTENTION_SYMBOL,
    GDN_SYMBOL,
    MIXER_SYMBOLS,
    check_backend,
    final_norm,
    hybrid_layer_spec,
)

DEFAULT_PATTERN = GDN_SYMBOL * 3 + ATTENTION_SYMBOL  # "GGG*": three GDN layers, then one attention layer


def check_pattern(pattern: str) -> str:
    """A non-empty string over {G, *}."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty string over {MIXER_SYMBOLS}, e.g. 'GGG*', got {pattern!r}")
    unknown = sorted(set(pattern) - set(MIXER_SYMBOLS))
    if unknown:
        raise ValueError(
            f"pattern {pattern!r} has unknown symbols {unknown}; use 'G' (Gated DeltaNet) and '*' (attention), "
            f"one symbol per layer, e.g. 'GGG*'."
        )
    return pattern


def layer_symbols(pattern: str, num_layers: int) -> list[str]:
    """Layer i (0-based, global) gets pattern[i % len(pattern)]."""
    check_pattern(pattern)
    if len(pattern) > num_layers:
        raise ValueError(f"pattern {pattern!r} has more symbols than the model has layers ({num_layers}).")
    return [pattern[i % len(pattern)] for i in range(num_layers)]


def pattern_from_linear_attention_freq(freq, num_layers: int) -> str:
    """Megatron's `linear_attention_freq` (int N: every N-th layer is attention; list: 1 = GDN, 0 = attention)."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return "".join(ATTENTION_SYMBOL if (i + 1) % freq == 0 else GDN_SYMBOL for i in range(num_layers))
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and set(freq) <= {0, 1}:
        return "".join(GDN_SYMBOL if flag else ATTENTION_SYMBOL for flag in freq)
    raise ValueError(
        f"linear_attention_freq must be a positive int or a list of {num_layers} zeros/ones, got {freq!r}."
    )


def resolve_pattern(config, pattern: str) -> str:
    """`config.linear_attention_freq` (the `--linear-attention-freq` flag), when set, overrides the spec pattern."""
    freq = getattr(config, "linear_attention_freq", None)
    return check_pattern(pattern) if freq is None else pattern_from_linear_attention_freq(freq, config.num_layers)


def use_per_layer_checkpoint_keys(config, symbols) -> None:
    """Mixed layer types have different parameters, so megatron cannot stack them into one [num_layers, ...]
    tensor per name: switch its block checkpoint to per-layer keys ("layers.<i>.…", as it does itself for
    `linear_attention_freq`)."""
    if len(set(symbols)) > 1:
        config.hetereogenous_dist_checkpoint = True


def stage_layer_ids(config, vp_stage=None, pp_rank=None) -> list[int]:
    """Global 0-based ids of the layers this pipeline stage builds (megatron's own offset rules)."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType

        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))


def hybrid_block_spec(
    config, pattern: str = DEFAULT_PATTERN, backend: str = "local", vp_stage=None, pp_rank=None,
    qk_layernorm: bool = False, keep_gdn_chunk_states: bool = True,
) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs for `pattern`, plus the final norm."""
    symbols = layer_symbols(resolve_pattern(config, pattern), config.num_layers)
    use_per_layer_checkpoint_keys(config, symbols)
    by_symbol = {symbol: hybrid_layer_spec(symbol, backend, qk_layernorm, keep_gdn_chunk_states)
                 for symbol in set(symbols)}
    layer_specs = [by_symbol[symbols[i]] for i in stage_layer_ids(config, vp_stage, pp_rank)]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=final_norm(backend))


@dataclass
class HybridPatternSubmodules:
    """The pattern and one full layer spec per symbol."""

    pattern: str = DEFAULT_PATTERN
    layer_specs: dict = field(default_factory=dict)
    backend: str = "local"


class HybridPatternLayer(BaseTransformerLayer):
    """Spec target that becomes the right layer for its position: `__new__` builds and returns the layer of the
    pattern's type (the same factory idiom as megatron's `TENorm`), so no instance of this class ever exists."""

    def __new__(cls, config, submodules: HybridPatternSubmodules, layer_number: int = 1, vp_stage=None,
                pg_collection=None, **layer_kwargs):
        if submodules.backend == "te" and not HAVE_TE:
            raise ImportError(TE_INSTALL_HINT)
        pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None else None
        global_index = layer_number - 1 + get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        symbols = layer_symbols(resolve_pattern(config, submodules.pattern), config.num_layers)
        use_per_layer_checkpoint_keys(config, symbols)  # read later by TransformerBlock.sharded_state_dict
        symbol = symbols[global_index]
        return build_module(
            submodules.layer_specs[symbol], config=config, layer_number=layer_number, vp_stage=vp_stage,
            pg_collection=pg_collection, **layer_kwargs,
        )


def hybrid_pattern_layer_spec(pattern: str = DEFAULT_PATTERN, backend: str = "local",
                              qk_layernorm: bool = False, keep_gdn_chunk_states: bool = True) -> ModuleSpec:
    """One spec for every layer of a GPTModel (the `--spec` form); see the module docstring
    (`keep_gdn_chunk_states`: see `gdn_mixer_spec`)."""
    check_backend(backend)
    return ModuleSpec(
        module=HybridPatternLayer,
        submodules=HybridPatternSubmodules(
            pattern=check_pattern(pattern),
            layer_specs={symbol: hybrid_layer_spec(symbol, backend, qk_layernorm, keep_gdn_chunk_states)
                         for symbol in MIXER_SYMBOLS},
            backend=backend,
        ),
    )
