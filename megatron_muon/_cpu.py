"""CPU mode: run megatron-core's real code paths (parallel_state, models, DDP, optimizers, dist_checkpointing) on a
machine without a GPU, over gloo.

megatron-core assumes CUDA in a handful of places (device queries used as allocation targets, `param.type()` checks,
streams/events, the CUDA RNG tracker). CPU mode redirects exactly those: it is for tests and the CPU demo only, is
opt-in, and refuses to activate when CUDA is available, so it can never change a GPU run.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_state: dict[str, object] = {"enabled": False, "mode": None}

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}
_EMPTY_FACTORIES = {torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.empty_strided}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuMode(TorchFunctionMode):
    """With `redirect_cuda`, rewrites CUDA device arguments to CPU and reports CPU tensors as `torch.cuda.*` types.

    With `nan_empty`, floating `torch.empty*` results are filled with NaN so any output a kernel forgets to write
    shows up in tests instead of passing by accident on zeroed memory.
    """

    def __init__(self, redirect_cuda: bool, nan_empty: bool):
        super().__init__()
        self.redirect_cuda = redirect_cuda
        self.nan_empty = nan_empty

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if not self.redirect_cuda:
            return self._maybe_nan(func, func(*args, **kwargs))
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.float and _state.get("float64_as_float32") and args[0].dtype == torch.float64:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return self._maybe_nan(func, func(*args, **kwargs))

    def _maybe_nan(self, func, out):
        if self.nan_empty and func in _EMPTY_FACTORIES and isinstance(out, torch.Tensor) and out.is_floating_point():
            with torch.no_grad():
                out.fill_(math.nan)
        return out


class _NullStream:
    """Stands in for torch.cuda.Stream / current_stream(): CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cpu")

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    """Stands in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        return None

    def wait(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # "cpu" rather than 0: `device=torch.cuda.current_device()` then allocates on CPU even where the function mode
    # is not active (autograd backward of custom Functions).
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.device = lambda *a, **k: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    # The RNG tracker keeps one state per name and swaps it in and out: route that to the CPU generator.
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls this; keep it from recursing
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    torch.nn.Module.cuda = lambda self, *a, **k: self


def _patch_megatron_rng() -> None:
    try:
        from megatron.core.tensor_parallel import random as megatron_random
    except ImportError:  # megatron not installed: nothing of megatron's to redirect
        return
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    megatron_random._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )


def enable_cpu_mode(nan_empty: bool = False) -> None:
    """Make megatron-core run on CPU for the rest of this process (idempotent).

    Raises when CUDA is available: CPU mode exists for machines without a GPU and must never alter a GPU run.
    """
    with _lock:
        if _state["enabled"]:
            _state["mode"].nan_empty = nan_empty
            return
        if torch.cuda.is_available():
            raise RuntimeError(
                "CPU mode is only for machines without a GPU; CUDA is available here, so run without CPU mode."
            )
        _patch_torch_cuda()
        _patch_megatron_rng()
        mode = _CpuMode(redirect_cuda=True, nan_empty=nan_empty)
        mode.__enter__()
        _state.update(enabled=True, mode=mode)


def report_float64_as_float32(enabled: bool = True) -> None:
    """megatron's DistributedOptimizer shards only fp32 and 16-bit parameters (a `Tensor.type()` check); fp64 runs,
    which keep layout rounding negligible in parity tests, report fp64 CPU tensors as `torch.cuda.FloatTensor` so it
    shards them too (its update math does not depend on the dtype), and keep `.float()` of fp64 tensors in fp64
    (where it copies gradients and masters)."""
    _CUDA_TYPE_NAMES[torch.float64] = "torch.cuda.FloatTensor" if enabled else "torch.cuda.DoubleTensor"
    _state["float64_as_float32"] = enabled


def cpu_mode_enabled() -> bool:
    return bool(_state["enabled"])


@contextlib.contextmanager
def nan_filled_empty():
    """Within the block, floating `torch.empty*` results are NaN (for tests outside CPU mode)."""
    if _state["enabled"]:
        previous = _state["mode"].nan_empty
        _state["mode"].nan_empty = True
        try:
            yield
        finally:
            _state["mode"].nan_empty = previous
        return
    with _CpuMode(redirect_cuda=False, nan_empty=True):
        yield
