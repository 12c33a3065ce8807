"""Run under TRITON_INTERPRET=1 in a subprocess: the fused elementwise passes on CPU against the torch sequence.

Momentum: bit-exact for every dtype mix (the interpreter kernels emulate the GPU's fma and bf16 rounding, and
torch's CPU lerp is an fma too). Decay + update: bit-exact with the torch path for fp32 parameters and with a
one-fma fp32 reference for all; 16-bit parameters stay near the torch path, whose CPU add rounds alpha to the
parameter's dtype (the kernel keeps alpha in fp32, as torch's CUDA add does).
"""

import itertools
import sys

import torch

from megatron_muon.optimizer.wave_muon import WaveMuon
from megatron_muon.optimizer import Muon, fused_elementwise, fused_pieces, muon_math
from megatron_muon.optimizer.routing import MatrixLayout, piece_views

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    if not ok:
        FAILURES.append(what)


def strided_pieces(dtype, generator, scale=1.0):
    """Same-shaped views of one fresh tensor: routing's 4-D fused-QKV piece (experts 2, groups 3), a 3-D slice
    with a row stride, and a 2-D view of every other row (cols not a power of two: masked tail)."""
    qkv = (torch.randn(2 * 3 * 9, 40, generator=generator) * scale).to(dtype)
    yield "qkv piece", qkv, lambda t: piece_views(t, MatrixLayout(num_experts=2, split_sections=(5, 2, 2)))[0]
    slab = (torch.randn(3, 12, 37, generator=generator) * scale).to(dtype)
    yield "3-D slice", slab, lambda t: t[:, 2:8]
    rows = (torch.randn(22, 33, generator=generator) * scale).to(dtype)
    yield "2-D every other row", rows, lambda t: t[::2]


def check_momentum(generator) -> None:
    mixes = list(itertools.product(DTYPES, (torch.float32, torch.bfloat16), DTYPES))
    cases = [(g, b, s, True, 0.95) for g, b, s in mixes]
    cases += [(torch.float32, torch.float32, torch.bfloat16, False, 0.95), (torch.bfloat16, torch.float32,
              torch.float16, False, 0.95), (torch.float32, torch.float32, torch.bfloat16, True, 0.3)]
    for grad_dtype, buffer_dtype, slot_dtype, nesterov, momentum in cases:
        grads = strided_pieces(grad_dtype, generator)
        buffers = strided_pieces(buffer_dtype, generator, scale=0.5)
        for (layout, grad_base, view), (_, buffer_base, _) in zip(grads, buffers):
            grad = view(grad_base)
            expected_base = buffer_base.clone()
            expected_buffer = view(expected_base)
            slot, expected_slot = (torch.empty(grad.shape, dtype=slot_dtype) for _ in range(2))
            muon_math.momentum_buffers_update_([grad], [expected_buffer], momentum)
            muon_math.nesterov_into_(grad, expected_buffer, expected_slot, momentum, nesterov)
            fused_elementwise.momentum_into_slot_(grad, view(buffer_base), slot, momentum=momentum, nesterov=nesterov)
            case = f"momentum {layout} grad {grad_dtype} buffer {buffer_dtype} slot {slot_dtype} nesterov {nesterov}"
            check(torch.equal(buffer_base, expected_base), f"{case}: buffer (incl. untouched rows) differs")
            check(torch.equal(slot, expected_slot), f"{case}: slot differs")


