"""ModuleSpecs for one hybrid decoder layer (mixer + MLP), for the local and Transformer Engine backends.

A layer is megatron's `TransformerLayer`: pre-norm, a token mixer (GDN or softmax attention), pre-norm, SwiGLU/GeLU
MLP (megatron's MLP, SwiGLU computed in pieces: `layers.mlp.PiecewiseSwiGLUMLP`). The TE backend fuses each pre-norm
into the following column-parallel linear (TELayerNormColumnParallelLinear); the local backend keeps them separate
and maps their checkpoint keys onto the TE names, so checkpoints move between backends.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from megatron.core.extensions.transformer_engine import (
    TELayerNormColumnParallelLinear,
    TENorm,
    TERowParallelLinear,
)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_muon.layers.attention import SDPADotProductAttention, TEFusedDotProductAttention
from megatron_muon.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron_muon.layers.linear import CompilableRowParallelLinear
from megatron_muon.layers.mlp import PiecewiseSwiGLUMLP

BACKENDS = ("local", "te")
GDN_SYMBOL = "G"
ATTENTION_SYMBOL = "*"
MIXER_SYMBOLS = (GDN_SYMBOL, ATTENTION_SYMBOL)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def mlp_builder(backend: str):
    """Megatron's dense MLP with the backend's linears (fc1 carries the fused pre-norm under TE); a SwiGLU config
    computes its activation in pieces (PiecewiseSwiGLUMLP), any other activation runs megatron's MLP as is."""
    fc1 = TELayerNormColumnParallelLinear if check_backend(backend) == "te" else ColumnParallelLinear
    fc2 = TERowParallelLinear if backend == "te" else CompilableRowParallelLinear
    return partial(PiecewiseSwiGLUMLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2))


def with_piecewise_swiglu(layer_spec: ModuleSpec) -> ModuleSpec:
    """A megatron GPT layer spec (e.g. `get_gpt_layer_local_spec()`) whose dense MLP is PiecewiseSwiGLUMLP, same
    submodules; specs with another MLP (MoE, TE's op-fused MLP) come back unchanged."""
    mlp = getattr(layer_spec.submodules, "mlp", None)
    if not (isinstance(mlp, partial) and mlp.func == MLP.as_mlp_submodule):
        return layer_spec
    swapped = partial(PiecewiseSwiGLUMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=swapped))


def gdn_mixer_spec(backend: str, keep_chunk_states: bool = True) -> ModuleSpec:
    """Our GatedDeltaNet; under TE its in_proj also applies the layer's input norm. `keep_chunk_states=False` makes
    the backward recompute the chunk states instead of keeping them from the forward (less memory, more time)."""
    te = check_backend(backend) == "te"
    return ModuleSpec(
        module=GatedDeltaNet,
        params={"keep_chunk_states": keep_chunk_states},
        submodules=GatedDeltaNetSubmodules(
            in_proj=TELayerNormColumnParallelLinear if te else ColumnParallelLinear,
            out_proj=TERowParallelLinear if te else CompilableRowParallelLinear,
        ),
    )


def attention_mixer_spec(backend: str, qk_layernorm: bool = False) -> ModuleSpec:
    """Causal self-attention; TE: TEDotProductAttention pinned to fused/cuDNN; local: SDPA pinned to cuDNN."""
    te = check_backend(backend) == "te"
    qk_norm = (TENorm if te else WrappedTorchNorm) if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=TELayerNormColumnParallelLinear if te else ColumnParallelLinear,
            core_attention=TEFusedDotProductAttention if te else SDPADotProductAttention,
            linear_proj=TERowParallelLinear if te else CompilableRowParallelLinear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def hybrid_layer_spec(symbol: str, backend: str = "local", qk_layernorm: bool = False,
                      keep_gdn_chunk_states: bool = True) -> ModuleSpec:
    """One decoder layer: the mixer named by `symbol` ("G" GDN, "*" attention) followed by the dense MLP."""
    if symbol not in MIXER_SYMBOLS:
        raise ValueError(f"layer symbol must be one of {MIXER_SYMBOLS} (G = GDN, * = attention), got {symbol!r}")
    te = check_backend(backend) == "te"
    if symbol == GDN_SYMBOL:
        mixer = gdn_mixer_spec(backend, keep_gdn_chunk_states)
    else:
        mixer = attention_mixer_spec(backend, qk_layernorm)
    fused_norm_owner = "self_attention.in_proj" if symbol == GDN_SYMBOL else "self_attention.linear_qkv"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if te else WrappedTorchNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if te else WrappedTorchNorm,
            mlp=mlp_builder(backend),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={} if te else {
                "input_layernorm.": f"{fused_norm_owner}.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def final_norm(backend: str):
    """The norm after the last layer."""
    return TENorm if check_backend(backend) == "te" else WrappedTorchNorm
