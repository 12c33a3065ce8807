"""Every shipped recipe loads and validates; the hybrid-1.5B recipe is DESIGN.md's reference workload exactly."""

from pathlib import Path

import pytest

from megatron_muon.cli.main import intended_world_size
from megatron_muon.metrics import training_flops_per_token
from megatron_muon.metrics.flops import parameter_count
from megatron_muon.training.config import RecipeError, parse_overrides
from megatron_muon.training.recipes import available_recipes, load_recipe
from megatron_muon.training.validation import full_layer_pattern, model_shape, validate

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"


def test_recipe_directory_is_found_and_complete():
    found = available_recipes()
    assert {p.stem for p in RECIPES.glob("*.yaml")} <= set(found)
    assert {"tiny-cpu", "hybrid-1.5b-h200", "hybrid-1.5b-8gpu", "hybrid-1.5b-multinode",
            "qwen3-next-1.5b-h200"} <= set(found)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_loads_and_validates(path):
    recipe = load_recipe(str(path))
    world_size = intended_world_size(recipe) or 1
    validate(recipe, world_size)
    assert recipe.name == path.stem and recipe.description
    assert training_flops_per_token(model_shape(recipe)) > 0


def test_hybrid_1p5b_is_the_reference_workload():
    recipe = load_recipe("hybrid-1.5b-h200")
    m = recipe.model
    assert full_layer_pattern(recipe) == "GGG*" * 6
    assert (m.hidden_size, m.num_layers, m.ffn_hidden_size, m.swiglu) == (2048, 24, 5632, True)
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (16, 4, 128)
    assert (m.gdn_num_key_heads, m.gdn_num_value_heads, m.gdn_key_head_dim, m.gdn_value_head_dim) == (6, 6, 256, 512)
    assert (m.gdn_conv_kernel, m.vocab_size, m.seq_length) == (4, 32000, 16384)
    assert recipe.training.precision == "bf16" and recipe.optimizer.name == "muon" and m.untie_embeddings
    assert intended_world_size(recipe) == 1 and recipe.training.micro_batch_size == 1
    # Megatron-fused matrix shapes of DESIGN.md: in_proj 9228 x 2048, out_proj 2048 x 3072, qkv 3072 x 2048.
    assert 2 * 6 * 256 + 2 * 6 * 512 + 2 * 6 == 9228 and 6 * 512 == 3072 and (16 + 2 * 4) * 128 == 3072
    for name in ("hybrid-1.5b-8gpu", "hybrid-1.5b-multinode"):  # the scaled-out versions train the same model
        assert load_recipe(name).model == m


def test_the_h100_recipe_is_the_h200_one_with_recomputed_gdn_states():
    h200, h100 = load_recipe("hybrid-1.5b-h200"), load_recipe("hybrid-1.5b-h100")
    assert h200.model.gdn_keep_chunk_states and not h100.model.gdn_keep_chunk_states
    assert {k for k, v in vars(h100.model).items() if vars(h200.model)[k] != v} == {"gdn_keep_chunk_states"}
    assert (h100.optimizer, h100.training, h100.parallel) == (h200.optimizer, h200.training, h200.parallel)


def test_qwen3_next_is_the_hybrid_with_qwen3_nexts_gdn_heads():
    """16 q/k heads and 32 value heads of 128 (FlashQLA's K = V = 128), a narrower FFN, the same parameter count."""
    hybrid, qwen = load_recipe("hybrid-1.5b-h200"), load_recipe("qwen3-next-1.5b-h200")
    m = qwen.model
    assert (m.gdn_num_key_heads, m.gdn_num_value_heads, m.gdn_key_head_dim, m.gdn_value_head_dim) == (16, 32, 128, 128)
    assert full_layer_pattern(qwen) == "GGG*" * 6
    assert (m.hidden_size, m.ffn_hidden_size, m.seq_length, m.gdn_kernels) == (2048, 4608, 16384, "fused")
    differs = {"ffn_hidden_size", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim", "gdn_value_head_dim",
               "gdn_kernels"}  # the fused output terms, faster at these heads (results/gdn_fused_terms.md)
    assert {k for k, v in vars(m).items() if vars(hybrid.model)[k] != v} == differs
    assert qwen.optimizer == hybrid.optimizer and qwen.training == hybrid.training and qwen.parallel == hybrid.parallel
    params = parameter_count(model_shape(qwen))
    assert abs(params / parameter_count(model_shape(hybrid)) - 1) < 0.01 and 1.45e9 < params < 1.55e9


