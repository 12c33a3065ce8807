"""SwiGLU in pieces (layers.mlp) against megatron's SwiGLU: the torch.chunk path of megatron's MLP and the fused
`bias_swiglu_impl`, values and gradients, fp32 and bf16, widths that 9 does not divide; and the MLP subclass against
megatron's MLP on the same weights, with and without bias and bias-activation fusion."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

from megatron_muon.layers.gradient_pieces import MIN_GRADIENT_PIECES, piece_sizes, split_sizes
from megatron_muon.layers.mlp import swiglu_in_pieces

# 5632 (hybrid-1.5B ffn): 11 equal pieces; 101 (prime) and 38 (2 * 19): unequal pieces; 5 and 7: fewer than 9
# elements, one per piece.
WIDTHS = (5, 7, 38, 101, 5632)
DTYPE_TOLERANCES = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


@pytest.mark.parametrize("width", WIDTHS + (2816, 176, 19, 1_000_003))
def test_split_sizes_cover_the_width_in_enough_pieces(width):
    sizes = split_sizes(width, MIN_GRADIENT_PIECES)
    assert sum(sizes) == width and all(size > 0 for size in sizes)
    assert min(width, MIN_GRADIENT_PIECES) <= len(sizes) <= 2 * MIN_GRADIENT_PIECES + 1


def test_split_sizes_prefers_equal_aligned_pieces():
    assert split_sizes(5632, MIN_GRADIENT_PIECES) == [512] * 11  # hybrid-1.5B, tp=1
    assert split_sizes(2816, MIN_GRADIENT_PIECES) == [256] * 11  # tp=2
    assert split_sizes(101, MIN_GRADIENT_PIECES) == [11] * 9 + [2]  # a prime: no equal cut short of 101 pieces
    assert split_sizes(7, MIN_GRADIENT_PIECES) == [1] * 7  # narrower than the wanted count
    assert piece_sizes(7, MIN_GRADIENT_PIECES) == [7]  # equal cuts: none with >= 9 pieces, so one


def _megatron_chunk_swiglu(x):
    """megatron MLP's unfused path (`glu` in MLP.forward)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def _megatron_fused_swiglu(x):
    """megatron's bias_swiglu_impl (the bias_activation_fusion path)."""
    return bias_swiglu_impl(x, None)


def _value_and_grad(fn, x, grad):
    x = x.detach().clone().requires_grad_(True)
    with torch._dynamo.config.patch(disable=True):  # megatron's fused SwiGLU (and its backward) is torch.compile'd
        out = fn(x)
        out.backward(grad)
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("reference", [_megatron_chunk_swiglu, _megatron_fused_swiglu], ids=["chunk", "fused"])
def test_swiglu_in_pieces_equals_megatron_swiglu(reference, width, dtype):
    tokens = 3 if width > 1000 else 17
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(tokens, 2, 2 * width, generator=generator) * 3).to(dtype)
    grad = torch.randn(tokens, 2, width, generator=generator).to(dtype)
    out, dx = _value_and_grad(swiglu_in_pieces, x, grad)
    ref_out, ref_dx = _value_and_grad(reference, x, grad)
    assert out.shape == ref_out.shape == (tokens, 2, width) and dx.shape == x.shape
    assert ref_out.abs().max() > 0 and ref_dx[..., :width].abs().max() > 0 and ref_dx[..., width:].abs().max() > 0
    torch.testing.assert_close(out, ref_out, **DTYPE_TOLERANCES[dtype])
    if reference is _megatron_chunk_swiglu or dtype == torch.float32:
        torch.testing.assert_close(dx, ref_dx, **DTYPE_TOLERANCES[dtype])
    else:  # the fused backward rounds its bf16 products in another order: as close to the exact gradient as it
        exact = _value_and_grad(_megatron_chunk_swiglu, x.double(), grad.double())[1]
        assert (dx.double() - exact).abs().max() <= 1.5 * (ref_dx.double() - exact).abs().max()


def test_odd_last_dimension_is_an_internal_error():
    with pytest.raises(AssertionError, match="even last dimension"):
        swiglu_in_pieces(torch.randn(2, 7))


def _mlp_case(rank, world_size, overrides):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_muon.layers.linear import CompilableRowParallelLinear
    from megatron_muon.layers.mlp import PiecewiseSwiGLUMLP
    from megatron_muon.testing.models import tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    config = tiny_transformer_config(**{"ffn_hidden_size": 101, "activation_func": F.silu, **overrides})
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=CompilableRowParallelLinear)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    ours = PiecewiseSwiGLUMLP.as_mlp_submodule(submodules, config, pg_collection, is_mtp_layer=False)
    reference = MLP.as_mlp_submodule(submodules, config, pg_collection, is_mtp_layer=False)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(0, 0.3)
    reference.load_state_dict(ours.state_dict())
    torch.manual_seed(5)
    x = torch.randn(9, 2, config.hidden_size)
    grad = torch.randn(9, 2, config.hidden_size)
    results = []
    with torch._dynamo.config.patch(disable=True):  # megatron's bias_swiglu_impl is torch.compile'd
        for mlp in (ours, reference):
            mlp.zero_grad()
            inputs = x.clone().requires_grad_(True)
            out, bias = mlp(inputs)
            (out + (bias if bias is not None else 0)).backward(grad)
            results.append([out.detach(), inputs.grad] + [p.grad.clone() for p in mlp.parameters()])
    errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results)]
    return dict(pieces=ours.swiglu_in_pieces, errors=errors, tensors=len(results[1]),
                nonzero=all(t.abs().max() > 0 for t in results[1]))


@pytest.mark.parametrize("overrides,pieces", [
    (dict(), True),
    (dict(add_bias_linear=True, bias_activation_fusion=True), True),
    (dict(add_bias_linear=True), True),
    (dict(activation_func_clamp_value=0.5), False),
    (dict(activation_func=F.gelu), False),
    (dict(gated_linear_unit=False, activation_func=F.gelu), False),
], ids=["plain", "bias-fused", "bias", "clamped", "geglu", "gelu"])
def test_piecewise_mlp_equals_megatron_mlp(rank_pool_1, overrides, pieces):
    result = rank_pool_1.run(_mlp_case, overrides)[0]
    assert result["pieces"] is pieces
    assert result["nonzero"] and result["tensors"] == 2 + 2 * (1 + ("add_bias_linear" in overrides))
    # the same elementwise math in a different order of tensor slices: fp32 rounding at most
    assert max(result["errors"]) < 1e-6, result
