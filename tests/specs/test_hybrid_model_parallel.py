"""The "GGG*" hybrid GPTModel across tensor parallelism: tp=2 gives the tp=1 loss, and a dist checkpoint saved at
tp=1 loads at tp=2 (same loss) and back at tp=1 bit for bit."""

import pytest
import torch

from tests.layers.gdn_cases import gdn_config

VOCAB, SEQ = 128, 40


def _model(seed: int):
    from megatron_muon.specs import build_hybrid_model

    torch.manual_seed(seed)
    return build_hybrid_model(gdn_config(num_layers=4), "GGG*", vocab_size=VOCAB, max_seq_len=64)


def _loss(model) -> float:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(42))
    with torch.no_grad():
        return float(model(tokens, torch.arange(SEQ).expand(2, -1), None, labels=tokens).mean())


def _losses_by_tp(rank, world_size):
    from megatron_muon.testing.parallel import init_model_parallel

    losses = {}
    for tp in (1, 2):
        init_model_parallel(tp=tp)
        losses[tp] = _loss(_model(seed=1))
    return losses


def test_tp2_loss_equals_tp1(rank_pool_2):
    for losses in rank_pool_2.run(_losses_by_tp):
        assert losses[2] == pytest.approx(losses[1], rel=1e-5)


def _checkpoint_round_trip(rank, world_size, directory):
    from megatron_muon.megatron.checkpointing import load_checkpoint, save_checkpoint
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    original = _model(seed=1)
    original_loss = _loss(original)
    save_checkpoint(original, None, f"{directory}/tp1")

    init_model_parallel(tp=2)
    resharded = _model(seed=2)
    fresh_loss = _loss(resharded)
    load_checkpoint(resharded, None, f"{directory}/tp1")
    resharded_loss = _loss(resharded)
    save_checkpoint(resharded, None, f"{directory}/tp2")

    init_model_parallel(tp=1)
    restored = _model(seed=3)
    load_checkpoint(restored, None, f"{directory}/tp2")
    reference = {k: v for k, v in original.state_dict().items() if isinstance(v, torch.Tensor)}
    restored_state = {k: v for k, v in restored.state_dict().items() if isinstance(v, torch.Tensor)}
    mismatched = sorted(k for k in reference if not torch.equal(reference[k], restored_state[k]))
    gdn_keys = [k for k in reference if "self_attention.in_proj" in k or "conv1d" in k or "A_log" in k]
    return original_loss, fresh_loss, resharded_loss, mismatched, reference.keys() == restored_state.keys(), gdn_keys


def test_checkpoint_tp1_to_tp2_and_back_is_exact(rank_pool_2, tmp_path):
    for original, fresh, resharded, mismatched, same_keys, gdn_keys in rank_pool_2.run(
        _checkpoint_round_trip, str(tmp_path)
    ):
        assert gdn_keys, "the model must contain GDN layers for this test to mean anything"
        assert abs(fresh - original) > 1e-4, "differently seeded model should differ before loading"
        assert resharded == pytest.approx(original, rel=1e-5)
        assert same_keys and mismatched == []
