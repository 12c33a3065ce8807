"""The warp-specialized Gluon chunk-state kernels: compiled for sm90 on any machine (shared memory, wgmma), the
fallback to the Triton kernels, and on a Hopper GPU their outputs against FLA's, the Triton kernels' and the fp32
recurrences."""

import re
import subprocess
import sys
import warnings

import pytest
import torch

from megatron_muon.kernels.gluon_support import SM90_SHARED_MEMORY_PER_BLOCK
from megatron_muon.ops import fla_backend, kernel_choice, state_tma, state_ws
from tests.ops.helpers import chunk_kernel_inputs
from tests.ops.test_state_tma import _check_against_fla_and_reference, _relative

SHARED_MEMORY_LIMIT = SM90_SHARED_MEMORY_PER_BLOCK
needs_gluon = pytest.mark.skipif(state_ws.gluon is None, reason="this Triton has no Gluon")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm90 GPU")


def _compile_for_sm90(kernel, key_dim: int, dtype: torch.dtype, flags: dict, state_pointer: str = "*fp32",
                      group: int = 1, block_v: int = state_ws.BLOCK_V):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    key, state, value = state_ws._layouts(dtype, block_v)
    rows = torch.empty(256, 6 * 512, dtype=dtype)
    key_desc = mangle_type(TensorDescriptor.from_tensor(rows[:, : 6 * key_dim], [64, 64], key))
    state_desc = mangle_type(TensorDescriptor.from_tensor(rows[:, :key_dim], [block_v, 64], state))
    value_desc = mangle_type(TensorDescriptor.from_tensor(rows, [64, block_v], value))
    pointer = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    if kernel is state_ws._chunk_state_fwd_ws_kernel:
        names = {"q_desc": key_desc, "k_desc": key_desc, "w_desc": key_desc, "u_desc": value_desc,
                 "h_desc": state_desc, "v_desc": value_desc, "o_desc": value_desc, "g": "*fp32", "h0": state_pointer,
                 "ht": state_pointer, "scale": "fp32"}
    else:
        names = {"q_desc": key_desc, "k_desc": key_desc, "w_desc": key_desc, "dh_desc": state_desc,
                 "dv2_desc": value_desc, "do": pointer, "dv": pointer, "g": "*fp32", "dht": state_pointer,
                 "dh0": state_pointer, "scale": "fp32"}
    constants = {"H": 6, "GROUP": group, "K": key_dim, "V": 512, "BV": block_v, **flags}
    signature = {**names, "T": "i32", "NT": "i32", **{name: "constexpr" for name in constants}}
    source = GluonASTSource(kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@needs_gluon
@pytest.mark.parametrize("key_dim, dtype, group", [(256, torch.bfloat16, 1), (128, torch.float16, 1),
                                                   (64, torch.bfloat16, 1), (128, torch.bfloat16, 2)],
                         ids=["k256-bf16", "k128-fp16", "k64-bf16", "k128-bf16-gva"])
def test_kernels_compile_for_hopper_within_shared_memory(key_dim, dtype, group):
    """No GPU needed: both kernels lower to 64 × 32 wgmma and fit an sm90 block's shared memory."""
    forward = _compile_for_sm90(state_ws._chunk_state_fwd_ws_kernel, key_dim, dtype,
                                {"USE_INITIAL_STATE": True, "STORE_FINAL_STATE": True, "STORE_STATES": True,
                                 "WITH_OUTPUT": False}, group=group)
    backward = _compile_for_sm90(state_ws._chunk_state_bwd_ws_kernel, key_dim, dtype,
                                 {"USE_FINAL_STATE_GRADIENT": True, "USE_INITIAL_STATE": True, "LOCAL_DV": False},
                                 group=group)
    local_dv = _compile_for_sm90(state_ws._chunk_state_bwd_ws_kernel, key_dim, dtype,
                                 {"USE_FINAL_STATE_GRADIENT": True, "USE_INITIAL_STATE": True, "LOCAL_DV": True},
                                 group=group)
    for kernel in (forward, backward, local_dv):
        assert kernel.metadata.shared <= SHARED_MEMORY_LIMIT
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.(bf16|f16)", kernel.asm["ptx"])
    # with the local value gradient the 64 × 64 scores are one more wgmma product
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16", local_dv.asm["ptx"])
    assert not re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16", backward.asm["ptx"])


@needs_gluon
@pytest.mark.parametrize("key_dim, block_v", [(128, 16), (128, 64), (128, 128), (256, 16)],
                         ids=["k128-v16", "k128-v64", "k128-v128", "k256-v16"])
def test_other_value_blocks_compile_for_hopper_within_shared_memory(key_dim, block_v):
    """The value block the launchers take for measurements (`block_v`): each recurrence lowers to 64 × BV wgmma
    and fits an sm90 block's shared memory."""
    flags = ({"USE_INITIAL_STATE": True, "STORE_FINAL_STATE": True, "STORE_STATES": True, "WITH_OUTPUT": False},
             {"USE_FINAL_STATE_GRADIENT": True, "USE_INITIAL_STATE": True, "LOCAL_DV": True})
    for kernel, kernel_flags in zip((state_ws._chunk_state_fwd_ws_kernel, state_ws._chunk_state_bwd_ws_kernel),
                                    flags):
        compiled = _compile_for_sm90(kernel, key_dim, torch.bfloat16, kernel_flags, group=2, block_v=block_v)
        assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_v}k16\.f32\.bf16", compiled.asm["ptx"])


