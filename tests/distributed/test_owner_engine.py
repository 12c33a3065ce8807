"""The owner engine's behaviour beyond parity: Newton–Schulz inside the backward, what a clipped step does with it,
memory per rank against distributed AdamW, and the errors for inputs it cannot take (CPU, gloo)."""

import contextlib

import pytest
import torch

from tests.distributed.dist_training import OVERLAP, build, owner_optimizers, train_step
from tests.megatron.muon_training import one_thread


def _wave_order(rank, world_size):
    with one_thread():
        model, optimizer = build(1, 1, "dist_muon", "fp32", "gpt", clip_grad=0.0, ddp_overrides=OVERLAP)
        owner = owner_optimizers(optimizer)[0]
        owner.newton_schulz_start = "bucket"
        for step in range(3):
            train_step(model, optimizer, step)
        return {"log": list(owner.wave_log), "waves": len(owner._waves),
                "used": sum(e.speculation_used for e in owner.engines)}


def test_newton_schulz_starts_before_the_last_bucket_is_reduced(rank_pool_2):
    """Per step the hooks see bucket k's reduce-scatter launched, orthogonalize its matrices, and only then does the
    backward reach the next bucket: some Newton–Schulz runs before the last bucket's gradients are reduced."""
    for result in rank_pool_2.run(_wave_order):
        waves = result["waves"]
        assert waves >= 2, "the test needs several buckets"
        step = result["log"][-2 * waves:]  # the last step: every wave reduced, then speculated
        assert [kind for kind, _ in step] == ["reduced", "speculated"] * waves
        first_done = next(i for i, (kind, _) in enumerate(step) if kind == "speculated")
        last_reduced = max(i for i, (kind, _) in enumerate(step) if kind == "reduced")
        assert first_done < last_reduced
        assert result["used"] > 0


def _clipped_pair(rank, world_size):
    """The same engine with and without NS in the backward, under a clip that fires every step; `surprised`: every
    step is the first clipped one after unclipped steps (the engine speculates), `settled`: the engine's own policy
    (after a clipped step it waits for the clip factor)."""
    from megatron_muon.testing.training import full_parameters

    runs = {}
    with one_thread():
        for name in ("surprised", "settled", "after"):
            model, optimizer = build(1, 1, "dist_muon", "fp32", "gpt", clip_grad=1e-3, ddp_overrides=OVERLAP)
            owner = owner_optimizers(optimizer)[0]
            owner.newton_schulz_start = "step" if name == "after" else "bucket"
            losses = []
            for step in range(3):
                if name == "surprised":
                    owner._last_step_clipped = False
                losses.append(train_step(model, optimizer, step))
            runs[name] = {"losses": losses, "params": full_parameters(model),
                          "used": sum(e.speculation_used for e in owner.engines),
                          "discarded": sum(e.speculation_discarded for e in owner.engines)}
    return runs


def test_a_clipped_step_recomputes_what_the_backward_speculated(rank_pool_2):
    from megatron_muon.testing.training import max_relative_error

    for result in rank_pool_2.run(_clipped_pair):
        surprised, settled, after = result["surprised"], result["settled"], result["after"]
        assert surprised["used"] == 0 and surprised["discarded"] > 0
        assert settled["used"] == settled["discarded"] == 0, "after a clipped step nothing is speculated"
        assert after["used"] == after["discarded"] == 0
        for run in (surprised, settled):
            assert run["losses"] == after["losses"]
            assert max_relative_error(after["params"], run["params"])[1] == 0.0


