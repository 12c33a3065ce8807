"""OwnerMuon on synthetic TP shards equals single-process Muon on the full matrices, at every (tp, dp) layout."""

import pytest
import torch

from megatron_muon.testing.parallel import init_model_parallel

STEPS = 3
# (name, full shape, TP partition dim or None, fused sections (full rows) or None, experts)
MATRICES = [
    ("column", (16, 8), 0, None, 1),
    ("column_twin", (16, 8), 0, None, 1),
    ("row", (8, 12), 1, None, 1),
    ("replicated", (6, 10), None, None, 1),
    ("qkv", (4 * 6, 8), 0, "qkv", 1),  # 4 query groups of q=4, k=1, v=1
    ("in_proj", (8 + 8 + 4 + 6, 8), 0, "sections", 1),  # sections q8 k8 v4 z6, each split across TP
    ("experts", (3, 6, 8), None, None, 3),
]
QKV_SECTIONS = (4, 1, 1)
IN_PROJ_SECTIONS = (8, 8, 4, 6)


def _full_tensor(seed: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen)


def _shard(full: torch.Tensor, dim, sections, tp: int, tp_rank: int) -> torch.Tensor:
    if dim is None or tp == 1:
        return full.clone()
    if sections == "sections":  # GDN in_proj: every section split across TP, local sections stacked
        parts = torch.split(full, IN_PROJ_SECTIONS, dim=0)
        return torch.cat([p.chunk(tp, dim=0)[tp_rank] for p in parts], dim=0)
    return full.chunk(tp, dim=dim)[tp_rank].clone()


def _tag(param: torch.Tensor, dim, sections, experts: int, tp: int) -> None:
    if dim is not None:
        param.tensor_model_parallel, param.partition_dim = True, dim
    if sections == "qkv":
        param.is_qkv, param.qkv_split_shapes = True, list(QKV_SECTIONS)
    elif sections == "sections":
        param.is_qkv, param.qkv_split_shapes = True, [s // tp for s in IN_PROJ_SECTIONS]
    if experts > 1:
        param.muon_num_experts = experts


def _make_params(tp: int, tp_rank: int, dtype=torch.float32):
    params, fulls = [], []
    for index, (name, shape, dim, sections, experts) in enumerate(MATRICES):
        full = _full_tensor(index, shape).to(dtype)
        param = torch.nn.Parameter(_shard(full, dim, sections, tp, tp_rank))
        _tag(param, dim, sections, experts, tp)
        params.append(param)
        fulls.append(full)
    return params, fulls


def _grads(step: int, tp: int, tp_rank: int, dtype=torch.float32):
    return [_shard(_full_tensor(1000 * (step + 1) + i, shape).to(dtype), dim, sections, tp, tp_rank)
            for i, (_, shape, dim, sections, _) in enumerate(MATRICES)]


SETTINGS = dict(lr=0.02, momentum=0.9, weight_decay=0.1, scale_mode="spectral", compute_dtype=torch.float32)


def _owner_vs_reference(rank, world_size, tp, settings):
    from megatron.core import parallel_state as ps

    from megatron_muon.distributed.owner_muon import OwnerMuon
    from megatron_muon.optimizer import Muon

    init_model_parallel(tp=tp)
    tp_rank = ps.get_tensor_model_parallel_rank()
    params, _ = _make_params(tp, tp_rank)
    names = [m[0] for m in MATRICES]
    opt = OwnerMuon([{"params": params, "param_names": names}], tp_group=ps.get_tensor_model_parallel_group(),
                    dp_group=ps.get_data_parallel_group(), **settings)
    ref_params, _ = _make_params(1, 0)
    ref = Muon([{"params": ref_params, "param_names": names}], batched=False, **settings)
    for step in range(STEPS):
        for p, g in zip(params, _grads(step, tp, tp_rank)):
            p.grad = g
        for p, g in zip(ref_params, _grads(step, 1, 0)):
            p.grad = g
        opt.step()
        ref.step()
    expected = [_shard(p.detach(), m[2], m[3], tp, tp_rank) for p, m in zip(ref_params, MATRICES)]
    errors = {n: float((p.detach() - e).abs().max() / e.abs().max()) for n, p, e in zip(names, params, expected)}
    return {"errors": errors, "ns": opt.orthogonalized_matrices, "units": len(opt.owners),
            "owners": opt.owners, "method": opt.owner_plan.method}


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 1)])
def test_owner_muon_matches_single_process(rank_pool_1, rank_pool_2, rank_pool_4, world_size, tp):
    pool = {1: rank_pool_1, 2: rank_pool_2, 4: rank_pool_4}[world_size]
    results = pool.run(_owner_vs_reference, tp, SETTINGS)
    for rank, result in enumerate(results):
        for name, error in result["errors"].items():
            assert error < 1e-6, f"rank {rank} {name}: relative error {error:.2e}"
    units = results[0]["units"]
    # every matrix orthogonalized exactly once per step across all ranks
    assert sum(r["ns"] for r in results) == units * STEPS
    assert all(r["owners"] == results[0]["owners"] for r in results)
    if world_size > 1:
        assert len(set(results[0]["owners"])) > 1, "work should be spread over several owners"
