"""The rungs of the end-to-end ladder and the upstream (megatron-core only) hybrid spec they start from.

Each rung is cumulative over the one before it:
  1 upstream       megatron-core modules only: its GatedDeltaNet (FLA kernels inside) and its local
                   DotProductAttention (megatron's attention when Transformer Engine is absent), AdamW, eager
  2 +cudnn-attn    attention through torch SDPA pinned to cuDNN
  3 +compile       torch.compile of the model's forward
  4 +our-gdn       our hybrid spec: compile-friendly GDN custom ops, compilable row-parallel linear;
                   megatron's torch-AdamW fallback on torch's fused kernel (megatron_muon.megatron.fused_adam;
                   the optimizer column shows its share separately), then clip factor, AdamW and bf16 model copy
                   in one pass (megatron_muon.megatron.master_adamw); gradients added into DDP's fp32 buffers
                   in one vectorized pass, the first of each step overwriting them instead of a zeroing pass
                   (megatron_muon.megatron.main_grad_add)
  5 mcore-muon     AdamW -> megatron-core's own Muon (TensorParallelMuon), on the Muon-eligible matrices
                   (the remaining parameters stay on fused AdamW here and in rung 6)
  6 our-muon       -> our Muon (MegaBatch, batched orthogonalization)
`1r` is rung 1 with megatron's selective recompute of core attention, the setting that makes megatron's local
attention fit at 16k (rung 1 materializes a 16 x 16k x 16k score matrix per attention layer and can run out of memory).
`4m` is rung 4 with megatron's mixed-dtype `main_grad.add_` instead of our vectorized one (the gain of
`megatron_muon.megatron.main_grad_add`, measured in the same run).
`4f` is rung 4 with FLA's kernels where GDN's ops run ours by default: the two chunk-state recurrences
(`megatron_muon.ops.state_ws`) and the chunk output gradients (`megatron_muon.ops.dqkwg`; the gain of those,
measured in the same run).
`4t` is rung 4 with our Triton chunk-state kernels (`megatron_muon.ops.state_tma`) in place of the warp-specialized
Gluon ones (`megatron_muon.ops.state_ws`; the gain of those, measured in the same run).
`4u` is rung 4 with GDN's intra-chunk output terms inside the state recurrences (`model.gdn_kernels: fused`: the
fused forward and the state gradients computing the local value gradient), `4b` with the backward's term only (the
gain of each, measured in the same run).
`4g` is rung 4 with GDN's chunk-parallel backward in one kernel (`ops/chunk_bwd_fused.py`: the output gradients, the
WY backward and the gate gradient's reverse cumsum), `4i` with the forward's chunk-parallel part in one kernel
(`ops/chunk_fwd_intra.py`: the gate cumsum, the WY inverse, w and u), `4c` with both (the gain of each and of both,
measured in the same run); `4ib` joins `4i` and `4b`, the two op-level gains at the hybrid's heads. `4s` is rung 4
with GDN's chunk states in segments side by side on our Triton kernels (`model.gdn_kernels` states `segments`,
`ops/state_segments.py`).
A rung without its own GDN kernels runs the recipe's `model.gdn_kernels` (the default where the recipe names none); the
other rung 4 variants name theirs, so on a recipe that names kernels they differ from it in more than one stage.
`4z` is rung 4 with DDP's buffers zeroed every step and every gradient added (the gain of
`megatron_muon.megatron.main_grad_add.install_first_grad_overwrite`, measured in the same run).
`4a` is rung 4 with megatron's clip multiply, torch's fused AdamW and megatron's master-to-model copy as three
passes (the gain of `megatron_muon.megatron.master_adamw`, measured in the same run).
`6c` is rung 6 with megatron's clip multiply instead of the factor inside our Muon's momentum pass (the gain of
`megatron_muon.megatron.clip_deferral.install_for_muon`, measured in the same run).
`6w` is rung 6 with megatron's master-to-model copy instead of the copies written by our Muon's update pass (the
gain of `megatron_muon.megatron.muon_model_copy`, measured in the same run).
`1te`, `1tm` and `3te` are upstream as its users run it with Transformer Engine installed: megatron-core's
HybridModel built from its own `hybrid_stack_spec` (TE linears with the fused pre-norm, TE's cuDNN attention,
megatron-core's GatedDeltaNet with FLA's kernels), AdamW eager, megatron-core's Muon eager, AdamW compiled (as far
as it goes). `4te-e` / `4te` are rungs 4e / 4 on our spec built with TE's modules (`model.spec_backend: te`); every
other "ours" rung pins the local spec, so TE being installed does not change what it measures.
`4e` (our spec, eager, AdamW) is an extra rung: it isolates the compile gain on our spec and gives the
eager-vs-compiled loss comparison.

megatron-core 0.19.2's own hybrid spec (`hybrid_stack_spec`) is built from Transformer Engine modules, so without TE
the upstream rungs put megatron-core's `GatedDeltaNet` into megatron's local (non-TE) GPT layer; with TE installed the
difference between the two is the fused pre-norm, not the GDN or attention kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_muon.ops.kernel_choice import GdnKernels


@dataclass(frozen=True)
class Rung:
    key: str
    label: str
    spec: str  # "upstream" (megatron-core modules, no TE), "upstream-te" (megatron's TE hybrid spec) or "ours"
    attention: str  # "megatron-local" or "cudnn"
    compiled: bool
    optimizer: str  # registered megatron optimizer name
    fused_adam: bool  # megatron's torch-AdamW fallback switched to torch's fused kernel (ours) or left foreach
    recompute_attention: bool = False  # megatron's selective recompute of core attention (drops the score matrices)
    main_grad_add: bool = False  # gradients added into DDP's fp32 buffers by our vectorized pass, not megatron's add_
    one_pass_adamw: bool = False  # clip factor, AdamW and 16-bit model copy in one pass (with fused_adam)
    muon_clip_in_momentum: bool = False  # megatron's clip applied inside our Muon's fused momentum pass
    muon_model_copy: bool = False  # the bf16 model copies written by our Muon's fused update pass
    first_grad_overwrite: bool = False  # each step's first gradient overwrites DDP's buffers (no zeroing pass)
    # GDN's chunk kernels: a preset of `ops.kernel_choice` or a per-stage mix; None: the recipe's (else the default)
    gdn_kernels: str | GdnKernels | None = None
    spec_backend: str = "local"  # our spec's modules: "local" or Transformer Engine's ("te")
    muon_graphs: bool = False  # our Muon's stacks and Newton–Schulz replayed from a CUDA graph


RUNGS = {
    "1": Rung("1", "upstream (mcore GDN, local attention, AdamW)", "upstream", "megatron-local", False, "adam", False),
    "1r": Rung("1r", "upstream + selective recompute of core attention", "upstream", "megatron-local", False,
               "adam", False, recompute_attention=True),
    "2": Rung("2", "+ cuDNN attention", "upstream", "cudnn", False, "adam", False),
    "3": Rung("3", "+ torch.compile", "upstream", "cudnn", True, "adam", False),
    "1te": Rung("1te", "upstream with TE (mcore HybridModel, TE hybrid spec, FLA GDN), AdamW", "upstream-te", "te",
                 False, "adam", False),
    "1tm": Rung("1tm", "upstream with TE, megatron-core Muon", "upstream-te", "te", False, "mcore_muon", False),
    "3te": Rung("3te", "upstream with TE + torch.compile", "upstream-te", "te", True, "adam", False),
    "4te-e": Rung("4te-e", "our spec on TE modules + fused AdamW, eager", "ours", "te", False, "adam", True,
                  main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True, spec_backend="te"),
    "4te": Rung("4te", "our spec on TE modules + fused AdamW (compiled)", "ours", "te", True, "adam", True,
                main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True, spec_backend="te"),
    "4e": Rung("4e", "our spec + fused AdamW, eager", "ours", "cudnn", False, "adam", True, main_grad_add=True,
               one_pass_adamw=True, first_grad_overwrite=True),
    "4": Rung("4", "+ our GDN ops/spec + fused AdamW (compiled)", "ours", "cudnn", True, "adam", True,
              main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True),
    "4f": Rung("4f", "rung 4 with FLA's chunk kernels", "ours", "cudnn", True, "adam", True,
               main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True, gdn_kernels="fla"),
    "4t": Rung("4t", "rung 4 with the Triton chunk-state kernels", "ours", "cudnn", True, "adam", True,
               main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True, gdn_kernels="triton"),
    "4u": Rung("4u", "rung 4 with GDN's output terms inside the state kernels", "ours", "cudnn", True, "adam", True,
               main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True, gdn_kernels="fused"),
    "4b": Rung("4b", "rung 4 with the backward's local dv inside the state kernels", "ours", "cudnn", True, "adam",
               True, main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True,
               gdn_kernels=GdnKernels("gluon", "ours", "backward")),
    "4g": Rung("4g", "rung 4 with GDN's chunk-parallel backward in one kernel", "ours", "cudnn", True, "adam", True,
               main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True,
               gdn_kernels=GdnKernels(output_grads="fused")),
    "4o": Rung("4o", "rung 4 with the fused preset's forward and GDN's backward in one pass (K, V <= 128)", "ours",
               "cudnn", True, "adam", True, main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True,
               gdn_kernels=GdnKernels(output_grads="one-pass", output_terms="fused")),
    "4i": Rung("4i", "rung 4 with GDN's chunk-parallel forward in one kernel", "ours", "cudnn", True, "adam", True,
               main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True,
               gdn_kernels=GdnKernels(intra="ours")),
    "4ib": Rung("4ib", "rung 4 with GDN's chunk-parallel forward in one kernel and the backward's local dv inside "
                "the state kernels", "ours", "cudnn", True, "adam", True, main_grad_add=True, one_pass_adamw=True,
                first_grad_overwrite=True, gdn_kernels=GdnKernels(output_terms="backward", intra="ours")),
    "4c": Rung("4c", "rung 4 with GDN's chunk-parallel forward and backward in one kernel each", "ours", "cudnn", True,
               "adam", True, main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True,
               gdn_kernels=GdnKernels(output_grads="fused", intra="ours")),
    "4s": Rung("4s", "rung 4 with GDN's chunk states in segments side by side", "ours", "cudnn", True, "adam", True,
               main_grad_add=True, one_pass_adamw=True, first_grad_overwrite=True,
               gdn_kernels=GdnKernels(states="segments")),
    "4z": Rung("4z", "rung 4 with DDP's buffers zeroed every step", "ours", "cudnn", True, "adam", True,
               main_grad_add=True, one_pass_adamw=True),
    "4m": Rung("4m", "rung 4 with megatron's own main_grad add", "ours", "cudnn", True, "adam", True,
               one_pass_adamw=True),
    "4a": Rung("4a", "rung 4 with clip, AdamW and master copy as three passes", "ours", "cudnn", True, "adam", True,
               main_grad_add=True, first_grad_overwrite=True),
    "5": Rung("5", "AdamW -> megatron-core Muon", "ours", "cudnn", True, "mcore_muon", True, main_grad_add=True,
              one_pass_adamw=True, first_grad_overwrite=True),
    "6": Rung("6", "-> our Muon", "ours", "cudnn", True, "muon", True, main_grad_add=True, one_pass_adamw=True,
              muon_clip_in_momentum=True, muon_model_copy=True, first_grad_overwrite=True),
    "6g": Rung("6g", "rung 6 with the stacks and Newton–Schulz from a CUDA graph", "ours", "cudnn", True, "muon", True,
               main_grad_add=True, one_pass_adamw=True, muon_clip_in_momentum=True, muon_model_copy=True,
               first_grad_overwrite=True, muon_graphs=True),
    "6c": Rung("6c", "rung 6 with megatron's clip multiply before our Muon", "ours", "cudnn", True, "muon", True,
               main_grad_add=True, one_pass_adamw=True, muon_model_copy=True, first_grad_overwrite=True),
    "6w": Rung("6w", "rung 6 with megatron's master-to-model copy after our Muon", "ours", "cudnn", True, "muon",
               True, main_grad_add=True, one_pass_adamw=True, muon_clip_in_momentum=True, first_grad_overwrite=True),
}
DEFAULT_RUNGS = ("1", "1r", "2", "3", "4e", "4", "5", "6")


def rung_gdn_kernels(rung: Rung, recipe_choice: str | None) -> GdnKernels:
    """The kernels a rung runs GDN's ops on: its own choice, else the recipe's (`model.gdn_kernels`), else the
    default."""
    choice = rung.gdn_kernels if rung.gdn_kernels is not None else recipe_choice
    return GdnKernels.named(choice) if isinstance(choice, str) else (choice or GdnKernels())


def parse_rungs(text: str) -> list[Rung]:
    """'all' or a comma list such as '1,2,4'."""
    keys = list(DEFAULT_RUNGS) if text == "all" else [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in RUNGS]
    if unknown or not keys:
        raise ValueError(f"unknown rung(s) {unknown or text!r}; choose from {', '.join(RUNGS)} or 'all'")
    return [RUNGS[k] for k in keys]


def upstream_layer_spec(symbol: str, attention: str):
    """A megatron-core TransformerLayer spec from megatron-core modules only (see the module docstring)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.gated_delta_net.common import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megatron_muon.layers.attention import SDPADotProductAttention
    from megatron_muon.specs.layer_specs import GDN_SYMBOL

    if symbol == GDN_SYMBOL:
        mixer = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear))
    else:
        core = DotProductAttention if attention == "megatron-local" else SDPADotProductAttention
        mixer = ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=core,
                                                              linear_proj=RowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm, self_attention=mixer, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))