def check_decay_and_update(generator) -> None:
    for target_dtype, update_dtype, decay in [*itertools.product(DTYPES, DTYPES, (0.99,)),
                                              (torch.float32, torch.float16, 1.0)]:
        targets = strided_pieces(target_dtype, generator)
        for layout, target_base, view in targets:
            update = torch.randn(view(target_base).shape, generator=generator).to(update_dtype)
            expected_base = target_base.clone()
            view(expected_base).mul_(decay)
            exact_base = expected_base.clone()  # fp32 alpha, one fma: what torch's CUDA add computes
            alpha = torch.tensor(-0.02 * 1.7, dtype=torch.float32).double()
            view(exact_base).copy_(view(exact_base).double().add_(update.double() * alpha).float())
            muon_math.apply_updates_([view(expected_base)], [update], lr=0.02, scale=1.7)
            fused_elementwise.decay_and_update_(view(target_base), update, decay=decay, alpha=-0.02 * 1.7)
            case = f"decay+update {layout} target {target_dtype} update {update_dtype} decay {decay}"
            check(torch.equal(target_base, exact_base), f"{case}: not the one-fma result")
            if target_dtype == torch.float32:
                check(torch.equal(target_base, expected_base), f"{case}: not bit-exact with the torch path")
            else:  # torch's CPU add rounds alpha to the tensor dtype: allow that much more
                slack = (update.float() * alpha.float()).abs() * torch.finfo(target_dtype).eps
                gap = (target_base.float() - expected_base.float()).abs()
                ulp = torch.finfo(target_dtype).eps * target_base.float().abs()
                check(bool((view(gap) <= view(ulp) + slack).all()), f"{case}: further from the torch path than "
                      "one rounding plus the rounded alpha")


def check_clip_factor(generator) -> None:
    """A grad_factor gives what megatron's clip (grad *= factor, in the gradient's dtype) followed by the unfactored
    pass gives, bit for bit, per piece and in one launch; the gradient itself is left as it was."""
    factor = torch.tensor([0.37])
    for grad_dtype, buffer_dtype, slot_dtype in [(torch.float32, torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32, torch.float16)]:
        grads = [torch.randn(3, 12, 37, generator=generator).to(grad_dtype)[:, 2:8] for _ in range(3)]
        before = [g.clone() for g in grads]
        buffers = [torch.randn(3, 12, 37, generator=generator).to(buffer_dtype)[:, 2:8] for _ in range(3)]
        clipped = [g * factor.to(g.dtype) if g.dtype == torch.float32 else (g.float() * factor).to(g.dtype)
                   for g in grads]
        expected_buffers, piece_buffers = [b.clone() for b in buffers], [b.clone() for b in buffers]
        expected, piece_slots, stacked = (torch.empty(3, 3, 6, 37, dtype=slot_dtype) for _ in range(3))
        for grad, buffer, slot in zip(clipped, expected_buffers, expected):
            fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.95, nesterov=True)
        for grad, buffer, slot in zip(grads, piece_buffers, piece_slots):
            fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.95, nesterov=True, grad_factor=factor)
        done = fused_pieces.momentum_into_slots_(grads, buffers, list(stacked), momentum=0.95, nesterov=True,
                                                 grad_factor=factor)
        case = f"clip factor: grad {grad_dtype} buffer {buffer_dtype} slot {slot_dtype}"
        check(done, f"{case}: not taken as one launch")
        for got_buffers, got_slots, how in ((piece_buffers, piece_slots, "per piece"), (buffers, stacked, "pieces")):
            check(all(torch.equal(a, b) for a, b in zip(got_buffers, expected_buffers)), f"{case} {how}: buffers")
            check(torch.equal(got_slots, expected), f"{case} {how}: slots differ")
        check(all(torch.equal(a, b) for a, b in zip(grads, before)), f"{case}: the gradients were changed")


def check_speculative_slots(generator) -> None:
    """store_buffer=False writes the slots the storing pass writes and leaves the buffers as they were, per piece
    and in one launch (WaveMuon's speculation: the step stores the EMA itself later)."""
    for grad_dtype, buffer_dtype, slot_dtype in [(torch.float32, torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32, torch.float16),
                                                 (torch.float32, torch.bfloat16, torch.bfloat16)]:
        grads = [torch.randn(3, 12, 37, generator=generator).to(grad_dtype)[:, 2:8] for _ in range(3)]
        buffers = [torch.randn(3, 12, 37, generator=generator).to(buffer_dtype)[:, 2:8] for _ in range(3)]
        before = [b.clone() for b in buffers]
        expected = torch.empty(3, 3, 6, 37, dtype=slot_dtype)
        for grad, buffer, slot in zip(grads, [b.clone() for b in buffers], expected):
            fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.95, nesterov=True)
        piece_slots, stacked = torch.empty_like(expected), torch.empty_like(expected)
        for grad, buffer, slot in zip(grads, buffers, piece_slots):
            fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.95, nesterov=True,
                                                  store_buffer=False)
        done = fused_pieces.momentum_into_slots_(grads, buffers, list(stacked), momentum=0.95, nesterov=True,
                                                 store_buffer=False)
        case = f"speculative: grad {grad_dtype} buffer {buffer_dtype} slot {slot_dtype}"
        check(done, f"{case}: not taken as one launch")
        check(torch.equal(piece_slots, expected) and torch.equal(stacked, expected), f"{case}: slots differ")
        check(all(torch.equal(a, b) for a, b in zip(buffers, before)), f"{case}: a buffer was written")


