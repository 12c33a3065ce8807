"""Recipe schema: nested dataclasses that a YAML recipe fills, with `--set section.key=value` overrides.

Every user mistake is a `RecipeError` (a ValueError) with one sentence that names the fix; the CLI turns it into
exit code 2 before anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

import yaml


class RecipeError(ValueError):
    """A recipe, override or command-line value the user can fix."""


@dataclass
class ModelSection:
    kind: str = "hybrid"  # "hybrid" (our GDN/attention specs) or "gpt" (megatron-core GPTModel)
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 176
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    layer_pattern: str = "GGG*"  # hybrid only: 'G' GDN, '*' attention; repeated to num_layers
    gdn_num_key_heads: int = 2
    gdn_num_value_heads: int = 2
    gdn_key_head_dim: int = 16
    gdn_value_head_dim: int = 32
    gdn_conv_kernel: int = 4
    gdn_chunk_size: int = 64  # chunk the GDN kernel uses; enters the FLOPs accounting
    gdn_keep_chunk_states: bool = True  # False: the backward recomputes the chunk states (less memory, slower)
    vocab_size: int = 256
    seq_length: int = 128
    swiglu: bool = True
    normalization: str = "RMSNorm"
    position_embedding: str = "rope"
    rotary_base: int = 10000
    untie_embeddings: bool = True
    spec_backend: str = "auto"  # "auto" (te when importable), "te" or "local"
    gdn_kernels: str | None = None  # "ours", "fused", "triton", "segments", "fla" (ops/kernel_choice.py); None: env
    init_method_std: float = 0.02
    dropout: float = 0.0
    qk_clip: bool = False  # MuonClip: rescale W_q, W_k per query group after each step (megatron's clip_qk)
    qk_clip_threshold: float = 100.0  # clip where a group's max pre-softmax logit exceeds this
    qk_clip_alpha: float = 0.5  # share of the clip taken by the queries (the keys take 1 - alpha)
    log_max_attention_logit: bool = False  # log the max logit without clipping (qk_clip logs it too)


@dataclass
class ParallelSection:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int | None = None  # None: whatever the world size leaves; set: checked against it
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # with the distributed optimizer: gather each bucket in the next forward
    # megatron's DDP checks each bucket's gradient for NaN/Inf before reducing it (a host read per bucket; on by
    # default in Megatron-LM's pretrain_*.py, off in megatron-core's DDP config)
    check_for_nan_in_grad: bool = False


@dataclass
class TrainingSection:
    train_iters: int = 300
    micro_batch_size: int = 8
    global_batch_size: int = 8
    seed: int = 1234
    precision: str = "fp32"  # "bf16", "fp16" or "fp32"
    torch_compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode: "reduce-overhead" adds CUDA graphs
    compile_scope: str = "layer"  # one compiled graph per distinct layer kind, shared by its layers; or "model"
    exit_signal_handler: bool | None = None  # on exit_signal: finish the step, save, end; None: on with a save dir
    exit_signal: str = "SIGTERM"  # or SIGUSR1 / SIGUSR2 / SIGINT, for jobs whose scheduler sends another signal
    # Triton autotune choices: "auto" pins the package's tables made on this GPU model and versions, then
    # <output_dir>/autotune_table.json if there, and writes it after the first step; a path pins that file; "none"
    autotune_table: str = "auto"


@dataclass
class OptimizerSection:
    name: str = "muon"  # "muon", "dist_muon", "adam", "sgd", or any name registered with megatron-core
    lr: float = 0.02
    min_lr: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    lr_decay_style: str = "cosine"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_num_ns_steps: int = 5
    muon_coefficient_type: str = "quintic"
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0
    muon_split_qkv: bool = True
    muon_split_heads: bool = False  # with muon_split_qkv: each head of QKV / GDN in_proj orthogonalized on its own
    muon_tp_mode: str = "blockwise"
    # with the distributed optimizer: where each owner starts its Newton–Schulz ("backward_end", "bucket", "step")
    muon_newton_schulz_start: str = "backward_end"
    # with the distributed optimizer: a non-finite gradient norm stops the step before any update ("before_update",
    # the host reads the norm) or is reported by the next step ("next_step": the host does not wait for the backward);
    # "auto": next_step where parallel.check_for_nan_in_grad already stops it in the backward, else before_update
    muon_nonfinite_check: str = "auto"
    # replay Muon's momentum stacks and Newton–Schulz from CUDA graphs once their tensors repeat (bit-identical)
    muon_graph_newton_schulz: bool = False
    one_pass_adamw: bool = True  # AdamW's clip factor, update and bf16 model copy in one pass where Triton runs
    muon_clip_in_momentum: bool = True  # megatron's clip applied inside our Muon's fused momentum pass
    muon_model_copy: bool = True  # the bf16 model copies written by our Muon's fused update pass
    first_grad_overwrite: bool = True  # each step's first gradient overwrites DDP's buffers instead of zeroing them


@dataclass
class DataSection:
    path: list[str] | None = None  # None: mock data; else Megatron blend ["prefix"] or ["w1", "p1", "w2", "p2"]
    split: str = "100,0,0"
    eod_id: int | None = None  # None: vocab_size - 1
    cache_dir: str | None = None  # None: <output_dir>/data_cache


@dataclass
class LoggingSection:
    log_interval: int = 10
    output_dir: str = "runs/{name}"
    progress_bar: bool = True
    plot: bool = True


@dataclass
class MetricsSection:
    peak_tflops: float | None = None  # None: the peak table entry for this GPU (unknown on CPU: no MFU)
    peak_precision: str = "bf16"


@dataclass
class CheckpointSection:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None  # None: save once at the end (when `save` is set)
    load_iteration: int | None = None  # None: the iteration the tracker file names (the newest finished save)
    override_lr_schedule: bool = False  # on resume: the recipe's LR schedule instead of the checkpoint's


@dataclass
class Recipe:
    name: str = "recipe"
    description: str = ""
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def output_dir(self) -> str:
        return self.logging.output_dir.format(name=self.name)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Recipe)
            if f.default_factory is not dataclasses.MISSING}
TOP_LEVEL_KEYS = ("name", "description", "extends")


def valid_keys() -> list[str]:
    """Every dotted key a recipe or `--set` may use."""
    keys = [k for k in TOP_LEVEL_KEYS]
    for section, factory in SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(factory)]
    return keys


def recipe_keys() -> list[tuple[str, str, Any]]:
    """(SECTION.KEY, type, default) for every recipe key (`megatron-muon keys`)."""
    rows = []
    for section, factory in SECTIONS.items():
        instance = factory()
        for f in dataclasses.fields(factory):
            rows.append((f"{section}.{f.name}", str(f.type), getattr(instance, f.name)))
    return rows


def _unknown_key_error(key: str, where: str) -> RecipeError:
    nearest = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    hint = f"did you mean '{nearest[0]}'? " if nearest else ""
    return RecipeError(
        f"unknown recipe key '{key}' in {where}; {hint}valid keys are: {', '.join(valid_keys())}."
    )


def _check_type(key: str, value: Any, default: Any, annotation: str) -> Any:
    """Coerce YAML scalars to the field's type (ints for floats, numbers from strings) or name the expected type."""
    if value is None:
        if "None" in annotation:
            return None
        raise RecipeError(f"'{key}' must not be empty; give it a value like {default!r}.")
    base = annotation.split("|")[0].strip()
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            raise TypeError
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if base == "float":
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if base == "str":
            if not isinstance(value, str):
                raise TypeError
            return value
        if base.startswith("list"):
            items = value if isinstance(value, list) else [value]
            return [str(item) for item in items]
    except (TypeError, ValueError):
        raise RecipeError(f"'{key}' must be {annotation.replace(' | None', '')}, got {value!r}.") from None
    return value


