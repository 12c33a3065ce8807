"""QK-clip with data parallelism (two gloo ranks, tiny hybrid): the owner engine (`dist_muon`: fp32 masters on each
matrix's owner only) ends where single-process Muon with the same clip ends, and so does megatron's
DistributedOptimizer, whose flat master slices megatron's own clip cannot scale.

Why these comparisons: the clip's maxima are all-reduced over data parallelism, so every layout clips by the same
eta. In fp64 the layouts' reductions round at ~1e-16, so dp=2 `dist_muon` must match the world-1 `muon` run to
1e-9. In bf16 the 16-bit weights and the fp32 masters are clipped separately; at dp=2 the owner engine is bit-exact
against `muon` without clipping (test_dist_muon_megatron; gradient clipping off, whose clipped steps round
differently), so it must stay bit-exact with QK-clip: a master left unclipped on its owner (the planted bug) makes
the next update start from the unclipped weight.
"""

import pytest
import torch

from megatron_muon.testing.training import max_relative_error, merged_params

THRESHOLD = 0.5  # the tiny hybrid's attention logits are about 0.4 to 0.7: some groups clip, some do not
STEPS = 6


def _train_with_qk_clip(rank, world_size, name: str, precision: str, steps: int, qk_clip: bool = True,
                        unclipped_masters: bool = False, distributed_optimizer: bool = False,
                        overlap_param_gather: bool = False):
    """`steps` steps of the tiny hybrid with optimizer `name`, QK-clip after each; returns the full parameters and
    the largest logit of every step. `unclipped_masters`: the planted bug, megatron's clip sees no fp32 master.
    `overlap_param_gather`: the owner engine's parameters come back in the next forward (bf16)."""
    import megatron_muon
    from megatron_muon.megatron import qk_clip as qk
    from megatron_muon.testing.models import GDN_SIZES, build_tiny_hybrid
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_muon_setup, build_training_setup, full_parameters, train_step
    from tests.megatron.muon_training import one_thread

    megatron_muon.register()  # `muon` and `dist_muon` for build_training_setup too
    init_model_parallel(tp=1, pp=1)
    options = dict(qk_clip=qk_clip, qk_clip_threshold=THRESHOLD, log_max_attention_logit=True)
    with one_thread():
        if name == "adam" or overlap_param_gather:  # bf16 (build_muon_setup's muon options for muon)
            muon = dict(muon_tp_mode="duplicated", muon_fp32_matmul_prec="medium") if name != "adam" else {}
            overlap = dict(overlap_param_gather=True) if overlap_param_gather else {}
            model, optimizer = build_training_setup(name, bf16=precision == "bf16", model_builder=build_tiny_hybrid,
                                                    use_distributed_optimizer=distributed_optimizer, clip_grad=0.0,
                                                    config_overrides={**GDN_SIZES, **options},
                                                    ddp_overrides=overlap or None, **overlap, **muon)
        else:
            model, optimizer = build_muon_setup(name, precision, "hybrid", clip_grad=0.0, config_overrides=options)
        layers = qk.attention_layers([model])
        clip = qk.QkClipAfterStep([model], optimizer, layers[0].config)
        masters, largest = {}, []
        for step in range(steps):
            train_step(model, optimizer, step)
            if unclipped_masters:
                masters = {id(layer): layer.linear_qkv.weight.__dict__.pop("main_param", None) for layer in layers}
            clip.after_step(True)
            for layer in layers:
                if masters.get(id(layer)) is not None:
                    layer.linear_qkv.weight.main_param = masters[id(layer)]
            largest.append(clip.read())
        if overlap_param_gather:  # the last step's gather would run in the next forward
            model.start_param_sync(force_sync=True)
        weights = [layer.linear_qkv.weight for layer in layers]
        return {"params": full_parameters(model), "largest": largest,
                "masters": sum(getattr(w, "main_param", None) is not None for w in weights)}


def test_owner_engine_with_qk_clip_equals_single_process_muon_fp64(rank_pool_1, rank_pool_2):
    fp64_reference = {clip: rank_pool_1.run(_train_with_qk_clip, "muon", "fp64", STEPS, clip)[0]
                      for clip in (True, False)}
    reference = fp64_reference[True]
    assert max(reference["largest"]) > THRESHOLD  # the run really clips
    results = rank_pool_2.run(_train_with_qk_clip, "dist_muon", "fp64", STEPS)
    for result in results:  # the maxima are all-reduced over dp: both ranks clip by the world-1 run's eta
        assert result["largest"] == pytest.approx(reference["largest"], rel=1e-12)
    name, error = max_relative_error(reference["params"], merged_params(results))
    assert error <= 1e-9, f"{name} off by {error:.2e}"
    # what the clip changes is far above that bound
    _, unclipped = max_relative_error(fp64_reference[False]["params"], reference["params"])
    assert unclipped > 1e-3


def _same_layout_error(pools, first: tuple, second: tuple) -> tuple[str, float]:
    return max_relative_error(merged_params(pools.run(_train_with_qk_clip, *first[0], **first[1])),
                              merged_params(pools.run(_train_with_qk_clip, *second[0], **second[1])))


@pytest.mark.parametrize("overlap_param_gather", [False, True], ids=["gather_after_step", "overlap_param_gather"])
def test_owner_engine_clips_the_owners_fp32_master_bf16(rank_pool_2, overlap_param_gather):
    """On the same dp=2 layout: `muon` (masters everywhere) and `dist_muon` (masters on owners) agree bit for bit;
    with overlap_param_gather the other ranks clip a stale copy, which the owner's clipped one then replaces."""
    results = rank_pool_2.run(_train_with_qk_clip, "dist_muon", "bf16", STEPS,
                              overlap_param_gather=overlap_param_gather)
    assert sum(r["masters"] for r in results) == 1  # the qkv weight's master lives on its owner only
    muon = merged_params(rank_pool_2.run(_train_with_qk_clip, "muon", "bf16", STEPS))
    name, error = max_relative_error(muon, merged_params(results))
    assert error == 0.0, f"{name} differs by {error:.2e}"
    planted = rank_pool_2.run(_train_with_qk_clip, "dist_muon", "bf16", STEPS, unclipped_masters=True,
                              overlap_param_gather=overlap_param_gather)
    name, error = max_relative_error(muon, merged_params(planted))
    assert name.endswith("linear_qkv.weight") and error > 1e-3, (name, error)


def test_distributed_adamw_clips_its_flat_master_slices_bf16(rank_pool_2):
    """megatron's DistributedOptimizer holds a flat slice of the qkv master per rank (or none), which megatron's
    clip_qk cannot reshape; the plugin scales the slices, so it matches AdamW with whole masters bit for bit."""
    sharded = rank_pool_2.run(_train_with_qk_clip, "adam", "bf16", STEPS, distributed_optimizer=True)
    whole = rank_pool_2.run(_train_with_qk_clip, "adam", "bf16", STEPS)
    name, error = max_relative_error(merged_params(whole), merged_params(sharded))
    assert error == 0.0, f"{name} differs by {error:.2e}"
    unclipped = rank_pool_2.run(_train_with_qk_clip, "adam", "bf16", STEPS, qk_clip=False, distributed_optimizer=True)
    _, error = max_relative_error(merged_params(whole), merged_params(unclipped))
    assert error > 1e-3
