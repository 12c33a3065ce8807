"""GDN's chunk-state recurrences with parallelism over the sequence: the algorithm segmented state kernels follow.

The sequential recurrences (`reference.chunk_state_forward_reference`, `..._backward_reference`, our Gluon and
Triton kernels, FLA's) walk every chunk in order with one program per (head, value block): at a few heads most
SMs idle while each program walks the whole sequence. Here the sequence is cut into segments of `segment_chunks`
chunks and the forward runs in three passes:

1. per segment, all at once: the state at the segment's end as if the segment started from zero, over the shortest
   trailing window of chunks whose decay 2^ΣG (G: a chunk's total log2 gate) is below 2^`drop_log2`. The state at
   the window's start is dropped; its weight is at most that decay, because a token's map 2^g·(I − β·k·kᵀ) has
   norm ≤ 2^g for unit-norm keys and β in [0, 2] (GDN's L2-normalized keys, sigmoid β). Where no trailing window
   decays that far, the whole segment runs and its transition M (end = start·M + local end) is kept: exact;
2. along the segments, a short scan: each segment's start state (from the initial state, exactly through M where
   the segment kept it);
3. per segment, all at once: the chunk states and v_new from the segment's start state, as the sequential
   recurrence computes them (the final state is the last segment's end).

The backward mirrors it: windows at each segment's start, the transposed transition, the scan from the last
segment. Dropped weights do not accumulate: a segment with a window restarts from its own window's state. The
same plan is FlashQLA's `get_warmup_chunks_bidi` / `prepare_h` / `correct_h0` (with e^-10 there). States are
value-first [B, H, V, K] and gates chunk-local cumulative log2, as in FLA's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_muon.ops.reference import chunk_state_backward_reference, chunk_state_forward_reference

DEFAULT_DROP_LOG2 = -24.0  # a dropped state weighs at most 2^-24 (fp32's relative rounding)


@dataclass(frozen=True)
class SegmentPlan:
    """Per (batch, head, segment): `window` chunks the first pass runs (trailing forward, leading backward) and
    `exact` (the whole segment ran; its transition carries the neighbour's state)."""

    segment_chunks: int
    chunks: int
    window: torch.Tensor  # [B, H, S] int64
    exact: torch.Tensor  # [B, H, S] bool

    @property
    def segments(self) -> int:
        return self.window.shape[-1]

    def rows(self, segment: int, chunk: int) -> slice:
        start = segment * self.segment_chunks * chunk
        return slice(start, min(self.chunks, (segment + 1) * self.segment_chunks) * chunk)

    def length(self, segment: int) -> int:
        return min(self.chunks, (segment + 1) * self.segment_chunks) - segment * self.segment_chunks


def chunk_totals(g: torch.Tensor, chunk: int) -> torch.Tensor:
    """Each chunk's total log2 gate [B, chunks, H]: the chunk-local cumulative gate at its last row."""
    seq_len = g.shape[1]
    last_rows = [min(start + chunk, seq_len) - 1 for start in range(0, seq_len, chunk)]
    return g[:, last_rows]


def plan_segments(g: torch.Tensor, segment_chunks: int, chunk: int = 64, drop_log2: float = DEFAULT_DROP_LOG2,
                  reverse: bool = False) -> SegmentPlan:
    """The first pass's window per segment: the fewest chunks from the segment's end (from its start with
    `reverse`, for the backward) whose total log2 gate is below `drop_log2`, else the whole segment (exact)."""
    if segment_chunks < 1:
        raise ValueError(f"segment_chunks must be >= 1, got {segment_chunks}")
    totals = chunk_totals(g.to(torch.float64), chunk).transpose(1, 2)  # [B, H, chunks]
    chunks = totals.shape[-1]
    segments = -(-chunks // segment_chunks)
    pad = segments * segment_chunks - chunks  # a short last segment, padded with chunks that do not decay
    lengths = torch.full((segments,), segment_chunks, dtype=torch.int64, device=g.device)
    lengths[-1] -= pad
    per_segment = torch.nn.functional.pad(totals, (0, pad)).unflatten(-1, (segments, segment_chunks))
    if not reverse:  # counted from each segment's end, the side next to the segment it feeds
        per_segment = per_segment.flip(-1)
    below = per_segment.cumsum(-1) < drop_log2
    reached = below.any(-1)
    first = below.to(torch.int64).argmax(-1) + 1  # [B, H, S]
    if not reverse:  # the flipped padding came first
        first = first - (segment_chunks - lengths)
    return SegmentPlan(segment_chunks, chunks, torch.where(reached, first, lengths), ~reached)


def chunk_transitions(k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Each chunk's state map T [B, chunks, H, K, K] (value-first: next = state·T + local),
    T = 2^G·I − wᵀ·D·k with D = diag(2^(G − g)); fp64 inputs give fp64."""
    dtype = torch.promote_types(k.dtype, torch.float32)
    k, w, g = (t.to(dtype) for t in (k, w, g))
    eye = torch.eye(k.shape[-1], dtype=dtype, device=k.device)
    maps = []
    for start in range(0, k.shape[1], chunk):
        rows = slice(start, start + chunk)
        last = g[:, rows][:, -1]  # [B, H]
        decay = torch.exp2(last[:, None] - g[:, rows])  # [B, L, H]
        maps.append(torch.exp2(last)[..., None, None] * eye
                    - torch.einsum("blhk,blh,blhj->bhkj", w[:, rows], decay, k[:, rows]))
    return torch.stack(maps, 1)


def _pick(values: torch.Tensor, b: int, h: int) -> torch.Tensor:
    return values[b : b + 1, :, h : h + 1]


def segmented_state_forward(k, w, u, g, initial_state=None, *, segment_chunks: int, chunk: int = 64,
                            drop_log2: float = DEFAULT_DROP_LOG2):
    """`chunk_state_forward_reference`'s (h, v_new, final state) by the three passes of the module docstring."""
    batch, _, heads, key_dim = k.shape
    value_dim = u.shape[-1]
    dtype = torch.promote_types(k.dtype, torch.float32)
    plan = plan_segments(g, segment_chunks, chunk, drop_log2)
    transitions = chunk_transitions(k, w, g, chunk)
    start = (torch.zeros(batch, heads, value_dim, key_dim, dtype=dtype, device=k.device) if initial_state is None
             else initial_state.to(dtype).clone())
    starts = [start]
    for s in range(plan.segments - 1):  # passes 1 and 2 (pass 1 is per segment; the reference loops)
        rows, first_chunk = plan.rows(s, chunk), s * segment_chunks
        following = torch.empty_like(start)
        for b in range(batch):
            for h in range(heads):
                window = int(plan.window[b, h, s])
                window_rows = slice(rows.stop - window * chunk, rows.stop) if window < plan.length(s) else rows
                local = chunk_state_forward_reference(*(_pick(t[:, window_rows], b, h) for t in (k, w, u, g)),
                                                      chunk=chunk)[2][0, 0]
                if plan.exact[b, h, s]:
                    carry = starts[s][b, h]
                    for c in range(first_chunk, first_chunk + plan.length(s)):
                        carry = carry @ transitions[b, c, h]
                    local = local + carry
                following[b, h] = local
        starts.append(following)
    h_all, v_new, final = [], [], None
    for s in range(plan.segments):  # pass 3
        rows = plan.rows(s, chunk)
        h_s, v_s, final = chunk_state_forward_reference(k[:, rows], w[:, rows], u[:, rows], g[:, rows], starts[s],
                                                        chunk=chunk)
        h_all.append(h_s)
        v_new.append(v_s)
    return torch.cat(h_all, 1), torch.cat(v_new, 1), final


def segmented_state_backward(q, k, w, g, do, dv, scale: float, dht=None, *, segment_chunks: int, chunk: int = 64,
                             drop_log2: float = DEFAULT_DROP_LOG2):
    """`chunk_state_backward_reference`'s (dh, dh0, dv2) by the mirrored passes: windows at each segment's start,
    the transposed transitions, the scan from the last segment."""
    batch, _, heads, key_dim = q.shape
    value_dim = do.shape[-1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    plan = plan_segments(g, segment_chunks, chunk, drop_log2, reverse=True)
    transitions = chunk_transitions(k, w, g, chunk)
    end = (torch.zeros(batch, heads, value_dim, key_dim, dtype=dtype, device=q.device) if dht is None
           else dht.to(dtype).clone())
    ends = {plan.segments - 1: end}
    for s in range(plan.segments - 1, 0, -1):  # passes 1 and 2: each segment's gradient at its start
        rows, first_chunk = plan.rows(s, chunk), s * segment_chunks
        preceding = torch.empty_like(end)
        for b in range(batch):
            for h in range(heads):
                window = int(plan.window[b, h, s])
                window_rows = slice(rows.start, rows.start + window * chunk) if window < plan.length(s) else rows
                local = chunk_state_backward_reference(
                    *(_pick(t[:, window_rows], b, h) for t in (q, k, w, g, do, dv)), scale, chunk=chunk)[1][0, 0]
                if plan.exact[b, h, s]:
                    carry = ends[s][b, h]
                    for c in reversed(range(first_chunk, first_chunk + plan.length(s))):
                        carry = carry @ transitions[b, c, h].transpose(-1, -2)
                    local = local + carry
                preceding[b, h] = local
        ends[s - 1] = preceding
    dh, dv2, dh0 = [None] * plan.segments, [None] * plan.segments, None
    for s in range(plan.segments):  # pass 3
        rows = plan.rows(s, chunk)
        dh[s], start_gradient, dv2[s] = chunk_state_backward_reference(
            q[:, rows], k[:, rows], w[:, rows], g[:, rows], do[:, rows], dv[:, rows], scale, ends[s], chunk=chunk)
        if s == 0:
            dh0 = start_gradient
    return torch.cat(dh, 1), dh0, torch.cat(dv2, 1)


def _fold(t: torch.Tensor, segments: int) -> torch.Tensor:
    """[B, T, ...] as [B·segments, T / segments, ...]: each segment a batch row of its own (a view)."""
    return t.reshape(t.shape[0] * segments, t.shape[1] // segments, *t.shape[2:])


def _check_segments(seq_len: int, segments: int, chunk: int) -> None:
    if segments < 1 or seq_len % (segments * chunk):
        raise ValueError(f"{segments} segments of whole {chunk}-token chunks do not tile {seq_len} tokens; "
                         f"choose a segment count that divides {seq_len // chunk} chunks")


def _identity(rows: int, heads: int, dim: int, device) -> torch.Tensor:
    """[rows, heads, dim, dim] fp32 identities: the start from which a recurrence with no input yields its map."""
    return torch.eye(dim, dtype=torch.float32, device=device).expand(rows, heads, dim, dim).contiguous()


def _scan(boundary, shape, local, maps, exact=None, reverse: bool = False) -> torch.Tensor:
    """Every segment's incoming state [B·S, H, V, K] (fp32): from `boundary` (None: zeros of `shape`) at the first
    segment (the last with `reverse`), each next one local + state·M (the M term only where `exact`, a 0/1 mask)."""
    state = torch.zeros(shape, dtype=torch.float32, device=local.device) if boundary is None else boundary.float()
    states = [state]
    order = range(local.shape[1] - 1, 0, -1) if reverse else range(local.shape[1] - 1)
    for s in order:
        carried = states[-1] @ maps[:, s]
        states.append(local[:, s] + (carried if exact is None else exact[:, s] * carried))
    return torch.stack(states[::-1] if reverse else states, 1).flatten(0, 1)


def batched_segments_forward(forward, k, w, u, g, initial_state=None, *, segments: int, chunk: int = 64):
    """The exact form of the three passes on any sequential forward `forward(k, w, u, g, initial_state) ->
    (h, v_new, final)` (our kernels, FLA's, the reference): equal segments run side by side as batch rows.
    Pass 1 is `forward` from zero, and each segment's transition M is `forward` itself from the identity with
    u = 0 and the key dim as the value dim (start·M + 0); pass 2 scans the segments with batched products; pass 3
    is `forward` from each segment's start. About 2 + K/V times the sequential work, `segments` times the
    programs, no dropped weight."""
    batch, seq_len, heads, key_dim = w.shape  # value heads (k may have fewer: GVA)
    value_dim = u.shape[-1]
    _check_segments(seq_len, segments, chunk)
    folded = [_fold(t, segments) for t in (k, w, u, g)]
    local = forward(*folded, None)[2].float().view(batch, segments, heads, value_dim, key_dim)
    identity = _identity(batch * segments, heads, key_dim, k.device)
    maps = forward(folded[0], folded[1], torch.zeros_like(folded[1]), folded[3], identity)[2].float()
    maps = maps.view(batch, segments, heads, key_dim, key_dim)
    starts = _scan(initial_state, (batch, heads, value_dim, key_dim), local, maps)
    h, v_new, final = forward(*folded, starts)
    return (h.reshape(batch, -1, *h.shape[2:]), v_new.reshape(batch, seq_len, *v_new.shape[2:]),
            final.view(batch, segments, *final.shape[1:])[:, -1])


def batched_segments_backward(backward, q, k, w, g, do, dv, scale: float, dht=None, *, segments: int,
                              chunk: int = 64):
    """The mirrored exact form on any sequential state-gradient recurrence `backward(q, k, w, g, do, dv, scale,
    dht) -> (dh, dh0, dv2)`: the transposed transitions are `backward` from the identity with do = dv = 0."""
    batch, seq_len, heads, key_dim = w.shape  # value heads (q and k may have fewer: GVA)
    value_dim = do.shape[-1]
    _check_segments(seq_len, segments, chunk)
    fq, fk, fw, fg, fdo, fdv = (_fold(t, segments) for t in (q, k, w, g, do, dv))
    local = backward(fq, fk, fw, fg, fdo, fdv, scale, None)[1].float().view(batch, segments, heads, value_dim,
                                                                             key_dim)
    nothing = torch.zeros_like(fw)
    maps = backward(fq, fk, fw, fg, nothing, nothing, scale, _identity(batch * segments, heads, key_dim, q.device))
    maps = maps[1].float().view(batch, segments, heads, key_dim, key_dim)
    ends = _scan(dht, (batch, heads, value_dim, key_dim), local, maps, reverse=True)
    dh, dh0, dv2 = backward(fq, fk, fw, fg, fdo, fdv, scale, ends)
    return (dh.reshape(batch, -1, *dh.shape[2:]), dh0.view(batch, segments, *dh0.shape[1:])[:, 0],
            dv2.reshape(batch, seq_len, *dv2.shape[2:]))


def _windows(g, segments: int, chunk: int, drop_log2: float, reverse: bool):
    """(chunks per segment, skip [B·S, HV] int32 for pass 1, skip for the transitions, exact [B, S, HV, 1, 1]):
    pass 1 runs each segment's window (none for the segment nobody reads: the last forward, the first backward);
    the transitions run only where the segment is exact."""
    batch, seq_len, heads = g.shape
    _check_segments(seq_len, segments, chunk)
    length = seq_len // (segments * chunk)
    plan = plan_segments(g, length, chunk, drop_log2, reverse=reverse)
    window, exact = plan.window.transpose(1, 2), plan.exact.transpose(1, 2)  # [B, S, HV]
    skip = (length - window).to(torch.int32)
    skip[:, 0 if reverse else -1] = length
    transition_skip = torch.where(exact, 0, length).to(torch.int32)
    return (length, skip.flatten(0, 1), transition_skip.flatten(0, 1),
            exact.to(torch.float32)[..., None, None])


def windowed_chunk_forward(kernels, k, w, u, g, initial_state=None, output_final_state: bool = False, *,
                           segments: int, chunk: int = 64, drop_log2: float = DEFAULT_DROP_LOG2, q=None,
                           scale: float = 1.0, store_states: bool = True, configs=None):
    """`kernels.chunk_forward`'s (h, v_new, o, final state) by the three passes with the plan's windows, on kernels
    that start each (row, head) some chunks in (`state_tma`): pass 1 runs only the windows, the transitions only the
    whole segments, pass 3 everything (with q, the output too: the fused forward)."""
    batch, seq_len, heads, key_dim = w.shape
    value_dim = u.shape[-1]
    _, skip, transition_skip, exact = _windows(g, segments, chunk, drop_log2, reverse=False)
    fk, fw, fu, fg = (_fold(t, segments) for t in (k, w, u, g))
    local = kernels.chunk_forward(fk, fw, fu, fg, None, True, store_states=False, skip_chunks=skip)[3]
    identity = _identity(batch * segments, heads, key_dim, k.device)
    maps = kernels.chunk_forward(fk, fw, torch.zeros_like(fw), fg, identity, True, store_states=False,
                                 skip_chunks=transition_skip)[3]
    local = local.view(batch, segments, heads, value_dim, key_dim)
    maps = maps.view(batch, segments, heads, key_dim, key_dim)
    starts = _scan(initial_state, (batch, heads, value_dim, key_dim), local, maps, exact)
    options = {} if configs is None else {"configs": configs}
    h, v_new, o, final = kernels.chunk_forward(fk, fw, fu, fg, starts,
                                               output_final_state, q=None if q is None else _fold(q, segments),
                                               scale=scale, store_states=store_states, **options)
    final = None if final is None else final.view(batch, segments, *final.shape[1:])[:, -1]
    return (*(None if t is None else t.reshape(batch, -1, *t.shape[2:]) for t in (h, v_new, o)), final)


def windowed_segments_forward(kernels, k, w, u, g, initial_state=None, *, segments: int, chunk: int = 64,
                              drop_log2: float = DEFAULT_DROP_LOG2):
    """(h, v_new, final state) as `segmented_state_forward` computes them, on the kernels (`windowed_chunk_forward`)."""
    h, v_new, _, final = windowed_chunk_forward(kernels, k, w, u, g, initial_state, True, segments=segments,
                                                chunk=chunk, drop_log2=drop_log2)
    return h, v_new, final


def windowed_segments_backward(kernels, q, k, w, g, do, dv, scale: float, dht=None, *, segments: int,
                               chunk: int = 64, drop_log2: float = DEFAULT_DROP_LOG2):
    """The mirrored passes with windows at each segment's start (`state_tma.chunk_dhu(..., skip_chunks=)`);
    (dh, dh0, dv2) as `segmented_state_backward` computes them (dv None: the chunks' own value gradient inside)."""
    batch, seq_len, heads, key_dim = w.shape
    value_dim = do.shape[-1]
    _, skip, transition_skip, exact = _windows(g, segments, chunk, drop_log2, reverse=True)
    fq, fk, fw, fg, fdo = (_fold(t, segments) for t in (q, k, w, g, do))
    fdv = None if dv is None else _fold(dv, segments)  # None: the kernels add the chunks' own value gradient
    local = kernels.chunk_dhu(fq, fk, fw, fg, fdo, fdv, scale, None, True, skip_chunks=skip)[1]
    nothing = torch.zeros_like(fw)
    identity = _identity(batch * segments, heads, key_dim, q.device)
    maps = kernels.chunk_dhu(fq, fk, fw, fg, nothing, nothing, scale, identity, True, skip_chunks=transition_skip)[1]
    local = local.view(batch, segments, heads, value_dim, key_dim)
    maps = maps.view(batch, segments, heads, key_dim, key_dim)
    ends = _scan(dht, (batch, heads, value_dim, key_dim), local, maps, exact, reverse=True)
    dh, dh0, dv2 = kernels.chunk_dhu(fq, fk, fw, fg, fdo, fdv, scale, ends, True)
    return (dh.reshape(batch, -1, *dh.shape[2:]), dh0.view(batch, segments, *dh0.shape[1:])[:, 0],
            dv2.reshape(batch, seq_len, *dv2.shape[2:]))


DEFAULT_SEGMENTS = 4


def segment_count(seq_len: int, chunk: int = 64, most: int = DEFAULT_SEGMENTS) -> int:
    """The most segments, up to `most` and a power of two, that cut `seq_len` into whole chunks (1: none)."""
    segments = most
    while segments > 1 and seq_len % (segments * chunk):
        segments //= 2
    return max(segments, 1)


def windowed_chunk_fwd_h(kernels, k, w, u, g, initial_state=None, output_final_state: bool = False, *,
                         segments: int):
    """`state_tma.chunk_fwd_h`'s (h, v_new, final state or None) in segments with windows."""
    h, v_new, _, final = windowed_chunk_forward(kernels, k, w, u, g, initial_state, output_final_state,
                                                segments=segments)
    return h, v_new, final


def windowed_chunk_dhu(kernels, q, k, w, g, do, dv, scale: float, dht=None, want_dh0: bool = False, *,
                       segments: int):
    """`state_tma.chunk_dhu`'s (dh, dh0 or None, dv2) in segments with windows."""
    dh, dh0, dv2 = windowed_segments_backward(kernels, q, k, w, g, do, dv, scale, dht, segments=segments)
    return dh, dh0 if want_dh0 else None, dv2