def recipe_from_dict(raw: dict[str, Any], where: str = "the recipe") -> Recipe:
    """Build a Recipe from a nested dict (YAML content), rejecting unknown keys with the nearest valid one."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{where} must be a YAML mapping of sections (model:, training:, ...), "
                          f"not {type(raw).__name__}.")
    recipe = Recipe()
    for key, value in raw.items():
        if key in ("name", "description"):
            setattr(recipe, key, str(value))
        elif key == "extends":
            continue
        elif key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise RecipeError(f"section '{key}' in {where} must be a mapping of key: value pairs.")
            section = getattr(recipe, key)
            types = {f.name: f for f in dataclasses.fields(section)}
            for sub_key, sub_value in value.items():
                dotted = f"{key}.{sub_key}"
                if sub_key not in types:
                    raise _unknown_key_error(dotted, where)
                coerced = _check_type(dotted, sub_value, getattr(section, sub_key), str(types[sub_key].type))
                setattr(section, sub_key, coerced)
        else:
            raise _unknown_key_error(str(key), where)
    return recipe


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` on top of `base`, section by section (used by `extends:` and `--set`)."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """['optimizer.lr=0.01', 'training.train_iters=30'] -> nested dict; values are parsed as YAML scalars."""
    nested: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(f"--set expects section.key=value (e.g. optimizer.lr=0.01), got '{assignment}'.")
        if key not in valid_keys() or key == "extends":
            raise _unknown_key_error(key, "--set")
        value = yaml.safe_load(text) if text.strip() else None
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested
