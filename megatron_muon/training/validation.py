"""Checks a recipe against itself and the world size before any process group, file or model exists.

Each failure is one `RecipeError` sentence that names the fix, so a bad launch ends at once with exit code 2 on
every rank instead of hanging in a collective or dying deep inside megatron.
"""

from __future__ import annotations

from pathlib import Path

from megatron_muon.metrics.flops import LAYER_SYMBOLS, ModelShape
from megatron_muon.ops.kernel_choice import KERNEL_CHOICES
from megatron_muon.training.config import Recipe, RecipeError

PRECISIONS = ("bf16", "fp16", "fp32")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "layer")
EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
MODEL_KINDS = ("hybrid", "gpt")
SPEC_BACKENDS = ("auto", "te", "local")
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


def full_layer_pattern(recipe: Recipe) -> str:
    """One symbol per layer: the hybrid's pattern repeated to num_layers, or all attention for a GPT."""
    model = recipe.model
    if model.kind == "gpt":
        return "*" * model.num_layers
    pattern = model.layer_pattern
    if len(pattern) == model.num_layers:
        return pattern
    return pattern * (model.num_layers // len(pattern))


def kv_channels(recipe: Recipe) -> int:
    model = recipe.model
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def model_shape(recipe: Recipe) -> ModelShape:
    """The FLOPs-relevant sizes of the recipe's model (our specs put an MLP in every layer)."""
    model = recipe.model
    return ModelShape(
        hidden_size=model.hidden_size,
        layer_pattern=full_layer_pattern(recipe),
        ffn_hidden_size=model.ffn_hidden_size,
        vocab_size=model.vocab_size,
        seq_length=model.seq_length,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=kv_channels(recipe),
        gated_mlp=model.swiglu,
        mlp_in_every_mixer_layer=True,
        gdn_num_key_heads=model.gdn_num_key_heads,
        gdn_num_value_heads=model.gdn_num_value_heads,
        gdn_key_head_dim=model.gdn_key_head_dim,
        gdn_value_head_dim=model.gdn_value_head_dim,
        gdn_conv_kernel=model.gdn_conv_kernel,
        gdn_chunk_size=model.gdn_chunk_size,
    )


def data_parallel_size(recipe: Recipe, world_size: int) -> int:
    return world_size // (recipe.parallel.tensor_model_parallel_size * recipe.parallel.pipeline_model_parallel_size)


def _require(condition: bool, sentence: str) -> None:
    if not condition:
        raise RecipeError(sentence)


def _one_of(key: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"'{key}' must be one of {', '.join(choices)}, got '{value}'.")


def _validate_model(recipe: Recipe) -> None:
    model, tp = recipe.model, recipe.parallel.tensor_model_parallel_size
    _one_of("model.kind", model.kind, MODEL_KINDS)
    _one_of("model.spec_backend", model.spec_backend, SPEC_BACKENDS)
    if model.gdn_kernels is not None:
        _one_of("model.gdn_kernels", model.gdn_kernels, KERNEL_CHOICES)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "vocab_size", "seq_length"):
        _require(getattr(model, key) > 0, f"'model.{key}' must be positive, got {getattr(model, key)}.")
    _require(model.kv_channels is not None or model.hidden_size % model.num_attention_heads == 0,
             f"model.hidden_size ({model.hidden_size}) is not divisible by model.num_attention_heads "
             f"({model.num_attention_heads}); set model.kv_channels or change the head count.")
    _require(model.num_attention_heads % model.num_query_groups == 0,
             f"model.num_attention_heads ({model.num_attention_heads}) must be a multiple of model.num_query_groups "
             f"({model.num_query_groups}).")
    _require(model.num_query_groups % tp == 0,
             f"model.num_query_groups ({model.num_query_groups}) must be divisible by tensor_model_parallel_size "
             f"({tp}); lower tp or use more query groups.")
    _require(model.vocab_size % tp == 0,
             f"model.vocab_size ({model.vocab_size}) must be divisible by tensor_model_parallel_size ({tp}); "
             "pad the vocabulary to a multiple of tp.")
    _require(model.ffn_hidden_size % tp == 0,
             f"model.ffn_hidden_size ({model.ffn_hidden_size}) must be divisible by tensor_model_parallel_size ({tp}).")
    if model.kind == "hybrid":
        bad = sorted(set(model.layer_pattern) - {"G", "*"})
        _require(model.layer_pattern != "" and not bad,
                 f"model.layer_pattern '{model.layer_pattern}' may only use 'G' (GDN) and '*' (attention), "
                 f"e.g. 'GGG*'.")
        _require(model.num_layers % len(model.layer_pattern) == 0,
                 f"model.num_layers ({model.num_layers}) must be a multiple of the length of model.layer_pattern "
                 f"'{model.layer_pattern}' ({len(model.layer_pattern)}), or give one symbol per layer.")
        if "G" in model.layer_pattern:
            _require(model.gdn_num_value_heads % model.gdn_num_key_heads == 0,
                     f"model.gdn_num_value_heads ({model.gdn_num_value_heads}) must be a multiple of "
                     f"model.gdn_num_key_heads ({model.gdn_num_key_heads}).")
            _require(model.gdn_num_key_heads % tp == 0,
                     f"model.gdn_num_key_heads ({model.gdn_num_key_heads}) must be divisible by "
                     f"tensor_model_parallel_size ({tp}).")
    _validate_qk_clip(recipe)
    assert set(full_layer_pattern(recipe)) <= set(LAYER_SYMBOLS)