def check_wave_speculation(generator, steps: int = 3) -> None:
    """WaveMuon's speculated step (fused, one pass that keeps the EMA out of the buffers) equals its plain fused
    step bit for bit, and the torch-path speculation too."""
    seed = int(torch.randint(1 << 30, (1,), generator=generator))
    results = {}
    for speculate, fused in ((False, True), (True, True), (True, False)):
        params = muon_params(torch.Generator().manual_seed(seed), torch.float32)
        engine = WaveMuon(params, lr=0.02, weight_decay=0.1, fused_elementwise=fused)
        grads = torch.Generator().manual_seed(seed + 1)
        for _ in range(steps):
            for param in params:
                param.grad = torch.randn(param.shape, generator=grads) * 1e-2
            if speculate:
                engine.speculate(None, lambda p: p.grad)
                engine.speculation_valid = True
            engine.step()
        results[speculate, fused] = (params, engine)
    plain = results[False, True][0]
    for key in ((True, True), (True, False)):
        params, engine = results[key]
        check(engine.speculation_used > 0, f"wave speculation {key}: nothing speculated was used")
        check(all(torch.equal(a, b) for a, b in zip(params, plain)), f"wave speculation {key}: parameters differ")


def clipped_wave_run(params, next_grad, factor, mode: str, speculate: bool, fused: bool, steps: int = 3):
    """WaveMuon over `params` for `steps` steps on gradients `next_grad(param)`, each clipped in place by `factor`
    as megatron's clip does; with `speculate`, the speculation is given the factor first (the owner engine's
    `backward_end` under clipping) and reads the gradients before the clip. Returns the engine."""
    engine = WaveMuon(params, lr=0.02, weight_decay=0.1, weight_decay_mode=mode, fused_elementwise=fused)
    for _ in range(steps):
        for param in params:
            param.grad = next_grad(param)
        if speculate:
            engine.speculate(None, lambda p: p.grad, grad_factor=factor)
            engine.speculation_valid = True
        for param in params:
            param.grad.mul_(factor.reshape(()))
        engine.step()
    return engine


def check_clipped_wave_speculation(generator) -> None:
    """The speculation given the clip factor, then megatron's clip, equals the plain fused step on the clipped
    gradients bit for bit, fused and on the torch path, with decoupled and with l2 weight decay."""
    factor = torch.tensor([0.37])
    for mode in ("decoupled", "l2"):
        seed = int(torch.randint(1 << 30, (1,), generator=generator))
        results = {}
        for speculate, fused in ((False, True), (True, True), (True, False)):
            params = muon_params(torch.Generator().manual_seed(seed), torch.float32)
            grads = torch.Generator().manual_seed(seed + 1)
            engine = clipped_wave_run(params, lambda p: torch.randn(p.shape, generator=grads) * 1e-2, factor, mode,
                                      speculate, fused)
            results[speculate, fused] = (params, engine)
        plain = results[False, True][0]
        for key in ((True, True), (True, False)):
            params, engine = results[key]
            case = f"clipped wave speculation {mode} {key}"
            check(engine.speculation_used > 0 and engine.speculation_discarded == 0, f"{case}: speculation not used")
            check(all(torch.equal(a, b) for a, b in zip(params, plain)), f"{case}: parameters differ")


