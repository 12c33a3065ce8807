"""Run under TRITON_INTERPRET=1 in a subprocess: the one-pass mixed-precision AdamW on CPU against torch.

1. The pass alone against torch's AdamW / Adam (L2) on tensors of several sizes (partial blocks, several blocks),
   with and without a clip factor and a bf16 model copy, over three steps.
2. Through megatron: a tiny GPT in bf16 with clipping active, trained with the pass installed and without; the
   losses and every master weight agree, the clip factor was left with the pass, and the model copy matches.
3. Through megatron with our Muon: the clip factor left with Muon's fused momentum pass gives the same training,
   bit for bit, as megatron's clip multiply.
"""

import datetime
import os

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.optimizer import one_pass_adamw  # noqa: E402
from megatron_muon.testing.pool import free_port  # noqa: E402

TOLERANCE = dict(rtol=2e-6, atol=1e-7)  # the interpreter computes some fp32 products in fp64; torch does not


def check_the_pass_alone():
    g = torch.Generator().manual_seed(0)
    sizes = [(3, 5), (one_pass_adamw.BLOCK + 17,), (2, one_pass_adamw.BLOCK)]
    cases = [(torch.optim.AdamW, None, 0), (torch.optim.AdamW, 0.3, 0), (torch.optim.Adam, None, 0),
             (torch.optim.Adam, 0.3, 0), (torch.optim.AdamW, 0.3, 1)]  # offset 1: gradients not 16-byte aligned
    for optimizer_class, factor, offset in cases:
        mains = [torch.randn(size, generator=g) for size in sizes]
        reference = [m.clone() for m in mains]
        models = [m.bfloat16() for m in mains[:2]]  # the last one has no model copy (an fp32 model param)
        options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
        model_of = {id(main): model for main, model in zip(mains, models)}
        ours = one_pass_adamw.OnePassAdamW(optimizer_class(mains, **options), model_of)
        torch_optimizer = optimizer_class(reference, **options)
        for _ in range(3):
            grads = [torch.randn(m.shape, generator=g) for m in mains]
            for main, ref, grad in zip(mains, reference, _in_one_buffer(grads, offset)):
                main.grad = grad
                ref.grad = grad * factor if factor is not None else grad.clone()
            ours.pending = None if factor is None else torch.tensor([factor])
            assert ours.run() and ours.pending is None
            torch_optimizer.step()
        for main, ref in zip(mains, reference):
            torch.testing.assert_close(main, ref, **TOLERANCE)
            ours_state, torch_state = ours.inner.state[main], torch_optimizer.state[ref]
            assert float(ours_state["step"]) == float(torch_state["step"]) == 3.0
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours_state[key], torch_state[key], **TOLERANCE)
        for model, main in zip(models, mains):  # the model copy is the master weight rounded as torch rounds
            assert torch.equal(model, main.bfloat16())


def check_parameters_that_miss_steps():
    """A parameter without a gradient in some step keeps its own step count (bias correction), as in torch."""
    g = torch.Generator().manual_seed(1)
    mains = [torch.randn(size, generator=g) for size in [(4, 8), (one_pass_adamw.BLOCK + 3,), (2, 5)]]
    reference = [m.clone() for m in mains]
    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    ours = one_pass_adamw.OnePassAdamW(torch.optim.AdamW(mains, **options), {})
    torch_optimizer = torch.optim.AdamW(reference, **options)
    for with_grad in [(True, True, True), (False, True, True), (False, True, False), (True, True, True)]:
        for main, ref, has_grad in zip(mains, reference, with_grad):
            grad = torch.randn(main.shape, generator=g)
            main.grad, ref.grad = (grad.clone(), grad) if has_grad else (None, None)
        assert ours.run()
        torch_optimizer.step()
    assert [float(ours.inner.state[m]["step"]) for m in mains] == [2.0, 4.0, 3.0]
    for main, ref in zip(mains, reference):
        torch.testing.assert_close(main, ref, **TOLERANCE)


class _TELayoutAdam(torch.optim.Optimizer):
    """Transformer Engine FusedAdam's state layout and arithmetic in plain torch (TE is not installable on a CPU
    machine): one integer `step` per group that advances every step, apex's multi_tensor_adam update
    (p -= lr·(m̂/(√v̂ + eps) + wd·p) in AdamW mode, L2 into the gradient otherwise), optional bias correction."""

    def __init__(self, params, lr, betas, eps, weight_decay, bias_correction=True, adam_w_mode=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.adam_w_mode = 1 if adam_w_mode else 0

    def initialize_state(self, param, store_param_remainders):
        self.state[param]["exp_avg"] = torch.zeros_like(param)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), count = group["betas"], group["step"]
            bc1, bc2 = (1 - beta1**count, 1 - beta2**count) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.initialize_state(p, False)
                m, v, g = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"], p.grad
                if not self.adam_w_mode:
                    g = g + group["weight_decay"] * p
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * p
                p.sub_(group["lr"] * update)


