"""On a Hopper GPU with flash-qla installed: the GDN op dispatched to FlashQLA against the naive fp32 reference
(outputs and every gradient, within FLA's bf16 tolerances) and against FlashQLA called directly, opcheck on its
custom ops, and a compiled step without graph breaks.

Every case uses Qwen3-Next's GDN heads (16 q/k heads, 32 value heads of 128), the default scale and beta in bf16 as
the layer passes it, so the TileLang kernels compiled for one case serve the others and the benchmark at that shape.
"""

import importlib.util

import pytest
import torch

from megatron_muon.ops import backend, chunk_gated_delta_rule, gdn_flashqla, reference
from tests.ops.helpers import FLA_TOLERANCES, assert_ratio, error_ratio, gdn_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flash_qla") is None,
                       reason='needs flash-qla (pip install "megatron-muon[flashqla]")'),
]

HEADS, VALUE_HEADS, HEAD_DIM = 16, 32, 128
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# One sequence is training's call: B = 1 takes FlashQLA's intra-card context-parallel path, where each partition's
# incoming state is rebuilt; the default gates forget it within a chunk, weak ones (x 0.01) keep it for hundreds
# of tokens, so a wrong hand-off shows.
CASES = {
    "one-sequence": dict(batch=1, seq_len=1000, l2norm=True),
    "one-sequence-weak-decay": dict(batch=1, seq_len=1000, gate_scale=0.01),
    "batch-with-states": dict(batch=2, seq_len=320, states=True),
    "packed-with-states": dict(batch=1, seq_len=600, bounds=[0, 100, 355, 600], states=True),
}


@pytest.fixture(autouse=True)
def flashqla_launches(monkeypatch):
    """FlashQLA on (skips where it cannot run); yields the names of FlashQLA's launchers as they are called."""
    gdn_flashqla.set_flashqla(None)
    if not gdn_flashqla.flashqla_enabled():
        pytest.skip(f"FlashQLA does not run here: {gdn_flashqla._why_unavailable(backend.hardware())}")
    calls = []
    for name in ("_flashqla_forward", "_flashqla_backward"):
        launcher = getattr(gdn_flashqla, name)
        monkeypatch.setattr(gdn_flashqla, name, lambda *a, _launch=launcher, _name=name: calls.append(_name)
                            or _launch(*a))
    yield calls
    gdn_flashqla.set_flashqla(None)


def _inputs(case: str, seed: int = 0):
    """([q, k, v, g, beta, h0 or None], cu_seqlens, l2norm) for one of CASES."""
    spec = CASES[case]
    bounds = spec.get("bounds")
    cu_seqlens = None if bounds is None else torch.tensor(bounds, device="cuda")
    q, k, v, g, beta, h0 = gdn_inputs(spec["batch"], spec["seq_len"], HEADS, VALUE_HEADS, HEAD_DIM, HEAD_DIM,
                                      dtype=torch.bfloat16, gate_scale=spec.get("gate_scale", 1.0),
                                      num_states=None if bounds is None else len(bounds) - 1, device="cuda",
                                      seed=seed or spec["seq_len"])
    h0 = h0 if spec.get("states") else None
    return [q, k, v, g, beta.to(torch.bfloat16), h0], cu_seqlens, spec.get("l2norm", False)


def _run(fn, inputs, cu_seqlens, l2norm, do, dht):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    with_states = leaves[5] is not None
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=with_states,
               use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu_seqlens)
    loss = (o.float() * do).sum() + ((ht * dht).sum() if with_states else 0)
    loss.backward()
    return [o] + ([ht] if with_states else []), [None if leaf is None else leaf.grad for leaf in leaves]


@pytest.mark.parametrize("case", list(CASES))
def test_flashqla_matches_the_reference(flashqla_launches, case):
    inputs, cu_seqlens, l2norm = _inputs(case)
    v, h0 = inputs[2], inputs[5]
    do = torch.randn_like(v, dtype=torch.float32)
    dht = None if h0 is None else torch.randn_like(h0)
    outputs, grads = _run(chunk_gated_delta_rule, inputs, cu_seqlens, l2norm, do, dht)
    assert flashqla_launches == ["_flashqla_forward", "_flashqla_backward"]
    ref_outputs, ref_grads = _run(reference.naive_recurrent_gated_delta_rule, inputs, cu_seqlens, l2norm, do, dht)
    pairs = list(zip(("o", "ht"), ref_outputs, outputs))
    pairs += [(name, ref, got) for name, ref, got in zip(GRAD_NAMES, ref_grads, grads) if ref is not None]
    print(f"FlashQLA vs reference ({case}):", {name: f"{error_ratio(ref, got):.2e}" for name, ref, got in pairs})
    assert outputs[0].dtype == torch.bfloat16 and all(got.dtype == ref.dtype for _, ref, got in pairs[len(outputs):])
    for name, ref, got in pairs:
        assert_ratio(name, ref, got, FLA_TOLERANCES[name])


def test_our_op_equals_flashqla_called_directly(flashqla_launches):
    """Our custom ops add no error to FlashQLA's own autograd path (which keeps its context-parallel states for the
    backward where ours recomputes them): outputs and every gradient, on training's call with weak decay."""
    import flash_qla

    inputs, _, _ = _inputs("one-sequence-weak-decay", seed=3)
    inputs = inputs[:5]
    do = torch.randn_like(inputs[2], dtype=torch.float32)
    ours, direct = (_run(fn, [*inputs, None], None, False, do, None) for fn in (chunk_gated_delta_rule,
                                                                                  flash_qla.chunk_gated_delta_rule))
    assert flashqla_launches == ["_flashqla_forward", "_flashqla_backward"]
    for name, expected, got in zip(("o", *GRAD_NAMES[:5]), [*direct[0], *direct[1][:5]], [*ours[0], *ours[1][:5]]):
        assert got.dtype == expected.dtype, name
        assert_ratio(name, expected, got, 1e-3)


def _grad(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_opcheck_the_flashqla_ops(flashqla_launches):
    (q, k, v, g, beta, h0), cu_seqlens, _ = _inputs("packed-with-states", seed=1)
    scale = HEAD_DIM**-0.5
    torch.library.opcheck(gdn_flashqla.gdn_flashqla_fwd, (*_grad(q, k, v, g, beta), scale, _grad(h0)[0], True,
                                                          cu_seqlens))
    o, ht, g_cumsum, a_matrix = gdn_flashqla.gdn_flashqla_fwd(q, k, v, g, beta, scale, h0, True, cu_seqlens)
    torch.library.opcheck(gdn_flashqla.gdn_flashqla_bwd, (q, k, v, g, beta, g_cumsum, a_matrix, scale, h0, cu_seqlens,
                                                          torch.randn_like(o), torch.randn_like(ht)))


def test_compiled_step_has_no_graph_breaks(flashqla_launches):
    """fullgraph compile of the op as the layer calls it: one graph, no breaks, FlashQLA's kernels in both passes,
    and the eager outputs and gradients."""
    inputs, _, _ = _inputs("one-sequence", seed=2)
    inputs = inputs[:5]
    do = torch.randn_like(inputs[2], dtype=torch.float32)

    def step(q, k, v, g, beta):
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return (o.float() * do).sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        leaves = _grad(*inputs)
        loss = fn(*leaves)
        loss.backward()
        results.append([loss, *(leaf.grad for leaf in leaves)])
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert flashqla_launches == ["_flashqla_forward", "_flashqla_backward"] * 2
    for name, expected, got in zip(("loss", "dq", "dk", "dv", "dg", "dbeta"), *results):
        assert_ratio(name, expected, got, 1e-3)