def check_model_copies(generator) -> None:
    """With a 16-bit model copy, decay+update also writes the new target rounded as torch's copy_ rounds, per piece
    and in one launch; the update itself is the one without a copy, and the rest of the copy's tensor is untouched."""
    for model_dtype in (torch.bfloat16, torch.float16):
        targets = [torch.randn(3, 12, 37, generator=generator)[:, 2:8] for _ in range(3)]
        updates = torch.randn(3, 3, 6, 37, generator=generator).half()
        model_bases = [torch.randn(3, 12, 37, generator=generator).to(model_dtype) for _ in range(3)]
        expected_targets = [t.clone() for t in targets]
        for target, update in zip(expected_targets, updates):
            fused_elementwise.decay_and_update_(target, update, decay=0.99, alpha=-0.03)
        for how in ("per piece", "pieces"):
            got_targets = [t.clone() for t in targets]
            got_bases = [base.clone() for base in model_bases]
            models = [base[:, 2:8] for base in got_bases]
            if how == "pieces":
                check(fused_pieces.decay_and_update_pieces_(got_targets, list(updates), decay=0.99, alpha=-0.03,
                                                            models=models), f"model copy {model_dtype}: not one launch")
            else:
                for target, update, model in zip(got_targets, updates, models):
                    fused_elementwise.decay_and_update_(target, update, decay=0.99, alpha=-0.03, model=model)
            case = f"model copy {model_dtype} {how}"
            check(all(torch.equal(a, b) for a, b in zip(got_targets, expected_targets)), f"{case}: targets differ")
            check(all(torch.equal(m, t.to(model_dtype)) for m, t in zip(models, expected_targets)),
                  f"{case}: the copy is not the new target rounded")
            for got, base in zip(got_bases, model_bases):
                check(torch.equal(got[:, :2], base[:, :2]) and torch.equal(got[:, 8:], base[:, 8:]),
                      f"{case}: rows outside the copy were written")


def check_pieces_in_one_launch(generator) -> None:
    """fused_pieces against the per-piece passes, bit for bit: pieces in separate tensors (any element offset
    between them), slots / updates evenly spaced in one stacked tensor; unqualified pieces are left untouched."""
    for grad_dtype, buffer_dtype, slot_dtype in [(torch.float32, torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32, torch.float16)]:
        grads = [torch.randn(3, 12, 37, generator=generator).to(grad_dtype)[:, 2:8] for _ in range(3)]
        buffers = [torch.randn(3, 12, 37, generator=generator).to(buffer_dtype)[:, 2:8] for _ in range(3)]
        expected_buffers = [b.clone() for b in buffers]
        stacked, expected = (torch.empty(3, 3, 6, 37, dtype=slot_dtype) for _ in range(2))
        for grad, buffer, slot in zip(grads, expected_buffers, expected):
            fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.95, nesterov=True)
        done = fused_pieces.momentum_into_slots_(grads, buffers, list(stacked), momentum=0.95, nesterov=True)
        case = f"pieces: momentum grad {grad_dtype} buffer {buffer_dtype} slot {slot_dtype}"
        check(done, f"{case}: not taken as one launch")
        check(all(torch.equal(a, b) for a, b in zip(buffers, expected_buffers)), f"{case}: buffers differ")
        check(torch.equal(stacked, expected), f"{case}: slots differ")
    targets = [torch.randn(22, 33, generator=generator)[::2] for _ in range(3)]
    expected_targets = [t.clone() for t in targets]
    updates = torch.randn(3, 11, 33, generator=generator).half()
    for target, update in zip(expected_targets, updates):
        fused_elementwise.decay_and_update_(target, update, decay=0.99, alpha=-0.03)
    check(fused_pieces.decay_and_update_pieces_(targets, list(updates), decay=0.99, alpha=-0.03),
          "pieces: decay+update not taken as one launch")
    check(all(torch.equal(a, b) for a, b in zip(targets, expected_targets)), "pieces: decay+update differs")
    mixed = [torch.randn(11, 33, generator=generator), torch.randn(11, 32, generator=generator)]
    before = [t.clone() for t in mixed]
    check(not fused_pieces.decay_and_update_pieces_(mixed, list(updates[:2]), decay=0.5, alpha=1.0)
          and all(torch.equal(a, b) for a, b in zip(mixed, before)), "pieces: unqualified pieces were touched")
    uneven = [updates[0], updates[2]][::-1]
    check(not fused_pieces.decay_and_update_pieces_(targets[:2], uneven, decay=0.5, alpha=1.0),
          "pieces: updates in reverse order taken as evenly spaced")
    limit, fused_pieces._MAX_PIECES = fused_pieces._MAX_PIECES, 2  # more pieces than the grid's third axis holds
    try:
        check(not fused_pieces.decay_and_update_pieces_(targets, list(updates), decay=0.5, alpha=1.0)
              and all(torch.equal(a, b) for a, b in zip(targets, expected_targets)),
              "pieces: more pieces than the grid axis holds taken as one launch")
    finally:
        fused_pieces._MAX_PIECES = limit