def _starts(rank, world_size, clip_grad, nonfinite_check="before_update"):
    """One run per place where Newton–Schulz starts (in the backward per bucket, at its end batched, in the step)."""
    from megatron_muon.megatron.owner_optimizer import NEWTON_SCHULZ_STARTS
    from megatron_muon.testing.training import full_parameters

    runs = {}
    with one_thread():
        for start in NEWTON_SCHULZ_STARTS:
            model, optimizer = build(1, 1, "dist_muon", "fp32", "gpt", clip_grad=clip_grad, ddp_overrides=OVERLAP)
            owner = owner_optimizers(optimizer)[0]
            owner.newton_schulz_start = start
            owner.nonfinite_check = nonfinite_check
            losses = [train_step(model, optimizer, step) for step in range(3)]
            runs[start] = {"losses": losses, "params": full_parameters(model), "log": list(owner.wave_log),
                           "used": sum(e.speculation_used for e in owner.engines),
                           "discarded": sum(e.speculation_discarded for e in owner.engines)}
    return runs


@pytest.mark.parametrize("nonfinite_check", ["before_update", "next_step"])
@pytest.mark.parametrize("clip_grad", [0.0, 1e-3])
def test_every_newton_schulz_start_trains_to_the_steps_parameters_bit_for_bit(rank_pool_2, clip_grad, nonfinite_check):
    """`backward_end` speculates every owned matrix once per step (batched by shape, before the host reads the
    norm) and the step uses it, clipped or not (under clipping it takes the clip factor in); `bucket` and
    `backward_end` end where `step` ends, bit for bit, whichever step checks the norm for NaN."""
    from megatron_muon.testing.training import max_relative_error

    for result in rank_pool_2.run(_starts, clip_grad, nonfinite_check):
        step, batched = result["step"], result["backward_end"]
        assert step["used"] == step["discarded"] == 0 and not step["log"]
        assert [kind for kind, wave in batched["log"]] == ["speculated"] * len(batched["log"])
        assert all(wave is None for _, wave in batched["log"])
        assert len(batched["log"]) == 3 and batched["used"] > 0 and batched["discarded"] == 0
        for start in ("bucket", "backward_end"):
            assert result[start]["losses"] == step["losses"], start
            assert max_relative_error(step["params"], result[start]["params"])[1] == 0.0, start


def _clipped_starts(rank, world_size, tp, pp, model):
    """`backward_end` (speculation carrying the clip factor) against `step` under a clip that fires every step."""
    from megatron_muon.testing.training import full_parameters

    runs = {}
    with one_thread():
        for start in ("backward_end", "step"):
            built, optimizer = build(tp, pp, "dist_muon", "fp32", model, clip_grad=1e-3, ddp_overrides=OVERLAP)
            owner = owner_optimizers(optimizer)[0]
            owner.newton_schulz_start = start
            losses, used = [], []  # used: buckets taken from the speculation, after each step
            for step in range(3):
                losses.append(train_step(built, optimizer, step))
                used.append(sum(e.speculation_used for e in owner.engines))
            runs[start] = {"losses": losses, "params": full_parameters(built), "used": used,
                           "owned": sum(p.numel() for e in owner.engines for g in e.param_groups for p in g["params"]),
                           "discarded": sum(e.speculation_discarded for e in owner.engines)}
    return runs


@pytest.mark.parametrize("tp,pp,model", [(2, 1, "gpt"), (1, 2, "gpt"), (1, 1, "hybrid"), (2, 1, "hybrid")])
def test_clipped_steps_use_their_speculation_on_every_layout(rank_pool_4, tp, pp, model):
    """Under clipping the backward-end speculation takes the step's clip factor in: used on every step, never
    discarded, and the parameters are the `step` start's bit for bit, with tensor and pipeline parallelism."""
    from megatron_muon.testing.training import max_relative_error

    for result in rank_pool_4.run(_clipped_starts, tp, pp, model):
        ahead, step = result["backward_end"], result["step"]
        assert ahead["discarded"] == 0 and ahead["owned"] > 0
        assert all(now > before for before, now in zip([0, *ahead["used"]], ahead["used"])), ahead["used"]
        assert ahead["losses"] == step["losses"]
        assert max_relative_error(step["params"], ahead["params"])[1] == 0.0


