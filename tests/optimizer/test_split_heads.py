"""Per-head orthogonalization of fused projections (`split_heads`): which rows form a head, the step against a
per-head reference on fresh random inputs, and the errors a user can trigger."""

import copy

import pytest
import torch

from megatron_muon.kernels.reference import newton_schulz_reference
from megatron_muon.optimizer import Muon, muon_math
from megatron_muon.optimizer.routing import (
    fused_head_rows,
    matrix_layout,
    piece_matrix_count,
    piece_matrix_shape,
    piece_views,
    tag_fused_in_proj,
)

COLS = 16


def _param(rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(rows, COLS, generator=generator, dtype=torch.float64))


def _qkv(groups=2, q_heads_per_group=2, head=4, gated=False):
    """megatron's fused QKV: per query group [q (q_heads·head) | (gate) | k (head) | v (head)] rows."""
    sections = [q_heads_per_group * head] * (2 if gated else 1) + [head, head]
    param = _param(groups * sum(sections))
    param.is_qkv, param.qkv_split_shapes = True, sections
    return param


def _gdn_in_proj(key_heads=2, value_heads=4, key_dim=4, value_dim=2):
    """A GDN in_proj: one group of [q | k | v | z | beta | alpha], tagged with its head rows."""
    sections = [key_heads * key_dim] * 2 + [value_heads * value_dim] * 2 + [value_heads] * 2
    param = _param(sum(sections), seed=1)
    param.is_qkv, param.qkv_split_shapes = True, sections
    param.muon_head_rows = (key_dim, key_dim, value_dim, value_dim, 0, 0)
    return param


def _per_head_reference(matrix, sections, head_rows):
    """Split by hand: every group's every section cut into head blocks (or kept whole over the groups), each block
    orthogonalized on its own in fp64 and scaled by its own shape."""
    total = sum(sections)
    groups = matrix.shape[0] // total
    grouped = matrix.reshape(groups, total, -1)
    out = torch.empty_like(grouped)
    start = 0
    for size, head in zip(sections, head_rows):
        part = grouped[:, start:start + size]
        if head:
            for g in range(groups):
                for h in range(0, size, head):
                    block = part[g, h:h + head]
                    out[g, start + h:start + h + head] = _scaled_reference(block)
        else:
            out[:, start:start + size] = _scaled_reference(part.reshape(groups * size, -1)).reshape(groups, size, -1)
        start += size
    return out.reshape(matrix.shape)


def _scaled_reference(block):
    return newton_schulz_reference(block, 5, "simple") * muon_math.update_scale(block.shape, "spectral")


def test_megatron_qkv_heads_are_the_value_sections_rows():
    assert matrix_layout(_qkv(), split_heads=True).head_rows == (4, 4, 4)
    assert matrix_layout(_qkv(gated=True), split_heads=True).head_rows == (4, 4, 4, 4)
    assert matrix_layout(_qkv()).head_rows is None  # off by default
    assert matrix_layout(_qkv(), split_fused=False, split_heads=True).split_sections is None


def test_gdn_layers_tag_their_head_rows():
    class Shape:
        key_head_dim, value_head_dim = 4, 2

    class Layer(torch.nn.Module):
        shape = Shape()

        def __init__(self):
            super().__init__()
            self.in_proj = torch.nn.Linear(COLS, 2 * 8 + 2 * 8 + 2 * 4, bias=False)

        def in_proj_sections(self):
            return (8, 8, 8, 8, 4, 4)

    layer = Layer()
    assert tag_fused_in_proj(layer) == 1
    assert layer.in_proj.weight.muon_head_rows == (4, 4, 2, 2, 0, 0)
    assert matrix_layout(layer.in_proj.weight, split_heads=True).head_rows == (4, 4, 2, 2, 0, 0)


def test_megatrons_gdn_layer_is_tagged_from_its_own_head_dims():
    """megatron's GatedDeltaNet names its sections `in_proj_split_sections` and its head dims on itself."""

    class MegatronGDN(torch.nn.Module):
        key_head_dim, value_head_dim = 4, 2
        in_proj_split_sections = (8, 8, 8, 8, 4, 4)

        def __init__(self):
            super().__init__()
            self.in_proj = torch.nn.Linear(COLS, 40, bias=False)

    layer = MegatronGDN()
    tag_fused_in_proj(layer)
    assert layer.in_proj.weight.muon_head_rows == (4, 4, 2, 2, 0, 0)


