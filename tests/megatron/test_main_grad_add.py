"""Our main_grad accumulation hook: it adds every micro-batch's gradient exactly once, megatron's add is skipped,
and the buffers end equal to megatron's own accumulation (CPU: both add with torch, so bit for bit)."""

import pytest
import torch

from megatron_muon.kernels import grad_accumulate
from megatron_muon.megatron import main_grad_add


def _main_grads(rank, world_size, hooked: bool, overlap: bool, overwrite: bool = False, gradless: str | None = None,
                replace_wrapper: bool = False, distributed: bool = False, overwriting_class: bool = False):
    """main_grads after each of 3 steps of 4 micro-batches; `gradless` gets no gradient in the second step.
    `replace_wrapper`: after the first step, something replaces a bucket group's finish_grad_sync wrapper."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from megatron_muon.testing.models import build_tiny_gpt, forward_backward, synthetic_batch, tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(1, 1)
    torch.manual_seed(0)
    config = tiny_transformer_config(bf16=True)
    module = Float16Module(config, build_tiny_gpt(config))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
                                               use_distributed_optimizer=distributed)
    if overwriting_class:  # the class the owner path builds: hooks and overwrite without patching DDP
        from megatron_muon.megatron.overwriting_ddp import OverwritingDistributedDataParallel

        model = OverwritingDistributedDataParallel(config, ddp_config, module)
        assert model.overwrites_first_gradient and not vars(model).get("zero_grad_buffer")
    else:
        model = DistributedDataParallel(config, ddp_config, module)
    config.finalize_model_grads_func = finalize_model_grads
    calls = []
    if hooked:
        count = main_grad_add.install_main_grad_add(model)  # the overwriting class hooked them when it was built
        assert len(list(model.parameters())) > 0
        assert count == (0 if overwriting_class else len(list(model.parameters())))
        assert main_grad_add.install_main_grad_add(model) == 0  # idempotent: a second hook would add twice
        original = grad_accumulate.accumulate
        grad_accumulate.accumulate = lambda main_grad, grad, overwrite=False: (
            calls.append(grad.shape), original(main_grad, grad, overwrite))
    if overwrite:
        assert main_grad_add.install_first_grad_overwrite(model)
        assert main_grad_add.install_first_grad_overwrite(model)  # idempotent
    named = dict(model.named_parameters())
    if gradless is not None:
        (gradless,) = [name for name in named if name.endswith(gradless)]
    try:
        grads, zeroed = [], []
        for step in range(3):  # zero_grad_buffer must clear the flag: later steps add again
            if replace_wrapper and step == 1:
                group = model.bucket_groups[0]
                group.finish_grad_sync = type(group).finish_grad_sync.__get__(group)
            model.zero_grad_buffer()
            zeroed.append(all(p.main_grad.abs().sum() == 0 for p in named.values()))
            if gradless is not None:
                named[gradless].requires_grad_(step != 1)
            forward_backward(model, [synthetic_batch(8 * step + 4 * rank + i) for i in range(4)])
            grads.append({name: p.main_grad.clone() for name, p in named.items()})
        if gradless is not None:
            named[gradless].requires_grad_(True)
    finally:
        if hooked:
            grad_accumulate.accumulate = original
    return {"grads": grads, "calls": len(calls), "params": len(named), "zeroed": zeroed}


def test_hook_accumulates_each_micro_batch_once(rank_pool_1):
    for overlap in (False, True):
        reference = rank_pool_1.run(_main_grads, False, overlap)[0]
        hooked = rank_pool_1.run(_main_grads, True, overlap)[0]
        assert hooked["calls"] == 3 * 4 * hooked["params"]  # 3 steps x 4 micro-batches x every parameter
        for got, expected in zip(hooked["grads"], reference["grads"], strict=True):
            for name, value in expected.items():
                assert value.abs().sum() > 0, name
                torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


GRADLESS = "final_layernorm.weight"  # a name suffix


def test_first_gradient_overwrites_main_grad_without_zeroed_buffers(rank_pool_1):
    """Buffers left unzeroed between steps still end every step equal to megatron's, bit for bit, with and without
    overlapped reduction; a parameter without a gradient in the second step ends it at zero, not at its
    gradient of the first step."""
    for overlap in (False, True):
        gradless = None if overlap else GRADLESS  # overlap waits for every parameter's gradient before reducing
        reference = rank_pool_1.run(_main_grads, False, overlap, False, gradless)[0]
        fast = rank_pool_1.run(_main_grads, True, overlap, True, gradless)[0]
        assert reference["zeroed"] == [True] * 3 and fast["zeroed"] == [True, False, False]  # buffers kept
        for step, (got, expected) in enumerate(zip(fast["grads"], reference["grads"], strict=True)):
            for name, value in expected.items():
                if gradless is not None and name.endswith(gradless) and step == 1:
                    assert value.abs().sum() == 0
                else:
                    assert value.abs().sum() > 0, name
                torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{name} step {step}")


def test_first_gradient_overwrite_equals_zeroed_buffers_across_two_ranks(rank_pool_2):
    """dp=2, all-reduced and reduce-scattered (megatron's distributed optimizer): every rank's buffers, reduced
    shard and the rest, equal megatron's after each step."""
    for distributed in (False, True):
        reference = rank_pool_2.run(_main_grads, False, False, False, GRADLESS, False, distributed)
        fast = rank_pool_2.run(_main_grads, True, False, True, GRADLESS, False, distributed)
        for rank_fast, rank_reference in zip(fast, reference, strict=True):
            assert rank_fast["zeroed"] == [True, False, False]
            for got, expected in zip(rank_fast["grads"], rank_reference["grads"], strict=True):
                for name, value in expected.items():
                    torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{name} {distributed}")


def test_the_overwriting_ddp_class_equals_zeroed_buffers(rank_pool_1, rank_pool_2):
    """OverwritingDistributedDataParallel (no patch of megatron's objects): one rank with and without overlapped
    reduction, two ranks all-reduced and reduce-scattered; a parameter without a gradient in the second step ends it
    at zero; every buffer equals megatron's, bit for bit, after each step."""
    runs = [(rank_pool_1, overlap, distributed) for overlap in (False, True) for distributed in (False,)]
    runs += [(rank_pool_2, False, distributed) for distributed in (False, True)]
    for pool, overlap, distributed in runs:
        gradless = None if overlap else GRADLESS
        reference = pool.run(_main_grads, False, overlap, False, gradless, False, distributed)
        fast = pool.run(_main_grads, True, overlap, False, gradless, False, distributed, True)
        for rank_fast, rank_reference in zip(fast, reference, strict=True):
            assert rank_fast["zeroed"] == [True, False, False]
            for step, (got, expected) in enumerate(zip(rank_fast["grads"], rank_reference["grads"], strict=True)):
                for name, value in expected.items():
                    if gradless is not None and name.endswith(gradless) and step == 1:
                        assert value.abs().sum() == 0
                    torch.testing.assert_close(got[name], value, rtol=0, atol=0,
                                               msg=f"{name} step {step} overlap {overlap} distributed {distributed}")


def test_first_gradient_overwrite_falls_back_when_its_wrapper_is_replaced(rank_pool_1):
    """Something that replaces the group's sync wrapper after install would skip the zeroing of gradless
    parameters: zero_grad_buffer then zeroes as megatron does, and the results stay megatron's."""
    reference = rank_pool_1.run(_main_grads, False, False, False, GRADLESS)[0]
    fast = rank_pool_1.run(_main_grads, True, False, True, GRADLESS, True)[0]
    assert fast["zeroed"] == [True, True, True]
    for got, expected in zip(fast["grads"], reference["grads"], strict=True):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_first_gradient_overwrite_declines_without_the_add_hooks(rank_pool_1):
    assert rank_pool_1.run(_declines_without_hooks)[0]


def _declines_without_hooks(rank, world_size):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_muon.testing.models import build_tiny_gpt, tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(1, 1)
    config = tiny_transformer_config()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), build_tiny_gpt(config))
    declined = not main_grad_add.install_first_grad_overwrite(model)
    config.gradient_accumulation_fusion = True
    main_grad_add.install_main_grad_add(model)
    return declined and not main_grad_add.install_first_grad_overwrite(model)


