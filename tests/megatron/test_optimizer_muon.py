"""`--optimizer muon` / `dist_muon` through megatron-core's real optimizer factory, on CPU over gloo."""

import numpy as np
import pytest

from tests.megatron.muon_training import scheduled_steps, train_tiny_gpt

WAVE_MUON = "megatron_muon.optimizer.wave_muon.WaveMuon"
MUON = "megatron_muon.optimizer.muon.Muon"
ADAMW = "torch.optim.adamw.AdamW"
LR = 0.005


def _falls(losses, factor=0.5):
    return np.mean(losses[-5:]) < factor * np.mean(losses[:3])


_reference_runs: dict[str, dict] = {}


@pytest.fixture
def gpt_bf16_tp1(rank_pool_1):
    """The tp=1 bf16 run several tests compare against (trained once per session)."""
    if "gpt" not in _reference_runs:
        _reference_runs["gpt"] = rank_pool_1.run(train_tiny_gpt, 1, "muon", "bf16", 50, lr=LR)[0]
    return _reference_runs["gpt"]


def test_get_megatron_optimizer_builds_ours_and_trains(gpt_bf16_tp1):
    assert gpt_bf16_tp1["types"] == [MUON, ADAMW]
    assert gpt_bf16_tp1["skipped"] == 0
    assert _falls(gpt_bf16_tp1["losses"], 0.2)
    # QKV [q 32 | k 16 | v 16 per query group] split into parts: no 128x64 fused QKV bucket, 32x64 q parts batched.
    shapes = gpt_bf16_tp1["bucket_shapes"]
    assert (64, 64) in shapes and (32, 64) in shapes and (128, 64) not in shapes


def test_tp2_equals_tp1_bf16(gpt_bf16_tp1, rank_pool_2):
    split = rank_pool_2.run(train_tiny_gpt, 2, "muon", "bf16", 50, lr=LR)
    assert [r["layout"]["tp"] for r in split] == [2, 2]
    assert split[0]["losses"] == split[1]["losses"]
    # bf16 forward reductions differ between layouts; the loss curves still agree to a few hundredths.
    np.testing.assert_allclose(split[0]["losses"], gpt_bf16_tp1["losses"], atol=0.1)


def _assert_tp_invariant(rank_pool_1, rank_pool_2, model_kind):
    """fp32 with fp32 Newton–Schulz: tp=2 equals tp=1 to ~1e-8 after 3 steps (rounding is amplified chaotically
    later); megatron's default `blockwise` TP mode is visibly different (> 1e-3) — TP-invariance is what we test."""
    options = dict(lr=LR, muon_fp32_matmul_prec="highest", model_kind=model_kind)
    single = rank_pool_1.run(train_tiny_gpt, 1, "muon", "fp32", 3, **options)[0]
    split = rank_pool_2.run(train_tiny_gpt, 2, "muon", "fp32", 3, **options)[0]
    np.testing.assert_allclose(split["losses"], single["losses"], rtol=1e-6)
    for name, value in single["digest"].items():
        assert split["digest"][name] == pytest.approx(value, rel=1e-6), name
    blockwise = rank_pool_2.run(train_tiny_gpt, 2, "muon", "fp32", 3, **options, muon_tp_mode="blockwise")[0]
    gaps = [abs(blockwise["digest"][k] - v) / v for k, v in single["digest"].items()]
    assert max(gaps) > 1e-3


def test_gpt_tp_invariance_fp32(rank_pool_1, rank_pool_2):
    _assert_tp_invariant(rank_pool_1, rank_pool_2, "gpt")


def test_layer_wise_dist_muon_dp2_equals_muon_dp1(gpt_bf16_tp1, rank_pool_2):
    """The owner engine on DDP in megatron's own layer-wise layout (as Megatron-LM builds it for `--optimizer muon
    --use-distributed-optimizer` without the plugin's layout). Both DP ranks see the same batches here, so dp=2
    must train like dp=1."""
    replicas = rank_pool_2.run(
        train_tiny_gpt, 1, "dist_muon", "bf16", 30, distributed_layout=True, layer_wise=True, lr=LR
    )
    assert [r["layout"]["dp"] for r in replicas] == [2, 2]
    assert replicas[0]["types"] == [WAVE_MUON, ADAMW]
    assert replicas[0]["losses"] == replicas[1]["losses"]
    np.testing.assert_allclose(replicas[0]["losses"], gpt_bf16_tp1["losses"][:30], atol=0.1)


def test_registered_dist_muon_dp2_equals_muon_dp1(gpt_bf16_tp1, rank_pool_2):
    """`dist_muon` as registered (whichever distributed engine is installed) trains like muon at dp=1."""
    replicas = rank_pool_2.run(train_tiny_gpt, 1, "dist_muon", "bf16", 30, lr=LR)
    assert [r["layout"]["dp"] for r in replicas] == [2, 2]
    assert replicas[0]["losses"] == replicas[1]["losses"]
    np.testing.assert_allclose(replicas[0]["losses"], gpt_bf16_tp1["losses"][:30], atol=0.1)


def test_fp16_with_loss_scaling_trains(rank_pool_1):
    result = rank_pool_1.run(train_tiny_gpt, 1, "muon", "fp16", 20, lr=LR)[0]
    assert result["types"] == [MUON, ADAMW]
    assert _falls(result["losses"])


