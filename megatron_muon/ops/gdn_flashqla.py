"""FlashQLA (Qwen's fused TileLang kernels for the gated delta rule) behind the GDN chunk op, where it applies.

`chunk_gated_delta_rule` sends a call to FlashQLA when FlashQLA runs in this process (`flashqla_enabled`) and the
call `qualifies`: CUDA tensors, bf16 q, k, v and K = V = 128, the only head dims FlashQLA builds; packed sequences,
GVA and initial / final states included. Every other call runs our kernels (while FlashQLA runs in the process, the
first such call logs why).

FlashQLA runs in this process when the package is installed (``pip install "megatron-muon[flashqla]"``), the GPU is
a Hopper, TileLang finds nvcc for its JIT, and the GDN backend is an FLA one (never under the pure-torch backend).
``MEGATRON_MUON_GDN_FLASHQLA`` (auto | on | off) or `set_flashqla` overrides that: off keeps our kernels everywhere
(so a benchmark can compare both in one process), on raises where FlashQLA cannot run. The choice is made once, at
the first CUDA call, and logged. Compiled graphs read it while tracing (``torch.compiler.assume_constant_result``):
no guard and no graph break, and a graph keeps the choice it was traced with.

The custom ops call FlashQLA's forward and backward launchers rather than its autograd Function (which is wrapped in
``torch.compiler.disable``), so autograd stays ours. FlashQLA's forward can hand its intra-card context-parallel
states to the backward in a Python object; a custom op passes tensors only, so the backward recomputes them, as
FlashQLA does itself when that cache is off. The forward and backward always build the context-parallel split for
training, so both make the same split.
"""

import contextlib
import importlib.util
import logging
import os

import torch
from torch import Tensor

from megatron_muon.ops.backend import Hardware, hardware, selected_backend

FLASHQLA_ENV_VAR = "MEGATRON_MUON_GDN_FLASHQLA"
HEAD_DIM = 128  # FlashQLA's kernels assert K == V == 128
CHUNK_SIZE = 64  # FlashQLA's chunk on Hopper
_SETTINGS = {"auto": None, "on": True, "1": True, "off": False, "0": False}
_INSTALL = 'pip install "megatron-muon[flashqla]"'

_logger = logging.getLogger(__name__)
_requested: bool | None = None  # set_flashqla's override; None defers to the environment
_enabled: bool | None = None  # the process's choice, made at the first CUDA call
_fallback_logged = False


def set_flashqla(enabled: bool | None) -> None:
    """Turn FlashQLA on (the next op call raises where it cannot run), off, or back to automatic (None).

    Takes effect at the next op call; a compiled graph keeps the choice it was traced with until it is traced
    again (``torch._dynamo.reset()``).
    """
    global _requested, _enabled
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_flashqla takes True, False or None (automatic); got {enabled!r}.")
    _requested, _enabled = enabled, None


@torch.compiler.assume_constant_result
def flashqla_enabled() -> bool:
    """Whether qualifying GDN calls run on FlashQLA in this process (chosen and logged at the first call)."""
    global _enabled
    if selected_backend() == "torch":
        return False
    if _enabled is None:
        _enabled = _choose(hardware())
        if _enabled:
            _logger.info("megatron_muon GDN ops: FlashQLA runs the chunk op for bf16 q, k, v with K = V = %d "
                         "(%s=off keeps our kernels)", HEAD_DIM, FLASHQLA_ENV_VAR)
    return _enabled


def qualifies(q: Tensor, v: Tensor) -> bool:
    """Whether FlashQLA's kernels take these inputs; reads tensor metadata only, so Dynamo traces it.
    (k and v share q's dtype, and HV is a multiple of H: `chunk_gated_delta_rule` checks both first.)"""
    return q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-1] == HEAD_DIM and v.shape[-1] == HEAD_DIM


def log_first_fallback(q: Tensor, v: Tensor) -> None:
    """One log line at the first CUDA call that runs our kernels although FlashQLA is on: which shape it was."""
    global _fallback_logged
    if _fallback_logged or not q.is_cuda or not flashqla_enabled() or qualifies(q, v):
        return
    _fallback_logged = True
    _logger.info("megatron_muon GDN ops: FlashQLA takes bf16 q, k, v with K = V = %d only; calls with %s, K = %d, "
                 "V = %d run our kernels", HEAD_DIM, q.dtype, q.shape[-1], v.shape[-1])


def _choose(hw: Hardware) -> bool:
    requested = _requested if _requested is not None else _from_environment()
    if requested is False:
        return False
    missing = _why_unavailable(hw)
    if missing is None:
        return True
    if requested:
        raise RuntimeError(
            f"FlashQLA was turned on ({FLASHQLA_ENV_VAR}=on or set_flashqla(True)), but {missing}. Unset it to run "
            "our GDN kernels where FlashQLA cannot run."
        )
    _logger.info("megatron_muon GDN ops: FlashQLA not used: %s", missing)
    return False


def _from_environment() -> bool | None:
    value = os.environ.get(FLASHQLA_ENV_VAR, "auto").strip().lower() or "auto"
    if value not in _SETTINGS:
        raise ValueError(f"{FLASHQLA_ENV_VAR}={value!r}: use auto, on or off.")
    return _SETTINGS[value]