def check_uncovered_fall_back(generator) -> None:
    grad = torch.randn(6, 10, generator=generator, dtype=torch.float64)
    buffer, expected = torch.zeros_like(grad), torch.zeros_like(grad)
    slot, expected_slot = torch.empty(6, 10), torch.empty(6, 10)
    muon_math.momentum_buffers_update_([grad], [expected], 0.9)
    muon_math.nesterov_into_(grad, expected, expected_slot, 0.9, True)
    fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.9, nesterov=True)
    check(torch.equal(buffer, expected) and torch.equal(slot, expected_slot), "fp64 fallback differs")
    target = torch.randn(10, 6, generator=generator).mT  # column stride 6: not covered
    update = torch.randn(6, 10, generator=generator).half()
    expected = target.clone().mul_(0.9).add_(update, alpha=-0.1)
    fused_elementwise.decay_and_update_(target, update, decay=0.9, alpha=-0.1)
    check(torch.equal(target, expected), "strided-column fallback differs")


def check_norm_partials(generator) -> None:
    """The momentum passes' partial sums of squares add up to each slot's squared Frobenius norm (fp32 sums in
    another order: within a few ulps), one row per piece, for a single piece and for pieces in one launch; slots
    and buffers stay bit-identical to the passes without the sums."""
    for slot_dtype in (torch.bfloat16, torch.float16, torch.float32):
        grads = [torch.randn(40, 300, generator=generator) * 1e-2 for _ in range(3)]  # 300: masked column tail
        buffers = [torch.randn(40, 300, generator=generator) * 1e-2 for _ in range(3)]
        plain_buffers = [b.clone() for b in buffers]
        stacked, plain = (torch.empty(3, 40, 300, dtype=slot_dtype) for _ in range(2))
        programs = fused_elementwise.norm_programs(stacked[0])
        partials = torch.full((3, programs), float("nan"))
        case = f"norm partials, slot {slot_dtype}"
        check(programs is not None and programs > 1, f"{case}: {programs} programs (the sums are not split)")
        check(fused_pieces.momentum_into_slots_(grads, buffers, list(stacked), momentum=0.9, nesterov=True,
                                                norm_partials=partials), f"{case}: not one launch")
        for grad, buffer, slot in zip(grads, plain_buffers, plain):
            fused_elementwise.momentum_into_slot_(grad, buffer, slot, momentum=0.9, nesterov=True)
        check(torch.equal(stacked, plain) and all(torch.equal(a, b) for a, b in zip(buffers, plain_buffers)),
              f"{case}: the sums changed what the pass stores")
        exact = stacked.double().square().sum(dim=(1, 2))
        check(torch.allclose(partials.double().sum(dim=1), exact, rtol=1e-6, atol=0), f"{case}: pieces' sums")
        single = torch.full((programs, ), float("nan"))
        ran = fused_elementwise.momentum_into_slot_(grads[1], buffers[1].clone(), torch.empty_like(plain[1]),
                                                    momentum=0.9, nesterov=True, norm_partials=single)
        again = torch.empty_like(plain[1])
        fused_elementwise.momentum_into_slot_(grads[1], buffers[1].clone(), again, momentum=0.9, nesterov=True)
        check(ran and torch.allclose(single.double().sum(), again.double().square().sum(), rtol=1e-6, atol=0),
              f"{case}: one piece's sums")
    fp64 = torch.randn(8, 8, dtype=torch.float64, generator=generator)
    check(fused_elementwise.norm_programs(fp64) is not None  # the geometry is covered; the dtype decides below
          and not fused_elementwise.momentum_into_slot_(fp64, fp64.clone(), torch.empty_like(fp64), momentum=0.9,
                                                        nesterov=True),
          "norm partials: an fp64 piece did not report the torch fallback")


