"""Digests of a training step's tensors, for finding where two runs part (`dist_sim_step.py --trace/--digest`), and
memory poisoning that makes a read of unwritten memory show up as NaN (`--poison`)."""

from __future__ import annotations

import torch


def poisonfree_memory() -> None:
    """Fill most of the device's free memory with NaN bytes and hand it to the caching allocator: a kernel that reads
    memory nobody wrote (an `empty` buffer taken as zeros) then makes NaNs, which `--trace` locates."""
    if not torch.cuda.is_available():
        return
    free, _ = torch.cuda.mem_get_info()
    block = torch.empty(int(free * 0.8), dtype=torch.uint8, device="cuda").fill_(0xFF)  # NaN in bf16 and fp32
    del block


def _short_digest(tensor: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()).hexdigest()[:12]


def tensor_digests(model, optimizer, stage: str) -> dict:
    """Per-tensor digests at one point of a step, to find the first tensor where two runs part: after the backward
    every parameter's main_grad, after the step every parameter and the Muon engines' momentum and fp32 masters."""
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    named = sorted(model.named_parameters(), key=lambda item: item[0])
    nonfinite = [n for n, p in named if not torch.isfinite(p).all()]
    if stage == "backward":
        grads = {n: p.main_grad for n, p in named if getattr(p, "main_grad", None) is not None}
        return {"grads": {n: _short_digest(g) for n, g in grads.items()},
                "nonfinite": [f"grad:{n}" for n, g in grads.items() if not torch.isfinite(g).all()] + nonfinite}
    names = {id(p): n for n, p in named}
    state = {}
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_group, main_group in zip(getattr(member, "float16_groups", []),
                                           getattr(member, "fp32_from_float16_groups", [])):
            for model_param, main in zip(model_group, main_group):
                state[f"master:{names.get(id(model_param), '?')}"] = _short_digest(main)
                momentum = member.optimizer.state.get(main, {}).get("momentum_buffer")
                if momentum is not None:
                    state[f"momentum:{names.get(id(model_param), '?')}"] = _short_digest(momentum)
    engines = [e for m in getattr(optimizer, "chained_optimizers", []) for e in getattr(m, "engines", [])]
    for e, engine in enumerate(engines):
        for g, group in enumerate(engine.param_groups):
            for i, param in enumerate(group["params"]):
                momentum = engine.state.get(param, {}).get("momentum_buffer")
                if momentum is not None:
                    state[f"muon{e}.{g}.{i}:momentum"] = _short_digest(momentum)
    return {"params": {n: _short_digest(p) for n, p in named}, "state": state, "nonfinite": nonfinite}


def param_digest(model) -> str:
    """SHA-256 of every parameter's bytes after the steps: variants that must agree bit for bit compare these."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(param.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()
