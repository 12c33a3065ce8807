"""The TMA chunk-state kernels: the fp32 recurrences on CPU through the interpreter, FLA's kernels on the GPU; and
the two references checked against each other by autograd. Also the GDN op on all of our chunk kernels."""

import types
from pathlib import Path

import pytest
import torch

from megatron_muon.ops import dqkwg, kernel_choice, state_tma, state_ws
from tests.interpreter import run_under_interpreter
from tests.ops.helpers import needs_flas_gpu_backward

OUR_KERNELS = [(state_ws, "chunk_fwd_h"), (state_ws, "chunk_dhu"), (state_tma, "chunk_fwd_h"),
               (state_tma, "chunk_dhu"), (dqkwg, "chunk_dqkwg")]


def test_the_backward_reference_is_the_adjoint_of_the_forward_reference():
    """Autograd through the forward recurrence, with the loss the backward kernel differentiates (the output's
    inter-chunk part scale·diag(2^g)·q·hᵀ against do, plus v_new against dv), gives its dv2 (the gradient of u)
    and dh0 (of the initial state)."""
    from megatron_muon.ops.reference import chunk_state_backward_reference, chunk_state_forward_reference

    torch.manual_seed(0)
    batch, seq_len, heads, key_dim, value_dim, scale = 2, 150, 2, 16, 8, 0.25
    q, k, w = (torch.randn(batch, seq_len, heads, key_dim, dtype=torch.float64) * 0.3 for _ in range(3))
    u = torch.randn(batch, seq_len, heads, value_dim, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(batch, heads, value_dim, key_dim, dtype=torch.float64, requires_grad=True)
    steps = -torch.rand(batch, seq_len, heads, dtype=torch.float64) * 0.3
    g = torch.cat([steps[:, i : i + 64].cumsum(1) for i in range(0, seq_len, 64)], dim=1)
    do, dv = (torch.randn(batch, seq_len, heads, value_dim, dtype=torch.float64) for _ in range(2))
    h, v_new, _ = chunk_state_forward_reference(k, w, u, g, initial_state=h0)
    states = h.repeat_interleave(64, dim=1)[:, :seq_len]  # [B, T, H, V, K]: each token's chunk state
    inter = scale * torch.einsum("blhk,blhvk->blhv", q * torch.exp2(g)[..., None], states)
    loss = (inter * do).sum() + (v_new * dv).sum()
    du, dh0 = torch.autograd.grad(loss, [u, h0])
    _, ref_dh0, ref_dv2 = chunk_state_backward_reference(q, k, w, g, do, dv, scale)
    torch.testing.assert_close(ref_dv2, du, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ref_dh0, dh0, rtol=1e-10, atol=1e-10)


def test_the_local_value_gradient_reference_is_the_adjoint_of_the_chunk_output():
    """fp64, GVA: autograd of the chunk output's loss against do through v_new (states held) is FLA's dv_local."""
    from megatron_muon.ops.reference import chunk_local_dv_reference, chunk_output_reference

    torch.manual_seed(1)
    batch, seq_len, heads, value_heads, key_dim, value_dim, scale = 2, 150, 1, 2, 16, 8, 0.25
    q, k = (torch.randn(batch, seq_len, heads, key_dim, dtype=torch.float64) * 0.3 for _ in range(2))
    v_new = torch.randn(batch, seq_len, value_heads, value_dim, dtype=torch.float64, requires_grad=True)
    h = torch.randn(batch, 3, value_heads, value_dim, key_dim, dtype=torch.float64)
    steps = -torch.rand(batch, seq_len, value_heads, dtype=torch.float64) * 0.3
    g = torch.cat([steps[:, i : i + 64].cumsum(1) for i in range(0, seq_len, 64)], dim=1)
    do = torch.randn(batch, seq_len, value_heads, value_dim, dtype=torch.float64)
    (dv,) = torch.autograd.grad((chunk_output_reference(q, k, v_new, h, g, scale) * do).sum(), [v_new])
    torch.testing.assert_close(chunk_local_dv_reference(q, k, g, do, scale), dv, rtol=1e-10, atol=1e-10)


def test_kernels_under_triton_interpreter():
    """Partial last chunk, two batch elements and heads, with and without initial / final states."""
    pytest.importorskip("triton", reason="the interpreter comes with Triton")
    run_under_interpreter(Path(__file__).with_name("_state_tma_interpret_check.py"))


def test_cpu_tensors_do_not_qualify_without_the_interpreter():
    q = torch.randn(1, 64, 1, 64).half()
    do = torch.randn(1, 64, 1, 16).half()
    assert state_tma.qualifies([q, q, q], [do, do], torch.zeros(1, 64, 1), None, 64) == state_tma._INTERPRETING


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _hybrid_inputs(seq_len: int):
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    torch.manual_seed(seq_len)
    shape = (1, seq_len, 6, 256)
    q = torch.nn.functional.normalize(torch.randn(shape, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(shape, device="cuda"), dim=-1).bfloat16()
    w = (torch.randn(shape, device="cuda") * 0.05).bfloat16()
    u, do, dv = (torch.randn(1, seq_len, 6, 512, device="cuda").bfloat16() for _ in range(3))
    g = chunk_local_cumsum(-torch.rand(1, seq_len, 6, device="cuda") * 0.1, chunk_size=64, scale=RCP_LN2)
    return q, k, w, u, do, dv, g, torch.randn(1, 6, 512, 256, device="cuda")


def _check_against_fla_and_reference(ours_fn, fla_fn, reference_fn):
    """At 16k tokens within 1e-2 of FLA's kernel; at 2k no further from the fp32 recurrence than twice FLA's error."""
    for seq_len in (16384, 2048):
        inputs = _hybrid_inputs(seq_len)
        ours, fla = ours_fn(*inputs), fla_fn(*inputs)
        for got, want in zip(ours, fla):
            assert _relative(got, want) < 1e-2
        if seq_len == 2048:
            for got, theirs, want in zip(ours, fla, reference_fn(*(t.cpu() for t in inputs))):
                assert _relative(got.cpu(), want) < 2 * _relative(theirs.cpu(), want) + 1e-3


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", state_tma.FORWARD_CONFIGS, ids=str)
def test_forward_states_equal_flas_kernel_at_the_hybrid_shape(config):
    """bf16 at the hybrid-1.5B's GDN shape (6 heads, key 256, value 512), every forward tile, with initial and
    final states."""
    pytest.importorskip("fla", reason="needs flash-linear-attention")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    from megatron_muon.ops.reference import chunk_state_forward_reference

    _check_against_fla_and_reference(
        lambda q, k, w, u, do, dv, g, s: state_tma.chunk_fwd_h(k, w, u, g, s, True, config=config),
        lambda q, k, w, u, do, dv, g, s: chunk_gated_delta_rule_fwd_h(
            k=k, w=w, u=u, g=g, initial_state=s, output_final_state=True, chunk_size=64, state_v_first=True),
        lambda q, k, w, u, do, dv, g, s: chunk_state_forward_reference(k, w, u, g, s),
    )


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", state_tma.BACKWARD_CONFIGS, ids=str)
def test_state_gradients_equal_flas_kernel_at_the_hybrid_shape(config):
    """bf16 at the hybrid-1.5B's GDN shape, every backward tile, with the final-state gradient and dh0."""
    pytest.importorskip("fla", reason="needs flash-linear-attention")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu

    from megatron_muon.ops.reference import chunk_state_backward_reference

    scale = 256**-0.5
    _check_against_fla_and_reference(
        lambda q, k, w, u, do, dv, g, s: state_tma.chunk_dhu(q, k, w, g, do, dv, scale, dht=s, want_dh0=True,
                                                             config=config),
        lambda q, k, w, u, do, dv, g, s: chunk_gated_delta_rule_bwd_dhu(
            q=q, k=k, w=w, g=g, h0=torch.zeros_like(s), dht=s, do=do, dv=dv, scale=scale, state_v_first=True,
            chunk_size=64),
        lambda q, k, w, u, do, dv, g, s: chunk_state_backward_reference(q, k, w, g, do, dv, scale, dht=s),
    )


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", state_tma.LOCAL_DV_CONFIGS, ids=str)
def test_state_gradients_with_the_local_value_gradient_equal_flas_two_kernels(config):
    """bf16 at the hybrid-1.5B shape, every tile that takes dv None: the kernel with the chunks' own value gradient
    inside equals FLA's `chunk_bwd_dv_local` followed by its state-gradient kernel."""
    pytest.importorskip("fla", reason="needs flash-linear-attention")
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    from megatron_muon.ops.reference import chunk_local_dv_reference, chunk_state_backward_reference

    scale = 256**-0.5

    def flas(q, k, w, u, do, dv, g, s):
        local = chunk_bwd_dv_local(q=q, k=k, g=g, do=do, scale=scale, chunk_size=64)
        return chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=torch.zeros_like(s), dht=s, do=do, dv=local,
                                              scale=scale, state_v_first=True, chunk_size=64)

    def reference(q, k, w, u, do, dv, g, s):
        local = chunk_local_dv_reference(q, k, g, do, scale)
        return chunk_state_backward_reference(q, k, w, g, do, local, scale, dht=s)

    _check_against_fla_and_reference(
        lambda q, k, w, u, do, dv, g, s: state_tma.chunk_dhu(q, k, w, g, do, None, scale, dht=s, want_dh0=True,
                                                             config=config),
        flas, reference)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seq_len, keep_states, with_state, gva",
                         [(1008, True, True, False), (1008, False, True, False), (496, True, False, False),
                          (1008, True, True, True), (1008, False, True, True)],
                         ids=["kept-states", "recomputed-states", "no-initial-state", "gva-kept", "gva-recomputed"])
