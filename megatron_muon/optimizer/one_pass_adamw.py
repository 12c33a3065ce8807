"""One Triton pass per param group for a mixed-precision AdamW step over fp32 master weights: the pending gradient
clip factor, the AdamW update and the 16-bit model copy together (`megatron/master_adamw.py` installs it in
megatron's mixed-precision wrapper, where it replaces three passes over the masters).

The state keeps the inner optimizer's layout, so checkpoints stay interchangeable with it: torch's (a `step` per
parameter, `exp_avg`, `exp_avg_sq`) or, for Transformer Engine's FusedAdam (`group_step=True`), one integer `step`
per param group that advances every step, as TE advances it. Gradients are not written back: after the step they
hold the unclipped values. Whole blocks load and store unmasked with alignment hints (128-bit accesses).
"""

from __future__ import annotations

import functools
import math

import torch

from megatron_muon.kernels.triton_math import INTERPRETING
from megatron_muon.optimizer import clip_scale

try:
    import triton
    import triton.language as tl

    from megatron_muon.kernels.triton_math import product, round_to
except ImportError:  # nothing qualifies for the pass
    triton = None

# elements per program (32 per thread) and warps: the tile sweep's choice (docs/design/optimizer_passes.md)
BLOCK = 4096
NUM_WARPS = 4