def _validate_qk_clip(recipe: Recipe) -> None:
    model = recipe.model
    if model.qk_clip:
        _require(model.qk_clip_threshold > 0,
                 f"model.qk_clip_threshold must be > 0 (the largest logit left unclipped), got "
                 f"{model.qk_clip_threshold}; megatron's default is 100.")
        _require(0 < model.qk_clip_alpha < 1,
                 f"model.qk_clip_alpha must lie strictly between 0 and 1, got {model.qk_clip_alpha}; megatron's "
                 "default is 0.5.")
    if model.qk_clip or model.log_max_attention_logit:
        _require(not (model.kind == "gpt" and model.spec_backend == "local"),
                 "model.qk_clip and model.log_max_attention_logit need an attention that records its max logits, "
                 "which megatron's local GPT spec does not; use model.kind: hybrid (model.layer_pattern: '*' is all "
                 "attention) or model.spec_backend: te.")


def _validate_layout(recipe: Recipe, world_size: int) -> None:
    par, train = recipe.parallel, recipe.training
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    _require(tp >= 1 and pp >= 1, "tensor_model_parallel_size and pipeline_model_parallel_size must be >= 1.")
    _require(world_size % (tp * pp) == 0,
             f"the parallel layout tp={tp} x pp={pp} does not divide the world size {world_size}; launch a multiple "
             f"of {tp * pp} processes or change parallel.tensor_model_parallel_size / pipeline_model_parallel_size.")
    _require(recipe.model.num_layers % pp == 0,
             f"model.num_layers ({recipe.model.num_layers}) must be divisible by pipeline_model_parallel_size ({pp}).")
    _require(not par.sequence_parallel or tp > 1,
             "parallel.sequence_parallel needs tensor_model_parallel_size > 1; turn it off for tp=1.")
    dp = data_parallel_size(recipe, world_size)
    _require(par.data_parallel_size is None or par.data_parallel_size == dp,
             f"the recipe asks for tp={tp} x pp={pp} x dp={par.data_parallel_size} = "
             f"{tp * pp * (par.data_parallel_size or 0)} ranks but {world_size} were launched; launch that many "
             "processes or set parallel.data_parallel_size to match.")
    _require(not par.overlap_param_gather or par.use_distributed_optimizer or recipe.optimizer.name == "dist_muon",
             "parallel.overlap_param_gather needs the distributed optimizer; set parallel.use_distributed_optimizer: "
             "true or turn overlap_param_gather off.")
    owner = recipe.optimizer.name == "dist_muon" or (recipe.optimizer.name == "muon" and par.use_distributed_optimizer)
    _require(not owner or train.precision != "fp16",
             "muon with the distributed optimizer runs bf16 or fp32; use training.precision: bf16, or drop "
             "parallel.use_distributed_optimizer for fp16 muon with loss scaling.")
    _require(train.micro_batch_size > 0 and train.global_batch_size > 0 and train.train_iters > 0,
             "training.micro_batch_size, global_batch_size and train_iters must be positive.")
    _require(train.global_batch_size % (train.micro_batch_size * dp) == 0,
             f"training.global_batch_size ({train.global_batch_size}) must be a multiple of micro_batch_size x "
             f"data-parallel size ({train.micro_batch_size} x {dp}).")


