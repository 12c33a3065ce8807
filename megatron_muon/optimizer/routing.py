"""Which parameters Muon updates, and how each parameter tensor maps to the matrices it orthogonalizes.

A parameter becomes one or more *pieces*: views [experts, groups, section, cols] whose matrices are
[groups·section, cols]. A plain weight is one piece with one expert and one group; megatron's fused QKV is one
piece per q/k/v part with one group per query group; a GDN in_proj is one piece per q/k/v/z/beta/alpha section;
an expert stack [E, m, n] (or E row blocks of a 2-D weight) contributes E matrices per piece. With heads split
(`split_heads`), a section made of whole heads contributes one [head rows, cols] matrix per head instead: the same
elements in the same order, cut into more, smaller matrices. The attributes read here are megatron's (`is_qkv`,
`qkv_split_shapes`, `partition_dim`, `tensor_model_parallel`, `is_embedding_or_output_parameter`) plus
`muon_num_experts` for concatenated expert weights and `muon_head_rows` for the head size of each fused section.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_muon.optimizer.muon_math import check_sections, fused_part_views

_NON_MATRIX_NAME_HINTS = ("embedding", "output_layer", "lm_head")


@dataclass(frozen=True)
class MatrixLayout:
    """How a parameter splits into matrices: expert blocks, fused row sections (each whole or per head: `head_rows`,
    0 for a whole section), and its TP-sharded matrix dim."""

    num_experts: int = 1
    split_sections: tuple[int, ...] | None = None
    partition_dim: int | None = None
    head_rows: tuple[int, ...] | None = None

    def piece_head_rows(self, piece_index: int) -> int:
        """Rows of one head's matrix in this piece, or 0 when the piece is one matrix per expert."""
        return self.head_rows[piece_index] if self.head_rows else 0


def describe(param: torch.Tensor, name: str | None = None) -> str:
    """A short handle for error messages."""
    return f"{name or 'parameter'} (shape {tuple(param.shape)}, dtype {param.dtype})"


def num_experts_of(param: torch.Tensor) -> int | None:
    """Experts stacked in this tensor: `muon_num_experts`, or the leading dim of a tagged 3-D grouped weight."""
    tagged = getattr(param, "muon_num_experts", None)
    if tagged is not None:
        return int(tagged)
    return None


def is_muon_param(param: torch.Tensor, name: str | None = None) -> bool:
    """Default routing: 2-D non-embedding, non-output matrices (and tagged 3-D expert stacks) go to Muon.

    Embeddings, the output layer, norms, biases, conv kernels and gate vectors go to the scalar optimizer (AdamW).
    """
    if getattr(param, "is_embedding_or_output_parameter", False):
        return False
    if name is not None and any(hint in name for hint in _NON_MATRIX_NAME_HINTS):
        return False
    if param.ndim == 2:
        return True
    return param.ndim == 3 and num_experts_of(param) == param.shape[0]