class OnePassAdamW:
    """The pass for one torch Adam/AdamW over fp32 master weights, with a pending clip factor.

    `model_of` maps id(master weight) to the 16-bit model parameter the pass writes (masters without one are fp32
    model parameters themselves). `pending` is the clip factor for the next `run()`, a one-element fp32 device
    tensor, or None.
    """

    def __init__(self, inner: torch.optim.Optimizer, model_of: dict[int, torch.Tensor], group_step: bool = False):
        self.inner, self.model_of, self.group_step = inner, model_of, group_step
        self.claimed = frozenset(id(p) for group in inner.param_groups for p in group["params"])
        self.pending: torch.Tensor | None = None
        self._host_counts: dict[int, tuple[torch.Tensor, int]] = {}  # id(step tensor) -> (it, its host count)

    def apply_pending(self) -> None:
        """Multiply the gradients by the pending clip factor (for megatron's own path)."""
        if self.pending is not None:
            grads = [p.grad for group in self.inner.param_groups for p in group["params"] if p.grad is not None]
            if not clip_scale.scale_in_place(grads, self.pending):  # megatron's own clip kernel (tensor_fallbacks)
                torch._foreach_mul_(grads, self.pending.reshape(()))
            self.pending = None

    def run(self) -> bool:
        """The pass for every param group; False (nothing done) when a tensor does not qualify this step."""
        work = []
        for group in self.inner.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(not _pass_ready(p, self.model_of.get(id(p))) for p in params):
                return False
            work.append((group, params))
        for group, params in work:
            if self.group_step:  # TE advances every group's count, with gradients or not
                group["step"] = group.get("step", 0) + 1
            if params:
                self._run_group(group, params)
        self.pending = None
        return True

    def _run_group(self, group: dict, params: list[torch.Tensor]) -> None:
        states = [self._state(p) for p in params]
        if self.group_step:
            counts = [group["step"]] * len(params)
            decoupled = bool(self.inner.adam_w_mode)
        else:
            steps = [state["step"] for state in states]
            counts = self._step_counts(steps)
            torch._foreach_add_(steps, 1.0)
            decoupled = isinstance(self.inner, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
        beta1, beta2 = group["betas"]
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
        corrected = group.get("bias_correction", True)
        # one launch per step count (bias correction), model-copy dtype and address alignment: each launch's
        # accesses are as wide as its tensors' alignment allows (DDP's gradient views start wherever the previous
        # parameter ended)
        launches: dict[tuple, list[tuple]] = {}
        for param, state, count in zip(params, states, counts):
            model = self.model_of.get(id(param))
            row = (param, param.grad, state["exp_avg"], state["exp_avg_sq"], model)
            alignments = tuple(_alignment(t) for t in row)
            launches.setdefault((count, None if model is None else model.dtype, alignments), []).append(row)
        for (count, model_dtype, alignments), rows in launches.items():
            scalars = dict(
                decay=lr * weight_decay if decoupled else weight_decay, decoupled=decoupled, beta1=beta1,
                beta2=beta2, step_size=lr / (1 - beta1**count) if corrected else lr,
                bc2_sqrt=math.sqrt(1 - beta2**count) if corrected else 1.0,
                eps=group["eps"],
            )
            _launch(rows, self.pending, model_dtype, alignments, scalars)

    def _state(self, param: torch.Tensor) -> dict:
        state = self.inner.state[param]
        if not state and self.group_step:  # TE's own init: zero fp32 moments, the count lives in the group
            self.inner.initialize_state(param, False)
        elif not state:  # torch's lazy init for fused groups: a device step, zero moments
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _step_counts(self, steps: list[torch.Tensor]) -> list[int]:
        """This step's count per state (its device `step` + 1), kept on the host: read from the device once (one
        sync for all the new step tensors: the first step, or after a load), then counted. Counts differ where a
        parameter had no gradient in some steps, as torch's AdamW counts them."""
        unknown = [step for step in steps if self._host_counts.get(id(step), (None,))[0] is not step]
        read = dict(zip(map(id, unknown), torch.stack(unknown).tolist())) if unknown else {}
        if unknown:  # forget the step tensors a load replaced
            live = {id(state.get("step")) for state in self.inner.state.values()}
            self._host_counts = {key: value for key, value in self._host_counts.items() if key in live}
        counts = [int(read[id(step)]) + 1 if id(step) in read else self._host_counts[id(step)][1] + 1
                  for step in steps]
        self._host_counts.update({id(step): (step, count) for step, count in zip(steps, counts)})
        return counts


def _pass_ready(param: torch.Tensor, model: torch.Tensor | None) -> bool:
    grad = param.grad
    return (grad.dtype == torch.float32 and grad.is_contiguous() and grad.shape == param.shape
            and grad.device == param.device
            and (model is None or (model.is_contiguous() and model.numel() == param.numel()
                                   and model.device == param.device)))


def _alignment(tensor: torch.Tensor | None) -> int:
    """The largest of 16, 8, 4, 2 and 1 bytes that divides the tensor's address."""
    address = 0 if tensor is None else tensor.data_ptr()
    return next(size for size in (16, 8, 4, 2, 1) if address % size == 0)


def _launch(rows, factor, model_dtype, alignments, scalars) -> None:
    device = rows[0][0].device
    addresses = tuple((*(t.data_ptr() for t in row[:4]), 0 if row[4] is None else row[4].data_ptr(), row[0].numel())
                      for row in rows)
    pointers, numels, block_tensor, block_start = _tables(device, addresses)
    if block_tensor.numel() == 0:
        return
    model_carrier = rows[0][4] if model_dtype is not None else rows[0][0]
    _adamw_kernel[(block_tensor.numel(),)](
        pointers, numels, block_tensor, block_start, rows[0][0] if factor is None else factor, model_carrier,
        scalars["decay"], scalars["beta1"], 1.0 - scalars["beta1"], scalars["beta2"], 1.0 - scalars["beta2"],
        scalars["step_size"], scalars["bc2_sqrt"], scalars["eps"], DECOUPLED=scalars["decoupled"],
        HAS_FACTOR=factor is not None, HAS_MODEL=model_dtype is not None, EMULATE=INTERPRETING,
        PARAM_ALIGN=alignments[0], GRAD_ALIGN=alignments[1], EXP_AVG_ALIGN=alignments[2],
        EXP_AVG_SQ_ALIGN=alignments[3], MODEL_ALIGN=alignments[4], BLOCK=BLOCK, num_warps=NUM_WARPS,
    )


@functools.lru_cache(maxsize=64)
def _tables(device: torch.device, rows: tuple[tuple[int, ...], ...]):
    """Device tables: per tensor its 5 addresses and numel; per block its tensor and first element."""
    pointers = torch.tensor([row[:5] for row in rows], dtype=torch.int64)
    numels = torch.tensor([row[5] for row in rows], dtype=torch.int64)
    blocks_per = [-(-row[5] // BLOCK) for row in rows]
    block_tensor = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32), torch.tensor(blocks_per))
    block_start = torch.cat([torch.arange(0, row[5], BLOCK, dtype=torch.int64) for row in rows])
    return tuple(t.to(device) for t in (pointers, numels, block_tensor, block_start))


if triton is not None:

    @triton.jit
    def _adamw_kernel(
        Pointers, Numels, BlockTensor, BlockStart, Factor, ModelCarrier,
        decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
        DECOUPLED: tl.constexpr, HAS_FACTOR: tl.constexpr, HAS_MODEL: tl.constexpr, EMULATE: tl.constexpr,
        PARAM_ALIGN: tl.constexpr, GRAD_ALIGN: tl.constexpr, EXP_AVG_ALIGN: tl.constexpr,
        EXP_AVG_SQ_ALIGN: tl.constexpr, MODEL_ALIGN: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(0)
        tensor = tl.load(BlockTensor + block).to(tl.int64)
        start = tl.multiple_of(tl.load(BlockStart + block), BLOCK)
        numel = tl.load(Numels + tensor)
        row = Pointers + tensor * 5
        pointers = (
            _address(row, tl.float32, PARAM_ALIGN), _address(row + 1, tl.float32, GRAD_ALIGN),
            _address(row + 2, tl.float32, EXP_AVG_ALIGN), _address(row + 3, tl.float32, EXP_AVG_SQ_ALIGN),
            _address(row + 4, ModelCarrier.dtype.element_ty, MODEL_ALIGN),
        )
        scalars = (decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps)
        # whole blocks load and store unmasked: as 128-bit accesses where the addresses are 16-byte aligned
        if start + BLOCK <= numel:
            _adamw_block(pointers, start, numel, Factor, scalars, DECOUPLED, HAS_FACTOR, HAS_MODEL, EMULATE,
                         False, BLOCK)
        else:
            _adamw_block(pointers, start, numel, Factor, scalars, DECOUPLED, HAS_FACTOR, HAS_MODEL, EMULATE,
                         True, BLOCK)

    @triton.jit
    def _address(entry, dtype: tl.constexpr, ALIGN: tl.constexpr):
        """A table's address with its known alignment in bytes: what lets loads and stores be vector accesses."""
        pointer = tl.load(entry).to(tl.pointer_type(dtype))
        if ALIGN > 1:
            pointer = tl.multiple_of(pointer, ALIGN)
        return pointer

    @triton.jit
    def _adamw_block(
        pointers, start, numel, Factor, scalars, DECOUPLED: tl.constexpr, HAS_FACTOR: tl.constexpr,
        HAS_MODEL: tl.constexpr, EMULATE: tl.constexpr, MASKED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        Param, Grad, ExpAvg, ExpAvgSq, Model = pointers
        decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps = scalars
        index = start + tl.arange(0, BLOCK).to(tl.int64)
        inside = None
        if MASKED:
            inside = index < numel
        param = tl.load(Param + index, mask=inside)
        grad = tl.load(Grad + index, mask=inside)
        exp_avg = tl.load(ExpAvg + index, mask=inside)
        exp_avg_sq = tl.load(ExpAvgSq + index, mask=inside)
        if HAS_FACTOR:  # the clip megatron would have applied to the stored gradient (same fp32 product)
            grad = product(grad, tl.load(Factor), EMULATE)
        # torch's fused Adam(W): decay (decoupled: by lr·wd; else L2 into the gradient), moments, bias-corrected step
        if DECOUPLED:
            param = param - decay * param
        else:
            grad = grad + decay * param
        exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
        exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bc2_sqrt) + eps
        param = param - tl.div_rn(step_size * exp_avg, denom)
        tl.store(Param + index, param, mask=inside)
        tl.store(ExpAvg + index, exp_avg, mask=inside)
        tl.store(ExpAvgSq + index, exp_avg_sq, mask=inside)
        if HAS_MODEL:  # rounded to nearest-even as torch's copy_ (emulated under the interpreter, whose cast truncates)
            tl.store(Model + index, round_to(param, Model.dtype.element_ty, EMULATE), mask=inside)
