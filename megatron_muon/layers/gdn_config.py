"""GDN sizes read from megatron's TransformerConfig (its `linear_*` fields), checked once with messages that say
what to change."""

from __future__ import annotations

from dataclasses import dataclass

GDN_CONFIG_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """Global (unsharded) GDN sizes; per-rank sizes are these divided by the TP size."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def qk_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.qk_dim + self.v_dim

    @property
    def conv_sections(self) -> tuple[int, int, int]:
        return (self.qk_dim, self.qk_dim, self.v_dim)

    @property
    def in_proj_sections(self) -> tuple[int, ...]:
        """q, k, v, z (output gate), beta (write strength), alpha (decay), in megatron's order."""
        return (self.qk_dim, self.qk_dim, self.v_dim, self.v_dim, self.num_value_heads, self.num_value_heads)

    @property
    def in_proj_dim(self) -> int:
        return sum(self.in_proj_sections)


def gdn_shape_from_config(config, tp_size: int = 1, cp_size: int = 1) -> GatedDeltaNetShape:
    """Validate the GDN part of a TransformerConfig for this parallel layout and return its sizes."""
    missing = [name for name in GDN_CONFIG_FIELDS if getattr(config, name, None) is None]
    if missing:
        raise ValueError(f"GatedDeltaNet needs TransformerConfig fields {missing} set (positive integers).")
    values = {name: getattr(config, name) for name in GDN_CONFIG_FIELDS}
    bad = {name: value for name, value in values.items() if not isinstance(value, int) or value < 1}
    if bad:
        raise ValueError(f"GatedDeltaNet sizes must be positive integers, got {bad}.")
    shape = GatedDeltaNetShape(
        num_key_heads=values["linear_num_key_heads"],
        num_value_heads=values["linear_num_value_heads"],
        key_head_dim=values["linear_key_head_dim"],
        value_head_dim=values["linear_value_head_dim"],
        conv_kernel=values["linear_conv_kernel_dim"],
    )
    if shape.num_value_heads % shape.num_key_heads:
        raise ValueError(
            f"linear_num_value_heads ({shape.num_value_heads}) must be a multiple of linear_num_key_heads "
            f"({shape.num_key_heads}): each key head serves a group of value heads."
        )
    for name, heads in (("linear_num_key_heads", shape.num_key_heads), ("linear_num_value_heads",
                                                                         shape.num_value_heads)):
        if heads % tp_size:
            raise ValueError(
                f"{name} ({heads}) must be divisible by the tensor-parallel size ({tp_size}); pick a TP size that "
                f"divides it or change the head count."
            )
    if cp_size != 1:
        raise ValueError(
            f"megatron_muon's GatedDeltaNet does not support context parallelism (context_parallel_size="
            f"{cp_size}); set context_parallel_size=1 or use megatron-core's GatedDeltaNet."
        )
    if getattr(config, "context_parallel_size", 1) != 1:
        raise ValueError(
            f"megatron_muon's GatedDeltaNet does not support context parallelism (context_parallel_size="
            f"{config.context_parallel_size}); set it to 1."
        )
    return shape