def check_te_layout():
    """With `group_step` the pass keeps TE FusedAdam's layout and matches its arithmetic: AdamW and L2 modes, with
    and without bias correction and a clip factor, a parameter without a gradient in some steps (its group's count
    still advances, as TE's does) and an empty group."""
    g = torch.Generator().manual_seed(2)
    for adam_w_mode, bias_correction, factor in [(True, True, None), (True, True, 0.3), (False, True, 0.3),
                                                 (True, False, None)]:
        mains = [torch.randn(size, generator=g) for size in [(4, 8), (one_pass_adamw.BLOCK + 3,), (2, 5)]]
        reference = [m.clone() for m in mains]
        options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, bias_correction=bias_correction,
                       adam_w_mode=adam_w_mode)

        def groups(params):
            return [{"params": params[:2]}, {"params": params[2:]}, {"params": []}]

        models = [m.bfloat16() for m in mains]
        ours = one_pass_adamw.OnePassAdamW(_TELayoutAdam(groups(mains), **options),
                                           {id(m): c for m, c in zip(mains, models)}, group_step=True)
        te = _TELayoutAdam(groups(reference), **options)
        for with_grad in [(True, True, True), (True, True, False), (False, True, True)]:
            for main, ref, has_grad in zip(mains, reference, with_grad):
                grad = torch.randn(main.shape, generator=g)
                main.grad = grad.clone() if has_grad else None
                ref.grad = (grad * factor if factor is not None else grad) if has_grad else None
            ours.pending = None if factor is None else torch.tensor([factor])
            assert ours.run()
            te.step()
        assert [group["step"] for group in ours.inner.param_groups] == [3, 3, 3]
        assert [group["step"] for group in te.param_groups] == [3, 3, 3]
        for main, ref, model in zip(mains, reference, models):
            torch.testing.assert_close(main, ref, rtol=1e-5, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.inner.state[main][key], te.state[ref][key], **TOLERANCE)
            assert "step" not in ours.inner.state[main]
            assert torch.equal(model, main.bfloat16())


def _in_one_buffer(tensors, offset: int):
    """Copies of `tensors` as views of one buffer, the first starting `offset` elements in (as megatron's DDP)."""
    flat = torch.zeros(offset + sum(t.numel() for t in tensors))
    views, start = [], offset
    for tensor in tensors:
        views.append(flat[start:start + tensor.numel()].view(tensor.shape).copy_(tensor))
        start += tensor.numel()
    return views


def _train_tiny_gpt(install: bool, steps: int = 2):
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_training_setup, train_step

    import megatron_muon
    from megatron_muon.megatron.fast_paths import install_fast_paths

    megatron_muon.register()  # as the training loop: the grad norm and the clip factor stay on the device
    init_model_parallel(1, 1)
    torch.manual_seed(0)
    model, optimizer = build_training_setup("adam", bf16=True, lr=1e-2, clip_grad=0.05)  # every step clipped
    installed = install_fast_paths(optimizer)["one_pass_adamw"] if install else 0
    if install:  # a second call (the training CLI after megatron_muon.launch's hook, say) takes over nothing
        assert set(install_fast_paths(optimizer).values()) == {0}
    deferred = []
    if install:
        owner = _float16_part(optimizer).one_pass_adamw
        run = owner.run
        owner.run = lambda: (deferred.append(owner.pending is not None), run())[1]
    losses = [train_step(model, optimizer, step) for step in range(steps)]
    model_copies = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    return installed, deferred, losses, model_copies, optimizer


def _float16_part(optimizer):
    """megatron returns a ChainedOptimizer even around a single mixed-precision optimizer."""
    return getattr(optimizer, "chained_optimizers", [optimizer])[0]


def _masters(optimizer):
    return [p for group in _float16_part(optimizer).fp32_from_float16_groups for p in group]


def _moments(optimizer):
    inner = _float16_part(optimizer).optimizer
    return [inner.state[p][key] for group in inner.param_groups for p in group["params"]
            for key in ("exp_avg", "exp_avg_sq")]