def test_accumulate_falls_back_to_torch_off_the_gpu_and_for_other_dtypes():
    main = torch.zeros(5)
    grad_accumulate.accumulate(main, torch.ones(5, dtype=torch.bfloat16))
    grad_accumulate.accumulate(main, torch.full((5,), 2.0))
    assert torch.equal(main, torch.full((5,), 3.0))
    grad_accumulate.accumulate(main, torch.ones(5, dtype=torch.bfloat16), overwrite=True)
    assert torch.equal(main, torch.ones(5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_accumulate_equals_torch_add_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    for numel, dtype in [(3 * 4096 + 17, torch.bfloat16), (1 << 20, torch.float16)]:
        main = torch.randn(numel, device="cuda", generator=g)
        grad = torch.randn(numel, device="cuda", generator=g).to(dtype)
        expected = main + grad.float()
        grad_accumulate.accumulate(main, grad)
        assert torch.equal(main, expected)
        grad_accumulate.accumulate(main, grad, overwrite=True)
        assert torch.equal(main, grad.float())


def _train_on_gpu(overwrite: bool):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_muon.megatron.fast_paths import install_fast_paths
    from megatron_muon.testing.training import build_training_setup, train_step

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model, optimizer = build_training_setup("adam", bf16=True, lr=1e-2, clip_grad=0.05)
    installed = install_fast_paths(optimizer, [model], first_grad_overwrite=overwrite)
    losses = [train_step(model, optimizer, step) for step in range(3)]
    return installed["first_grad_overwrite_chunks"], losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_first_gradient_overwrite_trains_bit_for_bit_as_zeroed_buffers(single_gpu_model_parallel):
    reference, ours = _train_on_gpu(False), _train_on_gpu(True)
    assert reference[0] == 0 and ours[0] == 1
    assert ours[1] == reference[1]
    assert all(torch.equal(a, b) for a, b in zip(ours[2], reference[2]))


def _dist_muon_run(rank, world_size, overwrite: bool):
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_muon_setup, full_parameters, train_step

    init_model_parallel(1, 1)
    torch.manual_seed(0)
    model, optimizer = build_muon_setup("dist_muon", "bf16", "gpt")
    if overwrite:  # after the optimizer build, as install_fast_paths does: the owner sync is already in place
        main_grad_add.install_main_grad_add(model)
        assert main_grad_add.install_first_grad_overwrite(model)
    losses = [train_step(model, optimizer, step) for step in range(3)]
    return losses, full_parameters(model)


def test_first_gradient_overwrite_under_dist_muons_owner_gradient_sync(rank_pool_2):
    """dp=2 dist_muon: Muon gradients reduce-scattered to their owners through the sync that replaces megatron's;
    three bf16 steps with unzeroed buffers train bit for bit as with zeroed ones."""
    reference = rank_pool_2.run(_dist_muon_run, False)
    fast = rank_pool_2.run(_dist_muon_run, True)
    for (losses, params), (reference_losses, reference_params) in zip(fast, reference, strict=True):
        assert losses == reference_losses
        for name, value in reference_params.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)