def test_gdn_op_on_our_kernels_matches_the_torch_backend(monkeypatch, seq_len, keep_states, with_state, gva):
    """The GDN custom op with MEGATRON_MUON_GDN_KERNELS=ours (and =triton): every output and gradient within FLA's
    tolerances of the torch backend, and all three of our kernels really ran: the state recurrences on the Gluon
    kernels wherever Gluon is there (=ours), on the Triton ones otherwise."""
    from tests.ops import test_gdn_gpu

    calls = []
    for module, name in OUR_KERNELS:
        kernel = getattr(module, name)
        tag = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _t=tag, **kw: calls.append(_t) or _k(*a, **kw))
    qk_heads = test_gdn_gpu.HEADS // 2 if gva else test_gdn_gpu.HEADS
    for choice, states in (("ours", "state_ws" if state_ws.SWITCH.available() else "state_tma"),
                           ("triton", "state_tma")):
        calls.clear()
        monkeypatch.setattr(kernel_choice, "_chosen", kernel_choice.GdnKernels.named(choice))
        test_gdn_gpu.test_fla_gdn_matches_torch_backend(None, seq_len, keep_states, with_state, False, qk_heads)
        assert set(calls) == {f"{states}.chunk_fwd_h", f"{states}.chunk_dhu", "dqkwg.chunk_dqkwg"}, choice