def test_a_value_block_that_does_not_divide_the_values_is_refused_with_the_choices():
    inputs = [torch.empty(1, 128, 2, 64) for _ in range(3)]
    with pytest.raises(ValueError, match=r"value block 64 for value dim 96: pick one of \(16, 32, 64, 128\)"):
        state_ws.chunk_fwd_h(inputs[0], inputs[1], torch.empty(1, 128, 2, 96), inputs[2], block_v=64)
    with pytest.raises(ValueError, match="value block 48"):
        state_ws.chunk_dhu(*inputs, inputs[0], torch.empty(1, 128, 2, 96), None, 1.0, block_v=48)


def test_the_gdn_ops_import_without_triton():
    """The Gluon kernels' module sits on the GDN ops' import path; without Triton it turns itself off."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import megatron_muon.ops.gdn\n"
            "from megatron_muon.ops import state_ws\n"
            "assert state_ws.gluon is None and not state_ws.SWITCH.available()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_cpu_tensors_are_never_ready():
    key = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    value = torch.zeros(1, 64, 1, 32, dtype=torch.bfloat16)
    assert not state_ws.ready([key, key], [value])


def _stub_kernels(monkeypatch, gluon_error=None):
    """Our two state-kernel modules replaced by recorders; the Gluon one raises `gluon_error` if given."""
    calls = []

    def recorder(module, name):
        def call(*args, **kwargs):
            calls.append(f"{module}.{name}")
            if module == "state_ws" and gluon_error is not None:
                raise gluon_error
            return module
        return call

    for name in ("chunk_fwd_h", "chunk_dhu"):
        monkeypatch.setattr(state_ws, name, recorder("state_ws", name))
        monkeypatch.setattr(state_tma, name, recorder("state_tma", name))
    monkeypatch.setattr(state_ws, "ready", lambda key_side, value_side: state_ws.SWITCH.available())
    monkeypatch.setattr(state_ws.SWITCH, "why", [])
    return calls


@needs_gluon
def test_a_rejected_gluon_kernel_warns_once_and_hands_every_call_to_triton(monkeypatch):
    calls = _stub_kernels(monkeypatch, TypeError("warp_specialize() got an unexpected keyword argument"))
    monkeypatch.setattr(kernel_choice, "_chosen", kernel_choice.GdnKernels.named("ours"))
    with pytest.warns(UserWarning, match="GDN state kernel failed to compile"):
        assert fla_backend._state_kernel("chunk_fwd_h", [], []) == "state_tma"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fla_backend._state_kernel("chunk_dhu", [], []) == "state_tma"
    assert calls == ["state_ws.chunk_fwd_h", "state_tma.chunk_fwd_h", "state_tma.chunk_dhu"]
    assert not state_ws.SWITCH.available()


@needs_gluon
@pytest.mark.parametrize("choice, module", [("ours", "state_ws"), ("triton", "state_tma")])
def test_the_kernel_choice_picks_the_state_kernels(monkeypatch, choice, module):
    calls = _stub_kernels(monkeypatch)
    monkeypatch.setattr(kernel_choice, "_chosen", kernel_choice.GdnKernels.named(choice))
    assert fla_backend._state_kernel("chunk_dhu", [], []) == module
    assert calls == [f"{module}.chunk_dhu"]


@pytest.mark.gpu
@needs_hopper
@needs_gluon
def test_forward_states_equal_flas_kernel_at_the_hybrid_shape():
    """bf16, 6 heads, key 256, value 512, with initial and final states: within 1e-2 of FLA's kernel at 16k tokens,
    and at 2k no further from the fp32 recurrence than twice FLA's error."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    from megatron_muon.ops.reference import chunk_state_forward_reference

    _check_against_fla_and_reference(
        lambda q, k, w, u, do, dv, g, s: state_ws.chunk_fwd_h(k, w, u, g, s, True),
        lambda q, k, w, u, do, dv, g, s: chunk_gated_delta_rule_fwd_h(
            k=k, w=w, u=u, g=g, initial_state=s, output_final_state=True, chunk_size=64, state_v_first=True),
        lambda q, k, w, u, do, dv, g, s: chunk_state_forward_reference(k, w, u, g, s),
    )