def _validate_training(recipe: Recipe) -> None:
    train, opt, ckpt = recipe.training, recipe.optimizer, recipe.checkpoint
    _one_of("training.precision", train.precision, PRECISIONS)
    _one_of("training.compile_mode", train.compile_mode, COMPILE_MODES)
    _one_of("training.compile_scope", train.compile_scope, COMPILE_SCOPES)
    _one_of("training.exit_signal", train.exit_signal, EXIT_SIGNALS)
    _require(train.autotune_table in ("auto", "none") or Path(train.autotune_table).is_file(),
             f"training.autotune_table: {train.autotune_table} is not a file; give the autotune_table.json an "
             "earlier run wrote into its output directory, or auto / none.")
    _one_of("optimizer.lr_decay_style", opt.lr_decay_style, DECAY_STYLES)
    from megatron_muon.megatron.nonfinite_check import NONFINITE_CHECKS
    from megatron_muon.megatron.owner_optimizer import NEWTON_SCHULZ_STARTS

    _one_of("optimizer.muon_newton_schulz_start", opt.muon_newton_schulz_start, NEWTON_SCHULZ_STARTS)
    _one_of("optimizer.muon_nonfinite_check", opt.muon_nonfinite_check, NONFINITE_CHECKS)
    _require(opt.muon_split_qkv or not opt.muon_split_heads,
             "optimizer.muon_split_heads cuts the fused QKV / GDN in_proj sections per head: set "
             "optimizer.muon_split_qkv=true with it, or muon_split_heads=false.")
    _require(opt.lr > 0 and 0 <= opt.min_lr <= opt.lr, "optimizer.lr must be > 0 and 0 <= optimizer.min_lr <= lr.")
    decay = opt.lr_decay_iters or train.train_iters
    _require(0 <= opt.lr_warmup_iters < decay,
             f"optimizer.lr_warmup_iters ({opt.lr_warmup_iters}) must be at least 0 and below the decay length "
             f"({decay}: optimizer.lr_decay_iters, else training.train_iters); lower the warm-up or train longer.")
    _require(recipe.logging.log_interval > 0, "logging.log_interval must be positive.")
    _require(ckpt.save_interval is None or ckpt.save_interval > 0, "checkpoint.save_interval must be positive.")
    _require(recipe.metrics.peak_tflops is None or recipe.metrics.peak_tflops > 0,
             "metrics.peak_tflops must be positive (TFLOP/s per GPU) or empty for the built-in table.")


def _validate_paths(recipe: Recipe) -> None:
    data = recipe.data
    if data.path:
        prefixes = data.path[1::2] if len(data.path) > 1 and _is_number(data.path[0]) else data.path
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                _require(Path(prefix + suffix).is_file(),
                         f"data path '{prefix}' has no '{prefix}{suffix}'; pass the prefix of a Megatron indexed "
                         "dataset (the .bin/.idx pair) or drop --data-path to train on mock data.")
    load, save = recipe.checkpoint.load, recipe.checkpoint.save
    if load and Path(load).resolve() != Path(save or "").resolve():  # `--save X --load X`: a first run starts fresh
        _require(Path(load).is_dir(), f"checkpoint directory '{load}' does not exist; check --load (or pass the same "
                 "directory to --save and --load to resume when it holds a checkpoint and start fresh when not).")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def validate(recipe: Recipe, world_size: int = 1) -> Recipe:
    """Raise RecipeError for the first problem found; return the recipe unchanged when it is runnable."""
    _validate_model(recipe)
    _validate_layout(recipe, world_size)
    _validate_training(recipe)
    _validate_paths(recipe)
    model_shape(recipe)  # the metrics' own checks
    return recipe