def split_params_for_muon(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], predicate=is_muon_param
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(muon_params, adamw_params) of the trainable parameters; pass `predicate(param, name)` to override."""
    muon, other = [], []
    for name, param in named_parameters:
        if param.requires_grad:
            (muon if predicate(param, name) else other).append(param)
    return muon, other


def matrix_layout(param: torch.Tensor, *, split_fused: bool = True, split_heads: bool = False,
                  name: str | None = None) -> MatrixLayout:
    """Read a parameter's layout from its attributes; raises for tensors Muon cannot treat as matrices.
    `split_heads` (with `split_fused`) cuts each fused section made of heads into one matrix per head."""
    experts = num_experts_of(param)
    if param.ndim == 3:
        if experts != param.shape[0]:
            raise ValueError(
                f"Muon got 3-D {describe(param, name)}; only stacks of expert matrices are orthogonalized. Route it "
                "to AdamW, or mark an [experts, rows, cols] weight with `param.muon_num_experts = experts`"
            )
    elif param.ndim != 2:
        raise ValueError(
            f"Muon orthogonalizes matrices, but {describe(param, name)} is {param.ndim}-D; route it to AdamW "
            "(e.g. with megatron_muon.optimizer.split_params_for_muon)"
        )
    experts = experts or 1
    rows = param.shape[-2] if param.ndim == 3 else param.shape[0]
    if param.ndim == 2 and rows % experts != 0:
        raise ValueError(f"{describe(param, name)} has {rows} rows, not divisible into muon_num_experts={experts}")
    sections = None
    if split_fused and getattr(param, "is_qkv", False):
        shapes = getattr(param, "qkv_split_shapes", None)
        if shapes is None:
            raise ValueError(f"{describe(param, name)} is marked is_qkv but has no qkv_split_shapes; set them")
        sections = tuple(int(s) for s in shapes)
        check_sections(rows // experts if param.ndim == 2 else rows, sections, describe(param, name))
    head_rows = fused_head_rows(param, sections, describe(param, name)) if sections and split_heads else None
    partition_dim = None
    if getattr(param, "tensor_model_parallel", False):
        dim = getattr(param, "partition_dim", -1)
        if param.ndim == 3:
            dim = dim - 1 if dim in (1, 2) else -1
        partition_dim = dim if dim in (0, 1) else None
    return MatrixLayout(num_experts=experts, split_sections=sections, partition_dim=partition_dim, head_rows=head_rows)


def fused_head_rows(param: torch.Tensor, sections: tuple[int, ...], what: str) -> tuple[int, ...]:
    """Rows of one head in each fused section (0: the section is not made of heads and stays one matrix).

    From `param.muon_head_rows` where set (GDN in_proj: q, k, v, z by head; beta, alpha whole); else megatron's QKV
    rule: its `qkv_split_shapes` end with one value head per query group (kv_channels rows) and every section is
    whole heads of that size."""
    tagged = getattr(param, "muon_head_rows", None)
    if tagged is not None:
        heads = tuple(int(h) for h in tagged)
        if len(heads) != len(sections) or any(h < 0 or (h and s % h) for h, s in zip(heads, sections)):
            raise ValueError(f"{what}: muon_head_rows {list(heads)} must give, per split section {list(sections)}, "
                             "a head size dividing it (0 keeps the section whole)")
        return heads
    head = sections[-1]
    if len(sections) not in (3, 4) or any(s % head for s in sections):
        raise ValueError(f"{what}: its sections {list(sections)} are not megatron's QKV ([q, (gate,) k, v] per query "
                         "group, whole heads of the v section's rows), so their heads are unknown; set "
                         "`param.muon_head_rows` (one head size per section, 0 to keep one whole) or turn "
                         "split_heads off")
    return (head,) * len(sections)


def piece_views(tensor: torch.Tensor, layout: MatrixLayout) -> list[torch.Tensor]:
    """Views [experts, groups, section, cols] of `tensor` (a parameter or anything shaped like it)."""
    cols = tensor.shape[-1]
    stack = tensor.reshape(layout.num_experts, -1, cols)
    if layout.split_sections is None:
        return [stack.unsqueeze(1)]
    return fused_part_views(stack, layout.split_sections)


def piece_matrix_shape(piece: torch.Tensor, head_rows: int = 0) -> tuple[int, int]:
    """The [rows, cols] of each matrix a piece contributes (one head's rows where `head_rows`)."""
    if head_rows:
        return head_rows, piece.shape[-1]
    return piece.shape[-3] * piece.shape[-2], piece.shape[-1]


def piece_matrix_count(piece: torch.Tensor, head_rows: int = 0) -> int:
    """How many matrices a piece contributes: one per expert, or one per expert, group and head."""
    if head_rows:
        return piece.shape[0] * piece.shape[1] * piece.shape[2] // head_rows
    return piece.shape[0]


def tag_fused_in_proj(module: torch.nn.Module) -> int:
    """Mark GDN-style fused input projections so Muon orthogonalizes each section on its own.

    Any submodule exposing this rank's row count per in_proj section (q, k, v, z, beta, alpha) as megatron's
    GatedDeltaNet `in_proj_split_sections` attribute or the plugin layer's `in_proj_sections()` method gets its
    `in_proj.weight` tagged with megatron's fused-projection attributes, which megatron copies onto fp32 master
    weights, and with `muon_head_rows` (q, k by key head, v, z by value head, beta and alpha whole) where the
    layer names its head dims (`key_head_dim` / `value_head_dim`, on it or its `shape`). Returns how many weights
    were tagged.
    """
    tagged = 0
    for sub in module.modules():
        sections = getattr(sub, "in_proj_split_sections", None)
        if sections is None and callable(getattr(sub, "in_proj_sections", None)):
            sections = sub.in_proj_sections()
        in_proj = getattr(sub, "in_proj", None)
        weight = getattr(in_proj, "weight", None)
        if sections is None or not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            continue
        if weight.shape[0] % sum(int(s) for s in sections) != 0:
            continue
        weight.is_qkv = True
        weight.qkv_split_shapes = [int(s) for s in sections]
        heads = _gdn_head_rows(sub, sections)
        if heads is not None:
            weight.muon_head_rows = heads
        tagged += 1
    return tagged


def _gdn_head_rows(layer: torch.nn.Module, sections) -> tuple[int, ...] | None:
    """(K, K, V, V, 0, 0) for a GDN layer's q|k|v|z|beta|alpha sections, or None when it does not name its head dims."""
    dims = layer if hasattr(layer, "key_head_dim") else getattr(layer, "shape", None)
    key, value = getattr(dims, "key_head_dim", None), getattr(dims, "value_head_dim", None)
    if len(sections) != 6 or not isinstance(key, int) or not isinstance(value, int):
        return None
    return (key, key, value, value, 0, 0)


def assert_pieces_cover_params(bucket_items, params, layouts) -> None:
    """Every piece of every parameter sits in exactly one bucket (`bucket_items`: per bucket, (param index, piece
    index) pairs) and the pieces partition the parameter: the per-piece passes (momentum EMA, weight decay) then
    touch each element exactly once per step."""
    seen = Counter(item for items in bucket_items for item in items)
    for index, (param, layout) in enumerate(zip(params, layouts)):
        pieces = piece_views(param, layout)
        assert all(seen[(index, k)] == 1 for k in range(len(pieces))), f"pieces of parameter {index} not bucketed once"
        assert sum(piece.numel() for piece in pieces) == param.numel(), f"pieces of parameter {index} do not cover it"
    assert sum(seen.values()) == sum(len(piece_views(p, l)) for p, l in zip(params, layouts))
