"""Owner reduce-scatter of Muon gradients + OwnerMuon equals single-process Muon on the summed gradients.

Each data-parallel rank holds only a part of every gradient (integer multiples of 2^-10, split so the parts sum
exactly), so the reduce must really happen and must deliver each matrix to its owner's row.
"""

import pytest
import torch

from megatron_muon.testing.parallel import init_model_parallel
from tests.distributed.test_owner_muon import MATRICES, SETTINGS, _grads, _make_params, _shard

STEPS = 5
QUANTUM = 2.0**-10


def _exact_parts(grad: torch.Tensor, parts: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient on a 2^-10 grid, this rank's part of it); the parts sum to it exactly in fp32."""
    ticks = torch.round(grad / QUANTUM)
    share = torch.div(ticks, parts, rounding_mode="floor")
    mine = share if index < parts - 1 else ticks - share * (parts - 1)
    return ticks * QUANTUM, mine * QUANTUM


def _reduced_vs_reference(rank, world_size, tp):
    from megatron.core import parallel_state as ps

    from megatron_muon.distributed.grad_reduce import OwnerReduceScatter
    from megatron_muon.distributed.owner_muon import OwnerMuon
    from megatron_muon.optimizer import Muon

    init_model_parallel(tp=tp)
    tp_rank, dp_group = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_group()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    params, _ = _make_params(tp, tp_rank)
    names = [m[0] for m in MATRICES]
    opt = OwnerMuon([{"params": params, "param_names": names}], tp_group=ps.get_tensor_model_parallel_group(),
                    dp_group=dp_group, **SETTINGS)
    ref_params, _ = _make_params(1, 0)
    ref = Muon([{"params": ref_params, "param_names": names}], batched=False, **SETTINGS)
    buffers = [torch.zeros_like(p) for p in params]  # stands in for DDP's persistent gradient buffer
    opt.freeze_plan()
    reduce = OwnerReduceScatter(opt.unit_views(buffers), opt.owner_rows(), dp_group, opt.comm_counter)
    owned_rows_ok = True
    for step in range(STEPS):
        for buffer, grad in zip(buffers, _grads(step, tp, tp_rank)):
            buffer.copy_(_exact_parts(grad, dp, dp_rank)[1])
        reduce.launch(async_op=step % 2 == 1)
        reduce.finish()
        for unit_view, row in zip(opt.unit_views(buffers), opt.owner_rows()):
            if row != dp_rank:
                owned_rows_ok &= bool((unit_view == 0).all())
        for p, buffer in zip(params, buffers):
            p.grad = buffer.clone()
        for p, g in zip(ref_params, _grads(step, 1, 0)):
            p.grad = _exact_parts(g, 1, 0)[0]
        opt.step()
        ref.step()
    # a forced all-reduce leaves every rank with every summed gradient
    for buffer, grad in zip(buffers, _grads(0, tp, tp_rank)):
        buffer.copy_(_exact_parts(grad, dp, dp_rank)[1])
    reduce.launch(everywhere=True)
    reduce.finish()
    summed = [_exact_parts(g, dp, dp_rank)[0] for g in _grads(0, tp, tp_rank)]
    everywhere_ok = all(torch.equal(b, s) for b, s in zip(buffers, summed))
    expected = [_shard(p.detach(), m[2], m[3], tp, tp_rank) for p, m in zip(ref_params, MATRICES)]
    errors = {n: float((p.detach() - e).abs().max() / e.abs().max()) for n, p, e in zip(names, params, expected)}
    rounds = opt._rounds([0] * len(opt.owners))
    return {"errors": errors, "owned_rows_ok": owned_rows_ok, "everywhere_ok": everywhere_ok,
            "calls": dict(opt.comm_counter.calls), "numel": dict(opt.comm_counter.numel), "rounds": len(rounds),
            "padding": reduce.padding, "width": reduce.width, "dp": dp}


@pytest.mark.parametrize("world_size,tp", [(2, 1), (4, 2), (4, 1)])
def test_reduce_scattered_gradients_give_single_process_muon(rank_pool_2, rank_pool_4, world_size, tp):
    pool = {2: rank_pool_2, 4: rank_pool_4}[world_size]
    results = pool.run(_reduced_vs_reference, tp)
    for rank, result in enumerate(results):
        for name, error in result["errors"].items():
            assert error <= 1e-6, f"rank {rank} {name}: relative error {error:.2e}"
        assert result["owned_rows_ok"], f"rank {rank} kept gradients of matrices another row owns"
        assert result["everywhere_ok"], f"rank {rank}: forced all-reduce did not deliver every gradient"
        calls, numel = result["calls"], result["numel"]
        assert calls["grad_reduce_scatter"] == STEPS and "update_all_reduce" not in calls
        assert numel["grad_reduce_scatter"] == STEPS * result["width"] * result["dp"]
        assert numel["grad_all_reduce"] == result["width"] * result["dp"]  # only the forced one
        # the updates went back in several rounds, one all-gather each, launched as owners finished buckets
        assert 1 < calls["update_all_gather"] <= STEPS * result["rounds"]
