"""Our main_grad accumulation hook: it adds every micro-batch's gradient exactly once, megatron's add is skipped,
and the buffers end equal to megatron's own accumulation (CPU: both add with torch, so bit for bit)."""

import pytest
import torch

from megatron_muon.megatron import main_grad_add


def _main_grads(rank, world_size, hooked: bool, overlap: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from megatron_muon.testing.models import build_tiny_gpt, forward_backward, synthetic_batch, tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(1, 1)
    torch.manual_seed(0)
    config = tiny_transformer_config(bf16=True)
    module = Float16Module(config, build_tiny_gpt(config))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap)
    model = DistributedDataParallel(config, ddp_config, module)
    config.finalize_model_grads_func = finalize_model_grads
    calls = []
    if hooked:
        count = main_grad_add.install_main_grad_add(model)
        assert count == len(list(model.parameters())) > 0
        assert main_grad_add.install_main_grad_add(model) == 0  # idempotent: a second hook would add twice
        original = main_grad_add.accumulate
        main_grad_add.accumulate = lambda main_grad, grad: (calls.append(grad.shape), original(main_grad, grad))
    try:
        grads = []
        for step in range(2):  # zero_grad_buffer must clear the flag: the second step adds again
            model.zero_grad_buffer()
            forward_backward(model, [synthetic_batch(4 * step + i) for i in range(4)])
            grads.append({name: p.main_grad.clone() for name, p in model.named_parameters()})
    finally:
        if hooked:
            main_grad_add.accumulate = original
    return {"grads": grads, "calls": len(calls), "params": len(list(model.parameters()))}


def test_hook_accumulates_each_micro_batch_once(rank_pool_1):
    for overlap in (False, True):
        reference = rank_pool_1.run(_main_grads, False, overlap)[0]
        hooked = rank_pool_1.run(_main_grads, True, overlap)[0]
        assert hooked["calls"] == 2 * 4 * hooked["params"]  # 2 steps x 4 micro-batches x every parameter
        for got, expected in zip(hooked["grads"], reference["grads"], strict=True):
            for name, value in expected.items():
                assert value.abs().sum() > 0, name
                torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_accumulate_falls_back_to_torch_off_the_gpu_and_for_other_dtypes():
    main = torch.zeros(5)
    main_grad_add.accumulate(main, torch.ones(5, dtype=torch.bfloat16))
    main_grad_add.accumulate(main, torch.full((5,), 2.0))
    assert torch.equal(main, torch.full((5,), 3.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_accumulate_equals_torch_add_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    for numel, dtype in [(3 * 4096 + 17, torch.bfloat16), (1 << 20, torch.float16)]:
        main = torch.randn(numel, device="cuda", generator=g)
        grad = torch.randn(numel, device="cuda", generator=g).to(dtype)
        expected = main + grad.float()
        main_grad_add.accumulate(main, grad)
        assert torch.equal(main, expected)
