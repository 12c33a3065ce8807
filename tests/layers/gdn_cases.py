"""Tiny GDN configs and layers for layer/spec tests (run inside rank-pool workers)."""

from __future__ import annotations

import torch

GDN_SIZES = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # 2 value heads per key head: exercises the grouped (GVA) mapping
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
SEQ_LEN = 70  # crosses the 64-token chunk boundary and is not a multiple of it


def gdn_config(**overrides):
    from megatron_muon.testing.models import tiny_transformer_config

    settings = dict(GDN_SIZES)
    settings.update(overrides)
    return tiny_transformer_config(**settings)


def build_gdn_layer(config, seed: int = 1234):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_muon.specs import gdn_mixer_spec

    torch.manual_seed(seed)
    return build_module(
        gdn_mixer_spec("local"), config=config, layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def tp_slice(name: str, full: torch.Tensor, shape, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of a tp=1 parameter, written out independently of the layer's own sharding code."""
    if name in ("in_proj.weight", "conv1d.weight"):
        sections = shape.in_proj_sections if name == "in_proj.weight" else shape.conv_sections
        parts, start = [], 0
        for size in sections:
            step = size // tp
            parts.append(full[start + rank * step: start + (rank + 1) * step])
            start += size
        return torch.cat(parts)
    if name in ("A_log", "dt_bias"):
        return full.chunk(tp)[rank]
    if name == "out_proj.weight":
        return full.chunk(tp, dim=1)[rank]
    if name == "out_norm.weight":
        return full
    raise KeyError(name)
