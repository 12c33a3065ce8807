"""Rank functions for the dist_muon tests: tiny GPT / GDN-hybrid trained through megatron's optimizer factory."""

from __future__ import annotations

import contextlib

import torch

from megatron_muon.testing.parallel import init_model_parallel, layout
from megatron_muon.testing.training import (  # noqa: F401  (merged_params, max_relative_error: used by the tests)
    build_muon_setup,
    full_parameters,
    max_relative_error,
    merged_params,
    train_step,
)
from tests.megatron.muon_training import one_thread


def owner_optimizers(optimizer) -> list:
    """The OwnerMuonOptimizer members of a megatron optimizer chain."""
    from megatron_muon.megatron.owner_optimizer import OwnerMuonOptimizer

    return [c for c in getattr(optimizer, "chained_optimizers", []) if isinstance(c, OwnerMuonOptimizer)]


def owner_engines(optimizer) -> list:
    """The WaveMuon engines of the owner optimizers in a megatron optimizer chain."""
    return [engine for owner in owner_optimizers(optimizer) for engine in owner.engines]


def build(tp: int, pp: int, name: str, precision: str, model: str, lr: float = 0.01, clip_grad: float | None = None,
          ddp_overrides: dict | None = None):
    """The tiny model and optimizer `name` on a fresh (tp, pp) layout of the pool's world."""
    init_model_parallel(tp=tp, pp=pp)
    return build_muon_setup(name, precision, model, lr=lr, clip_grad=clip_grad, ddp_overrides=ddp_overrides)


OVERLAP = {"overlap_grad_reduce": True, "bucket_size": 6000}  # several buckets, each reduced during the backward


def train(rank, world_size, tp: int, pp: int, name: str, precision: str, model: str, steps: int,
          ddp_overrides: dict | None = None):
    """`steps` steps on a layout; returns losses, gathered full parameters (global names), NS counts, the
    speculation counters and the dtypes the Muon engines iterate Newton–Schulz in."""
    with one_thread():
        model_, optimizer = build(tp, pp, name, precision, model, ddp_overrides=ddp_overrides)
        losses = [train_step(model_, optimizer, step) for step in range(steps)]
        engines = owner_engines(optimizer)
        return {
            "losses": losses,
            "params": full_parameters(model_),
            "layout": layout(),
            "orthogonalized": sum(e.orthogonalized_matrices for e in engines),
            "speculation_used": sum(e.speculation_used for e in engines),
            "speculation_discarded": sum(e.speculation_discarded for e in engines),
            "owned": sum(p.numel() for e in engines for g in e.param_groups for p in g["params"]),
            "ns_dtypes": sorted({str(e.compute_dtype) for e in engines}),
        }


def train_with_a_wrong_scale_on_the_last_rank(rank, world_size, tp: int, pp: int, name: str, precision: str,
                                              model: str, steps: int, relative_error: float):
    """`train`, but the last rank scales its Muon updates by (1 + relative_error): a planted bug that a parity
    test must catch."""
    from megatron_muon.optimizer import muon_math

    correct = muon_math.update_scale
    if rank == world_size - 1:
        muon_math.update_scale = lambda *args, **kwargs: correct(*args, **kwargs) * (1.0 + relative_error)
    try:
        return train(rank, world_size, tp, pp, name, precision, model, steps)
    finally:  # the pool's ranks outlive this call
        muon_math.update_scale = correct