@pytest.mark.gpu
@needs_gpu
@needs_flas_gpu_backward
def test_gdn_op_keeps_flas_kernels_when_asked(monkeypatch):
    """MEGATRON_MUON_GDN_KERNELS=fla: the GDN op matches the torch backend and neither of our kernels runs."""
    from tests.ops import test_gdn_gpu

    calls = []
    for module, name in OUR_KERNELS:
        monkeypatch.setattr(module, name, lambda *a, _n=name, **kw: calls.append(_n))
    monkeypatch.setattr(kernel_choice, "_chosen", kernel_choice.GdnKernels.named("fla"))
    test_gdn_gpu.test_fla_gdn_matches_torch_backend(None, 1008, True, True, False, test_gdn_gpu.HEADS)
    assert calls == []


def test_the_kernel_choice_is_seeded_once_from_the_environment_and_ours_by_default(monkeypatch):
    monkeypatch.delenv(kernel_choice.KERNELS_ENV_VAR, raising=False)
    monkeypatch.setattr(kernel_choice, "_chosen", None)
    assert kernel_choice.gdn_kernels() == kernel_choice.GdnKernels("gluon", "ours")
    monkeypatch.setattr(kernel_choice, "_chosen", None)
    monkeypatch.setenv(kernel_choice.KERNELS_ENV_VAR, "triton")
    assert kernel_choice.gdn_kernels() == kernel_choice.GdnKernels("triton", "ours")
    monkeypatch.setenv(kernel_choice.KERNELS_ENV_VAR, "fla")  # read once: a later change does not move it
    assert kernel_choice.gdn_kernels().name == "triton"
    kernel_choice.set_gdn_kernels("fla")
    assert kernel_choice.gdn_kernels() == kernel_choice.GdnKernels("fla", "fla")
    kernel_choice.set_gdn_kernels(None)  # seeds again from the environment
    assert kernel_choice.gdn_kernels().name == "fla"


