"""The GDN chunk op alone, forward + backward, for ``gdn.py --chunk-op``: ours, FLA's and FlashQLA's on one input.

The input is what the layer feeds the op: q and unit-norm k [B=1, T, H, K], v [1, T, HV, V] in bf16, g = logsigmoid
(fp32), beta = sigmoid (bf16), no initial or final state, the default scale. Variants:
  FlashQLA chunk op (direct)          flash_qla.chunk_gated_delta_rule as FlashQLA ships it (its forward keeps its
                                      context-parallel states for the backward)
  FlashQLA through our chunk op       megatron_muon.ops.chunk_gated_delta_rule where FlashQLA runs it (installed,
                                      Hopper, bf16, K = V = 128)
  ours chunk op                       the same call with FlashQLA turned off: our kernels, chunk states kept
  ours chunk op (recomputing ...)     the same, the backward recomputing the chunk states (the memory-lean choice,
                                      `model.gdn_keep_chunk_states: false`)
  ours chunk op (STAGES)              the same with other kernels per stage (`ops/kernel_choice`): FLA's state
                                      recurrences or output gradients, our Triton states, the output terms fused
                                      into our state recurrences (both passes, or the backward only), or FLA's
                                      everywhere (our op still keeping the chunk states), so each stage's choice is
                                      measured
  fla chunk op                        fla.ops.gated_delta_rule.chunk_gated_delta_rule with FLA_FLASH_QLA=0, so FLA
                                      runs its own kernels rather than handing the call to FlashQLA
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from megatron_muon.ops import chunk_gated_delta_rule, flashqla_enabled, set_flashqla
from megatron_muon.ops.kernel_choice import GdnKernels, set_gdn_kernels
from megatron_muon.ops.gdn_flashqla import qualifies

REFERENCE_VARIANT = "FlashQLA chunk op (direct)"
# (variant suffix, kernels per stage) beside the default ("gluon" states, "ours" output gradients); each changes one
# stage of the default or of a variant timed before it
STAGE_VARIANTS = [("states: fla", GdnKernels("fla", "ours")), ("states: triton", GdnKernels("triton", "ours")),
                  ("states: segments", GdnKernels("segments", "ours")),
                  ("output grads: fla", GdnKernels("gluon", "fla")),
                  ("output grads: fused", GdnKernels(output_grads="fused")),
                  ("output grads: one-pass", GdnKernels(output_grads="one-pass")),
                  ("intra: ours", GdnKernels(intra="ours")),
                  ("output terms: fused", GdnKernels(output_terms="fused")),
                  ("output terms and grads: fused", GdnKernels(output_terms="fused", output_grads="fused")),
                  ("output terms: fused, intra: ours", GdnKernels(output_terms="fused", intra="ours")),
                  ("output terms: backward only", GdnKernels(output_terms="backward")),
                  ("fused terms, fused grads, intra ours", GdnKernels(output_terms="fused", output_grads="fused",
                                                                      intra="ours")),
                  ("all stages: fla", GdnKernels("fla", "fla"))]


def chunk_op_inputs(sizes: dict, seq_len: int, device: str) -> list[torch.Tensor]:
    """(q, k, v, g, beta) leaves that require grad, and the output gradient last."""
    torch.manual_seed(0)
    heads, value_heads, key_dim, value_dim = (sizes[n] for n in ("key_heads", "value_heads", "key_dim", "value_dim"))
    bf16 = torch.bfloat16
    q = torch.randn(1, seq_len, heads, key_dim, device=device, dtype=bf16)
    k = F.normalize(torch.randn(1, seq_len, heads, key_dim, device=device), dim=-1).to(bf16)
    v = torch.randn(1, seq_len, value_heads, value_dim, device=device, dtype=bf16)
    g = F.logsigmoid(torch.randn(1, seq_len, value_heads, device=device))
    beta = torch.rand(1, seq_len, value_heads, device=device).sigmoid().to(bf16)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    return [*leaves, torch.randn_like(v)]


def _ours(q, k, v, g, beta):
    return chunk_gated_delta_rule(q, k, v, g, beta, keep_states_for_backward=True)[0]


def _ours_recomputing(q, k, v, g, beta):
    return chunk_gated_delta_rule(q, k, v, g, beta, keep_states_for_backward=False)[0]


def _fla(q, k, v, g, beta):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    return fla_chunk_gated_delta_rule(q, k, v, g, beta)[0]


def _flashqla(q, k, v, g, beta):
    import flash_qla

    return flash_qla.chunk_gated_delta_rule(q, k, v, g, beta)[0]


def _without_flashqla(kernels: GdnKernels):
    def setup() -> None:
        set_flashqla(False)
        set_gdn_kernels(kernels)

    return setup


def _fla_without_flashqla() -> None:
    os.environ["FLA_FLASH_QLA"] = "0"  # FLA reads it at every call; no other variant goes through FLA's dispatch


def chunk_op_variants(inputs: list[torch.Tensor], device: str) -> list[tuple[str, object, object]]:
    """(name, forward function, setup) of every variant that can run here, in the order they are timed."""
    q, _, v, *_ = inputs
    variants = []
    on_gpu = device == "cuda"
    if on_gpu and importlib.util.find_spec("flash_qla") and q.shape[-1] == v.shape[-1] == 128:
        variants.append((REFERENCE_VARIANT, _flashqla, None))
    set_flashqla(None)
    if qualifies(q, v) and flashqla_enabled():
        variants.append(("FlashQLA through our chunk op", _ours, lambda: set_flashqla(None)))
    variants.append(("ours chunk op", _ours, _without_flashqla(GdnKernels())))
    variants.append(("ours chunk op (recomputing its chunk states)", _ours_recomputing,
                     _without_flashqla(GdnKernels())))
    if on_gpu:
        variants += [(f"ours chunk op ({suffix})", _ours, _without_flashqla(kernels))
                     for suffix, kernels in STAGE_VARIANTS]
    if on_gpu and importlib.util.find_spec("fla"):
        variants.append(("fla chunk op", _fla, _fla_without_flashqla))
    return variants


def make_chunk_step(forward, setup, inputs):
    """A make_step for gdn.run_variant: one forward and the gradients of all five inputs."""
    *leaves, do = inputs

    def make():
        if setup is not None:
            setup()

        def step():
            torch.autograd.grad(forward(*leaves), leaves, do)

        return step

    return make


def output_agreement(variants, inputs) -> str:
    """Each variant's output against the first one's (FlashQLA's where it runs): relative error of o."""
    *leaves, _ = inputs
    outputs = {}
    for name, forward, setup in variants:
        try:
            if setup is not None:
                setup()
            outputs[name] = forward(*leaves).detach().float()  # with grad on: the timed kernels, not inference's
        except Exception as error:  # the timing row already reports the failure
            outputs[name] = f"failed: {type(error).__name__}"
    if not outputs:
        return "n/a (no variant ran)"
    first, *others = outputs
    if isinstance(outputs[first], str):
        return f"n/a ({first} {outputs[first]})"
    reference = outputs[first]
    errors = [f"{name} {out if isinstance(out, str) else f'{((out - reference).norm() / reference.norm()).item():.2e}'}"
              for name, out in ((n, outputs[n]) for n in others)]
    return f"vs {first}: " + ("; ".join(errors) or "no other variant")


def against_flashqla(rows: list[dict]) -> list[str]:
    """Report lines: our own kernels against FlashQLA called directly (DESIGN.md's target), and the dispatched op."""
    timed = {row["name"]: row for row in rows if "ms" in row}
    flashqla = timed.get(REFERENCE_VARIANT)
    if flashqla is None:
        return []
    lines = [""]
    own, dispatched = timed.get("ours chunk op"), timed.get("FlashQLA through our chunk op")
    if own:
        speed = flashqla["ms"] / own["ms"]
        verdict = "met" if speed >= 0.9 else "NOT met"
        lines.append(f"Target (our own kernels >= 0.9x FlashQLA called directly): {verdict} ({speed:.3f}x; "
                     f"back-to-back {flashqla['stream_ms'] / own['stream_ms']:.3f}x).")
        if "graph_ms" in flashqla and "graph_ms" in own:
            lines.append(f"Kernels only (each call replayed from a CUDA graph): {flashqla['graph_ms']:.2f} ms against "
                         f"{own['graph_ms']:.2f}, {flashqla['graph_ms'] / own['graph_ms']:.3f}x.")
    if dispatched:
        lines.append(f"FlashQLA through our op: {flashqla['ms'] / dispatched['ms']:.3f}x FlashQLA called directly "
                     f"(back-to-back {flashqla['stream_ms'] / dispatched['stream_ms']:.3f}x).")
    return lines