@pytest.mark.gpu
@needs_hopper
@needs_gluon
def test_state_gradients_equal_flas_kernel_at_the_hybrid_shape():
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu

    from megatron_muon.ops.reference import chunk_state_backward_reference

    scale = 256**-0.5
    _check_against_fla_and_reference(
        lambda q, k, w, u, do, dv, g, s: state_ws.chunk_dhu(q, k, w, g, do, dv, scale, dht=s, want_dh0=True),
        lambda q, k, w, u, do, dv, g, s: chunk_gated_delta_rule_bwd_dhu(
            q=q, k=k, w=w, g=g, h0=torch.zeros_like(s), dht=s, do=do, dv=dv, scale=scale, state_v_first=True,
            chunk_size=64),
        lambda q, k, w, u, do, dv, g, s: chunk_state_backward_reference(q, k, w, g, do, dv, scale, dht=s),
    )


@pytest.mark.gpu
@needs_hopper
@needs_gluon
@pytest.mark.parametrize("batch, seq_len, key_dim, value_dim, dtype, key_heads",
                         [(2, 1024, 128, 64, torch.float16, 3), (1, 1000, 64, 96, torch.bfloat16, 3),
                          (3, 192, 256, 32, torch.bfloat16, 3), (1, 1000, 128, 128, torch.bfloat16, 1)],
                         ids=["two-sequences-k128-fp16", "partial-chunk-k64", "three-sequences-k256", "gva-k128"])
