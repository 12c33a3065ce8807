"""Pure-torch chunked gated delta rule: forward and hand-written backward (the CPU / test / fallback backend).

Chunk form (chunk size C, within a chunk gc = cumsum(g), Γ = exp(gc), decay_ij = exp(gc_i - gc_j) for i >= j):
    Akk = strict_lower(beta_i (k_i·k_j) decay_ij),  A = (I + Akk)^-1          (WY representation)
    w = A (beta Γ k),  u = A (beta v)                                          (chunk-parallel)
    U_n = u_n - w_n S_n,  S_{n+1} = Γ_C S_n + (exp(gc_C - gc) k)^T U_n         (sequential over chunks)
    o = (scale q Γ) S_n + (scale q k^T ∘ decay) U_n                            (chunk-parallel)
Only the two state recurrences (forward and backward) loop over chunks; everything else is batched matmuls over
[chunks, batch, heads], laid out chunk-major so each loop step reads contiguous memory. The backward is written out
by hand because a custom op's kernel runs below autograd (it cannot differentiate its own recomputation).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


@dataclass
class _ChunkLayout:
    """Where each token sits in the padded chunk-major layout, and where the sequences start and end."""

    rows: int
    seq_len: int
    num_chunks: int
    token_index: torch.Tensor | None  # varlen only: padded position of every packed token
    segment_starts: dict[int, int]  # first chunk -> segment
    segment_ends: dict[int, int]  # last chunk -> segment

    @classmethod
    def build(cls, batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, device) -> "_ChunkLayout":
        if cu_seqlens is None:
            num_chunks = -(-seq_len // CHUNK_SIZE)
            return cls(batch, seq_len, num_chunks, None, {0: 0}, {num_chunks - 1: 0})
        bounds = cu_seqlens.tolist()
        positions, starts, ends, chunk = [], {}, {}, 0
        for segment in range(len(bounds) - 1):
            length = bounds[segment + 1] - bounds[segment]
            chunks = max(1, -(-length // CHUNK_SIZE))
            positions.append(torch.arange(length) + chunk * CHUNK_SIZE)
            starts[chunk], ends[chunk + chunks - 1] = segment, segment
            chunk += chunks
        token_index = torch.cat(positions).to(device)
        return cls(1, seq_len, chunk, token_index, starts, ends)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] (or [B, T, H]) -> [N, B, H, C, D] (or [N, B, H, C]), zero-padded."""
        squeeze = x.dim() == 3
        if squeeze:
            x = x.unsqueeze(-1)
        padded_len = self.num_chunks * CHUNK_SIZE
        if self.token_index is None:
            x = F.pad(x, (0, 0, 0, 0, 0, padded_len - self.seq_len))
        else:
            x = x.new_zeros(1, padded_len, *x.shape[2:]).index_copy_(1, self.token_index, x)
        x = x.view(self.rows, self.num_chunks, CHUNK_SIZE, *x.shape[2:]).permute(1, 0, 3, 2, 4).contiguous()
        return x.squeeze(-1) if squeeze else x

    def from_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of to_chunks: [N, B, H, C, D] (or [N, B, H, C]) -> [B, T, H, D] (or [B, T, H])."""
        squeeze = x.dim() == 4
        if squeeze:
            x = x.unsqueeze(-1)
        x = x.permute(1, 0, 3, 2, 4).reshape(self.rows, self.num_chunks * CHUNK_SIZE, x.shape[2], x.shape[-1])
        x = x[:, : self.seq_len] if self.token_index is None else x.index_select(1, self.token_index)
        return x.squeeze(-1) if squeeze else x

    def initial_state(self, initial_state: torch.Tensor | None, segment: int, like: torch.Tensor) -> torch.Tensor:
        if initial_state is None:
            return like.new_zeros(self.rows, *like.shape[1:])
        if self.token_index is None:
            return initial_state.to(like.dtype)
        return initial_state[segment : segment + 1].to(like.dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prepare(q, k, v, g, beta, scale, cu_seqlens):
    """Repeat q/k heads for GVA, move everything to fp32 chunk-major layout and build the chunk-local terms."""
    dtype = _compute_dtype(q)
    group = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) if group > 1 else x for x in (q, k))
    layout = _ChunkLayout.build(q.shape[0], q.shape[1], cu_seqlens, q.device)
    q, k, v, g, beta = (layout.to_chunks(x.to(dtype)) for x in (q, k, v, g, beta))
    t = dict(layout=layout, q=q, k=k, v=v, g=g, beta=beta)
    lower = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(CHUNK_SIZE, dtype=dtype, device=q.device)
    gc = g.cumsum(-1)
    decay = torch.exp((gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")))
    kk = k @ k.transpose(-1, -2)
    akk = (beta[..., None] * kk * decay).tril(-1)
    inverse = torch.linalg.solve_triangular(eye + akk, eye.expand_as(akk), upper=False, unitriangular=True)
    gamma = gc.exp()
    kbg = k * (beta * gamma)[..., None]
    vb = v * beta[..., None]
    qs = q * scale
    qk = qs @ k.transpose(-1, -2)
    tail = torch.exp(gc[..., -1:] - gc)
    t.update(lower=lower, gc=gc, decay=decay, kk=kk, inverse=inverse, gamma=gamma, kbg=kbg, vb=vb, qs=qs, qk=qk,
             w=inverse @ kbg, u=inverse @ vb, aqk=qk * decay, chunk_decay=gamma[..., -1], tail=tail,
             k_tail=k * tail[..., None])
    return t


def _state_recurrence(t, initial_state):
    """Forward loop over chunks: states[n] = S_n (state entering chunk n), U[n] = u_n - w_n S_n."""
    layout, u, w = t["layout"], t["u"], t["w"]
    num_chunks = u.shape[0]
    states = u.new_empty(num_chunks, *u.shape[1:3], w.shape[-1], u.shape[-1])
    new_values = torch.empty_like(u)
    finals = []
    state = None
    for n in range(num_chunks):
        if n in layout.segment_starts:
            state = layout.initial_state(initial_state, layout.segment_starts[n], states[0])
        states[n] = state
        new_values[n] = u[n] - w[n] @ state
        state = state * t["chunk_decay"][n][..., None, None] + t["k_tail"][n].transpose(-1, -2) @ new_values[n]
        if n in layout.segment_ends:
            finals.append(state)
    return states, new_values, torch.cat(finals)


def chunk_gdn_forward_torch(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens):
    """Returns (o [B,T,HV,V] in v.dtype, final_state fp32 [N,HV,K,V] or empty, g_cumsum fp32, A in k.dtype)."""
    t = _prepare(q, k, v, g, beta, scale, cu_seqlens)
    states, new_values, final_state = _state_recurrence(t, initial_state)
    o = (t["qs"] * t["gamma"][..., None]) @ states + t["aqk"] @ new_values
    layout = t["layout"]
    final_state = final_state.float() if output_final_state else final_state.new_empty(0, dtype=torch.float32)
    return (
        layout.from_chunks(o).to(v.dtype).contiguous(),
        final_state.contiguous(),
        layout.from_chunks(t["gc"]).float().contiguous(),
        layout.from_chunks(t["inverse"]).to(k.dtype).contiguous(),
    )


def chunk_gdn_backward_torch(q, k, v, g, beta, scale: float, initial_state, cu_seqlens, do, dht):
    """Gradients (dq, dk, dv, dg, dbeta, dh0-or-empty) of the chunked forward, each in its input's dtype."""
    t = _prepare(q, k, v, g, beta, scale, cu_seqlens)
    layout = t["layout"]
    states, new_values, _ = _state_recurrence(t, initial_state)
    d_out = layout.to_chunks(do.to(states.dtype))
    q_gamma = t["qs"] * t["gamma"][..., None]
    # Backward state recurrence: dS_n = Γ_C dS_{n+1} + (qΓ)^T dO_n - w_n^T dU_n, dU_n = k_tail dS_{n+1} + Aqk^T dO_n.
    from_output_to_values = t["aqk"].transpose(-1, -2) @ d_out
    from_output_to_state = q_gamma.transpose(-1, -2) @ d_out
    d_next_states = torch.empty_like(states)
    d_values = torch.empty_like(new_values)
    d_initial = {}
    d_state = None
    for n in reversed(range(states.shape[0])):
        if n in layout.segment_ends:
            d_state = _final_state_grad(dht, layout, layout.segment_ends[n], states[0])
        d_next_states[n] = d_state
        d_values[n] = t["k_tail"][n] @ d_state + from_output_to_values[n]
        d_state = (d_state * t["chunk_decay"][n][..., None, None] + from_output_to_state[n]
                   - t["w"][n].transpose(-1, -2) @ d_values[n])
        if n in layout.segment_starts:
            d_initial[layout.segment_starts[n]] = d_state
    grads = _chunk_local_grads(t, states, new_values, d_out, d_next_states, d_values, scale)
    dq, dk, dv, dg, dbeta = (layout.from_chunks(x) for x in grads)
    group = v.shape[2] // q.shape[2]
    if group > 1:
        dq, dk = (x.unflatten(2, (q.shape[2], group)).sum(3) for x in (dq, dk))
    if initial_state is None:
        dh0 = dq.new_empty(0)
    else:
        dh0 = torch.cat([d_initial[s] for s in range(len(d_initial))]).to(initial_state.dtype)
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0
    return tuple(grad.contiguous() for grad in grads)


