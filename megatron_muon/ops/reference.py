"""Naive fp32 references for every GDN op: the oracles the fast paths are tested against.

They follow the math literally (one token at a time for the delta rule) so that they are easy to audit; they are
slow on purpose and are never used for training.
"""

import math

import torch
import torch.nn.functional as F


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule in fp32 (or fp64 when given fp64).

    Per value head h and token t, with state S [K, V] (key head = h // (HV // H) under GVA):
        S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = scale * S^T q_t.
    Layout is [B, T, H, K] like FLA; with ``cu_seqlens`` B must be 1 and each segment starts from its own state.
    """
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_reference(q), l2norm_reference(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    num_value_heads = v.shape[2]
    group = num_value_heads // q.shape[2]
    q, k = (x.to(compute_dtype).repeat_interleave(group, dim=2) for x in (q, k))
    v, g, beta = (x.to(compute_dtype) for x in (v, g, beta))
    if cu_seqlens is None:  # every batch row is one sequence: step them together
        segments = [(slice(None), 0, q.shape[1])]
    else:
        bounds = cu_seqlens.tolist()
        segments = [(slice(0, 1), bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    outputs = []
    finals = []
    for index, (rows, start, end) in enumerate(segments):
        if initial_state is None:
            state = q.new_zeros(q[rows].shape[0], num_value_heads, q.shape[-1], v.shape[-1])
        elif cu_seqlens is None:
            state = initial_state.to(compute_dtype)
        else:
            state = initial_state[index : index + 1].to(compute_dtype)
        for t in range(start, end):
            state = state * g[rows, t].exp()[..., None, None]
            predicted = torch.einsum("bhk,bhkv->bhv", k[rows, t], state)
            update = (v[rows, t] - predicted) * beta[rows, t][..., None]
            state = state + k[rows, t][..., :, None] * update[..., None, :]
            outputs.append(torch.einsum("bhk,bhkv->bhv", q[rows, t] * scale, state))
        finals.append(state)
    outputs = torch.stack(outputs, dim=1)
    final_state = torch.cat(finals) if output_final_state else None
    return outputs, final_state


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = "silu"
) -> torch.Tensor:
    """Depthwise causal conv over time via F.conv1d, in fp32: x [B, T, D], weight [D, W]."""
    width = weight.shape[1]
    y = F.conv1d(
        x.float().transpose(1, 2),
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        padding=width - 1,
        groups=weight.shape[0],
    )[..., : x.shape[1]].transpose(1, 2)
    return F.silu(y) if activation in ("silu", "swish") else y


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (FLA's definition)."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """rmsnorm(x) * weight * silu(gate) over the last dim, in fp32 (FLA's FusedRMSNormGated, activation silu)."""
    x = x.float()
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return normed * weight.float() * F.silu(gate.float())


def chunk_state_forward_reference(k, w, u, g, initial_state=None, chunk: int = 64):
    """FLA's value-first chunk-state forward (`chunk_gated_delta_rule_fwd_h`) in fp32 (fp64), chunk by chunk:
    (h [B, NT, H, V, K], v_new [B, T, H, V], final state [B, H, V, K]); g is the chunk-local cumulative log2 gate."""
    batch, seq_len, heads, key_dim = k.shape
    dtype = torch.promote_types(k.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    k, w, u, g = (t.to(dtype) for t in (k, w, u, g))
    state = (torch.zeros(batch, heads, u.shape[-1], key_dim, dtype=dtype, device=k.device) if initial_state is None
             else initial_state.to(dtype).clone())
    chunks = -(-seq_len // chunk)
    h = torch.empty(batch, chunks, heads, u.shape[-1], key_dim, dtype=dtype, device=k.device)
    v_new = torch.empty_like(u)
    for t in range(chunks):
        rows = slice(t * chunk, min((t + 1) * chunk, seq_len))
        h[:, t] = state
        gates, last = g[:, rows], g[:, rows][:, -1]
        v_new[:, rows] = u[:, rows] - torch.einsum("blhk,bhvk->blhv", w[:, rows], state)
        gated = v_new[:, rows] * torch.exp2(last[:, None] - gates)[..., None]
        state = state * torch.exp2(last)[..., None, None] + torch.einsum("blhv,blhk->bhvk", gated, k[:, rows])
    return h, v_new, state


def chunk_state_backward_reference(q, k, w, g, do, dv, scale: float, dht=None, chunk: int = 64):
    """FLA's value-first state-gradient recurrence (`chunk_gated_delta_rule_bwd_dhu`) in fp32 (fp64), from the last
    chunk:
    (dh [B, NT, H, V, K], dh0 [B, H, V, K], dv2 [B, T, H, V])."""
    batch, seq_len, heads, key_dim = q.shape
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    q, k, w, do, dv, g = (t.to(dtype) for t in (q, k, w, do, dv, g))
    state = (torch.zeros(batch, heads, do.shape[-1], key_dim, dtype=dtype, device=q.device) if dht is None
             else dht.to(dtype).clone())
    chunks = -(-seq_len // chunk)
    dh = torch.empty(batch, chunks, heads, do.shape[-1], key_dim, dtype=dtype, device=q.device)
    dv2 = torch.empty_like(dv)
    for t in reversed(range(chunks)):
        rows = slice(t * chunk, min((t + 1) * chunk, seq_len))
        dh[:, t] = state
        gates, last = g[:, rows], g[:, rows][:, -1]
        decay = torch.exp2(last[:, None] - gates)[..., None]
        dv2[:, rows] = dv[:, rows] + torch.einsum("blhk,bhvk->blhv", k[:, rows], state) * decay
        gated_do = do[:, rows] * torch.exp2(gates)[..., None]
        state = (state * torch.exp2(last)[..., None, None]
                 + scale * torch.einsum("blhv,blhk->bhvk", gated_do, q[:, rows])
                 - torch.einsum("blhv,blhk->bhvk", dv2[:, rows], w[:, rows]))
    return dh, state, dv2


def chunk_output_grads_reference(q, k, v_new, w, g, h, do, dh, dv, scale: float, chunk: int = 64):
    """FLA's value-first `chunk_bwd_dqkwg` in fp32 (fp64), as a vector-Jacobian product taken by autograd:
    (dq, dk [B, T, H, K], dw [B, T, HV, K], dg [B, T, HV]); with HV > H value head h reads q/k head h // (HV // H).

    Per chunk t, with h_t and v_new held constant and g the chunk-local cumulative log2 gate, three outputs get the
    cotangents do, dh_t (the gradient of the state after chunk t) and dv (that of v_new):
        o_t = scale·(2^g ⊙ q_t)·h_tᵀ + scale·(causal(q_t·k_tᵀ ⊙ 2^(g_i − g_j)))·v_new_t,
        S_t = 2^g_last·h_t + (2^(g_last − g) ⊙ v_new_t)ᵀ·k_t,
        x_t = −w_t·h_tᵀ (so dw = −dv·h_t).
    dg is the gradient with respect to the gate in natural-log units (g·ln 2), as FLA's kernel returns it.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, w, g)]
    v_new, h, do, dh, dv = (t.to(dtype) for t in (v_new, h, do, dh, dv))
    seq_len, groups = inputs[0].shape[1], inputs[2].shape[2] // inputs[0].shape[2]
    total = inputs[0].new_zeros(())
    with torch.enable_grad():
        q, k = (t.repeat_interleave(groups, dim=2) for t in inputs[:2])  # autograd sums each group's gradients
        w, g = inputs[2:]
        for t in range(-(-seq_len // chunk)):
            rows = slice(t * chunk, min((t + 1) * chunk, seq_len))
            q_t, k_t, g_t, v_t, h_t = q[:, rows], k[:, rows], g[:, rows], v_new[:, rows], h[:, t]
            last = g_t[:, -1]
            causal = torch.ones(g_t.shape[1], g_t.shape[1], dtype=torch.bool, device=g_t.device).tril()
            gaps = torch.where(causal[None, :, :, None], g_t[:, :, None] - g_t[:, None, :], 0)  # [B, i, j, H]
            scores = torch.einsum("bihk,bjhk->bijh", q_t, k_t) * torch.exp2(gaps) * causal[None, :, :, None]
            o_t = scale * (torch.einsum("blhk,bhvk->blhv", q_t * torch.exp2(g_t)[..., None], h_t)
                           + torch.einsum("bijh,bjhv->bihv", scores, v_t))
            s_t = (h_t * torch.exp2(last)[..., None, None]
                   + torch.einsum("blhv,blhk->bhvk", v_t * torch.exp2(last[:, None] - g_t)[..., None], k_t))
            x_t = -torch.einsum("blhk,bhvk->blhv", w[:, rows], h_t)
            total = total + (o_t * do[:, rows]).sum() + (s_t * dh[:, t]).sum() + (x_t * dv[:, rows]).sum()
        dq, dk, dw, dg = torch.autograd.grad(total, inputs)
    return dq, dk, dw, dg / math.log(2)


def chunk_wy_reference(k, v, g, beta, chunk: int = 64):
    """The chunk-parallel WY terms of FLA's forward in fp32 (fp64): (w [B, T, HV, K], u [B, T, HV, V]) with
    w = A·(β·2^g ⊙ k), u = A·(β ⊙ v) and A = (I + strictly-lower(β_i·k_i·k_j·2^(g_i − g_j)))⁻¹ per chunk; g is the
    chunk-local cumulative log2 gate [B, T, HV]; with HV > H value head h reads key head h // (HV // H)."""
    dtype = torch.promote_types(k.dtype, torch.float32)
    inverses = chunk_wy_inverse_reference(k, g, beta, chunk, value_heads=v.shape[2])
    k = k.to(dtype).repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    v, g, beta = (t.to(dtype) for t in (v, g, beta))
    w, u = torch.empty_like(k), torch.empty_like(v)
    for start in range(0, k.shape[1], chunk):
        rows = slice(start, start + chunk)
        inverse = inverses[:, rows, :, : k[:, rows].shape[1]]  # [B, i, HV, j]
        gated_k = k[:, rows] * (beta[:, rows] * torch.exp2(g[:, rows]))[..., None]
        w[:, rows] = torch.einsum("bihj,bjhk->bihk", inverse, gated_k)
        u[:, rows] = torch.einsum("bihj,bjhv->bihv", inverse, v[:, rows] * beta[:, rows][..., None])
    return w, u


def chunk_wy_inverse_reference(k, g, beta, chunk: int = 64, value_heads: int | None = None):
    """FLA's per-chunk inverse A = (I + strictly-lower(β_i·k_i·k_j·2^(g_i − g_j)))⁻¹ in fp32 (fp64), stored as FLA
    keeps it: [B, T, HV, chunk], token i's row of its chunk's inverse (zeros past a partial last chunk's end)."""
    dtype = torch.promote_types(k.dtype, torch.float32)
    value_heads = value_heads or g.shape[2]
    k = k.to(dtype).repeat_interleave(value_heads // k.shape[2], dim=2)
    g, beta = g.to(dtype), beta.to(dtype)
    inverses = k.new_zeros(*k.shape[:3], chunk)
    for start in range(0, k.shape[1], chunk):
        rows = slice(start, start + chunk)
        k_c, g_c, beta_c = k[:, rows], g[:, rows], beta[:, rows]
        length = k_c.shape[1]
        lower = torch.ones(length, length, dtype=torch.bool, device=k.device).tril(-1)[None, :, :, None]  # [1, i, j, 1]
        gaps = torch.where(lower, g_c[:, :, None] - g_c[:, None, :], 0)
        a_kk = torch.einsum("bihk,bjhk->bijh", k_c, k_c) * torch.exp2(gaps) * beta_c[:, :, None] * lower
        identity = torch.eye(length, dtype=dtype, device=k.device)
        inverse = torch.linalg.inv(identity + a_kk.permute(0, 3, 1, 2))  # [B, HV, i, j]
        inverses[:, rows, :, :length] = inverse.permute(0, 2, 1, 3)
    return inverses


def chunk_wy_backward_reference(k, v, g, beta, dw, du, chunk: int = 64):
    """FLA's `prepare_wy_repr_bwd` in fp32 (fp64), as the vector-Jacobian product of `chunk_wy_reference` (through
    the inverse): (dk [B, T, H, K], dv, dβ, dg [B, T, HV]); dg in natural-log units, as FLA's kernel returns it."""
    dtype = torch.promote_types(k.dtype, torch.float32)
    inputs = [t.detach().to(dtype).requires_grad_() for t in (k, v, g, beta)]
    with torch.enable_grad():
        w, u = chunk_wy_reference(*inputs, chunk=chunk)
        total = (w * dw.to(dtype)).sum() + (u * du.to(dtype)).sum()
        dk, dv, dg, dbeta = torch.autograd.grad(total, inputs)
    return dk, dv, dbeta, dg / math.log(2)


def chunk_output_reference(q, k, v_new, h, g, scale: float, chunk: int = 64):
    """FLA's value-first `chunk_fwd_o` in fp32 (fp64): o [B, T, HV, V] with, per chunk t,
    o_t = scale·(2^g ⊙ q_t)·h_tᵀ + scale·causal(q_t·k_tᵀ ⊙ 2^(g_i − g_j))·v_new_t; h [B, NT, HV, V, K] are the
    states entering each chunk; with HV > H value head h reads q/k head h // (HV // H)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    groups = v_new.shape[2] // q.shape[2]
    q, k = (t.to(dtype).repeat_interleave(groups, dim=2) for t in (q, k))
    v_new, h, g = (t.to(dtype) for t in (v_new, h, g))
    o = torch.empty_like(v_new)
    for t in range(h.shape[1]):
        rows = slice(t * chunk, (t + 1) * chunk)
        q_t, k_t, g_t = q[:, rows], k[:, rows], g[:, rows]
        causal = torch.ones(g_t.shape[1], g_t.shape[1], dtype=torch.bool, device=g_t.device).tril()
        causal = causal[None, :, :, None]
        gaps = torch.where(causal, g_t[:, :, None] - g_t[:, None, :], 0)  # [B, i, j, HV]
        scores = torch.einsum("bihk,bjhk->bijh", q_t, k_t) * torch.exp2(gaps) * causal
        o[:, rows] = scale * (torch.einsum("blhk,bhvk->blhv", q_t * torch.exp2(g_t)[..., None], h[:, t])
                              + torch.einsum("bijh,bjhv->bihv", scores, v_new[:, rows]))
    return o


def chunk_local_dv_reference(q, k, g, do, scale: float, chunk: int = 64):
    """FLA's `chunk_bwd_dv_local` in fp32 (fp64): the gradient of v_new through each chunk's own output term,
    dv_j = scale·Σ_{i ≥ j in the chunk} (q_i·k_j)·2^(g_i − g_j)·do_i, [B, T, HV, V]; with HV > H value head h reads
    q/k head h // (HV // H)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    groups = do.shape[2] // q.shape[2]
    q, k = (t.to(dtype).repeat_interleave(groups, dim=2) for t in (q, k))
    g, do = g.to(dtype), do.to(dtype)
    dv = torch.empty_like(do)
    for start in range(0, q.shape[1], chunk):
        rows = slice(start, start + chunk)
        q_t, k_t, g_t = q[:, rows], k[:, rows], g[:, rows]
        causal = torch.ones(g_t.shape[1], g_t.shape[1], dtype=torch.bool, device=g_t.device).tril()
        causal = causal[None, :, :, None]  # [1, i, j, 1]
        gaps = torch.where(causal, g_t[:, :, None] - g_t[:, None, :], 0)
        scores = torch.einsum("bihk,bjhk->bijh", q_t, k_t) * torch.exp2(gaps) * causal
        dv[:, rows] = scale * torch.einsum("bijh,bihv->bjhv", scores, do[:, rows])
    return dv
