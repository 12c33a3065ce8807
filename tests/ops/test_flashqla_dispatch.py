"""FlashQLA dispatch on the CPU: when the process turns FlashQLA on, which calls it takes, and our custom ops around it
(schema, fake kernels, autograd, compile) with a stand-in for the flash_qla package built on the torch backend."""

import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch
from packaging.version import Version
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_muon.ops import backend, chunk_gated_delta_rule, gdn_flashqla, reference
from megatron_muon.ops.backend import Hardware
from megatron_muon.ops.gdn_torch import chunk_gdn_backward_torch, chunk_gdn_forward_torch
from tests.ops.helpers import FLA_TOLERANCES, assert_ratio, gdn_inputs

HOPPER = Hardware(True, (9, 0), "NVIDIA H200", Version("3.6.0"))
AMPERE = Hardware(True, (8, 0), "NVIDIA A100", Version("3.6.0"))
BLACKWELL = Hardware(True, (10, 0), "NVIDIA B200", Version("3.6.0"))
NO_GPU = Hardware(False, None, None, None)
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(gdn_flashqla.FLASHQLA_ENV_VAR, raising=False)
    for name, value in (("_requested", None), ("_enabled", None), ("_fallback_logged", False)):
        monkeypatch.setattr(gdn_flashqla, name, value)
    monkeypatch.setattr(gdn_flashqla, "_nvcc_found", lambda: True)
    monkeypatch.setattr(backend, "_selected", "fla-tilelang")
    _installed(monkeypatch, True)
    yield
    torch._dynamo.reset()


def _installed(monkeypatch, installed: bool):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "flash_qla":
            return importlib.machinery.ModuleSpec("flash_qla", None) if installed else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_installed_on_hopper_turns_flashqla_on():
    assert gdn_flashqla._choose(HOPPER)


@pytest.mark.parametrize("hw, installed, nvcc", [(HOPPER, False, True), (HOPPER, True, False), (AMPERE, True, True),
                                                 (BLACKWELL, True, True), (NO_GPU, True, True)],
                         ids=["not-installed", "no-nvcc", "ampere", "blackwell", "no-gpu"])
def test_without_flashqla_or_a_hopper_our_kernels_run(monkeypatch, caplog, hw, installed, nvcc):
    _installed(monkeypatch, installed)
    monkeypatch.setattr(gdn_flashqla, "_nvcc_found", lambda: nvcc)
    with caplog.at_level("INFO", logger=gdn_flashqla.__name__):
        assert not gdn_flashqla._choose(hw)
    assert "FlashQLA not used" in caplog.text


@pytest.mark.parametrize("value", ["off", "0", "OFF "])
def test_turned_off_by_the_environment(monkeypatch, value):
    monkeypatch.setenv(gdn_flashqla.FLASHQLA_ENV_VAR, value)
    assert not gdn_flashqla._choose(HOPPER)


def test_set_flashqla_overrides_the_environment(monkeypatch):
    monkeypatch.setenv(gdn_flashqla.FLASHQLA_ENV_VAR, "on")
    gdn_flashqla.set_flashqla(False)
    assert not gdn_flashqla._choose(HOPPER)
    gdn_flashqla.set_flashqla(None)  # automatic again: the environment's "on"
    assert gdn_flashqla._choose(HOPPER)


def test_turned_on_where_it_cannot_run_says_what_to_do(monkeypatch):
    _installed(monkeypatch, False)
    monkeypatch.setenv(gdn_flashqla.FLASHQLA_ENV_VAR, "on")
    with pytest.raises(RuntimeError, match=r'pip install "megatron-muon\[flashqla\]"'):
        gdn_flashqla._choose(HOPPER)
    _installed(monkeypatch, True)
    gdn_flashqla.set_flashqla(True)
    with pytest.raises(RuntimeError, match="Hopper GPUs only.*A100"):
        gdn_flashqla._choose(AMPERE)


def test_bad_settings_are_rejected(monkeypatch):
    monkeypatch.setenv(gdn_flashqla.FLASHQLA_ENV_VAR, "yes")
    with pytest.raises(ValueError, match="use auto, on or off"):
        gdn_flashqla._choose(HOPPER)
    with pytest.raises(TypeError, match="True, False or None"):
        gdn_flashqla.set_flashqla("on")