def check_through_megatron():
    from megatron_muon._cpu import enable_cpu_mode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    enable_cpu_mode(nan_empty=True)
    _, _, reference_losses, _, reference_optimizer = _train_tiny_gpt(install=False)
    from megatron_muon.testing.parallel import destroy_model_parallel

    destroy_model_parallel()
    installed, deferred, losses, model_copies, optimizer = _train_tiny_gpt(install=True)
    assert installed == 1 and deferred == [True] * len(losses), (installed, deferred)
    # Two steps: later, an ulp of fp32 rounding (ours vs torch's foreach AdamW) that moves a bf16 model weight across
    # a rounding boundary changes the next gradients, and Adam turns a sign flip of a tiny gradient into ~lr
    torch.testing.assert_close(losses, reference_losses, rtol=1e-6, atol=0)
    for ours, expected in zip(_masters(optimizer), _masters(reference_optimizer)):
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    # Adam's update barely depends on the gradient scale; its moments do: the clip factor was applied
    for ours, expected in zip(_moments(optimizer), _moments(reference_optimizer)):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-10)
    part = _float16_part(optimizer)
    for mains, models in zip(part.fp32_from_float16_groups, part.float16_groups):
        for main, model in zip(mains, models):  # the pass wrote every model copy
            assert torch.equal(model.detach(), main.detach().bfloat16())
    assert model_copies


def _train_muon(fold: bool, model_copy: bool = False, steps: int = 3):
    """Muon in bf16 through megatron, every step clipped: (installed, factor pending per step, losses, masters,
    bf16 model weights, how often megatron's master-to-model copy ran)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    import megatron_muon
    from megatron_muon.megatron import clip_deferral
    from megatron_muon.megatron.muon_model_copy import install_muon_model_copy
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_training_setup, train_step

    megatron_muon.register()
    init_model_parallel(1, 1)
    torch.manual_seed(0)
    model, optimizer = build_training_setup("muon", bf16=True, lr=1e-2, clip_grad=0.05)
    installed = clip_deferral.install_for_muon(optimizer) if fold else 0
    installed += install_muon_model_copy(optimizer) if model_copy else 0
    muon = next(part.optimizer for part in optimizer.chained_optimizers
                if hasattr(part.optimizer, "pending_grad_factor"))
    factors, copies = [], []
    step, copy = muon.step, Float16OptimizerWithFloat16Params._copy_main_params_to_model_params

    def recording_step(*args, **kwargs):
        factors.append(muon.pending_grad_factor is not None)
        return step(*args, **kwargs)

    def counting_copy(wrapper):
        copies.append(wrapper.optimizer is muon)
        return copy(wrapper)

    muon.step = recording_step
    Float16OptimizerWithFloat16Params._copy_main_params_to_model_params = counting_copy
    try:
        losses = [train_step(model, optimizer, i) for i in range(steps)]
    finally:
        Float16OptimizerWithFloat16Params._copy_main_params_to_model_params = copy
    masters = [p.detach().clone() for part in optimizer.chained_optimizers
               for group in part.fp32_from_float16_groups for p in group]
    weights = [p.detach().clone() for p in model.parameters()]
    return installed, factors, losses, masters, weights, copies.count(True)


def check_muon_clip_fold():
    from megatron_muon.testing.parallel import destroy_model_parallel

    destroy_model_parallel()
    _, reference_factors, reference_losses, reference_masters, _, _ = _train_muon(fold=False)
    destroy_model_parallel()
    folded, factors, losses, masters, _, _ = _train_muon(fold=True)
    assert folded == 1 and factors == [True] * len(losses) and reference_factors == [False] * len(losses)
    assert losses == reference_losses, (losses, reference_losses)
    assert all(torch.equal(a, b) for a, b in zip(masters, reference_masters))


def check_muon_model_copy():
    """Muon's update pass writing the bf16 model copies trains bit for bit as megatron's copy after the step, and
    megatron's copy no longer runs for Muon's wrapper."""
    from megatron_muon.testing.parallel import destroy_model_parallel

    destroy_model_parallel()
    _, _, reference_losses, reference_masters, reference_weights, reference_copies = _train_muon(fold=True)
    destroy_model_parallel()
    installed, _, losses, masters, weights, copies = _train_muon(fold=True, model_copy=True)
    assert installed == 2 and reference_copies == len(losses) and copies == 0, (installed, reference_copies, copies)
    assert losses == reference_losses, (losses, reference_losses)
    assert all(torch.equal(a, b) for a, b in zip(masters, reference_masters))
    assert all(torch.equal(a, b) for a, b in zip(weights, reference_weights))


def main():
    check_the_pass_alone()
    check_parameters_that_miss_steps()
    check_te_layout()
    check_through_megatron()
    check_muon_clip_fold()
    check_muon_model_copy()
    print("interpreter ok")


if __name__ == "__main__":
    main()
