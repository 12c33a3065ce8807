"""GatedDeltaNet layer on CPU: equals the plain-torch reference (outputs and every gradient), TP=2 equals TP=1 (with
and without sequence parallelism), packed sequences equal separate ones."""

import contextlib

import pytest
import torch

from tests.layers.gdn_cases import SEQ_LEN, build_gdn_layer, gdn_config, tp_slice

# fp32 everywhere, compared like FLA's tests (rmse(diff) / rmse(ref)), with bounds far tighter than FLA's bf16 ones
# (0.005 to 0.02): the chunked algorithm and the token-by-token oracle differ only by rounding (measured <= 7e-7,
# and <= 2e-4 for the decay-gate parameters, whose gradients are long sums with cancellation, like FLA's dg), while a
# wrong gate, section order or head mapping gives an error ratio of order 1.
MAX_ERROR_RATIO = 1e-5
GATE_GRAD_MAX_ERROR_RATIO = 1e-3


def _close(actual, expected, what, reference_rms=None):
    """rmse(actual - expected) / rms of `expected` (or of `reference_rms`, the whole unsharded tensor's, for a TP
    shard: a shard can hold only a few near-cancelling gate gradients, whose own rms says nothing about rounding)."""
    max_ratio = GATE_GRAD_MAX_ERROR_RATIO if ("A_log grad" in what or "dt_bias grad" in what) else MAX_ERROR_RATIO
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    expected, actual = expected.double(), actual.double()
    scale = expected.square().mean().sqrt() if reference_rms is None else reference_rms
    ratio = ((actual - expected).square().mean().sqrt() / (scale + 1e-30)).item()
    assert ratio < max_ratio, f"{what}: error ratio {ratio:.2e} >= {max_ratio}"


def _reference_case(rank, world_size, overrides, seq_len, batch):
    from megatron_muon.layers.reference import full_layer_weights, gated_deltanet_reference
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    config = gdn_config(**overrides)
    layer = build_gdn_layer(config)
    torch.manual_seed(7)
    with torch.no_grad():  # move the weights off their init so every parameter shapes the output
        for param in layer.parameters():
            param.add_(0.1 * torch.randn_like(param))
    x = torch.randn(seq_len, batch, config.hidden_size, requires_grad=True)
    out, bias = layer(x)
    weights = full_layer_weights(layer)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = gated_deltanet_reference(weights, layer.shape, x_ref, config.layernorm_epsilon,
                                   zero_centered_gamma=config.layernorm_zero_centered_gamma)
    grad_out = torch.randn_like(ref)
    out.backward(grad_out)
    ref.backward(grad_out)
    results = {"output": (out.detach(), ref.detach()), "input grad": (x.grad, x_ref.grad)}
    for name, param in layer.named_parameters():
        results[f"{name} grad"] = (param.grad, weights[name].grad)
    return bias, results


@pytest.mark.parametrize(
    "overrides,seq_len,batch",
    [({}, SEQ_LEN, 2), (dict(linear_num_value_heads=2, layernorm_zero_centered_gamma=True), 37, 1)],
    ids=["gva-T70-B2", "equal-heads-zero-gamma-T37"],
)
def test_layer_matches_reference(rank_pool_1, overrides, seq_len, batch):
    bias, results = rank_pool_1.run(_reference_case, overrides, seq_len, batch)[0]
    assert bias is None
    assert len(results) == 2 + 6  # output, input grad and the six parameters
    for what, (actual, expected) in results.items():
        assert expected.abs().max() > 0, f"{what} is all zeros: the comparison would prove nothing"
        _close(actual, expected, what)