def check_muon_norm_fusion(generator) -> None:
    """Muon hands Newton–Schulz the norms its momentum passes summed (none for buckets of several matrices per
    piece); they match the stack's own norm within fp32 rounding, and the step stays within one fp16 rounding of
    the NS input from the step that reduces the stack itself."""
    from megatron_muon.kernels import newton_schulz

    handed = []
    reduce = newton_schulz._normalized_padded

    def spy(X, eps, dtype, ops, norm=None):
        if norm is not None:
            own = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=torch.float32).reshape(-1)
            handed.append((tuple(X.shape), float(((norm.reshape(-1) - own).abs() / own).max())))
        return reduce(X, eps, dtype, ops, norm)

    seed = int(torch.randint(1 << 30, (1,), generator=generator))
    runs = {}
    for summed in (True, False):
        params = muon_params(torch.Generator().manual_seed(seed), torch.float32)
        initial = [p.detach().clone() for p in params]
        newton_schulz._normalized_padded, norm_partials = spy, Muon._norm_partials
        if not summed:
            Muon._norm_partials = lambda *args: None
        try:
            run_steps(lambda _: Muon(params, lr=0.02, fused_elementwise=True), params, 3)
        finally:
            newton_schulz._normalized_padded, Muon._norm_partials = reduce, norm_partials
        runs[summed] = params
    shapes = {shape for shape, _ in handed}
    check((3, 16, 40) in shapes and (2, 16, 24) not in shapes,
          f"norm fusion: handed norms for {sorted(shapes)} (want the three wide matrices, not the expert stack)")
    check(all(error < 1e-6 for _, error in handed), f"norm fusion: summed norms off by {handed}")
    for i, (a, b, start) in enumerate(zip(runs[True], runs[False], initial)):
        gap, moved = float((a - b).detach().norm()), float((b - start).detach().norm())
        check(gap <= 1e-3 * moved, f"norm fusion: parameter {i} gap {gap} vs moved {moved}")


def muon_params(generator, dtype):
    """A plain matrix, a fused QKV split per section (2 query groups), a 3-D expert stack, and three wide matrices
    of one shape (one launch per pass for the three: `fused_pieces`)."""
    plain = torch.nn.Parameter((torch.randn(24, 16, generator=generator) * 0.1).to(dtype))
    qkv = torch.nn.Parameter((torch.randn(2 * (8 + 4 + 4), 16, generator=generator) * 0.1).to(dtype))
    qkv.is_qkv, qkv.qkv_split_shapes = True, [8, 4, 4]
    experts = torch.nn.Parameter((torch.randn(2, 16, 24, generator=generator) * 0.1).to(dtype))
    experts.muon_num_experts = 2
    wide = [torch.nn.Parameter((torch.randn(16, 40, generator=generator) * 0.1).to(dtype)) for _ in range(3)]
    return [plain, qkv, experts, *wide]


def run_steps(make_optimizer, params, steps: int = 3):
    generator = torch.Generator().manual_seed(7)
    optimizer = make_optimizer(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype) * 1e-2
        optimizer.step()
    return optimizer


def check_muon_takes_one_launch_per_bucket() -> None:
    """Muon's fused step runs the three wide matrices' passes as one launch each (`fused_pieces`)."""
    taken = []
    momentum, update = fused_pieces.momentum_into_slots_, fused_pieces.decay_and_update_pieces_
    fused_pieces.momentum_into_slots_ = lambda *a, **k: taken.append(("momentum", momentum(*a, **k))) or taken[-1][1]
    fused_pieces.decay_and_update_pieces_ = lambda *a, **k: taken.append(("update", update(*a, **k))) or taken[-1][1]
    try:
        params = muon_params(torch.Generator().manual_seed(0), torch.float32)
        run_steps(lambda _: Muon(params, lr=0.02, fused_elementwise=True), params, 1)
    finally:
        fused_pieces.momentum_into_slots_, fused_pieces.decay_and_update_pieces_ = momentum, update
    check(("momentum", True) in taken and ("update", True) in taken, f"Muon did not launch per bucket: {taken}")


