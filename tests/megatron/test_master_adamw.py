"""The one-pass mixed-precision AdamW (clip factor, AdamW, 16-bit model copy) against megatron's three passes, and
the clip factor inside our Muon's momentum pass against megatron's clip multiply."""

from pathlib import Path

import pytest
import torch
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

from tests.interpreter import run_under_interpreter


def test_pass_and_megatron_integration_under_triton_interpreter():
    """The pass against torch's AdamW and Adam (L2) with and without a clip factor and model copies; then a bf16
    tiny GPT trained through megatron with clipping on every step, with the pass and without, and with our Muon
    taking the clip factor in its momentum pass and without (see the script)."""
    pytest.importorskip("triton", reason="the interpreter comes with Triton")
    run_under_interpreter(Path(__file__).with_name("_master_adamw_interpret_check.py"), timeout=400)


class _Float16Wrapper(Float16OptimizerWithFloat16Params):
    """Only the attributes of megatron's Float16OptimizerWithFloat16Params that `_attach` reads and replaces (its
    constructor is not run)."""

    def __init__(self, inner, models):
        self.optimizer, self.float16_groups = inner, [models]
        self.fp32_from_float16_groups = [inner.param_groups[0]["params"]]
        self.prepared = 0

    def prepare_grads(self):
        self.prepared += 1
        return False

    def step_with_ready_grads(self):
        return self.optimizer.step()


def _clip_rules(rank, world_size):
    import megatron_muon
    from megatron_muon.megatron import clip_deferral, master_adamw

    megatron_muon.register()  # the device-side clip megatron's path takes for a tensor norm

    masters = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    wrapper = _Float16Wrapper(torch.optim.AdamW(masters), [m.detach().bfloat16() for m in masters])
    one_pass = master_adamw._attach(wrapper)
    clip_deferral.install()
    from megatron.core.optimizer import clip_grads

    grads = [torch.randn(4, 3) for _ in masters]
    for master, grad in zip(masters, grads):
        master.grad = grad.clone()
    results = {}
    clip_grads.clip_grad_by_total_norm_fp32(masters, 1.0, torch.tensor([4.0]))  # all of them: deferred
    results["deferred"] = one_pass.pending is not None and all(torch.equal(m.grad, g) for m, g in zip(masters, grads))
    results["factor"] = float(one_pass.pending)
    clip_grads.clip_grad_by_total_norm_fp32(masters[:1], 1.0, torch.tensor([2.0]))  # a subset: multiplied now
    results["subset_multiplied"] = torch.allclose(masters[0].grad, grads[0] * 0.5) and torch.equal(
        masters[1].grad, grads[1])
    clip_grads.clip_grad_by_total_norm_fp32(masters, 1.0, 0.5)  # a host norm below max_norm: nothing happens
    results["unclipped_host_norm_kept_pending"] = float(one_pass.pending) == results["factor"]
    wrapper.prepare_grads()
    results["cleared_by_next_step"] = one_pass.pending is None and wrapper.prepared == 1
    clip_grads.clip_grad_by_total_norm_fp32([torch.nn.Parameter(torch.ones(2))], 1.0, 4.0)  # not claimed: megatron
    return results


def test_clip_is_deferred_only_for_exactly_the_claimed_params(rank_pool_1):
    (results,) = rank_pool_1.run(_clip_rules)
    assert results["deferred"] and results["factor"] == pytest.approx(1.0 / (4.0 + 1e-6))
    assert results["subset_multiplied"] and results["unclipped_host_norm_kept_pending"]
    assert results["cleared_by_next_step"]


def _install_on_cpu(rank, world_size):
    from megatron_muon.megatron.master_adamw import install_master_adamw
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_training_setup

    init_model_parallel(1, 1)
    _, optimizer = build_training_setup("adam", bf16=True)
    return install_master_adamw(optimizer)


def test_nothing_is_installed_where_triton_does_not_run(rank_pool_1):
    assert rank_pool_1.run(_install_on_cpu) == [0]  # CPU tensors outside the interpreter keep megatron's path


