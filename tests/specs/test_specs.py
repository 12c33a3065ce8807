"""Hybrid specs: pattern handling, the TE spec checked by construction (TE is not installed here), the `--spec`
objects as Megatron-LM resolves them, and both model paths (GPTModel, HybridModel) built and run on CPU."""

import pytest
import torch
from megatron.core.extensions import transformer_engine as megatron_te
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_layer_counts
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_muon.layers import GatedDeltaNet, SDPADotProductAttention, TEFusedDotProductAttention
from megatron_muon.layers.attention import TE_FUSED_ATTENTION_ENV
from megatron_muon.specs import (
    gdn_hybrid_te,
    hybrid_block_spec,
    layer_symbols,
    megatron_hybrid_pattern,
    pattern_from_linear_attention_freq,
)
from megatron_muon.specs.hybrid import HybridPatternLayer


def test_pattern_repeats_over_layers():
    assert "".join(layer_symbols("GGG*", 8)) == "GGG*GGG*"
    assert "".join(layer_symbols("G*", 5)) == "G*G*G"
    assert pattern_from_linear_attention_freq(4, 8) == "GGG*GGG*"
    assert pattern_from_linear_attention_freq([1, 0, 1, 1], 4) == "G*GG"


@pytest.mark.parametrize("pattern,needle", [("GGM*", "unknown symbols"), ("", "non-empty"), ("GGG*G", "more symbols")])
def test_bad_patterns_raise(pattern, needle):
    with pytest.raises(ValueError, match=needle):
        layer_symbols(pattern, 4)


def test_megatron_hybrid_pattern_is_mixer_plus_mlp_and_parses():
    pattern = megatron_hybrid_pattern(8)
    assert pattern == "G-G-G-*-G-G-G-*-"
    counts = get_hybrid_layer_counts(pattern)  # megatron's own parser
    assert (counts["G"], counts["*"], counts["-"]) == (6, 2, 8)


def _te_layers():
    return gdn_hybrid_te.submodules.layer_specs["G"], gdn_hybrid_te.submodules.layer_specs["*"]


def test_te_attention_layer_spec_by_construction():
    """Without TE, megatron's TE names are placeholders; identity with them proves the spec names TE's classes."""
    _, attention = _te_layers()
    assert attention.module is TransformerLayer
    sub = attention.submodules
    assert sub.input_layernorm is IdentityOp and sub.pre_mlp_layernorm is IdentityOp  # norms fused into linears
    assert sub.self_attention.module is SelfAttention
    core = sub.self_attention.submodules
    assert core.linear_qkv is megatron_te.TELayerNormColumnParallelLinear
    assert core.linear_proj is megatron_te.TERowParallelLinear
    assert core.core_attention is TEFusedDotProductAttention
    assert TEFusedDotProductAttention.required_environment == {
        "NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"
    }
    if megatron_te.HAVE_TE:  # pragma: no cover - TE machines only
        assert issubclass(TEFusedDotProductAttention, megatron_te.TEDotProductAttention)
    mlp = sub.mlp.keywords["submodules"]
    assert mlp.linear_fc1 is megatron_te.TELayerNormColumnParallelLinear
    assert mlp.linear_fc2 is megatron_te.TERowParallelLinear


def test_te_gdn_layer_spec_by_construction():
    gdn, _ = _te_layers()
    sub = gdn.submodules
    assert sub.input_layernorm is IdentityOp and sub.pre_mlp_layernorm is IdentityOp
    assert sub.self_attention.module is GatedDeltaNet
    assert sub.self_attention.submodules.in_proj is megatron_te.TELayerNormColumnParallelLinear
    assert sub.self_attention.submodules.out_proj is megatron_te.TERowParallelLinear
    assert sub.mlp.keywords["submodules"].linear_fc1 is megatron_te.TELayerNormColumnParallelLinear


