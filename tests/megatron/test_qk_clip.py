"""QK-clip after a real optimizer step (tiny hybrid, megatron's optimizer factory, CPU): the qkv weights and their
fp32 masters equal a naive MuonClip on copies of them; skipped steps, logging-only runs and negative maxima leave
the weights alone; models whose attention records no logits are refused."""

import pytest
import torch

HEADS, GROUPS, HEAD_DIM, HIDDEN = 4, 2, 16, 64  # the tiny models' attention (tiny_transformer_config)
ULP = {"fp32": 1e-6, "bf16": 2.0 ** -7}  # about two fp32 ulps; one bf16 ulp


def naive_muon_clip(weight, maxima, threshold, alpha):
    """MuonClip written out: per query group eta = min(threshold / max over its heads, 1); the group's query rows
    times eta^alpha, its key rows times eta^(1 - alpha), its value rows as they were (megatron's row layout per
    group: the group's query heads, then its key head, then its value head)."""
    clipped = weight.clone()
    rows = clipped.view(GROUPS, (HEADS // GROUPS + 2) * HEAD_DIM, -1)
    q_rows = HEADS // GROUPS * HEAD_DIM
    for group in range(GROUPS):
        eta = (threshold / maxima.view(GROUPS, -1)[group].max().float()).clamp(max=1.0)  # fp32, as megatron
        rows[group, :q_rows] *= eta ** alpha
        rows[group, q_rows:q_rows + HEAD_DIM] *= eta ** (1 - alpha)
    return clipped


def _snapshot(layers, maxima: bool = True) -> list[tuple]:
    """Per attention layer: (qkv weight, its fp32 master or None[, the recorded maxima]), copied."""
    out = []
    for layer in layers:
        weight = layer.linear_qkv.weight
        main = getattr(weight, "main_param", None)
        copies = (weight.detach().clone(), None if main is None else main.detach().clone())
        out.append(copies + ((layer.core_attention.current_max_attn_logits.clone(),) if maxima else ()))
    return out


def _clip_after_a_step(rank, world_size, precision: str, threshold_kind: str, alpha: float, update_ok: bool = True,
                       log_only: bool = False):
    from megatron_muon.megatron.qk_clip import QkClipAfterStep, attention_layers
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_muon_setup, train_step
    from tests.megatron.muon_training import one_thread

    init_model_parallel(tp=1, pp=1)
    options = dict(log_max_attention_logit=True) if log_only else dict(qk_clip=True, qk_clip_alpha=alpha)
    with one_thread():
        model, optimizer = build_muon_setup("muon", precision, "hybrid", config_overrides=options)
        layers = attention_layers([model])
        clip = QkClipAfterStep([model], optimizer, layers[0].config)
        train_step(model, optimizer, 0)  # the forward records the maxima; the optimizer steps
        before = _snapshot(layers)
        grouped = before[0][2].view(GROUPS, -1).amax(dim=1)
        # "tiny": every group is clipped; "between": the larger group is, the other is not
        threshold = float(grouped.min()) * 0.1 if threshold_kind == "tiny" else float(grouped.mean())
        layers[0].config.qk_clip_threshold = threshold
        clip.after_step(update_ok)
        after = _snapshot(layers, maxima=False)
        return {"before": before, "after": after, "threshold": threshold, "logged": clip.read(),
                "reset": [layer.core_attention.current_max_attn_logits is None for layer in layers]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("threshold_kind", ["tiny", "between"])
def test_clipped_weights_equal_naive_muon_clip(rank_pool_1, precision, threshold_kind):
    alpha = 0.3
    result = rank_pool_1.run(_clip_after_a_step, precision, threshold_kind, alpha)[0]
    assert result["reset"] == [True]
    ((weight, main, maxima),), ((clipped, clipped_main),) = result["before"], result["after"]
    assert result["logged"] == pytest.approx(float(maxima.max()))
    threshold = result["threshold"]
    expected = naive_muon_clip(weight, maxima, threshold, alpha)
    assert not torch.equal(expected, weight)  # the case really clips
    # megatron raises eta to its power on a vector, the reference on a scalar: CPU kernels may differ by an ulp
    torch.testing.assert_close(clipped, expected, rtol=ULP[precision], atol=0)
    grouped = maxima.view(GROUPS, -1).amax(dim=1)
    v_rows = clipped.view(GROUPS, -1, clipped.shape[-1])[:, -HEAD_DIM:]
    assert torch.equal(v_rows, weight.view(GROUPS, -1, weight.shape[-1])[:, -HEAD_DIM:])  # values untouched
    for group in range(GROUPS):
        same = torch.equal(clipped.view(GROUPS, -1, HIDDEN)[group], weight.view(GROUPS, -1, HIDDEN)[group])
        assert same == bool(grouped[group] <= threshold), group
    if precision == "bf16":  # megatron's mixed precision: the fp32 master is clipped too
        assert main is not None and clipped_main.dtype == torch.float32
        torch.testing.assert_close(clipped_main, naive_muon_clip(main, maxima, threshold, alpha), rtol=ULP["fp32"],
                                   atol=0)


def test_a_skipped_step_and_logging_only_leave_the_weights(rank_pool_1):
    for kwargs in (dict(update_ok=False), dict(log_only=True)):
        result = rank_pool_1.run(_clip_after_a_step, "bf16", "tiny", 0.5, **kwargs)[0]
        ((weight, main, maxima),), ((clipped, clipped_main),) = result["before"], result["after"]
        assert torch.equal(clipped, weight) and torch.equal(clipped_main, main), kwargs
        assert result["reset"] == [True]  # forgotten: the next step starts its own maxima
        assert result["logged"] == pytest.approx(float(maxima.max()))


def _negative_group(rank, world_size):
    from megatron_muon.megatron.qk_clip import attention_layers, clip_qk
    from megatron_muon.testing.models import GDN_SIZES, build_tiny_hybrid, tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1, pp=1)
    model = build_tiny_hybrid(tiny_transformer_config(qk_clip=True, qk_clip_threshold=1.0, **GDN_SIZES))
    (layer,) = attention_layers([model])
    weight = layer.linear_qkv.weight.detach().clone()
    maxima = torch.tensor([-1.0, -2.0, 5.0, 6.0])  # group 0 below zero, group 1 above the threshold
    layer.core_attention.current_max_attn_logits = maxima.clone()
    largest = clip_qk([model])
    return weight, layer.linear_qkv.weight.detach().clone(), maxima, float(largest)


def test_a_negative_group_maximum_is_left_alone(rank_pool_1):
    """megatron's eta = threshold / max would be negative there and its square root NaN."""
    weight, clipped, maxima, largest = rank_pool_1.run(_negative_group)[0]
    assert largest == 6.0
    assert torch.isfinite(clipped).all()
    assert torch.equal(clipped.view(GROUPS, -1, HIDDEN)[0], weight.view(GROUPS, -1, HIDDEN)[0])
    torch.testing.assert_close(clipped, naive_muon_clip(weight, maxima.clamp(min=0), 1.0, 0.5), rtol=ULP["fp32"],
                               atol=0)


def _check(rank, world_size, model_kind: str, options: dict):
    from megatron_muon.megatron.qk_clip import check_qk_clip
    from megatron_muon.testing.models import GDN_SIZES, build_tiny_gpt, build_tiny_hybrid, tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1, pp=1)
    if model_kind == "gpt":
        config = tiny_transformer_config(**options)
        model = build_tiny_gpt(config)
    else:
        config = tiny_transformer_config(**options, **GDN_SIZES)
        model = build_tiny_hybrid(config)
    try:
        check_qk_clip([model], config)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("model_kind,options,message", [
    ("gpt", dict(qk_clip=True), "DotProductAttention does not"),
    ("gpt", dict(log_max_attention_logit=True), "DotProductAttention does not"),
    ("hybrid", dict(qk_clip=True, qk_clip_threshold=0.0), "qk_clip_threshold must be > 0"),
    ("hybrid", dict(qk_clip=True, qk_clip_alpha=1.0), "qk_clip_alpha must lie strictly between 0 and 1"),
    ("hybrid", dict(qk_clip=True), None),
])
def test_what_cannot_clip_is_refused_with_the_fix(rank_pool_1, model_kind, options, message):
    error = rank_pool_1.run(_check, model_kind, options)[0]
    if message is None:
        assert error is None
    else:
        assert error is not None and message in error
