"""QK-clip in `megatron-muon pretrain` (tiny-cpu recipe, one gloo rank): after each step's clip the same batch's
attention logits are its unclipped ones times the naive MuonClip eta of their query group, so with a negligible
update they end at the threshold; the JSONL log carries the step's max logit; bad settings are recipe errors."""

import pytest
import torch

from megatron_muon.training.config import RecipeError
from megatron_muon.training.recipes import load_recipe
from megatron_muon.training.report import format_step, read_jsonl
from megatron_muon.training.validation import validate

GROUPS = 2  # tiny-cpu: 4 attention heads in 2 query groups
TINY = ["training.micro_batch_size=2", "training.global_batch_size=2", "model.seq_length=32", "training.train_iters=3",
        "optimizer.lr_warmup_iters=0", "logging.log_interval=1", "logging.plot=false", "logging.progress_bar=false"]


def _max_logits(layers) -> list[torch.Tensor]:
    return [layer.core_attention.current_max_attn_logits.clone() for layer in layers]


def _train_and_probe(rank, world_size, output_dir: str, overrides: list[str]):
    """pretrain, with a probe around each step's clip: the step's recorded maxima, then the same batch's maxima on
    the updated weights before and after the clip (forward passes that the probe takes back out of the record)."""
    from megatron_muon.megatron import qk_clip
    from megatron_muon.training import loop
    from megatron_muon.training.distributed import current_context, init_parallel_state

    recipe = validate(load_recipe("tiny-cpu", TINY + overrides + [f"logging.output_dir={output_dir}"]), world_size)
    init_parallel_state(1, 1)
    probes, batches = [], []
    forward_step, after_step = loop.forward_step, qk_clip.QkClipAfterStep.after_step

    def remembering_forward_step(data_iterator, model_chunk):
        batches.append(next(data_iterator))
        return forward_step(iter(batches[-1:]), model_chunk)

    def maxima_on(model, layers, batch) -> list[torch.Tensor]:
        for layer in layers:
            layer.core_attention.current_max_attn_logits = None
        with torch.no_grad():
            model(batch["tokens"], batch["position_ids"], None)
        found = _max_logits(layers)
        for layer in layers:
            layer.core_attention.current_max_attn_logits = None
        return found

    def probing_after_step(self, update_ok):
        layers = qk_clip.attention_layers(self.model_chunks)
        recorded = _max_logits(layers)
        before = maxima_on(self.model_chunks[0], layers, batches[-1])
        for layer, maxima in zip(layers, recorded):
            layer.core_attention.current_max_attn_logits = maxima.clone()
        after_step(self, update_ok)
        probes.append((recorded, before, maxima_on(self.model_chunks[0], layers, batches[-1])))

    loop.forward_step, qk_clip.QkClipAfterStep.after_step = remembering_forward_step, probing_after_step
    try:
        loop.pretrain(recipe, current_context())
    finally:  # the pool's rank outlives this call
        loop.forward_step, qk_clip.QkClipAfterStep.after_step = forward_step, after_step
    return probes, read_jsonl(f"{output_dir}/train_log.jsonl")


def _eta(maxima: torch.Tensor, threshold: float) -> torch.Tensor:
    """Naive MuonClip's per-head factor on the logits: its group's min(threshold / group max, 1)."""
    grouped = maxima.view(GROUPS, -1).amax(dim=1, keepdim=True)
    return torch.clamp(threshold / grouped, max=1.0).expand(GROUPS, maxima.numel() // GROUPS).reshape(-1)


@pytest.mark.parametrize("lr", ["5.0e-3", "1.0e-9"], ids=["training_lr", "negligible_update"])
def test_each_step_clips_the_logits_of_its_batch_to_the_threshold(rank_pool_1, tmp_path, lr):
    threshold = 0.09  # the tiny model's logits are about 0.1: some groups clip, some do not
    overrides = ["model.qk_clip=true", f"model.qk_clip_threshold={threshold}", f"optimizer.lr={lr}",
                 f"optimizer.min_lr={lr}", "optimizer.weight_decay=0.0"]
    probes, records = rank_pool_1.run(_train_and_probe, str(tmp_path), overrides)[0]
    steps = [r for r in records if r["event"] == "step"]
    assert len(probes) == len(steps) == 3
    clipped_groups = 0
    for (recorded, before, after), record in zip(probes, steps):
        assert record["max_attention_logit"] == pytest.approx(max(float(m.max()) for m in recorded), rel=1e-6)
        assert f"max logit {record['max_attention_logit']:.2f}" in format_step(record, 3)  # the console line
        for step_max, unclipped, clipped in zip(recorded, before, after):
            eta = _eta(step_max, threshold)
            clipped_groups += int((eta < 1).sum()) // (eta.numel() // GROUPS)
            # rescaling W_q and W_k of a group scales every logit of its heads by eta (through RoPE too)
            torch.testing.assert_close(clipped, unclipped * eta, rtol=1e-4, atol=1e-6)
            if lr == "1.0e-9":  # the clip's maxima are this batch's on these weights: clipped heads end at most at it
                assert bool((clipped[eta < 1] <= threshold * (1 + 1e-4)).all()), (clipped, threshold)
                assert torch.equal(clipped[eta == 1], unclipped[eta == 1])
    assert clipped_groups > 0  # the threshold is low enough to clip


def test_logging_only_records_the_max_logit_and_clips_nothing(rank_pool_1, tmp_path):
    probes, records = rank_pool_1.run(_train_and_probe, str(tmp_path), ["model.log_max_attention_logit=true"])[0]
    for (recorded, before, after), record in zip(probes, [r for r in records if r["event"] == "step"]):
        assert record["max_attention_logit"] == pytest.approx(max(float(m.max()) for m in recorded), rel=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_without_the_options_the_log_has_no_max_logit(rank_pool_1, tmp_path):
    probes, records = rank_pool_1.run(_train_and_probe, str(tmp_path), [])[0]
    steps = [r for r in records if r["event"] == "step"]
    assert probes == [] and steps and all("max_attention_logit" not in r for r in steps)
    assert "max logit" not in format_step(steps[0], 3)


@pytest.mark.parametrize("overrides,message", [
    (["model.qk_clip=true", "model.qk_clip_threshold=0"], "model.qk_clip_threshold must be > 0"),
    (["model.qk_clip=true", "model.qk_clip_alpha=1.5"], "model.qk_clip_alpha must lie strictly between 0 and 1"),
    (["model.qk_clip=true", "model.kind=gpt", "model.spec_backend=local"], "use model.kind: hybrid"),
    (["model.log_max_attention_logit=true", "model.kind=gpt", "model.spec_backend=local"], "use model.kind: hybrid"),
])
def test_settings_that_cannot_clip_are_recipe_errors(overrides, message):
    with pytest.raises(RecipeError, match=message):
        validate(load_recipe("tiny-cpu", overrides))