def test_other_shapes_match_the_triton_kernels_and_the_fp32_recurrences(batch, seq_len, key_dim, value_dim, dtype,
                                                                        key_heads):
    """Both recurrences with initial / final states: within 1e-2 of the Triton kernels and no further from the fp32
    references than twice their error; with GVA the references get q and k repeated per value head."""
    from megatron_muon.ops.reference import chunk_state_backward_reference, chunk_state_forward_reference

    torch.manual_seed(seq_len + key_dim)
    heads, scale = 3, key_dim**-0.5
    q, k, w, u, do, dv, g, state = chunk_kernel_inputs(batch, seq_len, key_heads, heads, key_dim, value_dim, dtype)
    assert state_tma.qualifies([k, w], [u], g, None, 64) and state_ws.ready([k, w], [u])
    q_rep, k_rep = (t.repeat_interleave(heads // key_heads, dim=2) for t in (q, k))
    runs = [
        (state_ws.chunk_fwd_h(k, w, u, g, state, True), state_tma.chunk_fwd_h(k, w, u, g, state, True),
         chunk_state_forward_reference(*(t.cpu() for t in (k_rep, w, u, g, state)))),
        (state_ws.chunk_dhu(q, k, w, g, do, dv, scale, dht=state, want_dh0=True),
         state_tma.chunk_dhu(q, k, w, g, do, dv, scale, dht=state, want_dh0=True),
         chunk_state_backward_reference(*(t.cpu() for t in (q_rep, k_rep, w, g, do, dv)), scale, dht=state.cpu())),
    ]
    for ours, triton_kernel, reference in runs:
        for got, theirs, want in zip(ours, triton_kernel, reference):
            assert _relative(got, theirs) < 1e-2
            assert _relative(got.cpu(), want) < 2 * _relative(theirs.cpu(), want) + 1e-3


@pytest.mark.gpu
@needs_hopper
@needs_gluon
@pytest.mark.parametrize("key_dim, value_dim, block_v", [(128, 128, 16), (128, 128, 64), (128, 128, 128),
                                                         (256, 512, 16)],
                         ids=["k128-v16", "k128-v64", "k128-v128", "k256-v16"])
def test_other_value_blocks_match_the_fp32_recurrences_as_the_default_block_does(key_dim, value_dim, block_v):
    """GVA, a partial last chunk, initial / final states: within 1e-2 of the default block's outputs and no further
    from the fp32 references than twice the Triton kernels' error."""
    from megatron_muon.ops.reference import chunk_state_backward_reference, chunk_state_forward_reference

    torch.manual_seed(block_v)
    key_heads, heads, scale = 1, 2, key_dim**-0.5
    q, k, w, u, do, dv, g, state = chunk_kernel_inputs(1, 1000, key_heads, heads, key_dim, value_dim, torch.bfloat16)
    q_rep, k_rep = (t.repeat_interleave(heads // key_heads, dim=2) for t in (q, k))
    runs = [
        (state_ws.chunk_fwd_h(k, w, u, g, state, True, block_v=block_v), state_ws.chunk_fwd_h(k, w, u, g, state, True),
         state_tma.chunk_fwd_h(k, w, u, g, state, True),
         chunk_state_forward_reference(*(t.cpu() for t in (k_rep, w, u, g, state)))),
        (state_ws.chunk_dhu(q, k, w, g, do, dv, scale, dht=state, want_dh0=True, block_v=block_v),
         state_ws.chunk_dhu(q, k, w, g, do, dv, scale, dht=state, want_dh0=True),
         state_tma.chunk_dhu(q, k, w, g, do, dv, scale, dht=state, want_dh0=True),
         chunk_state_backward_reference(*(t.cpu() for t in (q_rep, k_rep, w, g, do, dv)), scale, dht=state.cpu())),
    ]
    for ours, default_block, triton_kernel, reference in runs:
        for got, default, theirs, want in zip(ours, default_block, triton_kernel, reference):
            assert _relative(got, default) < 1e-2
            assert _relative(got.cpu(), want) < 2 * _relative(theirs.cpu(), want) + 1e-3


@needs_gluon
def test_the_host_wrappers_launch_the_kernels_with_their_signature(monkeypatch):
    """No GPU needed: every argument lands on the kernel parameter of its name, and the grid is (value blocks,
    batch·heads)."""
    batch, seq_len, heads, key_dim, value_dim = 2, 1000, 3, 128, 96
    launches = {}

    def recorder(kernel):
        def launch_with(grid):
            return lambda *args, **options: launches.update({kernel: (grid, dict(zip(kernel.arg_names, args)))})
        return type("Recorder", (), {"__getitem__": lambda self, grid: launch_with(grid)})()

    for name in ("_chunk_state_fwd_ws_kernel", "_chunk_state_bwd_ws_kernel"):
        monkeypatch.setattr(state_ws, name, recorder(getattr(state_ws, name)))
    key = torch.zeros(batch, seq_len, 1, key_dim, dtype=torch.bfloat16)  # q and k: one key head for three values
    w = torch.zeros(batch, seq_len, heads, key_dim, dtype=torch.bfloat16)
    value = torch.zeros(batch, seq_len, heads, value_dim, dtype=torch.bfloat16)
    boundary = torch.ones(batch, heads, value_dim, key_dim)
    gates = torch.zeros(batch, seq_len, heads)
    h, v_new, final = state_ws.chunk_fwd_h(key, w, value, gates, boundary, True)
    dh, dh0, dv2 = state_ws.chunk_dhu(key, key, w, gates, value, value, 0.5, None, True)
    expected = {"T": seq_len, "NT": 16, "H": heads, "GROUP": heads, "K": key_dim, "V": value_dim,
                "BV": state_ws.BLOCK_V}
    (forward_grid, forward), (backward_grid, backward) = launches.values()
    assert forward_grid == backward_grid == (value_dim // state_ws.BLOCK_V, batch * heads)
    assert {name: forward[name] for name in expected} == expected == {name: backward[name] for name in expected}
    assert forward["h0"] is not h and torch.equal(forward["h0"], boundary) and forward["ht"] is final
    assert forward["USE_INITIAL_STATE"] and forward["STORE_FINAL_STATE"] and backward["scale"] == 0.5
    assert forward["STORE_STATES"] and not forward["WITH_OUTPUT"] and not backward["LOCAL_DV"]
    assert backward["dh0"] is dh0 and not backward["USE_FINAL_STATE_GRADIENT"] and backward["USE_INITIAL_STATE"]
    assert h.shape == dh.shape == (batch, 16, heads, value_dim, key_dim) and v_new.shape == dv2.shape == value.shape


@pytest.mark.gpu
@needs_hopper
@needs_gluon
@pytest.mark.parametrize("seq_len, key_heads, heads, key_dim, value_dim",
                         [(2048, 6, 6, 256, 512), (2048, 16, 32, 128, 128), (1000, 2, 2, 64, 96)],
                         ids=["hybrid-1.5b", "qwen3-next-gva", "partial-chunk-k64"])
def test_state_gradients_with_the_local_value_gradient_match_the_triton_kernel(seq_len, key_heads, heads, key_dim,
                                                                                value_dim):
    """dv None (the chunks' own value gradient inside): within 1e-2 of the Triton kernel doing the same, and no
    further from the fp32 references (dv_local, then the state-gradient recurrence) than twice its error."""
    from megatron_muon.ops.reference import chunk_local_dv_reference, chunk_state_backward_reference

    torch.manual_seed(seq_len + key_dim)
    scale = key_dim**-0.5
    q, k, w, _, do, _, g, state = chunk_kernel_inputs(1, seq_len, key_heads, heads, key_dim, value_dim)
    assert state_tma.qualifies([q, k, w], [do], g, None, 64) and state_ws.ready([q, k, w], [do])
    ours = state_ws.chunk_dhu(q, k, w, g, do, None, scale, dht=state, want_dh0=True)
    theirs = state_tma.chunk_dhu(q, k, w, g, do, None, scale, dht=state, want_dh0=True)
    cpu = [t.cpu() for t in (q, k, w, g, do)]
    groups = heads // key_heads
    local = chunk_local_dv_reference(cpu[0], cpu[1], cpu[3], cpu[4], scale)
    reference = chunk_state_backward_reference(cpu[0].repeat_interleave(groups, dim=2),
                                               cpu[1].repeat_interleave(groups, dim=2), cpu[2], cpu[3], cpu[4],
                                               local, scale, dht=state.cpu())
    for got, other, want in zip(ours, theirs, reference):
        assert _relative(got, other) < 1e-2
        assert _relative(got.cpu(), want) < 2 * _relative(other.cpu(), want) + 1e-3
