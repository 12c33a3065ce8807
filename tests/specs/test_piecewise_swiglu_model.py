"""The spec-built hybrid with SwiGLU in pieces (PiecewiseSwiGLUMLP) against the same model with megatron's MLP:
training losses equal; compiled with fullgraph: 0 graph breaks, compiled equal to eager, and the traced backward
assembles the fc1-output gradient from >= 9 pieces (megatron's MLP: from 2, the cat Inductor fuses into one kernel).
"""

import torch
import torch.nn.functional as F

from tests.specs.test_compile import _dynamo_enabled, _fwd_bwd, _max_difference

STEPS = 3
FFN = 101  # prime: the gate and up halves are cut into 9 pieces of 11 and one of 2


def _swiglu_hybrid(config, piecewise: bool = True):
    from megatron.core.transformer.mlp import MLP

    from megatron_muon.testing.models import build_tiny_hybrid

    model = build_tiny_hybrid(config)
    if not piecewise:  # the reference: megatron's own MLP class on the same parameters
        for layer in model.decoder.layers:
            layer.mlp.__class__ = MLP
    return model


def _mlp_types(model):
    return [(type(layer.mlp).__name__, layer.mlp.swiglu_in_pieces) for layer in model.module.decoder.layers]


def _training_case(rank, world_size):
    from megatron_muon.testing.models import GDN_SIZES
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_training_setup, train_step

    overrides = dict(GDN_SIZES, activation_func=F.silu, ffn_hidden_size=FFN)
    result = {}
    for piecewise in (True, False):
        init_model_parallel(tp=1)
        model, optimizer = build_training_setup(
            "adam", model_builder=lambda config: _swiglu_hybrid(config, piecewise), config_overrides=overrides)
        result[piecewise] = dict(mlps=_mlp_types(model),
                                 losses=[train_step(model, optimizer, step) for step in range(STEPS)])
    return result


def test_hybrid_trains_identically_with_swiglu_in_pieces(rank_pool_1):
    result = rank_pool_1.run(_training_case)[0]
    assert result[True]["mlps"] == [("PiecewiseSwiGLUMLP", True)] * 2
    assert [name for name, _ in result[False]["mlps"]] == ["MLP"] * 2
    ours, reference = result[True]["losses"], result[False]["losses"]
    assert reference[-1] < reference[0], reference  # it trains, so equal losses compare real updates
    assert max(abs(a - b) for a, b in zip(ours, reference)) < 1e-6, (ours, reference)


def _graph_capturing_backend(graphs: dict):
    """aot_eager that keeps the forward and backward aten graphs it traced."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compile_graph(graph_module, example_inputs):
            graphs.setdefault(kind, []).append(graph_module)
            return make_boxed_func(graph_module.forward)
        return compile_graph

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def _cat_input_counts(graph_modules) -> list[int]:
    return sorted(len(node.args[0]) for gm in graph_modules for node in gm.graph.nodes
                  if node.target is torch.ops.aten.cat.default)


def _compile_case(rank, world_size):
    from torch._dynamo.utils import counters

    from megatron_muon.testing.models import GDN_SIZES, tiny_transformer_config
    from megatron_muon.testing.parallel import init_model_parallel

    init_model_parallel(tp=1)
    config = tiny_transformer_config(**GDN_SIZES, activation_func=F.silu, ffn_hidden_size=FFN)
    torch.manual_seed(3)
    x = torch.randn(16, 2, config.hidden_size)
    result = {}
    with _dynamo_enabled():
        counters.clear()
        for name, piecewise in (("ours", True), ("megatron", False)):
            model = _swiglu_hybrid(config, piecewise)
            mlp, graphs = model.decoder.layers[0].mlp, {}
            compiled = torch.compile(lambda h: mlp(h)[0], backend=_graph_capturing_backend(graphs), fullgraph=True)
            names, params = zip(*mlp.named_parameters())
            eager, traced = _fwd_bwd(lambda h: mlp(h)[0], params, x), _fwd_bwd(compiled, params, x)
            result[name] = dict(
                forward_cats=_cat_input_counts(graphs["forward"]), backward_cats=_cat_input_counts(graphs["backward"]),
                mismatch=max(float((e - c).abs().max() / e.abs().max())
                             for e, c in zip([eager[0], eager[1], *eager[2]], [traced[0], traced[1], *traced[2]])))

        model = _swiglu_hybrid(config)
        rotary = model.rotary_pos_emb(x.shape[0])

        def block(hidden_states, rotary_pos_emb):
            return model.decoder(hidden_states, attention_mask=None, rotary_pos_emb=rotary_pos_emb)

        compiled_block = torch.compile(block, backend="aot_eager", fullgraph=True)
        names, params = zip(*model.decoder.named_parameters())
        result["block_mismatch"], result["block_gate_grad_mismatch"] = _max_difference(
            _fwd_bwd(block, params, x, rotary), _fwd_bwd(compiled_block, params, x, rotary), names)
        result["graph_breaks"] = sum(counters["graph_break"].values())
    return result


def test_piecewise_swiglu_compiles_without_breaks_into_many_piece_cats(rank_pool_1):
    result = rank_pool_1.run(_compile_case)[0]
    assert result["graph_breaks"] == 0
    # forward: the 10 products of one cat; backward: the 2 x 10 gate and up gradient pieces of one cat
    assert result["ours"]["forward_cats"] == [10] and result["ours"]["backward_cats"] == [20], result
    assert result["megatron"]["backward_cats"] == [2], result  # gate | up: the cat this module exists to avoid
    assert result["ours"]["mismatch"] < 1e-6 and result["megatron"]["mismatch"] < 1e-6, result
    # the GDN's compiled gated norm reorders fp32 sums, as in test_compile (gate-parameter gradients amplify it)
    assert result["block_mismatch"] < 1e-5 and result["block_gate_grad_mismatch"] < 1e-3, result


def test_our_specs_and_the_gpt_spec_build_the_piecewise_mlp():
    from functools import partial

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP

    from megatron_muon.layers.mlp import PiecewiseSwiGLUMLP
    from megatron_muon.specs import gdn_hybrid_local, gdn_hybrid_stack_te, gdn_hybrid_te, with_piecewise_swiglu

    layer_specs = [*gdn_hybrid_local.submodules.layer_specs.values(), *gdn_hybrid_te.submodules.layer_specs.values(),
                   gdn_hybrid_stack_te.submodules.mlp_layer]
    assert all(spec.submodules.mlp.func == PiecewiseSwiGLUMLP.as_mlp_submodule for spec in layer_specs)

    megatron_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    swapped = with_piecewise_swiglu(megatron_spec)
    assert megatron_spec.submodules.mlp.func == MLP.as_mlp_submodule  # the input spec is left as it was
    assert swapped.submodules.mlp.func == PiecewiseSwiGLUMLP.as_mlp_submodule
    assert swapped.submodules.mlp.keywords == megatron_spec.submodules.mlp.keywords
    assert swapped.submodules.self_attention is megatron_spec.submodules.self_attention

    other = partial(lambda **kwargs: None)  # e.g. an MoE or TE op-fused MLP builder: not ours to replace
    moe_spec = with_piecewise_swiglu(get_gpt_layer_local_spec(normalization="RMSNorm"))
    moe_spec.submodules.mlp = other
    assert with_piecewise_swiglu(moe_spec).submodules.mlp is other
