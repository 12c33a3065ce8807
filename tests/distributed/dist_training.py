"""Rank functions for the dist_muon tests: tiny GPT / GDN-hybrid trained through megatron's optimizer factory."""

from __future__ import annotations

import contextlib

import torch

from megatron_muon.testing.parallel import init_model_parallel, layout
from megatron_muon.testing.training import build_training_setup, full_parameters, train_step

# A tiny GDN geometry: 2 key heads of 16, 4 value heads of 8, conv 4.
GDN_SIZES = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


@contextlib.contextmanager
def one_thread():
    """Tiny matmuls on a loaded 2-core machine stall on intra-op thread wake-ups; one thread is much faster."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _hybrid_builder(config):
    from megatron_muon.specs import build_hybrid_model
    from megatron_muon.testing.models import SEQ_LENGTH, VOCAB_SIZE

    torch.manual_seed(1234)  # the GDN layer initializes its full weights from the seed, then takes its TP slice
    return build_hybrid_model(config, "G*", vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LENGTH, backend="local")


def owner_engines(optimizer) -> list:
    """The OwnerMuon instances inside a megatron optimizer chain."""
    from megatron_muon.distributed.owner_muon import OwnerMuon

    children = getattr(optimizer, "chained_optimizers", None)
    if children is not None:
        return [e for child in children for e in owner_engines(child)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, OwnerMuon) else []


def build(tp: int, pp: int, name: str, precision: str, model: str, lr: float = 0.01):
    import megatron_muon

    megatron_muon.register()
    init_model_parallel(tp=tp, pp=pp)
    options = dict(muon_tp_mode="duplicated", muon_fp32_matmul_prec="highest" if precision == "fp32" else "medium")
    builder = {"gpt": {}, "hybrid": dict(model_builder=_hybrid_builder, config_overrides=GDN_SIZES)}[model]
    return build_training_setup(name, bf16=precision == "bf16", lr=lr, **builder, **options)


def train(rank, world_size, tp: int, pp: int, name: str, precision: str, model: str, steps: int):
    """`steps` steps on a layout; returns losses, gathered full parameters (global names) and NS counts."""
    with one_thread():
        model_, optimizer = build(tp, pp, name, precision, model)
        losses = [train_step(model_, optimizer, step) for step in range(steps)]
        engines = owner_engines(optimizer)
        return {
            "losses": losses,
            "params": full_parameters(model_),
            "layout": layout(),
            "orthogonalized": sum(e.orthogonalized_matrices for e in engines),
            "units": sum(len(e.owners) for e in engines),
            "owners": [sorted(set(e.owners)) for e in engines],
        }
