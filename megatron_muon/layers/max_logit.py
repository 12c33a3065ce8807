"""Per-head maximum of the pre-softmax attention logits, for QK-clip (MuonClip) and its logging.

TE's fused attention returns this maximum from its kernel (`return_max_logit`); torch SDPA returns no logits, so
the local attention recomputes q·kᵀ·scale here, without gradients, a block of queries at a time so that memory
stays bounded at long sequences whatever the batch and head count.
"""

from __future__ import annotations

import torch

# Logits per block: a block of queries times every key, for every batch row and head (fp32: 128 MiB).
BLOCK_ELEMENTS = 1 << 25


@torch.no_grad()
def max_attention_logits(query: torch.Tensor, key: torch.Tensor, scale: float, causal: bool,
                         block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """(heads,) fp32: max over batch, query and (unmasked) key positions of `scale * q·k` per query head.

    query [s_q, b, heads, d] and key [s_k, b, kv_heads, d], megatron's layout; query head h reads key head
    h // (heads // kv_heads), as GQA does. `causal` masks key j > query i (SDPA's `is_causal`, top-left aligned).
    """
    seq_q, batch, heads, dim = query.shape
    seq_k, kv_heads = key.shape[0], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key heads ({kv_heads})")
    dtype = torch.promote_types(query.dtype, torch.float32)  # fp32 logits from 16-bit inputs, fp64 kept
    q_BHGSD = query.permute(1, 2, 0, 3).reshape(batch, kv_heads, heads // kv_heads, seq_q, dim)
    k_BHSD = key.permute(1, 2, 0, 3).to(dtype)
    block = max(1, block_elements // max(1, batch * heads * seq_k))
    result = torch.full((kv_heads, heads // kv_heads), float("-inf"), dtype=dtype, device=query.device)
    for start in range(0, seq_q, block):
        end = min(start + block, seq_q)
        keys = min(end, seq_k) if causal else seq_k  # causal: later keys are masked for every query in the block
        if keys == 0:
            continue
        logits = torch.einsum("bhgqd,bhkd->bhgqk", q_BHGSD[:, :, :, start:end].to(dtype), k_BHSD[:, :, :keys])
        logits.mul_(scale)
        if causal:
            rows = torch.arange(start, end, device=query.device)[:, None]
            logits.masked_fill_(torch.arange(keys, device=query.device)[None, :] > rows, float("-inf"))
        result = torch.maximum(result, logits.amax(dim=(0, 3, 4)))
    return result.reshape(heads).float()


def running_max(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """The running maximum across micro-batches, kept until QK-clip (or the loop) resets it to None, as TE does."""
    return new if current is None else torch.maximum(current, new)