def _train_on_gpu(install: bool):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_muon
    from megatron_muon.megatron.master_adamw import install_master_adamw
    from megatron_muon.testing.training import build_training_setup, train_step

    megatron_muon.register()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model, optimizer = build_training_setup("adam", bf16=True, lr=1e-2, clip_grad=0.05)
    installed = install_master_adamw(optimizer) if install else 0
    losses = [train_step(model, optimizer, step) for step in range(2)]
    part = optimizer.chained_optimizers[0]
    masters = [p.detach().clone() for group in part.fp32_from_float16_groups for p in group]
    copies_exact = all(torch.equal(model_param.detach(), master.detach().bfloat16())
                       for models, mains in zip(part.float16_groups, part.fp32_from_float16_groups)
                       for model_param, master in zip(models, mains))
    moments = [part.optimizer.state[p]["exp_avg"].clone() for group in part.fp32_from_float16_groups for p in group]
    return installed, losses, masters, moments, copies_exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_pass_equals_megatrons_three_passes(single_gpu_model_parallel):
    """Two clipped bf16 steps of a tiny GPT: same losses, master weights and moments within fp32 rounding, and
    every bf16 model weight is its master rounded as torch rounds."""
    reference, ours = _train_on_gpu(False), _train_on_gpu(True)
    assert reference[0] == 0 and ours[0] == 1 and ours[4]
    torch.testing.assert_close(ours[1], reference[1], rtol=1e-6, atol=0)
    for got, want in zip(ours[2], reference[2]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(ours[3], reference[3]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-10)


def _muon_fold_on_cpu(rank, world_size):
    from megatron_muon.megatron import clip_deferral
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_training_setup

    init_model_parallel(1, 1)
    _, optimizer = build_training_setup("muon", bf16=True)
    return clip_deferral.install_for_muon(optimizer)


def test_the_muon_clip_fold_needs_the_fused_momentum_pass(rank_pool_1):
    assert rank_pool_1.run(_muon_fold_on_cpu) == [0]  # on CPU Muon's momentum is foreach: megatron keeps the clip


def _fused_muon_wrappers_if_fused(rank, world_size, name):
    import megatron_muon
    from megatron_muon.megatron.muon_wrappers import fused_muon_wrappers
    from megatron_muon.optimizer import fused_elementwise
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_training_setup

    megatron_muon.register()
    init_model_parallel(1, 1)
    _, optimizer = build_training_setup(name, bf16=True)
    real = fused_elementwise.use_fused
    fused_elementwise.use_fused = lambda *args, **kwargs: True  # as on a GPU with Triton
    try:
        return len(fused_muon_wrappers(optimizer))
    finally:
        fused_elementwise.use_fused = real


def test_the_muon_fast_paths_leave_dist_muon_to_megatrons_clip_and_copy(rank_pool_1):
    """dist_muon's owner engine reads no deferred clip factor and writes no model copies: were its wrapper taken
    over, its gradients would go unclipped and its bf16 weights would never change."""
    assert rank_pool_1.run(_fused_muon_wrappers_if_fused, "muon") == [1]
    assert rank_pool_1.run(_fused_muon_wrappers_if_fused, "dist_muon") == [0]


def _train_muon_on_gpu(fold: bool, model_copy: bool = False):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_muon
    from megatron_muon.megatron import clip_deferral
    from megatron_muon.megatron.muon_model_copy import install_muon_model_copy
    from megatron_muon.testing.training import build_training_setup, train_step

    megatron_muon.register()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model, optimizer = build_training_setup("muon", bf16=True, lr=1e-2, clip_grad=0.05)
    installed = clip_deferral.install_for_muon(optimizer) if fold else 0
    installed += install_muon_model_copy(optimizer) if model_copy else 0
    losses = [train_step(model, optimizer, step) for step in range(3)]
    masters = [p.detach().clone() for part in optimizer.chained_optimizers
               for group in part.fp32_from_float16_groups for p in group]
    return installed, losses, masters, [p.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_muon_clip_fold_trains_bit_for_bit_as_megatrons_clip(single_gpu_model_parallel):
    reference, folded = _train_muon_on_gpu(False), _train_muon_on_gpu(True)
    assert reference[0] == 0 and folded[0] == 1
    assert folded[1] == reference[1]
    assert all(torch.equal(a, b) for a, b in zip(folded[2], reference[2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_muons_model_copies_train_bit_for_bit_as_megatrons_copy(single_gpu_model_parallel):
    reference, ours = _train_muon_on_gpu(True), _train_muon_on_gpu(True, model_copy=True)
    assert reference[0] == 1 and ours[0] == 2
    assert ours[1] == reference[1]
    assert all(torch.equal(a, b) for a, b in zip(ours[2], reference[2]))
    assert all(torch.equal(a, b) for a, b in zip(ours[3], reference[3]))


def test_te_fused_adam_qualifies_only_as_megatron_builds_it_without_precision_aware_state(monkeypatch):
    """megatron's plain build (fp32 moments, masters in its wrapper, host lr) takes the pass; TE's precision-aware
    options, capturable mode and decoupled gradients keep TE's own step."""
    from types import SimpleNamespace

    from megatron_muon.megatron import master_adamw

    plain = dict(master_weights=False, capturable=False, use_decoupled_grad=False, store_param_remainders=False,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, adam_w_mode=1,
                 initialize_state=lambda param, remainders: None)
    assert master_adamw.te_adam_qualifies(SimpleNamespace(**plain))
    for change in [dict(master_weights=True), dict(capturable=True), dict(use_decoupled_grad=True),
                   dict(store_param_remainders=True), dict(exp_avg_dtype=torch.bfloat16),
                   dict(exp_avg_sq_dtype=torch.float16)]:
        assert not master_adamw.te_adam_qualifies(SimpleNamespace(**{**plain, **change})), change
    for missing in plain:  # an older TE without one of these keeps its own step; without remainders it stores none
        without = SimpleNamespace(**{key: value for key, value in plain.items() if key != missing})
        assert master_adamw.te_adam_qualifies(without) == (missing == "store_param_remainders"), missing

    class FusedAdam:  # stands in for TE's class: the layout is chosen by exact type
        pass

    monkeypatch.setattr(master_adamw, "te_fused_adam_class", lambda: FusedAdam)
    assert master_adamw._is_te_adam(FusedAdam()) and not master_adamw._is_te_adam(torch.optim.AdamW([torch.zeros(1)]))
    monkeypatch.setattr(master_adamw, "te_fused_adam_class", lambda: None)
    assert not master_adamw._is_te_adam(FusedAdam())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_pass_over_te_fused_adam_equals_its_step():
    """Three steps of the pass in TE FusedAdam's layout against TE's own step (AdamW and L2 modes, a clip factor):
    masters and moments within fp32 rounding, the group counts equal, and the bf16 copies are the masters rounded."""
    from megatron_muon.megatron.master_adamw import te_fused_adam_class
    from megatron_muon.optimizer.one_pass_adamw import OnePassAdamW

    FusedAdam = te_fused_adam_class()
    if FusedAdam is None:
        pytest.skip("needs Transformer Engine (pip install megatron-muon[te])")
    g = torch.Generator(device="cuda").manual_seed(0)
    for adam_w_mode, factor in [(True, None), (True, 0.3), (False, 0.3)]:
        mains = [torch.randn(size, device="cuda", generator=g) for size in [(512, 384), (4099,), (3, 5)]]
        reference = [m.clone() for m in mains]
        options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=adam_w_mode)
        models = [m.bfloat16() for m in mains]
        ours = OnePassAdamW(FusedAdam(mains, **options), {id(m): c for m, c in zip(mains, models)}, group_step=True)
        te = FusedAdam(reference, **options)
        for _ in range(3):
            for main, ref in zip(mains, reference):
                grad = torch.randn(main.shape, device="cuda", generator=g)
                main.grad, ref.grad = grad.clone(), grad * factor if factor is not None else grad
            ours.pending = None if factor is None else torch.tensor([factor], device="cuda")
            assert ours.run()
            te.step()
        assert ours.inner.param_groups[0]["step"] == te.param_groups[0]["step"] == 3
        for main, ref, model in zip(mains, reference, models):
            torch.testing.assert_close(main, ref, rtol=1e-5, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):  # moments of order-1 gradients: TE's CUDA kernel and ours
                # contract multiply-adds differently, which moves a value by an ulp of its operands (~6e-8), seen
                # as 2.6e-8 on moments that cancel to near zero; a wrong formula errs by orders more
                torch.testing.assert_close(ours.inner.state[main][key], te.state[ref][key], rtol=1e-5, atol=1e-7)
            assert torch.equal(model, main.bfloat16())
