"""megatron's `make_viewless_tensor` inside a compiled layer whose last op returns a view from outside the graph
(as Transformer Engine's dynamo-disabled linears do): megatron's own function breaks the graph there and, with grad
enabled, crashes Inductor; the plugin's replacement, installed by `register()` into the callers that run inside
compiled regions, gives the eager outputs and gradients. Outside compiled code it is megatron's function."""

import pytest
import torch
from torch._dynamo.utils import counters

import megatron_muon
from megatron_muon.megatron.viewless import COMPILED_CALLERS, make_viewless_tensor


@torch._dynamo.disable
def _linear_returning_a_view(x, weight):  # what TE's Linear does: eager behind a graph break, a view back
    return (x.reshape(-1, x.shape[-1]) @ weight).view(x.shape[0], x.shape[1], -1)


def _layer(viewless):
    def layer(x, weight):
        hidden = torch.nn.functional.silu(x) + x
        out = _linear_returning_a_view(hidden, weight)
        return viewless(inp=out, requires_grad=out.requires_grad, keep_graph=True) * 2
    return layer


def _inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 1, 32, generator=generator, requires_grad=True)
    return x, torch.randn(32, 48, generator=generator, requires_grad=True)


def test_megatrons_viewless_tensor_crashes_a_compiled_layer_ending_in_a_view():
    """The failure the replacement exists for (if a torch release fixes it, this test says the patch can go)."""
    from megatron.core.utils import make_viewless_tensor as megatrons

    torch._dynamo.reset()
    compiled = torch.compile(_layer(megatrons))
    with pytest.raises(AssertionError, match="wrong number of dimensions"):
        for _ in range(2):
            compiled(*_inputs(0))


def test_the_replacement_gives_eager_outputs_and_gradients_with_no_graph_break_of_its_own():
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_layer(make_viewless_tensor))
    for seed in range(3):
        x, weight = _inputs(seed)
        out = compiled(x, weight)
        out.square().sum().backward()
        x_ref, weight_ref = (t.detach().clone().requires_grad_() for t in (x, weight))
        ref = _layer(make_viewless_tensor)(x_ref, weight_ref)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(weight.grad, weight_ref.grad, rtol=1e-6, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 1  # the dynamo-disabled linear's own


def test_outside_compiled_code_it_is_megatrons_viewless_tensor():
    base = torch.randn(4, 6, requires_grad=True) * 1.0
    view = base.view(2, 2, 6)
    assert view._base is not None
    out = make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    assert out._base is None and torch.equal(out, view)
    (out * 3).sum().backward()
    assert out.grad_fn is not None


def test_register_installs_it_where_megatrons_layers_and_blocks_call_it():
    import importlib

    megatron_muon.register()
    for name in COMPILED_CALLERS:
        assert importlib.import_module(name).make_viewless_tensor is make_viewless_tensor
