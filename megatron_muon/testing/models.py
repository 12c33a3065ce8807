"""Tiny megatron-core models and one training step, shared by tests of every layer of the plugin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

VOCAB_SIZE = 128
SEQ_LENGTH = 32

# A tiny GDN geometry for the hybrid: 2 key heads of 16, 4 value heads of 8, conv 4.
GDN_SIZES = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


def tiny_transformer_config(**overrides: Any):
    """A 2-layer, hidden-64 TransformerConfig that initializes on CPU, so every TP layout starts from the same
    full weights (required for tp=1 vs tp=2 comparisons)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        add_bias_linear=False,
        gated_linear_unit=True,
        normalization="RMSNorm",
        params_dtype=torch.float32,
    )
    settings.update(overrides)
    settings.setdefault("pipeline_dtype", torch.bfloat16 if settings.get("bf16") else settings["params_dtype"])
    return TransformerConfig(**settings)


def build_tiny_gpt(config=None, vocab_size: int = VOCAB_SIZE, seq_length: int = SEQ_LENGTH):
    """A megatron GPTModel with the local (non-TE) spec, sized for CPU tests; this rank's pipeline stage only."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = config or tiny_transformer_config()
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )
    reinitialize_by_global_name(model)
    return model


def build_tiny_hybrid(config):
    """A "G*" hybrid (one GDN layer, one attention layer) on the local backend; `config` must carry GDN_SIZES.

    Initialized like the tiny GPT by global name, so every (tp, pp) layout starts from the same full model; the GDN
    layers then redraw their own parameters from a seed of their global layer number (their sectioned in_proj and
    conv are split across tp section by section, which only the layer itself knows).
    """
    import zlib

    from megatron_muon.specs import build_hybrid_model

    torch.manual_seed(1234)
    model = build_hybrid_model(config, "G*", vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LENGTH, backend="local")
    reinitialize_by_global_name(model)
    for module in model.modules():
        if callable(getattr(module, "in_proj_sections", None)) and hasattr(module, "reset_parameters"):
            torch.manual_seed(zlib.crc32(f"gated_deltanet.{module.layer_number}".encode()))
            module.reset_parameters()
    return model


def global_parameter_names(model) -> dict[str, torch.nn.Parameter]:
    """Parameters keyed by a name that is the same in every pipeline layout (layer indices made global)."""
    import re

    layer_numbers = {}
    for name, module in model.named_modules():
        if hasattr(module, "layer_number") and re.search(r"layers\.\d+$", name):
            layer_numbers[name] = module.layer_number - 1
    result = {}
    for name, param in model.named_parameters():
        for prefix, number in layer_numbers.items():
            if name.startswith(prefix + "."):
                head = prefix.rsplit(".", 1)[0]
                name = f"{head}.{number}.{name[len(prefix) + 1:]}"
                break
        while name.startswith("module."):
            name = name[len("module."):]
        result[name] = param
    return result


def shard_of(full: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """This tp rank's shard of `full`, following megatron's (possibly strided) partitioning of `param`."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    return torch.cat([chunk.chunk(tp, dim=dim)[rank] for chunk in full.chunk(stride, dim=dim)], dim=dim)


def full_shape(param: torch.nn.Parameter) -> list[int]:
    from megatron.core import parallel_state as ps

    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= ps.get_tensor_model_parallel_world_size()
    return shape


@torch.no_grad()
def reinitialize_by_global_name(model, std: float = 0.05) -> None:
    """Give every parameter values that depend only on its global name, so any (tp, pp) layout starts from exactly
    the same full model: matrices ~ N(0, std²), norm weights 1, other vectors 0."""
    import zlib

    for name, param in global_parameter_names(model).items():
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if param.dim() >= 2:
            full = torch.randn(full_shape(param), generator=generator) * std
        elif "norm" in name or "layernorm" in name:
            full = torch.ones(full_shape(param))
        else:
            full = torch.zeros(full_shape(param))
        param.copy_(shard_of(full, param).to(param.dtype))


@dataclass
class Batch:
    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.tokens, self.labels, self.position_ids, self.loss_mask)))


def synthetic_batch(index: int, micro_batch_size: int = 2, seq_length: int = SEQ_LENGTH,
                    vocab_size: int = VOCAB_SIZE) -> Batch:
    """Micro-batch number `index` of a deterministic stream with a learnable pattern (next token = token + 1)."""
    generator = torch.Generator().manual_seed(10_000 + index)
    start = torch.randint(0, vocab_size, (micro_batch_size, 1), generator=generator)
    tokens = (start + torch.arange(seq_length + 1)) % vocab_size
    return Batch(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        position_ids=torch.arange(seq_length).expand(micro_batch_size, -1).contiguous(),
        loss_mask=torch.ones(micro_batch_size, seq_length),
    )


def _fp64_token_losses(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [b, s] in fp64 from the vocab-parallel logits of the last stage (other stages'
    hidden states pass through). megatron's vocab-parallel cross entropy computes in fp32 and sums exp(logits)
    per tp shard before the all-reduce, so its rounding would depend on tp; here all tp ranks compute the same
    loss from the gathered logits (the gather's backward hands each rank its shard of the gradient)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if not ps.is_pipeline_last_stage():
        return output
    logits = gather_from_tensor_model_parallel_region(output)  # [b, s, vocab]
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def forward_backward(model, batches: list[Batch], seq_length: int = SEQ_LENGTH, forward_only: bool = False) -> float:
    """Megatron's forward/backward schedule over `batches` (one per micro-batch); works for any pp.

    Returns the mean loss on the last pipeline stage (0.0 elsewhere).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = iter(batches)
    recorded: list[float] = []  # per-micro-batch losses as computed, independent of megatron's reporting scale

    def forward_step(data_iterator, model_chunk):
        parameter = next(model_chunk.parameters())
        batch = next(data_iterator).to(parameter.device)
        if parameter.dtype == torch.float64:
            output = _fp64_token_losses(model_chunk(batch.tokens, batch.position_ids, None), batch.labels)
        else:
            output = model_chunk(batch.tokens, batch.position_ids, None, labels=batch.labels)

        def loss_func(losses):
            losses = losses.to(torch.promote_types(losses.dtype, torch.float32))
            loss = (losses * batch.loss_mask).sum() / batch.loss_mask.sum()
            recorded.append(float(loss.detach()))
            return loss, {"loss": loss.detach()}

        return output, loss_func

    models = model if isinstance(model, list) else [model]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=models,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=batches[0].tokens.shape[0],
        forward_only=forward_only,
    )
    if ps.is_pipeline_last_stage():
        assert len(recorded) == len(batches)
        return sum(recorded) / len(recorded)
    return 0.0