def _final_state_grad(dht, layout: _ChunkLayout, segment: int, like: torch.Tensor) -> torch.Tensor:
    if dht is None:
        return torch.zeros_like(like)
    if layout.token_index is None:
        return dht.to(like.dtype)
    return dht[segment : segment + 1].to(like.dtype)


def _chunk_local_grads(t, states, new_values, d_out, d_next_states, d_values, scale):
    """Chunk-parallel part of the backward: everything that does not depend on the order of chunks."""
    k, v, beta, gamma, inverse, decay = t["k"], t["v"], t["beta"], t["gamma"], t["inverse"], t["decay"]
    states_t = states.transpose(-1, -2)
    # S_{n+1} = Γ_C S_n + k_tail^T U_n
    d_k_tail = new_values @ d_next_states.transpose(-1, -2)
    d_chunk_log_decay = (states * d_next_states).sum((-1, -2)) * t["chunk_decay"]
    # o = (q Γ) S_n + Aqk U_n  and  U_n = u_n - w_n S_n
    d_q_gamma = d_out @ states_t
    d_aqk = (d_out @ new_values.transpose(-1, -2)).masked_fill(~t["lower"], 0)
    d_w = -(d_values @ states_t)
    d_qs = d_q_gamma * gamma[..., None] + (d_aqk * decay) @ k
    d_gamma = (d_q_gamma * t["qs"]).sum(-1)
    dk = (d_aqk * decay).transpose(-1, -2) @ t["qs"]
    d_decay = d_aqk * t["qk"]
    # w = A kbg, u = A vb, A = (I + Akk)^-1
    d_kbg = inverse.transpose(-1, -2) @ d_w
    d_vb = inverse.transpose(-1, -2) @ d_values
    d_inverse = d_values @ t["vb"].transpose(-1, -2) + d_w @ t["kbg"].transpose(-1, -2)
    d_akk = -(inverse.transpose(-1, -2) @ d_inverse @ inverse.transpose(-1, -2)).tril(-1)
    # Akk = beta_i kk_ij decay_ij (strictly lower)
    d_akk_decay = d_akk * decay
    dbeta = (d_akk_decay * t["kk"]).sum(-1)
    d_kk = d_akk_decay * beta[..., None]
    dk = dk + (d_kk + d_kk.transpose(-1, -2)) @ k
    d_decay = d_decay + d_akk * beta[..., None] * t["kk"]
    # kbg = k beta Γ,  vb = v beta,  k_tail = k exp(gc_C - gc)
    dk = dk + d_kbg * (beta * gamma)[..., None] + d_k_tail * t["tail"][..., None]
    k_dot_kbg = (k * d_kbg).sum(-1)
    dbeta = dbeta + k_dot_kbg * gamma + (v * d_vb).sum(-1)
    d_gamma = d_gamma + k_dot_kbg * beta
    dv = d_vb * beta[..., None]
    d_tail = (k * d_k_tail).sum(-1) * t["tail"]
    # log-space decays back to gc, then gc = cumsum(g)
    weighted = d_decay * decay
    dgc = d_gamma * gamma + weighted.sum(-1) - weighted.sum(-2) - d_tail
    dgc[..., -1] += d_tail.sum(-1) + d_chunk_log_decay
    dg = dgc.flip(-1).cumsum(-1).flip(-1)
    return d_qs * scale, dk, dv, dg, dbeta