@contextlib.contextmanager
def _cuda_allocations_on_cpu():
    """CPU mode redirects `device="cuda"` through a TorchFunctionMode, which autograd does not apply inside
    `Function.backward`; megatron's sequence-parallel all-gather in backward allocates on
    `torch.cuda.current_device()`, so point that at the CPU while this test runs."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _tp_case(rank, world_size, sequence_parallel):
    with _cuda_allocations_on_cpu():
        return _tp_case_body(rank, sequence_parallel)


def _tp_case_body(rank, sequence_parallel):
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    full = build_gdn_layer(gdn_config())
    torch.manual_seed(11)
    x = torch.randn(SEQ_LEN + 2, 2, full.config.hidden_size)  # 72: divisible by tp for sequence parallelism
    grad_out = torch.randn_like(x)
    x_full = x.clone().requires_grad_(True)
    out_full, _ = full(x_full)
    out_full.backward(grad_out)

    init_model_parallel(tp=2)
    split = build_gdn_layer(gdn_config(sequence_parallel=sequence_parallel))
    shard = slice(rank * x.shape[0] // 2, (rank + 1) * x.shape[0] // 2) if sequence_parallel else slice(None)
    x_split = x[shard].clone().requires_grad_(True)
    out_split, _ = split(x_split)
    out_split.backward(grad_out[shard])

    full_params = dict(full.named_parameters())
    checks = {"output": (out_split.detach(), out_full.detach()[shard]),
              "input grad": (x_split.grad, x_full.grad[shard])}
    for name, param in split.named_parameters():
        expected = tp_slice(name, full_params[name].detach(), full.shape, rank, 2)
        checks[f"{name} init"] = (param.detach(), expected)
        full_grad = full_params[name].grad
        checks[f"{name} grad"] = (param.grad, tp_slice(name, full_grad, full.shape, rank, 2),
                                  full_grad.double().square().mean().sqrt().item())
    return checks


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_equals_tp1(rank_pool_2, sequence_parallel):
    per_rank = rank_pool_2.run(_tp_case, sequence_parallel)
    for rank, checks in enumerate(per_rank):
        assert len(checks) == 2 + 2 * 6
        for what, (actual, expected, *reference_rms) in checks.items():
            _close(actual, expected, f"rank {rank} {what}", *reference_rms)


def _packed_case(rank, world_size):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    layer = build_gdn_layer(gdn_config())
    torch.manual_seed(5)
    lengths = (30, 40)
    x = torch.randn(sum(lengths), 1, layer.config.hidden_size)
    cu_seqlens = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    with torch.no_grad():
        together, _ = layer(x, packed_seq_params=packed)
        apart = torch.cat([layer(part)[0] for part in x.split(list(lengths))])
        whole, _ = layer(x)  # no boundaries: the second sequence sees the first
    return together, apart, whole


def test_packed_sequences_equal_separate_runs(rank_pool_1):
    together, apart, whole = rank_pool_1.run(_packed_case)[0]
    _close(together, apart, "packed vs separate")
    assert not torch.allclose(whole[30:], apart[30:], rtol=1e-3, atol=1e-6), "boundaries had no effect"


def _inference_rejected(rank, world_size):
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    layer = build_gdn_layer(gdn_config())
    try:
        layer(torch.randn(4, 1, layer.config.hidden_size), inference_context=object())
    except NotImplementedError as error:
        return str(error)
    return None


def test_inference_is_rejected_with_a_message(rank_pool_1):
    message = rank_pool_1.run(_inference_rejected)[0]
    assert message is not None and "train-only" in message


def test_gradient_piece_sizes():
    from megatron_muon.layers.gradient_pieces import piece_sizes as _piece_sizes

    assert _piece_sizes(3072, 5) == [512] * 6  # the reference z section: 6 cuts of 512
    assert _piece_sizes(1536, 3) == [512] * 3
    assert _piece_sizes(40, 7) == [5] * 8  # the smallest divisor >= 7
    assert _piece_sizes(1031, 5) == [1031]  # prime: no cut into <= 64 pieces, so one piece
    assert _piece_sizes(8, 1) == [8]
    for width, wanted in [(3072, 5), (1536, 3), (96, 9), (7, 9)]:
        assert sum(_piece_sizes(width, wanted)) == width
