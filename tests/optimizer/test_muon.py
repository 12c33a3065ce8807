"""The single-process Muon: equality with torch.optim.Muon, MegaBatch == per-matrix, fused and expert layouts,
state_dict round trips, and the errors a user can trigger."""

import copy
import io

import pytest
import torch

from megatron_muon.optimizer import Muon, muon_math

SHAPES = [(16, 48), (16, 48), (48, 16), (32, 32), (32, 32), (24, 40)]


def _params(shapes, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=generator).to(dtype)) for s in shapes]


def _grads(params, step, seed=100):
    generator = torch.Generator().manual_seed(seed + step)
    return [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]


def _run(optimizer, params, steps, start=0):
    for step in range(start, start + steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        optimizer.step()


def _relative_gap(ours, reference, initial):
    """|ours - reference| relative to how far the reference moved: bf16 NS rounding stays well under 2%."""
    gap = torch.stack([(a - b).detach().norm() for a, b in zip(ours, reference)]).norm()
    moved = torch.stack([(b - c).detach().norm() for b, c in zip(reference, initial)]).norm()
    return float(gap / moved)


@pytest.mark.parametrize(
    "nesterov, adjust_lr_fn, scale_mode, weight_decay",
    [(True, None, "original", 0.1), (False, "match_rms_adamw", "match_rms_adamw", 0.0)],
)
def test_matches_torch_muon_over_20_steps(nesterov, adjust_lr_fn, scale_mode, weight_decay):
    initial = _params(SHAPES)
    ours, theirs = copy.deepcopy(initial), copy.deepcopy(initial)
    kwargs = dict(lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=weight_decay)
    _run(Muon(ours, **kwargs, coefficients="simple", method="standard", scale_mode=scale_mode), ours, 20)
    _run(torch.optim.Muon(theirs, **kwargs, adjust_lr_fn=adjust_lr_fn), theirs, 20)
    assert _relative_gap(ours, theirs, initial) < 0.02
    # The same comparison with the scale mode swapped fails: the test can tell scale modes apart.
    wrong = copy.deepcopy(initial)
    other = "spectral" if scale_mode == "original" else "original"
    _run(Muon(wrong, **kwargs, coefficients="simple", method="standard", scale_mode=other), wrong, 20)
    assert _relative_gap(wrong, theirs, initial) > 0.1


def _layout_zoo(seed=0):
    """Plain matrices of repeated shapes, a fused QKV, a GDN-like in_proj, a 3-D expert stack, concatenated experts."""
    params = _params([(16, 24), (16, 24), (24, 16), (2 * 12, 16), (10, 16), (3, 8, 16), (3 * 8, 16)], seed)
    params[3].is_qkv, params[3].qkv_split_shapes = True, [6, 3, 3]
    params[4].is_qkv, params[4].qkv_split_shapes = True, [4, 4, 1, 1]
    params[5].muon_num_experts = 3
    params[6].muon_num_experts = 3
    return params


def _copy_layout_attrs(dst, src):
    for d, s in zip(dst, src):
        for attr in ("is_qkv", "qkv_split_shapes", "muon_num_experts"):
            if hasattr(s, attr):
                setattr(d, attr, getattr(s, attr))


@pytest.mark.parametrize(
    "method, compute_dtype, tolerance",
    # bf16/fp16 iterations: a batched matmul may round one element differently (one bf16 ulp of an update of
    # size lr·scale ≈ 1e-2 is ≈ 4e-5); in fp32 the two paths agree to fp32 rounding.
    [("standard", None, 1e-4), ("auto", None, 1e-4), ("standard", torch.float32, 1e-6), ("auto", torch.float32, 1e-6)],
)
def test_batched_equals_unbatched(method, compute_dtype, tolerance):
    initial = _layout_zoo()
    batched, single = copy.deepcopy(initial), copy.deepcopy(initial)
    _copy_layout_attrs(batched, initial)
    _copy_layout_attrs(single, initial)
    options = dict(lr=0.01, weight_decay=0.05, method=method, compute_dtype=compute_dtype)
    _run(Muon(batched, **options, batched=True), batched, 3)
    _run(Muon(single, **options, batched=False), single, 3)
    for a, b in zip(batched, single):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_fused_parameter_is_orthogonalized_per_part():
    """fp32 iteration on both sides (so the fp32 NS input stack is kept): the split is the only difference left."""
    (param,) = _params([(2 * 12, 16)])
    param.is_qkv, param.qkv_split_shapes = True, [6, 3, 3]
    initial = param.detach().clone()
    grad = _grads([param], 0)[0]
    param.grad = grad.clone()
    Muon([param], lr=0.1, weight_decay=0.0, method="standard", scale_mode="spectral", compute_dtype=torch.float32).step()
    update = muon_math.momentum_update_([grad], [torch.zeros_like(grad)], 0.95, True)[0]
    parts = muon_math.split_fused(update, [6, 3, 3])
    scaled = [
        muon_math.scaled_orthogonal_update(
            p, ns_steps=5, coefficients="simple", method="standard", compute_dtype=torch.float32
        )
        for p in parts
    ]
    expected = initial - 0.1 * muon_math.merge_fused(scaled, [6, 3, 3])
    torch.testing.assert_close(param.detach(), expected, rtol=1e-5, atol=1e-5)


# The fp16 iteration's own error against fp64 on the zoo's 16×24 matrices: standard 0.25%, Gram (one restart)
# 1.5%; the bf16 input rounding adds little, so the bound is about twice the iteration's noise.
STACK_GAP = {"standard": 0.01, "gram": 0.03}


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_bf16_stack_stays_close_to_fp32_stack(method):
    """Default path (bf16 NS input stack, fp16 iteration, fp16 result added in place) against an fp32 stack fed to
    the same fp16 iteration: only the bf16 rounding of the input differs, over 5 steps."""
    initial = _layout_zoo()
    fast, exact = copy.deepcopy(initial), copy.deepcopy(initial)
    _copy_layout_attrs(fast, initial)
    _copy_layout_attrs(exact, initial)
    options = dict(lr=0.01, weight_decay=0.05, method=method)
    _run(Muon(fast, **options), fast, 5)
    reference = Muon(exact, **options)
    reference._stack_dtype = lambda grad_dtype: grad_dtype  # keep the stack in the gradient dtype (fp32)
    _run(reference, exact, 5)
    gap = _relative_gap(fast, exact, initial)
    assert 0.0 < gap < STACK_GAP[method], gap


def test_expert_layouts_equal_separate_expert_matrices():
    experts = _params([(8, 16)] * 3, seed=3)
    stacked = torch.nn.Parameter(torch.stack([e.detach() for e in experts]))
    stacked.muon_num_experts = 3
    concatenated = torch.nn.Parameter(torch.cat([e.detach() for e in experts]))
    concatenated.muon_num_experts = 3
    options = dict(lr=0.05, weight_decay=0.0, method="standard")
    for step in range(3):
        grads = _grads(experts, step)
        for e, g in zip(experts, grads):
            e.grad = g
        stacked.grad, concatenated.grad = torch.stack(grads), torch.cat(grads)
        if step == 0:
            optimizers = [Muon(experts, **options), Muon([stacked], **options), Muon([concatenated], **options)]
        for optimizer in optimizers:
            optimizer.step()
    torch.testing.assert_close(stacked.detach(), torch.stack([e.detach() for e in experts]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(concatenated.detach(), torch.cat([e.detach() for e in experts]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("momentum_dtype", [None, torch.bfloat16])
def test_state_dict_round_trip_resumes_bit_exact(momentum_dtype):
    params = _layout_zoo(seed=5)
    options = dict(lr=0.01, weight_decay=0.1, momentum_dtype=momentum_dtype)
    optimizer = Muon(params, **options)
    _run(optimizer, params, 3)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "params": [p.detach().clone() for p in params]}, buffer)
    _run(optimizer, params, 3, start=3)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [torch.nn.Parameter(t) for t in saved["params"]]
    _copy_layout_attrs(resumed, params)
    restored = Muon(resumed, **options)
    restored.load_state_dict(saved["optimizer"])
    if momentum_dtype is not None:
        assert restored.state[resumed[0]]["momentum_buffer"].dtype == momentum_dtype
    _run(restored, resumed, 3, start=3)
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


def test_mixed_shapes_and_dtypes_in_one_group():
    params = _params([(8, 12), (12, 8)]) + _params([(8, 12)], seed=1, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in params]
    _run(Muon(params, lr=0.01), params, 2)
    assert params[2].dtype == torch.bfloat16
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


def test_plan_follows_params_swapped_after_construction():
    """Megatron swaps fp32 master copies into the param groups after the optimizer is built."""
    params = _params([(8, 12), (8, 12)])
    optimizer = Muon(params, lr=0.01)
    _run(optimizer, params, 1)
    master = torch.nn.Parameter(params[1].detach().clone())
    optimizer.param_groups[0]["params"][1] = master
    optimizer.state[master] = optimizer.state.pop(params[1])
    mirror = [params[0], master]
    before = master.detach().clone()
    _run(optimizer, mirror, 1, start=1)
    assert not torch.equal(master, before)


def test_closure_is_called_and_its_loss_returned():
    (param,) = _params([(4, 6)])
    optimizer = Muon([param], lr=0.01)

    def closure():
        loss = (param**2).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss is not None and param.grad is not None


def test_rejects_a_vector_by_name():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"bias.*1-D.*AdamW"):
        Muon(model.named_parameters())


def test_rejects_an_untagged_3d_tensor_and_unknown_settings():
    conv = torch.nn.Parameter(torch.randn(8, 1, 4))
    with pytest.raises(ValueError, match="muon_num_experts"):
        Muon([conv])
    (param,) = _params([(4, 6)])
    with pytest.raises(ValueError, match="valid names"):
        Muon([param], coefficients="fancy")
    with pytest.raises(ValueError, match="valid choices"):
        Muon([param], scale_mode="fancy")
    with pytest.raises(ValueError, match="valid choices"):
        Muon([param], tp_mode="fancy")


def test_non_finite_gradient_names_the_parameter_and_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(6, 4, bias=False), torch.nn.Linear(4, 6, bias=False))
    optimizer = Muon(model.named_parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    snapshot = copy.deepcopy((optimizer.state_dict(), [p.detach().clone() for p in model.parameters()]))
    model[1].weight.grad = torch.ones_like(model[1].weight)
    model[1].weight.grad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite gradient.*1\.weight.*no optimizer state was changed"):
        optimizer.step()
    state, params = optimizer.state_dict(), list(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params, snapshot[1]))
    for key, value in state["state"].items():
        assert torch.equal(value["momentum_buffer"], snapshot[0]["state"][key]["momentum_buffer"])


def test_step_phases_are_named_in_profiler_traces():
    params = _params(SHAPES)
    optimizer = Muon(params, lr=0.02)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _run(optimizer, params, 1)
    names = {event.name for event in prof.events()}
    for phase in ("muon.stack_momentum", "muon.orthogonalize", "muon.apply_updates"):
        # one range per shape bucket: (16, 48) (two matrices), (48, 16), (32, 32) (two), (24, 40)
        assert sum(name.startswith(phase) for name in names) == 4, (phase, sorted(names))
