"""Per-rank memory of the gpt-7b recipe at dp=4 and dp=8, accounted from megatron's parameter layouts on the meta
device: the owner engine (Muon matrices: 16-bit parameter + fp32 gradient on every rank, fp32 master + momentum on
the owner) against megatron's distributed AdamW (master + two moments per shard)."""

import pytest
import torch

from megatron_muon.metrics.memory import predicted_memory

HIDDEN, FFN, LAYERS, VOCAB, HEAD = 4096, 11008, 32, 32000, 128


def gpt7b_parameters(tag: bool) -> list[torch.nn.Parameter]:
    """The recipe's parameters in model order (Llama-2-7B shapes, untied embeddings), on the meta device; `tag`
    marks the Muon matrices as the owner layout expects."""
    from megatron_muon.megatron.owner_layout import TAG
    from megatron_muon.optimizer.routing import is_muon_param

    named = [("embedding.word_embeddings.weight", (VOCAB, HIDDEN))]
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}."
        named += [(prefix + "input_layernorm.weight", (HIDDEN,)),
                  (prefix + "self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN)),
                  (prefix + "self_attention.linear_proj.weight", (HIDDEN, HIDDEN)),
                  (prefix + "pre_mlp_layernorm.weight", (HIDDEN,)),
                  (prefix + "mlp.linear_fc1.weight", (2 * FFN, HIDDEN)),
                  (prefix + "mlp.linear_fc2.weight", (HIDDEN, FFN))]
    named += [("decoder.final_layernorm.weight", (HIDDEN,)), ("output_layer.weight", (VOCAB, HIDDEN))]
    params = []
    for name, shape in named:
        param = torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device="meta"))
        if "embedding" in name or "output_layer" in name:
            param.is_embedding_or_output_parameter = True
        if "linear_qkv" in name:
            param.is_qkv, param.qkv_split_shapes = True, [HEAD, HEAD, HEAD]
        if tag:
            setattr(param, TAG, is_muon_param(param, name))
        params.append(param)
    return params


def _busiest(layout, dp):
    ranks = [predicted_memory(layout, rank, dp) for rank in range(dp)]
    return max(ranks, key=lambda m: m.optimizer_state_bytes + m.param_bytes + m.grad_bytes)


def _total(memory) -> int:
    return memory.optimizer_state_bytes + memory.param_bytes + memory.grad_bytes


@pytest.mark.parametrize("dp", [4, 8])
def test_gpt7b_owner_engine_fits_wherever_distributed_adamw_fits(dp):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_muon.megatron.owner_layout import compute_full_param_layout

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    bucket_size = max(40_000_000, 1_000_000 * dp)
    muon_params, adam_params = gpt7b_parameters(tag=True), gpt7b_parameters(tag=False)
    muon = _busiest(compute_full_param_layout(muon_params, bucket_size, dp, ddp_config), dp)
    adam = _busiest(DistributedOptimizer.compute_full_param_layout(adam_params, bucket_size, dp, ddp_config), dp)

    matrices = sum(p.numel() for p in muon_params if getattr(p, "is_managed_by_layer_wise_optimizer"))
    rest = sum(p.numel() for p in muon_params) - matrices
    assert 6.4e9 < matrices + rest < 6.9e9
    # DESIGN.md: bytes per parameter per rank ~ 2 + 4 + 8/dp for Muon matrices, 2 + 4 + 12/dp for AdamW's
    muon_formula = matrices * (6 + 8 / dp) + rest * (6 + 12 / dp)
    adam_formula = (matrices + rest) * (6 + 12 / dp)
    assert _total(muon) == pytest.approx(muon_formula, rel=0.05)
    assert _total(adam) == pytest.approx(adam_formula, rel=0.05)
    assert _total(muon) <= _total(adam)
    assert muon.optimizer_state_bytes < adam.optimizer_state_bytes


def test_the_launcher_makes_megatrons_layer_wise_layout_the_owner_layout():
    """Megatron-LM wraps DDP for `--optimizer muon --use-distributed-optimizer` through megatron's layer-wise
    `compute_full_param_layout`; after `use_owner_layout_in_megatron` (what `megatron_muon.launch` calls) that is the
    owner layout, with megatron's own tags deciding which buffer is Muon's."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    from megatron_muon.megatron.owner_layout import use_owner_layout_in_megatron

    original = LayerWiseDistributedOptimizer.__dict__["compute_full_param_layout"]
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    try:
        use_owner_layout_in_megatron()
        use_owner_layout_in_megatron()  # idempotent
        full = LayerWiseDistributedOptimizer.compute_full_param_layout(gpt7b_parameters(tag=True), 40_000_000, 4,
                                                                       ddp_config)
    finally:
        LayerWiseDistributedOptimizer.compute_full_param_layout = original
    plans = {key.is_managed_by_layer_wise_optimizer: getattr(layout, "owner_plan", None)
             for key, layout in full.layouts.items()}
    assert plans[True] is not None and plans[True].method in ("milp", "greedy") and plans[False] is None