def test_te_hybrid_stack_spec_by_construction():
    stack = import_module(("megatron_muon.specs", "gdn_hybrid_stack_te"))
    assert stack.module is HybridStack
    gdn = stack.submodules.gdn_layer.submodules.self_attention
    assert gdn.module is GatedDeltaNet and gdn.submodules.in_proj is megatron_te.TELayerNormColumnParallelLinear
    attention = stack.submodules.attention_layer.submodules.self_attention.submodules
    assert attention.core_attention is TEFusedDotProductAttention
    mlp = stack.submodules.mlp_layer.submodules.mlp.keywords["submodules"]
    assert mlp.linear_fc2 is megatron_te.TERowParallelLinear


def test_spec_names_resolve_like_megatron_lm():
    """Megatron-LM's `--spec a b` calls import_module((a, b)) and passes the object itself to the model."""
    for name in ("gdn_hybrid_te", "gdn_hybrid_local"):
        spec = import_module(("megatron_muon.specs", name))
        assert isinstance(spec, ModuleSpec) and issubclass(spec.module, HybridPatternLayer)
        assert spec.submodules.pattern == "GGG*"
    assert TE_FUSED_ATTENTION_ENV["NVTE_FUSED_ATTN"] == "1"


def _build_both_gpt_paths(rank, world_size, pp):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from megatron_muon.specs import build_hybrid_model, gdn_hybrid_local
    from megatron_muon.testing.parallel import init_model_parallel
    from tests.layers.gdn_cases import gdn_config

    init_model_parallel(tp=1, pp=pp)
    config = gdn_config(num_layers=4)
    torch.manual_seed(0)
    built = build_hybrid_model(config, "GGG*", vocab_size=128, max_seq_len=64)
    torch.manual_seed(0)
    spec_config = gdn_config(num_layers=4)
    via_spec = GPTModel(config=spec_config, transformer_layer_spec=gdn_hybrid_local, vocab_size=128,
                        max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope")
    frequency = GPTModel(config=gdn_config(num_layers=4, linear_attention_freq=2),
                         transformer_layer_spec=gdn_hybrid_local, vocab_size=128, max_sequence_length=64,
                         pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())

    def mixers(model):
        return [type(layer.self_attention).__name__[0] for layer in model.decoder.layers]

    same = built.state_dict().keys() == via_spec.state_dict().keys() and all(
        torch.equal(a, b) for a, b in zip(built.state_dict().values(), via_spec.state_dict().values())
        if isinstance(a, torch.Tensor)
    )
    core_attention = [type(layer.self_attention.core_attention) for layer in built.decoder.layers
                      if isinstance(layer.self_attention, SelfAttention)]
    return {"built": mixers(built), "via_spec": mixers(via_spec), "frequency": mixers(frequency),
            "same_weights": same, "core_attention": core_attention,
            "per_layer_checkpoint_keys": (config.hetereogenous_dist_checkpoint,
                                          spec_config.hetereogenous_dist_checkpoint)}


def test_spec_path_equals_builder_and_follows_pattern(rank_pool_1):
    result = rank_pool_1.run(_build_both_gpt_paths, 1)[0]
    assert result["built"] == result["via_spec"] == list("GGGS")  # G = GatedDeltaNet, S = SelfAttention
    assert result["frequency"] == list("GSGS")  # --linear-attention-freq 2 overrides the spec's pattern
    assert result["same_weights"]
    assert result["core_attention"] == [SDPADotProductAttention]
    assert result["per_layer_checkpoint_keys"] == (True, True)  # mixed layers cannot share stacked checkpoint keys


def test_pipeline_stages_take_their_part_of_the_pattern(rank_pool_2):
    stages = rank_pool_2.run(_build_both_gpt_paths, 2)
    assert [stage["built"] for stage in stages] == [list("GG"), list("GS")]
    assert [stage["via_spec"] for stage in stages] == [list("GG"), list("GS")]


@pytest.mark.skipif(megatron_te.HAVE_TE, reason="checks the message shown when Transformer Engine is missing")
def test_te_paths_without_te_say_what_to_install():
    from types import SimpleNamespace

    from megatron_muon.specs import build_hybrid_model

    with pytest.raises(ImportError, match="pip install"):
        build_hybrid_model(SimpleNamespace(num_layers=4), backend="te")
    with pytest.raises(ImportError, match="pip install"):
        HybridPatternLayer(SimpleNamespace(num_layers=4), gdn_hybrid_te.submodules)


def _gdn_states_kept_by_recipe(rank, world_size):
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.training.model import build_model, transformer_config
    from megatron_muon.training.recipes import load_recipe

    init_model_parallel(tp=1)
    kept = {}
    for overrides in ([], ["model.gdn_keep_chunk_states=false"]):
        recipe = load_recipe("tiny-cpu", overrides)
        model = build_model(recipe, transformer_config(recipe, on_gpu=False))
        kept[bool(overrides)] = [layer.self_attention.keep_chunk_states for layer in model.decoder.layers
                                 if isinstance(layer.self_attention, GatedDeltaNet)]
    return kept


def test_the_recipes_gdn_state_choice_reaches_every_gdn_layer(rank_pool_1):
    """Kept by default (the faster backward); `model.gdn_keep_chunk_states=false` recomputes them in every layer."""
    kept = rank_pool_1.run(_gdn_states_kept_by_recipe)[0]
    assert kept == {False: [True] * 3, True: [False] * 3}


def test_layer_spec_passes_the_gdn_state_choice_to_gdn_mixers_only():
    from megatron_muon.specs import hybrid_layer_spec

    from megatron_muon.specs import hybrid_pattern_layer_spec, hybrid_stack_spec

    for keep in (True, False):
        mixers = [hybrid_layer_spec(symbol, keep_gdn_chunk_states=keep).submodules.self_attention for symbol in "G*"]
        assert [mixer.params.get("keep_chunk_states") for mixer in mixers] == [keep, None]
        # the Megatron-LM `--spec` forms: GPTModel's pattern layer and HybridModel's stack
        by_symbol = hybrid_pattern_layer_spec("GGG*", keep_gdn_chunk_states=keep).submodules.layer_specs
        assert by_symbol["G"].submodules.self_attention.params == {"keep_chunk_states": keep}
        assert by_symbol["*"].submodules.self_attention.params.get("keep_chunk_states") is None
        stack = hybrid_stack_spec("local", keep_gdn_chunk_states=keep).submodules
        assert stack.gdn_layer.submodules.self_attention.params == {"keep_chunk_states": keep}


def test_block_spec_rejects_unknown_backend():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="backend must be one of"):
        hybrid_block_spec(SimpleNamespace(num_layers=4, linear_attention_freq=None), "GGG*", backend="tex")