def test_an_unknown_newton_schulz_start_names_the_choices():
    from megatron_muon.megatron.owner_optimizer import OwnerMuonOptimizer

    owner = OwnerMuonOptimizer.__new__(OwnerMuonOptimizer)
    with pytest.raises(ValueError, match="optimizer.muon_newton_schulz_start.*backward_end"):
        owner.newton_schulz_start = "forward"
    owner.overlap_newton_schulz = False
    assert owner.newton_schulz_start == "step" and not owner.overlap_newton_schulz


def _nonfinite_check_modes(rank, world_size, clip_grad):
    """The same three steps with the norm checked before the update (host read) and at the next step (none)."""
    from megatron_muon.testing.training import full_parameters

    runs = {}
    with one_thread():
        for check in ("before_update", "next_step"):
            model, optimizer = build(1, 1, "dist_muon", "fp32", "gpt", clip_grad=clip_grad, ddp_overrides=OVERLAP)
            owner_optimizers(optimizer)[0].nonfinite_check = check
            losses = [train_step(model, optimizer, step) for step in range(3)]
            runs[check] = {"losses": losses, "params": full_parameters(model)}
    return runs


@pytest.mark.parametrize("clip_grad", [0.0, 1e-3])
def test_the_norm_checked_next_step_trains_like_the_norm_read_before_the_update(rank_pool_2, clip_grad):
    """Unclipped the two checks train bit for bit alike; under a clip that fires, `next_step` clips by megatron's
    tensor arithmetic on the device (fp32 coefficient) instead of its double on the host: within fp32 rounding."""
    from megatron_muon.testing.training import max_relative_error

    for result in rank_pool_2.run(_nonfinite_check_modes, clip_grad):
        read, deferred = result["before_update"], result["next_step"]
        error = max_relative_error(read["params"], deferred["params"])[1]
        if clip_grad == 0.0:
            assert deferred["losses"] == read["losses"] and error == 0.0
        else:
            assert deferred["losses"] == pytest.approx(read["losses"], rel=1e-6) and error < 1e-5, error


class _HostReadForbidden(RuntimeError):
    pass