def _why_unavailable(hw: Hardware) -> str | None:
    if not hw.cuda:
        return "there is no CUDA GPU"
    if not hw.hopper:
        return f"we run it on Hopper GPUs only and this is {hw.device_name} (compute capability {hw.capability})"
    if importlib.util.find_spec("flash_qla") is None:
        return f"flash-qla is not installed ({_INSTALL})"
    if not _nvcc_found():
        return "TileLang finds no nvcc to compile FlashQLA's kernels (install a CUDA toolkit or set CUDA_HOME)"
    return None


def _nvcc_found() -> bool:
    from fla.utils import has_usable_nvcc  # FLA's copy of TileLang's search for nvcc

    return has_usable_nvcc()


def _on_device(tensor: Tensor):
    """The tensor's CUDA device as the current one (FlashQLA launches on the current device)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _flashqla_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """(o, final_state or empty, g_cumsum, A) from FlashQLA's forward launcher; g goes in as fp32 (FlashQLA keeps
    the cumsum and its gradient in g's dtype) and the initial state as fp32."""
    from flash_qla import chunk_gated_delta_rule_fwd

    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    with _on_device(q):
        g_cumsum, a_matrix, o, _, final_state, _ = chunk_gated_delta_rule_fwd(
            q, k, v, g.float().contiguous(), beta, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens,
            output_final_state=output_final_state, output_h=False, auto_cp=True, state_v_first=False,
            enable_fwd_cp_cache=False, is_train=True,
        )
    if final_state is None:
        final_state = q.new_empty(0, dtype=torch.float32)
    return o.to(v.dtype).contiguous(), final_state.float().contiguous(), g_cumsum.contiguous(), a_matrix.contiguous()


def _flashqla_backward(q, k, v, g, beta, g_cumsum, a_matrix, scale, initial_state, cu_seqlens, do, dht):
    """(dq, dk, dv, dg, dbeta, dh0 or empty) from FlashQLA's backward launcher, each in its input's dtype."""
    from flash_qla import chunk_gated_delta_rule_bwd

    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    dht = None if dht is None else dht.float().contiguous()
    with _on_device(q):
        dq, dk, dv, dbeta, dg, dh0 = chunk_gated_delta_rule_bwd(
            q, k, v, g_cumsum, beta, a_matrix, do.to(v.dtype).contiguous(), dht=dht, scale=scale, initial_state=h0,
            cu_seqlens=cu_seqlens, state_v_first=False, auto_cp=True,
        )
    dh0 = q.new_empty(0) if initial_state is None else dh0.to(initial_state.dtype)
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0
    return tuple(grad.contiguous() for grad in grads)


@torch.library.custom_op("megatron_muon::gdn_flashqla_fwd", mutates_args=())
def gdn_flashqla_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor | None,
    output_final_state: bool, cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (o, final_state or empty, g_cumsum, A): FlashQLA's chunk-local cumsum of g and its chunk matrix A,
    both kept for the backward."""
    return _flashqla_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


@gdn_flashqla_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    batch, seq_len, value_heads, value_dim = v.shape
    num_states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final_shape = (num_states, value_heads, k.shape[-1], value_dim) if output_final_state else (0,)
    return (
        torch.empty_like(v, memory_format=torch.contiguous_format),
        q.new_empty(final_shape, dtype=torch.float32),
        q.new_empty(batch, seq_len, value_heads, dtype=torch.float32),
        k.new_empty(batch, seq_len, value_heads, CHUNK_SIZE),
    )


@torch.library.custom_op("megatron_muon::gdn_flashqla_bwd", mutates_args=())
def gdn_flashqla_bwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, g_cumsum: Tensor, a_matrix: Tensor, scale: float,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, do: Tensor, dht: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dg, dbeta, dh0); dh0 is empty when there is no initial state."""
    return _flashqla_backward(q, k, v, g, beta, g_cumsum, a_matrix, scale, initial_state, cu_seqlens, do, dht)


@gdn_flashqla_bwd.register_fake
def _(q, k, v, g, beta, g_cumsum, a_matrix, scale, initial_state, cu_seqlens, do, dht):
    dh0 = initial_state if initial_state is not None else q.new_empty(0)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, g, beta, dh0))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens = inputs
    _, _, g_cumsum, a_matrix = output
    ctx.save_for_backward(q, k, v, g, beta, g_cumsum, a_matrix, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.mark_non_differentiable(g_cumsum, a_matrix)
    ctx.set_materialize_grads(False)  # as ops/gdn.py: no zero gradients for the kept tensors


def _backward(ctx, do, dht, *_private_grads):
    q, k, v, g, beta, g_cumsum, a_matrix, initial_state, cu_seqlens = ctx.saved_tensors
    dht = dht if ctx.output_final_state else None
    if do is None:  # only the final state is used
        do = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dq, dk, dv, dg, dbeta, dh0 = gdn_flashqla_bwd(
        q, k, v, g, beta, g_cumsum, a_matrix, ctx.scale, initial_state, cu_seqlens, do.contiguous(), dht
    )
    return dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None


gdn_flashqla_fwd.register_autograd(_backward, setup_context=_setup_context)