def _hybrid_model_path(rank, world_size):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_muon.specs import gdn_hybrid_stack_local, megatron_hybrid_pattern
    from megatron_muon.testing.parallel import init_model_parallel
    from tests.layers.gdn_cases import gdn_config

    init_model_parallel(tp=1)
    pattern = megatron_hybrid_pattern(4)
    model = HybridModel(config=gdn_config(num_layers=len(pattern)), hybrid_stack_spec=gdn_hybrid_stack_local,
                        vocab_size=128, max_sequence_length=64, hybrid_layer_pattern=pattern,
                        position_embedding_type="rope")
    tokens = torch.randint(0, 128, (2, 32))
    loss = model(tokens, torch.arange(32).expand(2, -1), None, labels=tokens).mean()
    loss.backward()
    layers = [type(layer).__name__ if type(layer).__name__ == "MLPLayer" else type(layer.self_attention).__name__
              for layer in model.decoder.layers]
    grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    return layers, type(model.decoder.final_norm).__name__, float(loss), grads_ok


def test_hybrid_model_path_runs_on_cpu(rank_pool_1):
    layers, final_norm, loss, grads_ok = rank_pool_1.run(_hybrid_model_path)[0]
    assert layers == ["GatedDeltaNet", "MLPLayer"] * 3 + ["SelfAttention", "MLPLayer"]
    assert final_norm == "RMSNorm"  # torch.nn.RMSNorm from WrappedTorchNorm, not TE's
    assert loss == pytest.approx(torch.log(torch.tensor(128.0)).item(), rel=0.1)  # untrained: ~uniform
    assert grads_ok
