"""OwnerMuon on synthetic TP shards equals single-process Muon on the full matrices, at every (tp, dp) layout."""

import pytest
import torch

from megatron_muon.testing.parallel import init_model_parallel

STEPS = 20
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


def _owner_vs_reference(rank, world_size, tp, settings, dtype=torch.float32):
    from megatron.core import parallel_state as ps

    from megatron_muon.distributed.owner_muon import OwnerMuon
    from megatron_muon.optimizer import Muon

    init_model_parallel(tp=tp)
    tp_rank = ps.get_tensor_model_parallel_rank()
    params, _ = _make_params(tp, tp_rank, dtype)
    names = [m[0] for m in MATRICES]
    opt = OwnerMuon([{"params": params, "param_names": names}], tp_group=ps.get_tensor_model_parallel_group(),
                    dp_group=ps.get_data_parallel_group(), **settings)
    ref_params, _ = _make_params(1, 0, dtype)
    ref = Muon([{"params": ref_params, "param_names": names}], batched=False, **settings)
    for step in range(STEPS):
        for p, g in zip(params, _grads(step, tp, tp_rank, dtype)):
            p.grad = g
        for p, g in zip(ref_params, _grads(step, 1, 0, dtype)):
            p.grad = g
        opt.step()
        ref.step()
    expected = [_shard(p.detach(), m[2], m[3], tp, tp_rank) for p, m in zip(ref_params, MATRICES)]
    errors = {n: float((p.detach().float() - e.float()).abs().max() / e.float().abs().max())
              for n, p, e in zip(names, params, expected)}
    return {"errors": errors, "ns": opt.orthogonalized_matrices, "units": len(opt.owners),
            "owners": opt.owners, "method": opt.owner_plan.method}


@pytest.mark.parametrize("world_size,tp", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_owner_muon_matches_single_process(rank_pool_1, rank_pool_2, rank_pool_4, world_size, tp, dtype):
    """20 steps on identical gradients: same parameters as single-process Muon within 1e-6 (fp32) or one bf16
    rounding step (bf16), wherever the matrices' owners are."""
    pool = {1: rank_pool_1, 2: rank_pool_2, 4: rank_pool_4}[world_size]
    results = pool.run(_owner_vs_reference, tp, SETTINGS, dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    for rank, result in enumerate(results):
        for name, error in result["errors"].items():
            assert error <= tolerance, f"rank {rank} {name}: relative error {error:.2e}"
    units = results[0]["units"]
    # every matrix orthogonalized exactly once per step across all ranks
    assert sum(r["ns"] for r in results) == units * STEPS
    assert all(r["owners"] == results[0]["owners"] for r in results)
    if world_size > 1:
        assert len(set(results[0]["owners"])) > 1, "work should be spread over several owners"


def _bad_inputs(rank, world_size, case):
    """Each case must raise the same ValueError on every rank (no rank left waiting in a collective)."""
    from megatron.core import parallel_state as ps

    from megatron_muon.distributed.owner_muon import OwnerMuon

    init_model_parallel(tp=1)
    params, _ = _make_params(1, 0)
    if case == "mismatched" and rank == 1:
        params = params[:-1]
    names = [m[0] for m in MATRICES][: len(params)]
    opt = OwnerMuon([{"params": params, "param_names": names}], dp_group=ps.get_data_parallel_group(), **SETTINGS)
    for p, g in zip(params, _grads(0, 1, 0)):
        p.grad = g
    if case == "nan" and rank == 1:
        params[2].grad[0, 0] = float("nan")
    if case == "missing":
        params[0].grad = None
    before = [p.detach().clone() for p in params]
    try:
        opt.step()
    except ValueError as error:
        unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, params))
        return {"message": str(error), "unchanged": unchanged, "momentum": len(opt.owner_momentum)}
    return {"message": None}


@pytest.mark.parametrize("case,expected", [("nan", "non-finite gradient"), ("mismatched", "disagree"),
                                           ("missing", "needs a gradient")])
def test_bad_input_raises_on_every_rank(rank_pool_2, case, expected):
    for result in rank_pool_2.run(_bad_inputs, case):
        assert result["message"] is not None and expected in result["message"], result
        assert result["unchanged"] and result["momentum"] == 0
    if case == "nan":
        assert "row" in rank_pool_2.run(_bad_inputs, case)[0]["message"]  # names the parameter


def test_blockwise_mode_is_refused():
    from megatron_muon.distributed.owner_muon import OwnerMuon

    with pytest.raises(ValueError, match="blockwise"):
        OwnerMuon([torch.nn.Parameter(torch.zeros(4, 4))], tp_mode="blockwise")


class _FlatCost:
    """Every matrix costs the same: gives a different owner plan than the FLOP model."""

    def launch_cost(self, shape):
        return 0.0

    def matrix_cost(self, shape):
        return 1.0


def _state_dict_round_trip(rank, world_size, tp):
    """Momentum leaves through state_dict as parameter-shaped shards and reaches other owners after loading."""
    import copy

    from megatron.core import parallel_state as ps

    from megatron_muon.distributed.owner_muon import OwnerMuon

    init_model_parallel(tp=tp)
    tp_rank = ps.get_tensor_model_parallel_rank()
    groups = dict(tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_parallel_group())

    def set_grads(params, step):
        for p, g in zip(params, _grads(step, tp, tp_rank)):
            p.grad = g

    params, _ = _make_params(tp, tp_rank)
    opt = OwnerMuon(params, **groups, **SETTINGS)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    shapes_match = all(tuple(opt.state[p]["momentum_buffer"].shape) == tuple(p.shape) for p in params)
    results = {}
    for name, load in (("loaded", True), ("fresh", False)):
        others = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for other, p in zip(others, params):
            other.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
        engine = OwnerMuon(others, cost_model=_FlatCost(), **groups, **SETTINGS)
        if load:
            engine.load_state_dict(copy.deepcopy(state))
        set_grads(others, 2)
        engine.step()
        results[name] = (others, engine.owners)
    set_grads(params, 2)
    opt.step()

    def error(others):
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(others, params))

    return {"shapes_match": shapes_match, "loaded_error": error(results["loaded"][0]),
            "fresh_error": error(results["fresh"][0]), "owners_differ": results["loaded"][1] != opt.owners}


def test_momentum_survives_a_state_dict_round_trip_across_owner_plans(rank_pool_2):
    for result in rank_pool_2.run(_state_dict_round_trip, 2):
        assert result["shapes_match"] and result["owners_differ"]
        assert result["loaded_error"] <= 1e-6
        assert result["fresh_error"] > 1e-3  # without the momentum the step is visibly different