def test_an_unknown_kernel_choice_names_the_valid_ones(monkeypatch):
    monkeypatch.setattr(kernel_choice, "_chosen", None)
    monkeypatch.setenv(kernel_choice.KERNELS_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="MEGATRON_MUON_GDN_KERNELS='fast'; valid choices"):
        kernel_choice.gdn_kernels()
    with pytest.raises(ValueError, match="valid choices"):
        kernel_choice.set_gdn_kernels("fast")
    with pytest.raises(ValueError, match="output-gradient kernels 'gluon'"):
        kernel_choice.GdnKernels(states="gluon", output_grads="gluon")


def test_value_dims_the_default_tiles_do_not_divide_stay_on_fla(monkeypatch):
    """Qualifying means the default tiles divide V: a value dim of 48 would otherwise fail inside the op."""
    monkeypatch.setattr(state_tma, "_INTERPRETING", True)
    monkeypatch.setattr(state_tma, "_INTERPRETER_CONFIG", (32, 4, 1))
    key = torch.zeros(1, 64, 1, 64, dtype=torch.float16)
    gates = torch.zeros(1, 64, 1)
    for value_dim, expected in ((64, True), (48, False)):
        value = torch.zeros(1, 64, 1, value_dim, dtype=torch.float16)
        assert state_tma.qualifies([key, key], [value], gates, None, 64) == expected


def _as_if_on_gpu(tensor):
    """A stand-in that reports a CUDA device and otherwise answers as `tensor` does (what `qualifies` reads)."""
    return types.SimpleNamespace(is_cuda=True, device="cuda:0", dim=tensor.dim, shape=tensor.shape,
                                 dtype=tensor.dtype, is_contiguous=tensor.is_contiguous)


@pytest.mark.parametrize("capability, expected", [((9, 0), True), ((10, 0), False), ((8, 0), False)])
def test_only_hopper_gpus_qualify(monkeypatch, capability, expected):
    """The kernels are measured and tested on sm90 only; other GPUs keep FLA's (its Blackwell path differs)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    key = torch.zeros(1, 64, 1, 64, dtype=torch.float16)
    value = torch.zeros(1, 64, 1, 64, dtype=torch.float16)
    assert state_tma.qualifies([_as_if_on_gpu(key), key], [value], torch.zeros(1, 64, 1), None, 64) == expected
    q, h = torch.zeros(1, 64, 1, 64, dtype=torch.float16), torch.zeros(1, 1, 1, 128, 64, dtype=torch.float16)
    v = torch.zeros(1, 64, 1, 128, dtype=torch.float16)
    on_gpu_q = _as_if_on_gpu(q)
    assert dqkwg.qualifies(on_gpu_q, q, v, q, torch.zeros(1, 64, 1), h, v, h, v, None, 64) == expected
