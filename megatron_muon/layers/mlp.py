"""megatron's dense MLP with its SwiGLU computed on pieces of the fc1 output, so torch.compile writes each piece's
gradient straight into its slice (see `gradient_pieces`).

megatron computes SwiGLU from `torch.chunk(fc1_output, 2)` (or `bias_swiglu_impl`, whose backward is
`torch.cat((dgate, dup), -1)`): under torch.compile the gradient of those two halves is a two-input cat that Inductor
lowers as one kernel evaluating both halves' backward for every element (measured: docs/design/gdn_kernels.md).
Here each half is cut at the same >= MIN_GRADIENT_PIECES points: the forward concatenates >= 9 products and the
backward >= 18 gradient pieces, both as per-piece kernels. Same math, element by element.

The hook is an MLP subclass rather than megatron's `MLPSubmodules(activation_func=...)`: that builder is only used
under the global `config.use_te_activation_func`, which also switches MoE and shared experts and megatron's own
layer specs to Transformer Engine's activation ops (and, without an activation module, makes them apply plain silu
to the whole gated fc1 output), and which megatron refuses together with `bias_activation_fusion`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from megatron_muon.layers.gradient_pieces import MIN_GRADIENT_PIECES, split_sizes


def swiglu_in_pieces(fc1_output: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fc1_output = [..., gate | up], the same values as megatron's SwiGLU, computed piece by
    piece: `gate` and `up` are cut at the same >= MIN_GRADIENT_PIECES points."""
    width = fc1_output.shape[-1] // 2
    assert 2 * width == fc1_output.shape[-1], "a gated fc1 output has an even last dimension: gate | up"
    sizes = split_sizes(width, MIN_GRADIENT_PIECES)
    pieces = torch.split(fc1_output, sizes + sizes, dim=-1)
    gates, ups = pieces[: len(sizes)], pieces[len(sizes):]
    return torch.cat([F.silu(gate) * up for gate, up in zip(gates, ups)], dim=-1)


def is_plain_swiglu(config) -> bool:
    """SwiGLU with none of the variants megatron's MLP adds (clamping, an offset on the linear half, FP8 or
    CPU-offloaded activation inputs, TE activation ops); those keep megatron's own code path."""
    offloads_activation_input = (
        config.bias_activation_fusion and config.cpu_offloading and config.cpu_offloading_activations
    )
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and config.activation_func_clamp_value is None
        and config.glu_linear_offset == 0.0
        and not config.activation_func_fp8_input_store
        and not config.use_te_activation_func
        and not offloads_activation_input
    )


class PiecewiseSwiGLUMLP(MLP):
    """megatron's MLP (same parameters, checkpoint and math) whose SwiGLU runs as `swiglu_in_pieces`; any other
    activation, and the expert path with per-token scales, runs megatron's forward unchanged."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.swiglu_in_pieces = is_plain_swiglu(config)

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        if not self.swiglu_in_pieces or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu_in_pieces(intermediate))
