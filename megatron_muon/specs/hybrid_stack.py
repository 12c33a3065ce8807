"""Specs for megatron-core's HybridModel path (`--hybrid-layer-pattern`, pretrain_hybrid.py / pretrain_mamba.py).

There every pattern symbol is its own layer: "G" builds `gdn_layer`, "*" `attention_layer`, "-" `mlp_layer`. Our
"mixer + MLP" layer is therefore the pair "G-" / "*-"; `megatron_hybrid_pattern` writes that pattern.
megatron's HybridStack hard-codes a TE final norm, so the local variant uses `LocalNormHybridStack`.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_muon.specs.hybrid import DEFAULT_PATTERN, layer_symbols
from megatron_muon.specs.layer_specs import attention_mixer_spec, check_backend, gdn_mixer_spec, mlp_builder

MEGATRON_MLP_SYMBOL = "-"


class LocalNormHybridStack(HybridStack):
    """HybridStack whose final norm is megatron's torch norm, so the hybrid path also runs without TE."""

    def __init__(self, config, *args, post_layer_norm: bool = True, **kwargs):
        super().__init__(config, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(
                config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon
            )


def megatron_hybrid_pattern(num_layers: int, pattern: str = DEFAULT_PATTERN) -> str:
    """Our per-layer pattern as megatron's `--hybrid-layer-pattern`: each mixer followed by an MLP layer."""
    return "".join(symbol + MEGATRON_MLP_SYMBOL for symbol in layer_symbols(pattern, num_layers))


def _mixer_only_layer(mixer: ModuleSpec, te: bool) -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if te else WrappedTorchNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
        ),
    )


def hybrid_stack_spec(backend: str = "te", keep_gdn_chunk_states: bool = True) -> ModuleSpec:
    """A `hybrid_stack_spec` for HybridModel with our GDN in `gdn_layer` and cuDNN-pinned attention
    (`keep_gdn_chunk_states`: see `gdn_mixer_spec`)."""
    te = check_backend(backend) == "te"
    return ModuleSpec(
        module=HybridStack if te else LocalNormHybridStack,
        submodules=HybridStackSubmodules(
            gdn_layer=_mixer_only_layer(gdn_mixer_spec(backend, keep_gdn_chunk_states), te),
            attention_layer=_mixer_only_layer(attention_mixer_spec(backend), te),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=IdentityOp if te else WrappedTorchNorm,
                    mlp=mlp_builder(backend),
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
        ),
    )