def build_upstream_model(config, pattern: str, attention: str, vocab_size: int, seq_length: int,
                         untie_embeddings: bool, rotary_base: int):
    """A GPTModel whose layers follow `pattern` with megatron-core's modules only."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_muon.specs.hybrid import layer_symbols, use_per_layer_checkpoint_keys

    symbols = layer_symbols(pattern, config.num_layers)
    use_per_layer_checkpoint_keys(config, symbols)
    specs = {s: upstream_layer_spec(s, attention) for s in set(symbols)}
    block = TransformerBlockSubmodules(layer_specs=[specs[s] for s in symbols], layer_norm=WrappedTorchNorm)
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=vocab_size,
                    max_sequence_length=seq_length, position_embedding_type="rope",
                    share_embeddings_and_output_weights=not untie_embeddings, rotary_base=rotary_base)


def build_upstream_te_model(config, pattern: str, vocab_size: int, seq_length: int, untie_embeddings: bool,
                            rotary_base: int):
    """megatron-core's HybridModel from its own TE `hybrid_stack_spec` (what `pretrain_hybrid.py
    --hybrid-layer-pattern` builds): each of our layers is megatron's mixer layer followed by its MLP layer."""
    import dataclasses

    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from megatron_muon.training.te_cudnn import check_same_cudnn

    check_same_cudnn()
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_muon.specs import megatron_hybrid_pattern

    megatron_pattern = megatron_hybrid_pattern(config.num_layers, pattern)
    config = dataclasses.replace(config, num_layers=len(megatron_pattern))
    return HybridModel(config=config, hybrid_stack_spec=hybrid_stack_spec, vocab_size=vocab_size,
                       max_sequence_length=seq_length, hybrid_layer_pattern=megatron_pattern,
                       position_embedding_type="rope", rotary_base=rotary_base,
                       share_embeddings_and_output_weights=not untie_embeddings)
