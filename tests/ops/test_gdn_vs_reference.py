"""The torch backend of every op against the naive fp32 references: outputs and all gradients, fresh random inputs."""

import pytest
import torch

from megatron_muon.ops import causal_conv1d, chunk_gated_delta_rule, gated_rms_norm, l2norm
from megatron_muon.ops import reference
from megatron_muon.ops.gdn_torch import CHUNK_SIZE
from tests.ops.helpers import FLA_TOLERANCES, assert_ratio, gdn_inputs

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _run(fn, inputs, do, dht, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kwargs)
    ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
    return o, ht, [leaf.grad for leaf in leaves]


def _compare_to_reference(inputs, scale=None, tolerances=FLA_TOLERANCES, **kwargs):
    value_shape, state_shape = inputs[2].shape, inputs[5].shape
    do, dht = torch.randn(value_shape), torch.randn(state_shape)
    o, ht, grads = _run(chunk_gated_delta_rule, inputs, do, dht, scale=scale, **kwargs)
    ref_o, ref_ht, ref_grads = _run(reference.naive_recurrent_gated_delta_rule, inputs, do, dht, scale=scale, **kwargs)
    assert o.dtype == inputs[2].dtype and ht.dtype == torch.float32
    assert_ratio("o", ref_o, o, tolerances["o"])
    assert_ratio("ht", ref_ht, ht, tolerances["ht"])
    for name, ref_grad, grad in zip(GRAD_NAMES, ref_grads, grads):
        assert grad.dtype == ref_grad.dtype
        assert_ratio(name, ref_grad, grad, tolerances[name])