def test_upstream_muon_stays_available_as_mcore_muon(rank_pool_1):
    pytest.importorskip("emerging_optimizers", reason="upstream TensorParallelMuon needs emerging-optimizers")
    result = rank_pool_1.run(train_tiny_gpt, 1, "mcore_muon", "bf16", 10, lr=LR)[0]
    assert result["types"] == ["megatron.core.optimizer.emerging_optimizers.TensorParallelMuon", ADAMW]
    assert _falls(result["losses"], 0.8)


def test_optimizer_param_scheduler_drives_our_lr(rank_pool_1):
    used, expected = rank_pool_1.run(scheduled_steps, 4)[0]
    assert used == pytest.approx(expected)
    assert len(set(used)) > 1


def test_hybrid_trains_and_is_tp_invariant(rank_pool_1, rank_pool_2):
    single = rank_pool_1.run(train_tiny_gpt, 1, "muon", "bf16", 50, lr=LR, model_kind="hybrid")[0]
    assert single["types"] == [MUON, ADAMW]
    assert _falls(single["losses"], 0.2)
    # GDN in_proj [q 32 | k 32 | v 32 | z 32 | beta 4 | alpha 4] x 64 is orthogonalized per section.
    assert (4, 64) in single["bucket_shapes"] and (136, 64) not in single["bucket_shapes"]
    _assert_tp_invariant(rank_pool_1, rank_pool_2, "hybrid")


@pytest.mark.parametrize("model_kind, head_shapes, section_shapes", [
    ("gpt", [(16, 64)], [(32, 64)]),  # kv_channels 16; the q section of a query group is 2 heads (32 rows)
    ("hybrid", [(16, 64), (8, 64)], [(32, 64)]),  # + GDN key heads of 16 and value heads of 8 rows
])
def test_split_heads_is_tp_invariant_without_gathering(rank_pool_1, rank_pool_2, model_kind, head_shapes,
                                                        section_shapes):
    """`muon_split_heads`: every head of QKV / GDN in_proj is one matrix, whole on its TP rank, and the head buckets
    replace the sections. tp=2 equals tp=1 (fp32 iteration, 3 steps); in megatron's default blockwise mode, which
    orthogonalizes the other sharded matrices per shard, QKV's first update (all heads) still equals tp=1's."""
    options = dict(lr=LR, muon_fp32_matmul_prec="highest", model_kind=model_kind, muon_split_heads=True)
    single = rank_pool_1.run(train_tiny_gpt, 1, "muon", "fp32", 3, **options)[0]
    for shape in head_shapes:
        assert shape in single["bucket_shapes"]
    for shape in section_shapes:
        assert shape not in single["bucket_shapes"]
    split = rank_pool_2.run(train_tiny_gpt, 2, "muon", "fp32", 3, **options)[0]
    np.testing.assert_allclose(split["losses"], single["losses"], rtol=1e-6)
    for name, value in single["digest"].items():
        assert split["digest"][name] == pytest.approx(value, rel=1e-6), name
    first = rank_pool_1.run(train_tiny_gpt, 1, "muon", "fp32", 1, **options)[0]["digest"]
    blockwise = rank_pool_2.run(train_tiny_gpt, 2, "muon", "fp32", 1, **options, muon_tp_mode="blockwise")[0]["digest"]
    fused = [name for name in first if "linear_qkv" in name]  # GDN's in_proj keeps beta, alpha whole: per shard here
    assert fused
    for name in fused:
        assert blockwise[name] == pytest.approx(first[name], rel=1e-6), name
    assert max(abs(blockwise[k] - v) / v for k, v in first.items() if "linear_fc1" in k) > 1e-6  # blockwise differs
    sections = rank_pool_1.run(train_tiny_gpt, 1, "muon", "fp32", 3, **{**options, "muon_split_heads": False})[0]
    gaps = [abs(sections["digest"][k] - v) / v for k, v in single["digest"].items() if "qkv" in k or "in_proj" in k]
    assert max(gaps) > 1e-4  # per head is a different update than per section


@pytest.mark.parametrize("tp, pool", [(1, "rank_pool_2"), (2, "rank_pool_4")])
def test_split_heads_on_the_owner_engine_equals_plain_muon(rank_pool_1, request, tp, pool):
    """The owner engine (dp=2, both ranks fed the same batches; tp=1 and 2) with heads split trains like plain Muon
    at dp=1, tp=1."""
    options = dict(lr=LR, muon_fp32_matmul_prec="highest", model_kind="hybrid", muon_split_heads=True)
    single = rank_pool_1.run(train_tiny_gpt, 1, "muon", "fp32", 3, **options)[0]
    replicas = request.getfixturevalue(pool).run(train_tiny_gpt, tp, "dist_muon", "fp32", 3, **options)
    assert replicas[0]["types"] == [WAVE_MUON, ADAMW] and replicas[0]["layout"]["tp"] == tp
    assert replicas[0]["layout"]["dp"] == 2
    np.testing.assert_allclose(replicas[0]["losses"], single["losses"], rtol=1e-6)
    for name, value in single["digest"].items():
        assert replicas[0]["digest"][name] == pytest.approx(value, rel=1e-6), name
