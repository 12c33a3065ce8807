"""megatron DDP gradient sync for `dist_muon`: Muon gradients reduce-scattered to their owners, the rest all-reduced.

megatron's DDP (without its distributed optimizer) all-reduces every bucket. For each bucket group that holds
Muon matrices we take over `start_grad_sync` / `finish_grad_sync` (the methods DDP's backward hooks and
`finalize_model_grads` call, so `overlap_grad_reduce` keeps launching each group as soon as its gradients are
ready): the Muon gradients go to their owner's data-parallel row through one `OwnerReduceScatter`, the other
gradients of the group (AdamW / scalar parameters) through one all-reduce of a packed buffer. Bytes moved per step
are derived in `megatron_muon.distributed.grad_reduce`; each engine's `comm_counter` records them.

Because non-owner rows then hold zeros for a matrix, the Muon wrapper's gradient statistics (norm for clipping,
zero count) are reduced over the whole world instead of the model-parallel group: every matrix counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_muon.distributed.grad_reduce import OwnerReduceScatter
from megatron_muon.distributed.owner_muon import OwnerMuon


def _wrappers_with_engines(optimizer) -> list:
    """The megatron optimizer wrappers (FP32Optimizer / Float16OptimizerWithFloat16Params) around an OwnerMuon."""
    children = getattr(optimizer, "chained_optimizers", None)
    if children is not None:
        return [w for child in children for w in _wrappers_with_engines(child)]
    return [optimizer] if isinstance(getattr(optimizer, "optimizer", None), OwnerMuon) else []


def _model_param_of(wrapper) -> dict[int, torch.Tensor]:
    """id(parameter the engine updates) -> the model parameter whose DDP gradient buffer feeds it."""
    mapping = {}
    for model_group, main_group in zip(getattr(wrapper, "float16_groups", []),
                                       getattr(wrapper, "fp32_from_float16_groups", [])):
        mapping.update({id(main): model for model, main in zip(model_group, main_group)})
    for group in wrapper.optimizer.param_groups:
        for param in group["params"]:
            mapping.setdefault(id(param), param)
    return mapping


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def collective_group(bucket_group):
    """The data-parallel group DDP reduces a bucket group over (named differently for the distributed optimizer)."""
    if bucket_group.ddp_config.use_distributed_optimizer:
        return bucket_group.intra_distributed_optimizer_instance_group
    return bucket_group.data_parallel_group


class OwnedBucketGroupSync:
    """Gradient sync of one DDP bucket group: Muon views reduce-scattered to owners, the rest all-reduced."""

    def __init__(self, bucket_group, muon_reduce: OwnerReduceScatter, muon_params: set, counter):
        self.group, self.muon_reduce, self.counter = bucket_group, muon_reduce, counter
        self.rest = []  # contiguous grad_data ranges of the group's other parameters
        for bucket in bucket_group.buckets:
            ranges = sorted(bucket.param_to_index[p] for p in bucket.params_list if p not in muon_params)
            for start, end in ranges:
                if self.rest and self.rest[-1][0] is bucket.grad_data and self.rest[-1][2] == start:
                    self.rest[-1] = (bucket.grad_data, self.rest[-1][1], end)
                else:
                    self.rest.append((bucket.grad_data, start, end))
        self._rest_pending = None

    def install(self) -> None:
        self.group.start_grad_sync = self.start_grad_sync
        self.group.finish_grad_sync = self.finish_grad_sync

    def start_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        group, config = self.group, self.group.ddp_config
        if group.is_first_batch and group.grad_reduce_handle is not None:
            return  # already launched by the backward hooks of the first batch
        assert group.grad_reduce_handle is None, "gradient sync launched twice in one step"
        for bucket in group.buckets:
            for param in bucket.params_with_extra_main_grads:
                if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                    param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)
        if config.check_for_nan_in_grad or config.check_for_large_grads:
            group.check_grads(check_for_nan_or_inf=config.check_for_nan_in_grad,
                              check_for_large=config.check_for_large_grads)
        with torch.no_grad():
            for bucket in group.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
        op = dist.ReduceOp.AVG if config.average_in_collective else dist.ReduceOp.SUM
        async_op = config.overlap_grad_reduce
        if self.rest:
            flat = torch.cat([data[start:end] for data, start, end in self.rest])
            handle = dist.all_reduce(flat, op=op, group=collective_group(group), async_op=async_op)
            self.counter.record("grad_all_reduce", flat.numel(), flat.element_size())
            self._rest_pending = (handle, flat)
        self.muon_reduce.launch(op, async_op=async_op, everywhere=bool(force_all_reduce))
        if async_op:
            group.grad_reduce_handle = self
        else:
            self.wait()

    def wait(self) -> None:
        """Complete both collectives and put the reduced gradients in place (DDP calls it as the group's handle)."""
        if self._rest_pending is not None:
            handle, flat = self._rest_pending
            self._rest_pending = None
            if handle is not None:
                handle.wait()
            offset = 0
            for data, start, end in self.rest:
                data[start:end].copy_(flat[offset : offset + end - start])
                offset += end - start
        self.muon_reduce.finish()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        group = self.group
        group.param_gather_dispatched = False
        if not group.ddp_config.overlap_grad_reduce:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
            group._copy_back_extra_main_grads()
            return
        if group.grad_reduce_finished:
            return
        if group.is_first_batch:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        assert group.grad_reduce_handle is not None, "gradient sync of a bucket group was never launched"
        group.grad_reduce_handle.wait()
        group.grad_reduce_handle = None
        group._copy_back_extra_main_grads()
        group.grad_reduce_finished = True


def _buffer_locations(model_chunks) -> dict[torch.Tensor, tuple]:
    """model parameter -> (bucket group, its gradient's place in the DDP buffer)."""
    where = {}
    for chunk in model_chunks:
        for bucket_group in getattr(chunk, "bucket_groups", []) + getattr(chunk, "expert_parallel_bucket_groups", []):
            for bucket in bucket_group.buckets:
                for param in bucket.params_list:
                    start, end = bucket.param_to_index[param]
                    where[param] = (bucket_group, bucket.grad_data[start:end].view(param.shape))
    return where


def install_owner_grad_sync(optimizer, model_chunks) -> list[OwnedBucketGroupSync]:
    """Route the Muon gradients of `model_chunks` (megatron DDP modules) to their owners in `optimizer`'s engines.

    Collective over the world (every rank builds its optimizer at the same time). Returns the installed syncs.
    Where some rank has no OwnerMuon with data parallelism (a pipeline stage without Muon matrices), every rank
    keeps megatron's all-reduce, so the world-wide gradient statistics stay matched.
    """
    wrappers = _wrappers_with_engines(optimizer)
    for wrapper in wrappers:  # the plan (and the engine's dense or expert grid) is fixed from here on
        wrapper.optimizer.freeze_plan()
    wrappers = [w for w in wrappers if w.optimizer.grid.dp_size > 1]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([1 if wrappers else 0], dtype=torch.int64, device=device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not int(flag):
        return []
    where = _buffer_locations(model_chunks)
    syncs, taken = [], set()
    for wrapper in wrappers:
        engine = wrapper.optimizer
        model_param = _model_param_of(wrapper)
        params = engine.managed_parameters()
        missing = [i for i, p in enumerate(params) if model_param.get(id(p)) not in where]
        if missing:
            raise ValueError(f"{len(missing)} Muon parameters have no gradient buffer in the DDP model chunks passed "
                             "to the optimizer factory; wrap every model chunk in megatron's DistributedDataParallel")
        located = [where[model_param[id(p)]] for p in params]
        views = engine.unit_views([buffer_view for _, buffer_view in located])
        rows = engine.owner_rows()
        by_group: dict[int, tuple] = {}
        for u, param_index in enumerate(engine.unit_param_indices()):
            bucket_group = located[param_index][0]
            entry = by_group.setdefault(id(bucket_group), (bucket_group, [], [], set()))
            entry[1].append(views[u])
            entry[2].append(rows[u])
            entry[3].add(model_param[id(params[param_index])])
        for bucket_group, group_views, group_rows, muon_params in by_group.values():
            assert id(bucket_group) not in taken, "two Muon engines share one DDP bucket group"
            taken.add(id(bucket_group))
            if _ranks(collective_group(bucket_group)) != _ranks(engine.grid.dp_group):
                raise ValueError("the DDP bucket group and dist_muon disagree on the data-parallel group; build DDP "
                                 "and the optimizer from the same parallel state (pg_collection)")
            reduce = OwnerReduceScatter(group_views, group_rows, collective_group(bucket_group),
                                        engine.comm_counter)
            sync = OwnedBucketGroupSync(bucket_group, reduce, muon_params, engine.comm_counter)
            sync.install()
            syncs.append(sync)
        wrapper.grad_stats_parallel_group = dist.group.WORLD
    return syncs


def muon_bucket_groups(optimizer, model_chunks) -> list:
    """The DDP bucket groups holding parameters that `optimizer`'s OwnerMuon engines update."""
    where = _buffer_locations(model_chunks)
    found = {}
    for wrapper in _wrappers_with_engines(optimizer):
        model_param = _model_param_of(wrapper)
        for param in wrapper.optimizer.managed_parameters():
            located = where.get(model_param.get(id(param)))
            if located is not None:
                found[id(located[0])] = located[0]
    return list(found.values())