@contextlib.contextmanager
def counted_collectives(counts: dict, group):
    """Elements each torch.distributed collective over `group` is handed, by name (scalars left out)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)

    names = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "all_to_all_single")
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def collective(*args, **kwargs):
            tensor = args[1] if name in ("reduce_scatter_tensor", "all_gather_into_tensor") else args[0]
            numel = sum(t.numel() for t in tensor) if isinstance(tensor, list) else tensor.numel()
            used = kwargs.get("group")
            if numel > 8 and used is not None and dist.get_process_group_ranks(used) == ranks:
                counts[name] = counts.get(name, 0) + numel
            return originals[name](*args, **kwargs)
        return collective

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _muon_piece_count(optimizer) -> int:
    """Matrices megatron_muon.optimizer.Muon orthogonalizes per step on this rank (its own bucket plan)."""
    from megatron_muon.testing.training import muon_engines

    total = 0
    for muon in muon_engines(optimizer):
        plan = muon._plan_cache[1]
        for bucket in plan.buckets:
            for index, piece in bucket.items:
                total += plan.layouts[index].num_experts
    return total


def train_pair(rank, world_size, tp: int, pp: int, precision: str, model: str, steps: int, clip_grad: float = 1.0,
               ddp_overrides: dict | None = None, newton_schulz_start: str | None = None):
    """dist_muon and muon from the same initial weights on the same layout and batches; also what each step handed
    to data-parallel collectives (after a first step) and the gradient norm megatron reports. `newton_schulz_start`
    (None: the engine's default) is where dist_muon's owners start Newton–Schulz."""
    from megatron.core import parallel_state as ps

    results = {}
    with one_thread():
        for name in ("dist_muon", "muon"):
            model_, optimizer = build(tp, pp, name, precision, model, clip_grad=clip_grad,
                                      ddp_overrides=ddp_overrides if name == "dist_muon" else None)
            norms, step_ = [], optimizer.step

            def step_and_record_norm():
                outcome = step_()
                norms.append(float(outcome[1]))
                return outcome

            optimizer.step = step_and_record_norm
            engines = owner_engines(optimizer)
            for owner in owner_optimizers(optimizer):
                owner.newton_schulz_start = newton_schulz_start or owner.newton_schulz_start
            losses = [train_step(model_, optimizer, 0)]
            counts: dict = {}
            with counted_collectives(counts, ps.get_data_parallel_group()):
                losses += [train_step(model_, optimizer, step) for step in range(1, steps)]
            results[name] = {
                "losses": losses,
                "params": full_parameters(model_),
                "orthogonalized": sum(e.orthogonalized_matrices for e in engines),
                "speculation_used": sum(e.speculation_used for e in engines),
                "grad_norms": norms,
                "collective_numel_per_step": {k: v / (steps - 1) for k, v in counts.items()},
                "param_numel": sum(p.numel() for p in model_.parameters() if p.requires_grad),
            }
            if name == "muon":  # one replica of each stage counts its matrices once
                first_replica = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                results["matrices_per_step"] = _muon_piece_count(optimizer) if first_replica else 0
    results["layout"] = layout()
    return results


def checkpoint_then_continue(rank, world_size, tp: int, directory: str, save_at: int, total: int,
                             load: bool, drop_momentum: bool = False):
    """Either train `save_at` steps, save, and keep going to `total`; or load the checkpoint and train the rest."""
    from megatron_muon.megatron.checkpointing import load_checkpoint, save_checkpoint

    with one_thread():
        model_, optimizer = build(tp, 1, "dist_muon", "fp32", "gpt")
        if load:
            load_checkpoint(model_, optimizer, directory)
            if drop_momentum:
                for engine in owner_engines(optimizer):
                    for state in engine.state.values():
                        state["momentum_buffer"].zero_()
            steps = range(save_at, total)
        else:
            for step in range(save_at):
                train_step(model_, optimizer, step)
            save_checkpoint(model_, optimizer, directory)
            steps = range(save_at, total)
        losses = [train_step(model_, optimizer, step) for step in steps]
        return {"losses": losses, "params": full_parameters(model_), "layout": layout()}


def interrupted_save(rank, world_size, directory: str):
    """Train a step, then fail inside the save (after the momentum export, mid-write); report what is on disk."""
    from megatron.core import dist_checkpointing

    from megatron_muon.megatron import checkpointing

    with one_thread():
        model_, optimizer = build(1, 1, "dist_muon", "fp32", "gpt")
        train_step(model_, optimizer, 0)
        real_save = dist_checkpointing.save

        def failing_save(state, path, *args, **kwargs):
            real_save(state, path, *args, **kwargs)  # everything written...
            raise OSError("simulated failure while finalizing the checkpoint")

        dist_checkpointing.save = failing_save
        try:
            checkpointing.save_checkpoint(model_, optimizer, directory)
            raised = False
        except OSError:
            raised = True
        finally:
            dist_checkpointing.save = real_save
        torch.distributed.barrier()
        try:
            checkpointing.load_checkpoint(model_, optimizer, directory)
            loadable = True
        except ValueError:
            loadable = False
        return {"raised": raised, "loadable": loadable, "complete": checkpointing.is_complete_checkpoint(directory)}