@pytest.mark.parametrize(
    "batch, seq_len, heads, value_heads, key_dim, value_dim",
    [
        (2, CHUNK_SIZE, 2, 2, 16, 16),  # exactly one chunk
        (2, 100, 2, 2, 32, 16),  # T not a multiple of the chunk
        (1, 3 * CHUNK_SIZE + 7, 1, 3, 16, 24),  # several chunks, GVA 1 -> 3
        (3, 1, 2, 4, 8, 8),  # a single token
    ],
)
@pytest.mark.parametrize("use_qk_l2norm_in_kernel", [False, True])
def test_torch_backend_matches_reference(batch, seq_len, heads, value_heads, key_dim, value_dim,
                                         use_qk_l2norm_in_kernel):
    torch.manual_seed(seq_len)
    inputs = gdn_inputs(batch, seq_len, heads, value_heads, key_dim, value_dim, seed=seq_len)
    _compare_to_reference(inputs, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


@pytest.mark.parametrize("gate_scale, scale", [(10.0, 1.0), (0.1, 0.1)])
def test_strong_and_weak_decay(gate_scale, scale):
    torch.manual_seed(1)
    _compare_to_reference(gdn_inputs(2, 150, 2, 2, 16, 16, gate_scale=gate_scale, seed=1), scale=scale)


def test_bf16_inputs_within_fla_tolerances():
    torch.manual_seed(2)
    _compare_to_reference(gdn_inputs(1, 130, 2, 2, 32, 32, dtype=torch.bfloat16, seed=2))


def test_varlen_matches_per_sequence_reference():
    torch.manual_seed(3)
    cu_seqlens = torch.tensor([0, 40, 41, 150, 214])
    inputs = gdn_inputs(1, 214, 2, 2, 16, 16, num_states=4, seed=3)
    _compare_to_reference(inputs, cu_seqlens=cu_seqlens)


def test_without_initial_state_or_final_state():
    torch.manual_seed(4)
    q, k, v, g, beta, _ = gdn_inputs(2, 70, 2, 2, 16, 16, seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, ht = chunk_gated_delta_rule(*leaves)
    assert ht is None
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    ref_o, _ = reference.naive_recurrent_gated_delta_rule(*ref_leaves)
    do = torch.randn_like(ref_o)
    (o * do).sum().backward()
    (ref_o * do).sum().backward()
    assert_ratio("o", ref_o, o, FLA_TOLERANCES["o"])
    for name, a, b in zip(GRAD_NAMES, ref_leaves, leaves):
        assert_ratio(name, a.grad, b.grad, FLA_TOLERANCES[name])


def test_gradient_through_the_final_state_only():
    """The output unused: the op's backward gets no output gradient (none is materialized) and still matches."""
    torch.manual_seed(5)
    inputs = gdn_inputs(1, 90, 2, 4, 16, 8, seed=5)
    dht = torch.randn(inputs[5].shape)
    grads = []
    for fn in (chunk_gated_delta_rule, reference.naive_recurrent_gated_delta_rule):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        _, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        (ht.float() * dht).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    assert grads[1][0] is None  # q reaches the output only
    assert grads[0][0] is None or not grads[0][0].any()
    for name, ref_grad, grad in list(zip(GRAD_NAMES, grads[1], grads[0]))[1:]:
        assert_ratio(name, ref_grad, grad, FLA_TOLERANCES[name])


@pytest.mark.parametrize("activation, use_bias, width", [("silu", True, 4), (None, False, 3), ("silu", False, 1)])
def test_causal_conv1d_matches_reference(activation, use_bias, width):
    torch.manual_seed(5)
    x = torch.randn(2, 37, 12, requires_grad=True)
    weight = torch.randn(12, width, requires_grad=True)
    bias = torch.randn(12, requires_grad=True) if use_bias else None
    params = [p for p in (x, weight, bias) if p is not None]
    y = causal_conv1d(x, weight, bias, activation=activation)
    ref = reference.causal_conv1d_reference(x, weight, bias, activation=activation)
    dy = torch.randn_like(ref)
    grads = torch.autograd.grad(y, params, dy)
    ref_grads = torch.autograd.grad(ref, params, dy)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_causal_conv1d_varlen_never_crosses_a_sequence_start():
    torch.manual_seed(6)
    x = torch.randn(1, 30, 8, requires_grad=True)
    weight, bias = torch.randn(8, 4, requires_grad=True), torch.randn(8, requires_grad=True)
    bounds = [0, 2, 17, 30]
    y = causal_conv1d(x, weight, bias, cu_seqlens=torch.tensor(bounds))
    pieces = [reference.causal_conv1d_reference(x[:, s:e], weight, bias) for s, e in zip(bounds, bounds[1:])]
    ref = torch.cat(pieces, 1)
    dy = torch.randn_like(ref)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    params = (x, weight, bias)
    for got, expected in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(ref, params, dy)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_reference(dtype):
    torch.manual_seed(7)
    x = torch.randn(3, 5, 2, 16).to(dtype).requires_grad_()
    gate = torch.randn(3, 5, 2, 16).to(dtype).requires_grad_()
    weight = torch.randn(16, requires_grad=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    y = gated_rms_norm(x, gate, weight)
    ref = reference.gated_rms_norm_reference(x, gate, weight)
    assert y.dtype == dtype
    dy = torch.randn_like(ref)
    torch.testing.assert_close(y.float(), ref, **tol)
    for got, expected in zip(torch.autograd.grad(y, (x, gate, weight), dy.to(dtype)),
                             torch.autograd.grad(ref, (x, gate, weight), dy)):
        torch.testing.assert_close(got.float(), expected.float(), **tol)
    y = l2norm(x)
    ref = reference.l2norm_reference(x)
    torch.testing.assert_close(y.float(), ref, **tol)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy.to(dtype))[0].float(),
                               torch.autograd.grad(ref, x, dy)[0].float(), **tol)


def test_invalid_inputs_name_the_fix():
    q, k, v, g, beta, h0 = gdn_inputs(2, 8, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="multiple of the 2 q/k heads"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta, h0 = gdn_inputs(2, 8, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="head_first=False"):
        chunk_gated_delta_rule(q.transpose(1, 2), k.transpose(1, 2), v, g, beta)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="B = 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="squeezed"):
        causal_conv1d(torch.randn(1, 4, 6), torch.randn(6, 1, 4))
    with pytest.raises(ValueError, match="weight \\[D\\]"):
        gated_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.randn(4))
