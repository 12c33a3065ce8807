"""Muon for single-process use and for Megatron: MegaBatch updates, fused-projection splits, routing helpers."""

from megatron_muon.optimizer.muon import Muon
from megatron_muon.optimizer.routing import (
    MatrixLayout,
    is_muon_param,
    matrix_layout,
    split_params_for_muon,
    tag_fused_in_proj,
)

__all__ = ["Muon", "MatrixLayout", "is_muon_param", "matrix_layout", "split_params_for_muon", "tag_fused_in_proj"]
