"""The local attention's recorded max logits (what QK-clip reads) equal an explicit q·kᵀ·scale reference: per head,
masked, over batch and positions, a running max across micro-batches; blocked evaluation changes nothing."""

import pytest
import torch

from megatron_muon.layers.max_logit import max_attention_logits

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 24, 2, 4, 2, 16


def naive_max_logits(query, key, scale, causal):
    """(heads,) from the full logit matrix: every query head against its GQA key head, masked, then the max."""
    heads, groups = query.shape[2], key.shape[2]
    key = key.repeat_interleave(heads // groups, dim=2)
    logits = torch.einsum("sbhd,tbhd->bhst", query.double(), key.double()) * scale
    if causal:
        seq_q, seq_k = query.shape[0], key.shape[0]
        logits = logits.masked_fill(torch.ones(seq_q, seq_k, dtype=torch.bool).triu(1), float("-inf"))
    return logits.amax(dim=(0, 2, 3)).to(torch.float32)  # .float() stays fp64 after an fp64 run


def _inputs(generator, seq=SEQ, dtype=torch.float32):
    q = torch.randn(seq, BATCH, HEADS, HEAD_DIM, generator=generator, dtype=dtype)
    k = torch.randn(seq, BATCH, GROUPS, HEAD_DIM, generator=generator, dtype=dtype)
    v = torch.randn(seq, BATCH, GROUPS, HEAD_DIM, generator=generator, dtype=dtype)
    k[3, 1, 0] *= 20  # one large key late in the sequence: the causal mask hides it from earlier queries
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_elements", [1, 7 * BATCH * HEADS * SEQ, 1 << 25])
def test_blocked_max_logits_equal_the_full_matrix(causal, block_elements):
    generator = torch.Generator().manual_seed(11)
    q, k, _ = _inputs(generator)
    got = max_attention_logits(q, k, 0.25, causal, block_elements=block_elements)
    assert got.dtype == torch.float32 and got.shape == (HEADS,)
    torch.testing.assert_close(got, naive_max_logits(q, k, 0.25, causal), rtol=1e-6, atol=1e-6)


def test_the_causal_mask_is_respected():
    """A key that only later queries see must not raise the causal maximum (it does raise the unmasked one)."""
    q = torch.ones(4, 1, 2, 8)
    k = torch.ones(4, 1, 1, 8)
    k[3] *= 10  # visible to query 3 only
    q[3] = -1  # which sees it with a negative logit
    causal = max_attention_logits(q, k, 1.0, causal=True)
    full = max_attention_logits(q, k, 1.0, causal=False)
    torch.testing.assert_close(causal, torch.full((2,), 8.0))
    torch.testing.assert_close(full, torch.full((2,), 80.0))


def _recorded_max_logits(rank, world_size, causal: bool, softmax_scale, enabled: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_muon.layers.attention import SDPADotProductAttention
    from megatron_muon.testing.models import tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    options = {"qk_clip": dict(qk_clip=True), "log": dict(log_max_attention_logit=True), "off": {}}[enabled]
    config = tiny_transformer_config(num_attention_heads=HEADS, num_query_groups=GROUPS, **options)
    plain_config = tiny_transformer_config(num_attention_heads=HEADS, num_query_groups=GROUPS)
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    kwargs = dict(layer_number=1, attn_mask_type=mask, softmax_scale=softmax_scale,
                  pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    attention, plain = SDPADotProductAttention(config, **kwargs), SDPADotProductAttention(plain_config, **kwargs)
    generator = torch.Generator().manual_seed(5)
    scale = softmax_scale if softmax_scale is not None else HEAD_DIM ** -0.5
    recorded, expected, outputs_equal = [], None, True
    for _ in range(3):  # three micro-batches of one step
        q, k, v = (t.requires_grad_(True) for t in _inputs(generator))
        out = attention(q, k, v, None)
        out.sum().backward()
        outputs_equal &= torch.equal(out.detach(), plain(q, k, v, None).detach())
        reference = naive_max_logits(q.detach(), k.detach(), scale, causal)
        expected = reference if expected is None else torch.maximum(expected, reference)
        current = attention.current_max_attn_logits
        recorded.append(None if current is None else (current.clone(), current.requires_grad, expected.clone()))
    return recorded, outputs_equal


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("softmax_scale", [None, 0.3], ids=["default_scale", "scale_0.3"])
def test_sdpa_attention_records_the_running_max_logit_per_head(rank_pool_1, causal, softmax_scale):
    recorded, outputs_equal = rank_pool_1.run(_recorded_max_logits, causal, softmax_scale, "qk_clip")[0]
    assert outputs_equal  # recording changes nothing the attention returns
    increases = 0
    for index, (current, requires_grad, expected) in enumerate(recorded):
        assert current.dtype == torch.float32 and current.shape == (HEADS,) and not requires_grad
        torch.testing.assert_close(current, expected, rtol=1e-6, atol=1e-6)
        increases += index > 0 and bool((current > recorded[index - 1][0]).any())
    assert increases > 0  # the micro-batches really accumulate (a later one raised some head's max)


def test_recording_follows_the_config(rank_pool_1):
    """log_max_attention_logit alone records as qk_clip does; with both off nothing is recorded."""
    logged, _ = rank_pool_1.run(_recorded_max_logits, True, None, "log")[0]
    torch.testing.assert_close(logged[-1][0], logged[-1][2], rtol=1e-6, atol=1e-6)
    off, _ = rank_pool_1.run(_recorded_max_logits, True, None, "off")[0]
    assert off == [None, None, None]