@contextlib.contextmanager
def _no_host_reads():
    """Every way of reading a tensor's value on the host raises inside the block, except torch's single-tensor
    AdamW reading its step count: the CPU stand-in for the fused GPU kernel, which keeps it on the device."""
    import sys

    names = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def forbidding(name):
        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:  # through torch-function dispatch back to the caller
                if frame.f_code.co_name == "_get_value" and "torch/optim/" in frame.f_code.co_filename:
                    return saved[name](self, *args, **kwargs)
                frame = frame.f_back
            raise _HostReadForbidden(f"a tensor value was read on the host ({name})")
        return read

    for name in names:
        setattr(torch.Tensor, name, forbidding(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _step_reads(rank, world_size, clip_grad, check, tp=1, pp=1, model_kind="gpt"):
    from megatron_muon.testing.models import forward_backward, synthetic_batch

    with one_thread():
        model, optimizer = build(tp, pp, "dist_muon", "fp32", model_kind, clip_grad=clip_grad, ddp_overrides=OVERLAP)
        owner = owner_optimizers(optimizer)[0]
        owner.nonfinite_check = check
        train_step(model, optimizer, 0)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(model, [synthetic_batch(20 + 2 * rank + i, micro_batch_size=2) for i in range(2)])
        owner.check_last_norms(wait=True)  # the last step's norm, which this step reads if it has arrived
        try:
            with _no_host_reads():
                optimizer.step()
        except _HostReadForbidden as error:
            import traceback

            return "".join(traceback.format_exception(error)[-6:])
        return None


@pytest.mark.parametrize("clip_grad", [0.0, 1.0])
def test_with_the_norm_checked_next_step_the_step_reads_nothing_on_the_host(rank_pool_2, clip_grad):
    """`next_step` queues the whole step without reading a tensor on the host (megatron's chain, the clip, AdamW and
    the owners' update); `before_update` reads the norm."""
    for read in rank_pool_2.run(_step_reads, clip_grad, "next_step"):
        assert read is None, read
    assert all(read is not None for read in rank_pool_2.run(_step_reads, clip_grad, "before_update"))


@pytest.mark.parametrize("tp,pp,model", [(2, 1, "hybrid"), (1, 2, "gpt")])
def test_the_next_step_check_reads_nothing_on_the_host_with_model_parallelism(rank_pool_4, tp, pp, model):
    for read in rank_pool_4.run(_step_reads, 1.0, "next_step", tp, pp, model):
        assert read is None, read


def _nan_reported_next_step(rank, world_size):
    from megatron_muon.testing.models import forward_backward, synthetic_batch

    with one_thread():
        model, optimizer = build(1, 1, "dist_muon", "fp32", "gpt", clip_grad=1.0, ddp_overrides=OVERLAP)
        owner = owner_optimizers(optimizer)[0]
        owner.nonfinite_check = "next_step"
        train_step(model, optimizer, 0)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(model, [synthetic_batch(8 + 2 * rank + i, micro_batch_size=2) for i in range(2)])
        dict(model.named_parameters())["module.decoder.layers.0.mlp.linear_fc2.weight"].main_grad[0, 0] = float("nan")
        optimizer.step()  # applied: its norm is read when the next step starts
        applied = not all(bool(torch.isfinite(p).all()) for p in model.parameters())
        try:
            train_step(model, optimizer, 2)
        except ValueError as error:
            return {"message": str(error), "applied": applied}
        return {"message": None, "applied": applied}


def test_with_the_norm_checked_next_step_a_nan_step_is_reported_by_the_next(rank_pool_2):
    for result in rank_pool_2.run(_nan_reported_next_step):
        assert result["applied"], "the NaN step was applied before its norm was read"
        assert result["message"] and "earlier optimizer step" in result["message"], result
        assert "before_update" in result["message"]


def _nan_stopped_by_megatrons_ddp_check(rank, world_size):
    from megatron_muon.testing.models import forward_backward, synthetic_batch

    with one_thread():
        model, optimizer = build(1, 1, "dist_muon", "fp32", "gpt", clip_grad=1.0,
                                 ddp_overrides={**OVERLAP, "check_for_nan_in_grad": True})
        owner = owner_optimizers(optimizer)[0]
        train_step(model, optimizer, 0)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        owned = [(engine, p) for engine in owner.engines for g in engine.param_groups for p in g["params"]]
        momenta = [engine._momentum_buffer(p).clone() for engine, p in owned]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        weight = dict(model.named_parameters())["module.decoder.layers.0.mlp.linear_fc2.weight"]
        poison = weight.register_hook(lambda grad: grad * float("nan"))  # on every rank: none waits in a collective
        message = None
        try:
            forward_backward(model, [synthetic_batch(8 + 2 * rank + i, micro_batch_size=2) for i in range(2)])
            optimizer.step()
        except RuntimeError as error:
            message = str(error)
        poison.remove()
        unchanged = all(torch.equal(before[name], p) for name, p in model.named_parameters()) and all(
            torch.equal(m, engine._momentum_buffer(p)) for m, (engine, p) in zip(momenta, owned))
        return {"check": owner.nonfinite_check, "message": message, "unchanged": unchanged}


def test_auto_trusts_megatrons_ddp_nan_check_which_stops_a_nan_gradient_before_any_update(rank_pool_2):
    """With megatron's `check_for_nan_in_grad` on, `auto` drops the host's read of the norm before the update: the
    NaN gradient stops the step in the backward, before its bucket's reduce-scatter, with nothing updated."""
    for result in rank_pool_2.run(_nan_stopped_by_megatrons_ddp_check):
        assert result["check"] == "next_step"
        assert result["message"] and "found NaN in local grad norm" in result["message"], result
        assert result["unchanged"], "a parameter or momentum changed although the step was stopped"


def test_auto_resolves_from_the_ddp_config_of_every_chunk():
    from types import SimpleNamespace

    from megatron_muon.megatron.nonfinite_check import resolve_nonfinite_check

    def chunk(checked):
        return SimpleNamespace(ddp_config=SimpleNamespace(check_for_nan_in_grad=checked))

    assert resolve_nonfinite_check("auto", [chunk(True), chunk(True)]) == "next_step"
    assert resolve_nonfinite_check("auto", [chunk(True), chunk(False)]) == "before_update"
    assert resolve_nonfinite_check("auto", []) == "before_update"  # no chunks: nothing known to check
    assert resolve_nonfinite_check("auto", [object()]) == "before_update"  # not DDP-wrapped
    assert resolve_nonfinite_check("before_update", [chunk(True)]) == "before_update"
    assert resolve_nonfinite_check("next_step", []) == "next_step"


def test_pending_norms_are_checked_once_they_arrive_and_all_before_a_save():
    from megatron_muon.megatron.nonfinite_check import raise_if_a_norm_was_non_finite

    class Norm:
        def __init__(self, value, arrived):
            self._value, self._arrived, self.reads = value, arrived, 0

        def arrived(self):
            return self._arrived

        def value(self):
            self.reads += 1
            return self._value

    here, on_the_way = Norm(1.0, True), Norm(float("nan"), False)
    assert raise_if_a_norm_was_non_finite([here, on_the_way], wait=False) == [on_the_way]
    assert (here.reads, on_the_way.reads) == (1, 0)
    with pytest.raises(ValueError, match="non-finite gradient norm \\(nan\\) at an earlier optimizer step"):
        raise_if_a_norm_was_non_finite([on_the_way], wait=True)  # a checkpoint save waits for every norm
    assert raise_if_a_norm_was_non_finite([Norm(2.0, False)], wait=True) == []


def test_an_unknown_nonfinite_check_names_the_choices():
    from megatron_muon.megatron.nonfinite_check import check_nonfinite_choice

    with pytest.raises(ValueError, match="optimizer.muon_nonfinite_check.*auto.*before_update.*next_step"):
        check_nonfinite_choice("never")


def _memory(rank, world_size, name, precision):
    from megatron_muon.metrics.memory import measured_memory, predicted_memory
    from megatron_muon.testing.parallel import init_model_parallel
    from megatron_muon.testing.training import build_training_setup

    with one_thread():
        if name == "adam":
            init_model_parallel(tp=1)
            model, optimizer = build_training_setup("adam", bf16=precision == "bf16", use_distributed_optimizer=True,
                                                    clip_grad=0.0)
        else:
            model, optimizer = build(1, 1, name, precision, "gpt", clip_grad=0.0)
        train_step(model, optimizer, 0)
        from megatron.core import parallel_state as ps

        measured = measured_memory([model], optimizer)
        predicted = predicted_memory(model.full_param_layout, ps.get_data_parallel_rank(),
                                     ps.get_data_parallel_world_size(), param_bytes=2 if precision == "bf16" else 4)
        return {"measured": measured.as_dict(), "predicted": predicted.as_dict()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_muons_busiest_rank_holds_no_more_than_distributed_adamws(rank_pool_2, rank_pool_4, world, precision):
    """Measured from the tensors after a step: Muon's state (masters and momentum on owners only) against megatron's
    distributed AdamW (masters and two moments per shard); the layout-based prediction matches the tensors."""
    pool = {2: rank_pool_2, 4: rank_pool_4}[world]
    muon = pool.run(_memory, "dist_muon", precision)
    adam = pool.run(_memory, "adam", precision)

    def busiest(results):
        return max(sum(r["measured"][k] for k in ("optimizer_state_bytes", "param_bytes", "grad_bytes"))
                   for r in results)

    assert busiest(muon) <= busiest(adam)
    assert max(r["measured"]["optimizer_state_bytes"] for r in muon) < max(
        r["measured"]["optimizer_state_bytes"] for r in adam)
    for result in muon + adam:
        for key in ("optimizer_state_bytes", "param_bytes", "grad_bytes"):
            assert result["measured"][key] == result["predicted"][key], (key, result)


def _nan_gradient(rank, world_size):
    from megatron_muon.testing.models import forward_backward, synthetic_batch

    with one_thread():  # Newton–Schulz in the backward: the NaN step has speculated updates to throw away
        model, optimizer = build(1, 1, "dist_muon", "fp32", "gpt", clip_grad=0.0, ddp_overrides=OVERLAP)
        owner_optimizers(optimizer)[0].newton_schulz_start = "bucket"
        train_step(model, optimizer, 0)  # megatron's DDP reduces its first backward's buckets only at the end
        engines = owner_optimizers(optimizer)[0].engines
        speculated_before = sum(e.speculated_buckets for e in engines)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(model, [synthetic_batch(8 + 2 * rank + i, micro_batch_size=2) for i in range(2)])  # as step 0
        named = dict(model.named_parameters())  # on every rank, so the owner's reduced copy holds it
        named["module.decoder.layers.0.mlp.linear_fc2.weight"].main_grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        speculated = sum(e.speculated_buckets for e in engines) - speculated_before
        try:
            optimizer.step()
        except ValueError as error:
            return {"message": str(error), "unchanged": all(torch.equal(a, p) for a, p in zip(before, model.parameters())),
                    "speculated": speculated, "left_over": sum(len(e._prepared) for e in engines)}
        return {"message": None}


def test_a_nan_gradient_stops_the_step_on_every_rank_naming_the_parameter(rank_pool_2):
    for result in rank_pool_2.run(_nan_gradient):
        assert result["message"] and "non-finite" in result["message"], result
        assert "linear_fc2" in result["message"] and result["unchanged"]
        assert result["speculated"] > 0 and result["left_over"] == 0  # nothing speculated from NaNs waits for a step


def _bad_layout(rank, world_size, case):
    from megatron_muon.testing import training

    original = training.wrap_in_ddp

    def wrap(model, config, **kwargs):
        if case == "split":  # megatron's byte-level distributed-optimizer layout: matrices cross shard boundaries
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
            from megatron.core.optimizer.param_layout import FullParamLayout

            from megatron_muon.megatron.owner_layout import tag_params_for_owner_buffers

            tag_params_for_owner_buffers([model])
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
            params = [p for p in model.parameters() if p.requires_grad]
            layouts = {key: DistributedOptimizer._compute_per_buffer_param_layout(group, None, world_size, ddp_config,
                                                                                   indices)
                       for key, (group, indices) in group_params_for_buffers(params, True).items()}
            for key, layout in layouts.items():  # shift the Muon matrices off the shard boundaries
                if key.is_managed_by_layer_wise_optimizer:
                    layout.param_index_map = {p: (a + 64, b + 64, k) for p, (a, b, k) in layout.param_index_map.items()}
                    layout.bucket_indices = [(a, b + 256) for a, b in layout.bucket_indices]
            return DistributedDataParallel(config, ddp_config, model, full_param_layout=FullParamLayout(layouts))
        if case == "disagree" and rank == 1:  # one replica cuts its buffer into other buckets
            kwargs.update(overlap_grad_reduce=True, bucket_size=6000)
        return original(model, config, **kwargs)

    training.wrap_in_ddp = wrap
    try:
        with one_thread():
            build(1, 1, "dist_muon", "fp32", "gpt")
    except ValueError as error:
        return str(error)
    finally:
        training.wrap_in_ddp = original
    return None


@pytest.mark.parametrize("case,expected", [("split", "crosses a data-parallel shard boundary"),
                                           ("disagree", "disagree on the Muon buffers' layout")])
def test_layouts_the_engine_cannot_run_on_are_refused_with_the_fix(rank_pool_2, case, expected):
    for message in rank_pool_2.run(_bad_layout, case):
        assert message is not None and expected in message and "compute_full_param_layout" in message, message