def test_head_pieces_cover_the_section_in_order():
    """A head piece cut into [matrices, head rows, cols] (as the optimizer's slots view it) gives the section's head
    blocks of the parameter's rows, in order."""
    param = _gdn_in_proj()
    layout = matrix_layout(param, split_heads=True)
    start = 0
    for index, (piece, size) in enumerate(zip(piece_views(param, layout), param.qkv_split_shapes)):
        heads = layout.piece_head_rows(index)
        count, shape = piece_matrix_count(piece, heads), piece_matrix_shape(piece, heads)
        matrices = piece.reshape(count, *shape)
        blocks = param.detach()[start:start + size].reshape(count, *shape)  # one group: the section's rows
        torch.testing.assert_close(matrices, blocks, rtol=0, atol=0)
        start += size
    assert [piece_matrix_count(p, layout.piece_head_rows(i)) for i, p in enumerate(piece_views(param, layout))] \
        == [2, 2, 4, 4, 1, 1]


@pytest.mark.parametrize("make", [_qkv, lambda: _qkv(gated=True), _gdn_in_proj])
def test_step_orthogonalizes_each_head_like_the_fp64_reference(make):
    param = make()
    initial = param.detach().clone()
    grad = torch.randn(param.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    param.grad = grad.clone()
    exact = dict(lr=0.1, weight_decay=0.0, nesterov=False, coefficients="simple", method="standard",
                 compute_dtype=torch.float64, scale_mode="spectral")
    Muon([param], **exact, split_heads=True).step()
    layout = matrix_layout(param, split_heads=True)
    # the first step's momentum update is the gradient (no Nesterov blend)
    expected = initial - 0.1 * _per_head_reference(grad, layout.split_sections, layout.head_rows)
    torch.testing.assert_close(param.detach(), expected, rtol=1e-10, atol=1e-10)
    # The per-section result is a different update: the option changes what is orthogonalized.
    sections = copy.deepcopy(initial)
    sections_param = torch.nn.Parameter(sections)
    sections_param.is_qkv, sections_param.qkv_split_shapes = True, list(layout.split_sections)
    sections_param.grad = grad.clone()
    Muon([sections_param], **exact).step()
    assert (sections_param.detach() - param.detach()).abs().max() > 1e-3


@pytest.mark.parametrize("method, tolerance", [("standard", 1e-4), ("auto", 1e-4)])
def test_batched_heads_equal_one_call_per_head(method, tolerance):
    """Heads of several parameters share buckets with plain matrices of the same shape (4 × 16 here)."""
    params = [_qkv(), _gdn_in_proj(), _param(4, seed=3), _param(8, seed=4)]
    for p in params:
        p.data = p.data.float()
    batched, single = copy.deepcopy(params), copy.deepcopy(params)
    for copies in (batched, single):
        for dst, src in zip(copies, params):
            for attr in ("is_qkv", "qkv_split_shapes", "muon_head_rows"):
                if hasattr(src, attr):
                    setattr(dst, attr, getattr(src, attr))
    options = dict(lr=0.01, weight_decay=0.05, method=method, split_heads=True)
    for optimizer, group in ((Muon(batched, **options, batched=True), batched),
                             (Muon(single, **options, batched=False), single)):
        for step in range(3):
            generator = torch.Generator().manual_seed(100 + step)
            for p in group:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
    for a, b in zip(batched, single):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="needs split_fused=True"):
        Muon([_qkv()], split_fused=False, split_heads=True)
    odd = _param(2 * (6 + 4 + 4))
    odd.is_qkv, odd.qkv_split_shapes = True, [6, 4, 4]
    with pytest.raises(ValueError, match="muon_head_rows"):
        Muon([odd], split_heads=True)
    in_proj = _gdn_in_proj()
    del in_proj.muon_head_rows  # six sections and no head rows: not megatron's QKV, heads unknown
    with pytest.raises(ValueError, match="muon_head_rows"):
        matrix_layout(in_proj, split_heads=True)
    in_proj.muon_head_rows = (3, 4, 2, 2, 0, 0)  # 3 does not divide the q section's 8 rows
    with pytest.raises(ValueError, match="head size dividing it"):
        fused_head_rows(in_proj, (8, 8, 8, 8, 4, 4), "in_proj")
