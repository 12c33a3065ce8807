"""megatron-core's real code paths on CPU over gloo: the harness every other test builds on."""

import pytest
import torch

from megatron_muon.testing.models import build_tiny_gpt, forward_backward, synthetic_batch
from megatron_muon.testing.parallel import init_model_parallel, layout


def _loss_and_grad_norm(rank, world_size, tp, pp):
    init_model_parallel(tp=tp, pp=pp)
    model = build_tiny_gpt()
    loss = forward_backward(model, [synthetic_batch(0)])
    # Sharded parameters contribute their shard; replicated ones are counted on tp rank 0 only, so the sum over tp
    # ranks is the unsharded model's squared gradient norm.
    tp_rank = layout()["tp_rank"]
    grad_sq = sum(
        float(p.grad.double().pow(2).sum())
        for p in model.parameters()
        if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    )
    return {"loss": loss, "grad_sq": grad_sq, "layout": layout()}


def test_gpt_forward_backward_tp1_equals_tp2(rank_pool_1, rank_pool_2):
    single = rank_pool_1.run(_loss_and_grad_norm, 1, 1)[0]
    split = rank_pool_2.run(_loss_and_grad_norm, 2, 1)
    assert [r["layout"]["tp"] for r in split] == [2, 2]
    assert torch.isfinite(torch.tensor(single["loss"]))
    for result in split:
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert single["grad_sq"] > 0
    assert split[0]["grad_sq"] + split[1]["grad_sq"] == pytest.approx(single["grad_sq"], rel=1e-4)


def test_pool_reports_remote_errors(rank_pool_2):
    from megatron_muon.testing import RemoteError

    with pytest.raises(RemoteError, match="rank 1"):
        rank_pool_2.run(_fail_on_rank_one)
    assert rank_pool_2.run(_rank_and_world) == [(0, 2), (1, 2)]


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return rank


def _rank_and_world(rank, world_size):
    return rank, world_size


def _leave_fp64_state(rank, world_size):
    from megatron_muon._cpu import report_float64_as_float32

    report_float64_as_float32(True)  # what an fp64 parity run's setup turns on
    torch.set_default_dtype(torch.float64)
    return torch.ones(1, dtype=torch.float64).float().dtype == torch.float64


def _process_state(rank, world_size):
    return torch.get_default_dtype(), torch.ones(1, dtype=torch.float64).float().dtype


def test_a_task_starts_from_fresh_process_state_whatever_ran_before(rank_pool_1):
    assert rank_pool_1.run(_leave_fp64_state) == [True]
    assert rank_pool_1.run(_process_state) == [(torch.float32, torch.float32)]
