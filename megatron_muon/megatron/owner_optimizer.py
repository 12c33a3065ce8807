"""What megatron builds for `--optimizer muon --use-distributed-optimizer` (and its deprecated alias `dist_muon`).

`OwnerMuonOptimizer` is megatron's `LayerWiseDistributedOptimizer` with our `WaveMuon` inside: DDP lays each Muon
matrix out whole in the data-parallel shard of its owner (`owner_layout`), its reduce-scatter lands each owner's
gradients in place, fp32 masters and momentum exist on the owner only, and DDP's parameter all-gather brings the
updated 16-bit matrices back (after the step, or bucket by bucket in the next forward with `overlap_param_gather`).
AdamW takes every other parameter on megatron's DistributedOptimizer.

Where Newton–Schulz starts (`newton_schulz_start`): `bucket` (with `overlap_grad_reduce`) for each bucket as soon as
its reduce-scatter has landed, on a side stream while the backward continues (a hook on the parameters' gradient
accumulators, after DDP's own); `backward_end` for all owned matrices at once, one batch per shape, on the side
stream when the step prepares its gradients, so the host queues it before it blocks reading the gradient norm and
the GPU runs it while the host queues the step (with `nonfinite_check="next_step"` the host does not block on the
norm at all: `nonfinite_check.py`); `step` inside the step.

With gradient clipping, `backward_end` takes the clip factor into the speculation: the chain computes the global
gradient norm on the device first (megatron's own computation, which it then reuses instead of repeating), and each
owner speculates on its gradients times min(1, clip / norm), as megatron's clip will scale them, so a clipped step
keeps its Newton–Schulz ahead of the step. That needs the norm as a device tensor (megatron returns one when a
tensor clip kernel exists, as `register()` provides without TE or Apex) and one norm for every parameter (no
separately clipped grad-norm group). Otherwise, and for `bucket` (whose speculation starts before the norm exists),
speculation assumes the step will not clip: `OwnerMuonChain.get_grad_norm` tells the engines whether the clip
factor is 1, and a clipped step recomputes (`WaveMuon`). Clipping comes in runs (early training, loss spikes), so
after such a clipped step the next one waits for its clip factor instead of speculating.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer.layer_wise_optimizer import (
    LayerWiseDistributedOptimizer,
    _bucket_is_managed_by_layer_wise_optimizer,
)
from megatron.core.optimizer.optimizer import FP32Optimizer
from torch.profiler import record_function

from megatron_muon.megatron.nonfinite_check import (
    DEFAULT_NONFINITE_CHECK,
    PendingNorm,
    raise_if_a_norm_was_non_finite,
    resolve_nonfinite_check,
)
from megatron_muon.optimizer.speculation_graphs import static_factor
from megatron_muon.optimizer.wave_muon import WaveMuon

NEWTON_SCHULZ_STARTS = ("bucket", "backward_end", "step")  # where each owner starts its Newton–Schulz
DEFAULT_NEWTON_SCHULZ_START = "backward_end"  # measured in benchmarks/results/dist_sim_step.md


def _muon_bucket_groups(chunk) -> list:
    return [group for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups
            if group.buckets and _bucket_is_managed_by_layer_wise_optimizer(group.buckets[0], default_for_untagged=False)]


def _check_layouts_agree(model_chunks, pg_collection) -> None:
    """Every data-parallel replica must lay the Muon buffers out identically, or owners would disagree."""
    import hashlib
    import json

    from megatron_muon.distributed.comm import StageGrid

    spans = [[[list(bucket.param_to_index[p]) for p in bucket.params_list] + [bucket.grad_data.numel()]
              for group in _muon_bucket_groups(chunk) for bucket in group.buckets] for chunk in model_chunks]
    digest = int.from_bytes(hashlib.sha256(json.dumps(spans).encode()).digest()[:8], "big") >> 1
    dp_group = getattr(pg_collection, "dp_cp", None) if pg_collection is not None else None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else None
    if dp_group is not None and not StageGrid(None, dp_group, device).all_equal(digest):
        raise ValueError("data-parallel ranks disagree on the Muon buffers' layout (bucket or parameter offsets "
                         "differ), so they would disagree on who owns each matrix: compute the DDP layout the same "
                         "way on every rank (megatron_muon.megatron.owner_layout.compute_full_param_layout does)")


def _check_start(start: str) -> str:
    if start not in NEWTON_SCHULZ_STARTS:
        raise ValueError(f"unknown Newton–Schulz start {start!r} (muon_newton_schulz_start, the recipe's "
                         f"optimizer.muon_newton_schulz_start); valid choices: {NEWTON_SCHULZ_STARTS}")
    return start


class OwnerMuonOptimizer(LayerWiseDistributedOptimizer):
    """Megatron's layer-wise distributed optimizer over owner-laid-out DDP buffers, Newton–Schulz ahead of the step.

    Args beyond megatron's: `newton_schulz_start` (`NEWTON_SCHULZ_STARTS`, module docstring); `bucket` takes effect
    where DDP reduces buckets during the backward (`overlap_grad_reduce`). `graph_newton_schulz` replays each
    speculation from a CUDA graph once its inputs have repeated (`SpeculationGraphs`), so the CPU thread launches
    one graph instead of its kernels. `nonfinite_check` (`nonfinite_check.NONFINITE_CHECKS`): whether a non-finite
    gradient norm stops the step before any update (`before_update`, a host read of the norm) or is reported by the
    next step (`next_step`, no host read where the update does not depend on the norm); `auto` picks `next_step` where
    megatron's DDP already stops non-finite gradients in the backward (`check_for_nan_in_grad`)."""

    def __init__(self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None,
                 newton_schulz_start: str = DEFAULT_NEWTON_SCHULZ_START, graph_newton_schulz: bool = False,
                 nonfinite_check: str = DEFAULT_NONFINITE_CHECK):
        _check_start(newton_schulz_start)
        self.nonfinite_check = resolve_nonfinite_check(nonfinite_check, model_chunks or [])
        self._pending_norms: list[PendingNorm] = []  # next_step: norms not yet checked on the host
        if not config.bf16:  # megatron's layer-wise optimizer wraps bf16 only; fp32/fp64 get megatron's FP32 wrapper
            fns = init_state_fn_list or [None] * len(optimizers)
            optimizers = [FP32Optimizer(o, config, fn or (lambda *_: None)) for o, fn in zip(optimizers, fns)]
            init_state_fn_list = None
        _check_layouts_agree(model_chunks or [], pg_collection)
        super().__init__(optimizers, config, pg_collection, init_state_fn_list, model_chunks)
        self.newton_schulz_start = newton_schulz_start
        self.graph_newton_schulz = graph_newton_schulz
        self._last_step_clipped = False  # clipping comes in runs: after a clipped step, wait for the step's factor
        self.clip_factor_from_chain = False  # set by OwnerMuonChain while its prepare_grads runs (module docstring)
        self._carried = False  # this step's speculation took the clip factor in
        self._clip_factor: torch.Tensor | None = None  # where it lives (one address, for graph replays)
        self.engines = [child.optimizer for child in self.chained_optimizers if isinstance(child.optimizer, WaveMuon)]
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() and self._on_cuda() else None
        self._waves: list[tuple] = []  # per wave: (bucket group, [(engine, optimizer param, model param)])
        self._started: set[int] = set()
        self.wave_log: list[tuple[str, int]] = []  # ("reduced" | "speculated", wave) in order, for tests
        self._hooks = []
        self._install_waves(model_chunks or [])
        self._all_members = [member for _, members in self._waves for member in members]  # backward_end's wave

    @property
    def newton_schulz_start(self) -> str:
        return self._newton_schulz_start

    @newton_schulz_start.setter
    def newton_schulz_start(self, start: str) -> None:
        self._newton_schulz_start = _check_start(start)

    @property
    def overlap_newton_schulz(self) -> bool:
        """Whether Newton–Schulz starts before the step (`bucket` or `backward_end`); setting True means `bucket`."""
        return self._newton_schulz_start != "step"

    @overlap_newton_schulz.setter
    def overlap_newton_schulz(self, overlap: bool) -> None:
        self.newton_schulz_start = "bucket" if overlap else "step"

    def _on_cuda(self) -> bool:
        return any(p.is_cuda for engine in self.engines for g in engine.param_groups for p in g["params"])

    def _optimizer_params(self) -> dict[int, tuple]:
        """id(model param) -> (engine, the parameter the engine updates: its fp32 master or itself)."""
        mapping = {}
        for child in self.chained_optimizers:
            engine = child.optimizer
            if not isinstance(engine, WaveMuon):
                continue
            for model_group, main_group in zip(getattr(child, "float16_groups", []),
                                               getattr(child, "fp32_from_float16_groups", [])):
                mapping.update({id(model): (engine, main) for model, main in zip(model_group, main_group)})
            for group in engine.param_groups:
                for param in group["params"]:
                    mapping.setdefault(id(param), (engine, param))
        return mapping

    def _install_waves(self, model_chunks) -> None:
        owned = self._optimizer_params()
        for chunk in model_chunks:
            for group in _muon_bucket_groups(chunk):
                wave = len(self._waves)
                members = []
                for bucket in group.buckets:
                    for model_param in bucket.params_list:
                        if id(model_param) in owned:
                            engine, param = owned[id(model_param)]
                            engine.wave_of[id(param)] = wave
                            members.append((engine, param, model_param))
                self._waves.append((group, members))
                for bucket in group.buckets:
                    for model_param in bucket.params_list:
                        accumulator = model_param.expand_as(model_param).grad_fn.next_functions[0][0]
                        self._hooks.append(accumulator.register_hook(self._wave_hook(wave)))

    def _wave_hook(self, wave: int):
        def hook(*_):
            group, members = self._waves[wave]
            if self._newton_schulz_start != "bucket" or self._last_step_clipped or wave in self._started \
                    or group.grad_reduce_handle is None:
                return
            self._started.add(wave)
            self.wave_log.append(("reduced", wave))
            self._launch(wave, group.grad_reduce_handle, members)
        return hook

    def _launch(self, wave: int | None, handle, members, grad_factor: torch.Tensor | None = None) -> None:
        """Speculate `wave` (None: every wave, batched by shape) once `handle` (None: nothing) has landed, on the
        gradients times `grad_factor` where one is given."""
        grads = {id(param): model_param.main_grad for _, param, model_param in members}
        engines = {id(engine): engine for engine, _, _ in members}.values()
        if self._stream is None:
            if handle is not None:
                handle.wait()
            for engine in engines:
                engine.speculate(wave, lambda p: grads[id(p)], grad_factor=grad_factor)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                if handle is not None:
                    handle.wait()
                for engine in engines:
                    engine.speculate(wave, lambda p: grads[id(p)], graphed=self.graph_newton_schulz,
                                     grad_factor=grad_factor)
        self.wave_log.append(("speculated", wave))

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """With `backward_end`, queue every owned matrix's Newton–Schulz here, before the host blocks on the norm
        (under clipping the chain queues it right after, with the clip factor: `speculate_clipped`). The step's
        stream does not wait for the side stream: the gradient norm only reads the gradients, so the host can read
        it while Newton–Schulz still runs, and queue the step behind it (`join_newton_schulz`, before anything writes
        a gradient, a buffer or a parameter)."""
        self._started.clear()
        self._carried = False
        self.check_last_norms()
        with record_function("owner.prepare_grads"):
            found_inf = super().prepare_grads()
        if self._newton_schulz_start == "backward_end" and not found_inf and not self.clip_factor_from_chain:
            self._speculate_all_unclipped()
        return found_inf

    def _speculate_all_unclipped(self) -> None:
        """Every owned matrix, on the gradients as they are (unless the last step clipped: then the step waits)."""
        if not self._last_step_clipped:
            with record_function("owner.speculate_all"):
                self._launch(None, None, self._all_members)

    @torch.no_grad()
    def speculate_clipped(self, factor: torch.Tensor | None) -> None:
        """`backward_end` under clipping: every owned matrix's Newton–Schulz on its gradients times `factor`, the
        step's clip factor on the device (`OwnerMuonChain`); None: the factor is not known before the step, so the
        speculation assumes no clip, as without clipping."""
        if factor is None:
            self._speculate_all_unclipped()
            return
        self._clip_factor = static_factor(self._clip_factor, factor)
        with record_function("owner.speculate_all"):
            self._launch(None, None, self._all_members, grad_factor=self._clip_factor)
        self._carried = True

    def check_last_norms(self, wait: bool = False) -> None:
        """`next_step`: raise if an earlier step's gradient norm was non-finite (`nonfinite_check`); those not yet
        on the host are checked later, unless `wait`."""
        self._pending_norms = raise_if_a_norm_was_non_finite(self._pending_norms, wait)

    def join_newton_schulz(self) -> None:
        """Order everything after this on the step's stream behind the speculative Newton–Schulz."""
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.join_newton_schulz()  # also when no chain showed this optimizer the gradient norm
        with record_function("owner.step_with_ready_grads"):
            return super().step_with_ready_grads()

    # ---- checkpoints: model-space tensors written by their owners, so they reshard to any tp/pp/dp layout ----

    def _owned_state(self, model_sharded_state_dict) -> list[tuple]:
        """(model ShardedTensor, momentum buffer, fp32 master or None) of every parameter this rank owns."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        model_tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
        by_data = {id(sh.data): sh for sh in nested_values(model_tensors)}
        owned = []
        for child in self.chained_optimizers:
            engine = child.optimizer
            masters = {id(main): model for model_group, main_group in zip(getattr(child, "float16_groups", []),
                                                                           getattr(child, "fp32_from_float16_groups", []))
                       for model, main in zip(model_group, main_group)}
            for group in engine.param_groups:
                for param in group["params"]:
                    model = masters.get(id(param), param)
                    if id(model) not in by_data:
                        raise ValueError("a Muon parameter is missing from the model's sharded state dict; build the "
                                         "state dict from the same model chunks the optimizer was built for")
                    owned.append((by_data[id(model)], engine._momentum_buffer(param), param if model is not param else None))
        return owned

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """`optimizer.state.{momentum_buffer,fp32_param}.<model key>` (plain Muon's keys) on the owners only, each
        the main replica; the param groups' hyperparameters as common state."""
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        if not is_loading:
            self.check_last_norms(wait=True)  # a checkpoint of a step with a non-finite norm would be saved silently

        state, self._owned_keys = {}, {}
        for model_sh, momentum, master in self._owned_state(model_sharded_state_dict):
            self._owned_keys[model_sh.key] = (model_sh, momentum, master)
            for kind, tensor in (("momentum_buffer", momentum), ("fp32_param", master)):
                if tensor is not None:
                    sh = make_sharded_optimizer_tensor(model_sh, tensor, prefix=f"optimizer.state.{kind}")
                    sh.replica_id = (*model_sh.replica_id[:2], 0) if isinstance(model_sh.replica_id, tuple) else 0
                    state[sh.key] = sh
        groups = [{k: v for k, v in group.items() if k != "params"} for engine in self.engines
                  for group in engine.param_groups]
        return {"owned_state": state, "param_groups": groups}

    def load_state_dict(self, state_dict) -> None:
        """Copy the loaded tensors into this rank's momentum buffers and masters (the template's keys)."""
        loaded = state_dict["owned_state"]
        if not hasattr(self, "_owned_keys"):
            raise ValueError("load_state_dict needs the template from sharded_state_dict(..., is_loading=True) first "
                             "(megatron's dist_checkpointing load does this)")
        for key, (model_sh, momentum, master) in self._owned_keys.items():
            for kind, tensor in (("momentum_buffer", momentum), ("fp32_param", master)):
                if tensor is not None:
                    tensor.copy_(loaded[f"optimizer.state.{kind}.{key}"])
        groups = [group for engine in self.engines for group in engine.param_groups]
        if len(groups) != len(state_dict["param_groups"]):
            raise ValueError(f"the checkpoint has {len(state_dict['param_groups'])} Muon param groups, this optimizer "
                             f"{len(groups)}; load a checkpoint of the same model and optimizer settings")
        for group, saved in zip(groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def allow_speculation(self, grad_norm, model_chunks=()) -> None:
        """Called with the step's global gradient norm: the speculative updates hold iff nothing is clipped. A
        non-finite norm stops the step on every rank, before any state changes, naming a parameter."""
        clip = self.config.clip_grad
        if self.nonfinite_check == "next_step" and isinstance(grad_norm, torch.Tensor) \
                and (clip <= 0.0 or self._carried):
            self._update_regardless_of_the_norm(grad_norm)
            return
        norm = float(grad_norm)
        if not math.isfinite(norm):
            self.join_newton_schulz()
            for engine in self.engines:  # what the backward speculated from these gradients must not reach a step
                engine.discard_speculation()
            raise ValueError(f"non-finite gradient norm ({norm}): a NaN or Inf gradient reached the optimizer, first in "
                             f"{_first_non_finite(model_chunks)}; no optimizer state was changed. Lower the learning "
                             "rate or skip this batch (megatron's check_for_nan_in_grad stops at the source).")
        unclipped = clip <= 0.0 or clip / (norm + 1.0e-6) >= 1.0 + 1.0e-5  # the margin covers fp32 rounding
        if not unclipped:  # megatron's clip writes the gradients next, which the side stream may still read
            self.join_newton_schulz()
        self._settle_speculation(unclipped or self._carried)

    def _update_regardless_of_the_norm(self, grad_norm: torch.Tensor) -> None:
        """`next_step` where the update does not depend on the norm's value (no clip, or its factor carried): the
        speculation holds and nothing is read on the host; the next step checks the norm (`nonfinite_check`)."""
        self._pending_norms.append(PendingNorm(grad_norm))
        if self.config.clip_grad > 0.0:  # megatron's tensor clip scales the gradients that the side stream reads
            self.join_newton_schulz()
        self._settle_speculation(True)

    def _settle_speculation(self, valid: bool) -> None:
        """This step's speculative updates hold (`valid`) or are recomputed; after a step that could not keep them,
        the next one waits for its clip factor."""
        self._last_step_clipped = not valid
        self._carried = False
        for engine in self.engines:
            engine.speculation_valid = valid


def _first_non_finite(model_chunks) -> str:
    """The first parameter (by name, over every rank; collective) whose reduced gradient holds a NaN or Inf."""
    local = None
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            if grad is not None and not bool(torch.isfinite(grad).all()):
                local = f"{name} (shape {tuple(param.shape)})"
                break
        if local:
            break
    found = [local]
    if torch.distributed.is_initialized():
        found = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(found, local)
    return next((f for f in found if f), "a parameter whose gradient was not kept")