def check_muon(generator, steps: int = 3) -> None:
    """Bit for bit with the torch path, with Newton–Schulz reducing every stack's norm itself (the norms summed by
    the momentum passes differ in fp32 rounding: `check_muon_norm_fusion`)."""
    norm_partials, Muon._norm_partials = Muon._norm_partials, lambda *args: None
    try:
        check_muon_bits(generator, steps)
    finally:
        Muon._norm_partials = norm_partials


def check_muon_bits(generator, steps: int) -> None:
    settings = [
        dict(dtype=torch.float32, nesterov=True, weight_decay_mode="decoupled"),
        dict(dtype=torch.float32, nesterov=False, weight_decay_mode="independent", momentum_dtype=torch.bfloat16),
        dict(dtype=torch.float32, nesterov=True, weight_decay_mode="l2"),
        dict(dtype=torch.float32, nesterov=True, weight_decay_mode="decoupled", split_heads=True),  # QKV per head
        # torch's CPU foreach multiply rounds the decay factor to bf16 (0.998 -> 0.996): compare without decay
        dict(dtype=torch.bfloat16, nesterov=True, weight_decay_mode="decoupled", weight_decay=0.0),
    ]
    for setting in settings:
        dtype = setting.pop("dtype")
        seed = int(torch.randint(1 << 30, (1,), generator=generator))
        initial = muon_params(torch.Generator().manual_seed(seed), dtype)
        results = {}
        for engine, fused in itertools.product((Muon, WaveMuon), (True, False)):
            params = muon_params(torch.Generator().manual_seed(seed), dtype)  # deepcopy drops megatron's tags
            groups = [dict(params=params[:2] + params[3:]), dict(params=params[2:3], lr=0.01)]

            def make(_, engine=engine, fused=fused, groups=groups):
                return engine(groups, lr=0.02, fused_elementwise=fused, **{"weight_decay": 0.1, **setting})

            optimizer = run_steps(make, params, steps)
            results[engine.__name__, fused] = (params, optimizer)
        for engine in ("Muon", "WaveMuon"):
            (fused_params, fused_opt), (torch_params, torch_opt) = results[engine, True], results[engine, False]
            case = f"{engine} {dtype} {setting}"
            for i, (a, b) in enumerate(zip(fused_params, torch_params)):
                if dtype == torch.float32:
                    check(torch.equal(a, b), f"{case}: parameter {i} fused != torch path")
                else:  # one rounding per step, and torch's CPU add rounds alpha to bf16
                    gap, moved = (a - b).detach().float().norm(), (b - initial[i]).detach().float().norm()
                    check(float(gap) <= 0.02 * float(moved), f"{case}: parameter {i} gap {gap} vs moved {moved}")
                check(not torch.equal(a, initial[i]), f"{case}: parameter {i} did not move")
            for i, (a, b) in enumerate(zip(fused_params, results["Muon", True][0])):
                check(torch.equal(a, b), f"{case}: parameter {i} fused {engine} != fused Muon")
            if engine == "Muon":
                for a, b in zip(fused_params, torch_params):
                    same = torch.equal(fused_opt.state[a]["momentum_buffer"], torch_opt.state[b]["momentum_buffer"])
                    check(same, f"{case}: momentum buffers differ")


def main() -> None:
    assert fused_elementwise.supported(torch.device("cpu")), "run with TRITON_INTERPRET=1 and Triton installed"
    generator = torch.Generator().manual_seed(0)
    check_momentum(generator)
    check_decay_and_update(generator)
    check_pieces_in_one_launch(generator)
    check_model_copies(torch.Generator().manual_seed(2))
    check_clip_factor(torch.Generator().manual_seed(1))  # its own stream: the later checks keep their inputs
    check_uncovered_fall_back(generator)
    check_muon(generator)
    check_norm_partials(torch.Generator().manual_seed(5))
    check_muon_norm_fusion(torch.Generator().manual_seed(6))
    check_muon_takes_one_launch_per_bucket()
    check_speculative_slots(torch.Generator().manual_seed(3))
    check_wave_speculation(torch.Generator().manual_seed(4))
    check_clipped_wave_speculation(torch.Generator().manual_seed(14))
    if FAILURES:
        print("\n".join(FAILURES))
        sys.exit(1)
    print("interpreter ok")


if __name__ == "__main__":
    main()