def test_scaled_out_layouts():
    eight, multi = load_recipe("hybrid-1.5b-8gpu"), load_recipe("hybrid-1.5b-multinode")
    assert intended_world_size(eight) == 8 and intended_world_size(multi) == 32
    assert multi.parallel.pipeline_model_parallel_size == 2 and eight.parallel.sequence_parallel


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["optimizer.lrr=1"], 1, "did you mean 'optimizer.lr'"),
        (["model.hiden_size=8"], 1, "did you mean 'model.hidden_size'"),
        (["parallel.tensor_model_parallel_size=2"], 1, "does not divide the world size 1"),
        (["parallel.tensor_model_parallel_size=4"], 4, "num_query_groups (2) must be divisible"),
        (["parallel.pipeline_model_parallel_size=3"], 3, "num_layers (4) must be divisible"),
        (["training.global_batch_size=12"], 2, "multiple of micro_batch_size x data-parallel size"),
        (["model.layer_pattern=GGX*"], 1, "may only use 'G'"),
        (["training.precision=fp8"], 1, "training.precision"),
        (["training.compile_mode=fast"], 1, "'training.compile_mode' must be one of default, reduce-overhead"),
        (["training.compile_scope=block"], 1, "'training.compile_scope' must be one of model, layer"),
        (["training.train_iters=ten"], 1, "must be int"),
        (["data.path=/nonexistent/prefix"], 1, "no '/nonexistent/prefix.bin'"),
        (["parallel.data_parallel_size=4"], 2, "launch that many processes"),
        (["parallel.sequence_parallel=true"], 1, "sequence_parallel needs"),
        (["optimizer.lr_warmup_iters=1000"], 1, "lr_warmup_iters"),
        (["optimizer.muon_nonfinite_check=never"], 1, "'optimizer.muon_nonfinite_check' must be one of auto, before_update"),
        (["training.autotune_table=/nonexistent/table.json"], 1, "is not a file; give the autotune_table.json"),
        (["model.gdn_kernels=fast"], 1, "'model.gdn_kernels' must be one of ours, fused, triton, segments, fla"),
    ],
)
def test_bad_input_is_one_clear_sentence(overrides, world_size, message):
    with pytest.raises(RecipeError) as error:
        validate(load_recipe("tiny-cpu", overrides), world_size)
    text = str(error.value)
    assert message in text and "\n" not in text


def test_overrides_parse_yaml_scalars_and_reject_malformed():
    assert parse_overrides(["optimizer.lr=0.001", "data.path=[a, b]", "logging.plot=false"]) == {
        "optimizer": {"lr": 1e-3}, "data": {"path": ["a", "b"]}, "logging": {"plot": False}}
    recipe = load_recipe("tiny-cpu", ["optimizer.lr=1e-3", "training.train_iters=7", "model.kv_channels=null"])
    assert (recipe.optimizer.lr, recipe.training.train_iters, recipe.model.kv_channels) == (1e-3, 7, None)
    assert load_recipe("tiny-cpu", ["parallel.tensor_model_parallel_size=2"]).parallel.tensor_model_parallel_size == 2
    with pytest.raises(RecipeError, match="section.key=value"):
        parse_overrides(["optimizer.lr"])


def test_unknown_recipe_and_extends_cycle(tmp_path):
    with pytest.raises(RecipeError, match="did you mean 'tiny-cpu'"):
        load_recipe("tiny-cpuu")
    (tmp_path / "a.yaml").write_text("extends: b\n")
    (tmp_path / "b.yaml").write_text("extends: a\n")
    with pytest.raises(RecipeError, match="extends itself"):
        load_recipe(str(tmp_path / "a.yaml"))
    (tmp_path / "bad.yaml").write_text("model: {hidden_size: 8\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(tmp_path / "bad.yaml"))
    (tmp_path / "typo.yaml").write_text("extends: tiny-cpu\nmodel:\n  num_layer: 8\n")
    with pytest.raises(RecipeError, match="did you mean 'model.num_layers'"):
        load_recipe(str(tmp_path / "typo.yaml"))
