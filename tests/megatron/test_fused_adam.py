"""Switching megatron's torch-AdamW fallback to torch's fused kernel: same updates, only plain Adam groups touched."""

import torch

from megatron_muon.megatron.fused_adam import _inner_optimizers, use_fused_torch_adam


def _train(rank, world_size, optimizer_name, bf16, fused, steps=3):
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_training_setup, full_parameters, train_step

    import megatron_muon

    megatron_muon.register()
    init_model_parallel(1, 1)
    torch.manual_seed(0)
    model, optimizer = build_training_setup(optimizer_name, bf16=bf16, lr=1e-2)
    switched = use_fused_torch_adam(optimizer, devices=("cpu",)) if fused else 0
    inner_flags = [(type(o).__name__, [g.get("fused") for g in o.param_groups]) for o in _inner_optimizers(optimizer)]
    losses = [train_step(model, optimizer, step) for step in range(steps)]
    return {"switched": switched, "flags": inner_flags, "losses": losses, "params": full_parameters(model)}


def _compare(reference, fused, atol):
    assert fused["switched"] > 0
    for name, expected in reference["params"].items():
        torch.testing.assert_close(fused["params"][name], expected, rtol=0, atol=atol, msg=name)


def test_fused_adam_equals_foreach_fp32(rank_pool_1):
    reference = rank_pool_1.run(_train, "adam", False, False)[0]
    fused = rank_pool_1.run(_train, "adam", False, True)[0]
    assert all(flag is True for _, flags in fused["flags"] for flag in flags), fused["flags"]
    # Same math, different kernels: fp32 rounding only (a wrong update moves params by ~lr = 1e-2).
    _compare(reference, fused, atol=1e-5)


def test_fused_adam_under_muon_switches_only_the_adam_part_bf16(rank_pool_1):
    reference = rank_pool_1.run(_train, "muon", True, False)[0]
    fused = rank_pool_1.run(_train, "muon", True, True)[0]
    by_type = dict(fused["flags"])
    assert by_type["AdamW"] and all(by_type["AdamW"]) and not any(by_type["Muon"]), fused["flags"]
    _compare(reference, fused, atol=1e-5)


def test_nothing_to_switch_on_other_devices():
    param = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = torch.optim.AdamW([param])
    assert use_fused_torch_adam(optimizer) == 0  # default devices=("cuda",), params on CPU
    assert not optimizer.param_groups[0].get("fused")