def test_the_choice_is_made_once_and_logged(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(gdn_flashqla, "hardware", lambda: calls.append(1) or HOPPER)
    with caplog.at_level("INFO", logger=gdn_flashqla.__name__):
        assert gdn_flashqla.flashqla_enabled() and gdn_flashqla.flashqla_enabled()
    assert len(calls) == 1 and caplog.text.count("FlashQLA runs the chunk op") == 1
    monkeypatch.setattr(backend, "_selected", "torch")  # the pure-torch backend never runs FlashQLA
    assert not gdn_flashqla.flashqla_enabled()


class _CustomOps(TorchDispatchMode):
    """Names of the megatron_muon custom ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "megatron_muon":
            self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _forward_op(key_dim=128, value_dim=128, dtype=torch.bfloat16, varlen=False) -> list[str]:
    """The custom ops one forward runs on (fake) CUDA tensors: H = 2, HV = 4 (GVA)."""
    with FakeTensorMode():
        q, k = (torch.randn(1, 70, 2, key_dim, device="cuda", dtype=dtype) for _ in range(2))
        v = torch.randn(1, 70, 4, value_dim, device="cuda", dtype=dtype)
        g, beta = torch.randn(1, 70, 4, device="cuda"), torch.rand(1, 70, 4, device="cuda")
        cu_seqlens = torch.tensor([0, 30, 70], device="cuda") if varlen else None
        with _CustomOps() as ops:
            chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens)
    return ops.names


@pytest.mark.parametrize("shape", [dict(), dict(varlen=True)], ids=["dense", "varlen"])
def test_qualifying_calls_go_to_flashqla(monkeypatch, shape):
    monkeypatch.setattr(gdn_flashqla, "hardware", lambda: HOPPER)
    assert _forward_op(**shape) == ["megatron_muon::gdn_flashqla_fwd"]


@pytest.mark.parametrize("shape", [dict(key_dim=64, value_dim=64), dict(value_dim=256), dict(key_dim=256),
                                   dict(dtype=torch.float16), dict(dtype=torch.float32)],
                         ids=["k64-v64", "v256", "k256", "fp16", "fp32"])
def test_other_calls_run_our_kernels(monkeypatch, shape):
    monkeypatch.setattr(gdn_flashqla, "hardware", lambda: HOPPER)
    assert _forward_op(**shape) == ["megatron_muon::gdn_chunk_fwd"]


@pytest.mark.parametrize("setting", ["absent", "turned-off", "set-off", "torch-backend"])
def test_qualifying_calls_run_our_kernels_without_flashqla(monkeypatch, setting):
    monkeypatch.setattr(gdn_flashqla, "hardware", lambda: HOPPER)
    if setting == "absent":
        _installed(monkeypatch, False)
    elif setting == "turned-off":
        monkeypatch.setenv(gdn_flashqla.FLASHQLA_ENV_VAR, "off")
    elif setting == "set-off":
        gdn_flashqla.set_flashqla(False)
    else:
        monkeypatch.setattr(backend, "_selected", "torch")
    assert _forward_op() == ["megatron_muon::gdn_chunk_fwd"]


def test_the_first_fallback_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(gdn_flashqla, "hardware", lambda: HOPPER)
    with FakeTensorMode():
        wide, narrow = (torch.empty(1, 8, 2, dim, device="cuda", dtype=torch.bfloat16) for dim in (256, 128))
    with caplog.at_level("INFO", logger=gdn_flashqla.__name__):
        gdn_flashqla.log_first_fallback(narrow, narrow)  # qualifies: nothing to say
        gdn_flashqla.log_first_fallback(wide, wide)
        gdn_flashqla.log_first_fallback(wide, wide)
    assert caplog.text.count("run our kernels") == 1 and "K = 256" in caplog.text


# --- our ops around FlashQLA, with a stand-in for its launchers (FlashQLA's conventions on the torch backend) -------

def _chunk_local_differences(g_cumsum: torch.Tensor) -> torch.Tensor:
    """g back from its chunk-local cumsum (equal-length batches: chunks start at multiples of 64)."""
    g = g_cumsum.clone()
    g[:, 1:] -= g_cumsum[:, :-1]
    g[:, :: gdn_flashqla.CHUNK_SIZE] = g_cumsum[:, :: gdn_flashqla.CHUNK_SIZE]
    return g


def _stand_in_flash_qla(calls: list) -> types.ModuleType:
    """flash_qla's two launchers with its argument and return conventions, asserting what FlashQLA requires."""

    def check(q, k, v, g, beta, initial_state, state_v_first):
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and g.dtype == torch.float32 and not state_v_first
        assert all(t.is_contiguous() for t in (q, k, v, g, beta))
        assert initial_state is None or (initial_state.dtype == torch.float32 and initial_state.is_contiguous())

    def forward(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, output_final_state=True,
                output_h=False, auto_cp=True, state_v_first=False, enable_fwd_cp_cache=False, is_train=None, **_):
        check(q, k, v, g, beta, initial_state, state_v_first)
        assert cu_seqlens is None and is_train and not enable_fwd_cp_cache
        calls.append("forward")
        o, final_state, g_cumsum, a_matrix = chunk_gdn_forward_torch(q, k, v, g, beta, scale, initial_state,
                                                                     output_final_state, None)
        return g_cumsum, a_matrix, o, None, final_state if output_final_state else None, None

    def backward(q, k, v, g, beta, A, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                 state_v_first=False, auto_cp=True, **_):
        check(q, k, v, g, beta, initial_state, state_v_first)
        assert do.dtype == v.dtype and (dht is None or dht.dtype == torch.float32) and A.shape[-1] == 64
        calls.append("backward")
        dq, dk, dv, dg, dbeta, dh0 = chunk_gdn_backward_torch(q, k, v, _chunk_local_differences(g), beta, scale,
                                                              initial_state, None, do, dht)
        return dq, dk, dv, dbeta, dg, (dh0 if initial_state is not None else None)

    return types.SimpleNamespace(chunk_gated_delta_rule_fwd=forward, chunk_gated_delta_rule_bwd=backward)


@pytest.fixture
def stand_in(monkeypatch):
    """FlashQLA on for CPU tensors of its shapes, its launchers replaced by the stand-in; yields the launch log."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_qla", _stand_in_flash_qla(calls))
    monkeypatch.setattr(gdn_flashqla, "_enabled", True)
    monkeypatch.setattr(gdn_flashqla, "qualifies", lambda q, v: q.dtype == torch.bfloat16 and q.shape[-1] == 128)
    yield calls


@pytest.mark.parametrize("with_states", [True, False], ids=["states", "no-states"])
def test_the_flashqla_ops_give_the_reference_outputs_and_gradients(stand_in, with_states):
    q, k, v, g, beta, h0 = gdn_inputs(2, 100, 2, 4, 128, 128, dtype=torch.bfloat16, seed=5)
    inputs = [q, k, v, g, beta, h0] if with_states else [q, k, v, g, beta]
    do, dht = torch.randn(v.shape), torch.randn(h0.shape)
    results = []
    for fn in (chunk_gated_delta_rule, reference.naive_recurrent_gated_delta_rule):
        leaves = [x.clone().requires_grad_() for x in inputs]
        o, ht = fn(*leaves[:5], initial_state=leaves[5] if with_states else None, output_final_state=with_states)
        loss = (o.float() * do).sum() + ((ht.float() * dht).sum() if with_states else 0)
        loss.backward()
        results.append(([o, ht] if with_states else [o], [leaf.grad for leaf in leaves]))
    assert stand_in == ["forward", "backward"]
    (outputs, grads), (ref_outputs, ref_grads) = results
    for name, ref, got in zip(("o", "ht"), ref_outputs, outputs):
        assert_ratio(name, ref, got, FLA_TOLERANCES[name])
    for name, ref, got in zip(GRAD_NAMES, ref_grads, grads):
        assert got.dtype == ref.dtype
        assert_ratio(name, ref, got, FLA_TOLERANCES[name])


def _grad(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("with_states", [True, False], ids=["states", "no-states"])
def test_opcheck_the_flashqla_ops(stand_in, with_states):
    q, k, v, g, beta, h0 = gdn_inputs(1, 70, 1, 2, 128, 128, dtype=torch.bfloat16, seed=6)
    h0 = _grad(h0)[0] if with_states else None
    torch.library.opcheck(gdn_flashqla.gdn_flashqla_fwd, (*_grad(q, k, v, g, beta), 0.5, h0, with_states, None))
    h0 = None if h0 is None else h0.detach()
    o, ht, g_cumsum, a_matrix = gdn_flashqla.gdn_flashqla_fwd(q, k, v, g, beta, 0.5, h0, with_states, None)
    dht = torch.randn_like(ht) if with_states else None
    torch.library.opcheck(gdn_flashqla.gdn_flashqla_bwd,
                          (q, k, v, g, beta, g_cumsum, a_matrix, 0.5, h0, None, torch.randn_like(o), dht))


def test_compiled_dispatch_has_no_graph_breaks_and_keeps_its_traced_choice(stand_in):
    """The choice is read while tracing (no guard): FlashQLA's op is in the graph; after set_flashqla(False) a
    fresh trace holds ours."""
    graphs = []

    def backend_recording_graphs(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def step(q, k, v, g, beta):
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return o.float().square().sum()

    inputs = gdn_inputs(1, 70, 2, 4, 128, 128, dtype=torch.bfloat16, seed=7)[:5]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, backend=backend_recording_graphs, fullgraph=True)
    for _ in range(2):
        compiled(*inputs)
    gdn_flashqla.set_flashqla(False)
    compiled(*inputs)  # traced with FlashQLA on: keeps it
    assert len(graphs) == 1 and "gdn_flashqla_fwd" in graphs[0] and stand_in == ["forward"] * 3
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()
    compiled(*inputs)
    assert len(graphs) == 2 and "gdn_chunk_fwd" in graphs[1] and "gdn_flashqla" not in graphs[1]
