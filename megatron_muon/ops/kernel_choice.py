"""Which kernels each stage of the GDN chunk op runs on CUDA: one explicit setting, chosen once per process.

Stages (FLA's kernels run wherever ours do not qualify for the inputs):
- ``states``: the chunk-state recurrences (forward h, backward dh): "gluon" (the warp-specialized kernels where they
  apply, our Triton ones elsewhere), "triton" (our Triton kernels), "fla", or "segments" (our Triton kernels on
  segments of the sequence side by side, each segment's incoming state built over the window of chunks where the
  gate has decayed it below 2^-24, exactly through the segment's transition where it has not; the bound on what is
  dropped holds for unit-norm keys and β in [0, 2], as GDN's layers give them: `ops/state_segments.py`; opt-in
  until measured).
- ``output_grads``: the chunk output gradients (dq, dk, dw, dg): "ours", "fla", "fused" (ours with FLA's WY
  backward and the gate gradient's reverse cumulative sum in the same kernel, `ops/chunk_bwd_fused.py`: dw never
  leaves registers), or "one-pass" (the whole backward, the state-gradient recurrence included, as one program per
  value head (or per segment of chunks side by side, after the state-gradient recurrence, where the heads alone would
  leave SMs idle) with dh in registers, `ops/chunk_bwd_onepass.py`, for key and value dims up to 128; elsewhere as
  "fused"; opt-in until measured).
- ``output_terms``: the intra-chunk terms beside the state recurrences, the forward's output and the backward's
  local value gradient: "fla" (FLA's `chunk_fwd_o` and `chunk_bwd_dv_local`, around the recurrences of ``states``)
  or "fused" (computed inside our recurrences, in Gluon where ``states`` is "gluon" and the kernel applies, else in
  Triton: the fused forward, `ops/chunk_fwd_fused_ws.py` for K ≤ 128 or `ops/chunk_fwd_fused.py`, and the
  state-gradient kernel called without dv; a backward that recomputes the forward states runs them on ``states``),
  or "backward" (the backward's term only; the forward stays split).
- ``intra``: the chunk-parallel forward before the recurrence (the gate's chunk-local cumulative sum, the WY inverse,
  w and u): "fla" (FLA's cumsum, fused kkt + solve and `recompute_w_u`) or "ours" (one kernel,
  `ops/chunk_fwd_intra.py`).

Named presets: "ours" (gluon + ours + fla, the default), "fused" (gluon + ours + fused), "triton" (triton + ours +
fla), "segments" (segments + ours + fla) and "fla" (FLA's everywhere).
`set_gdn_kernels` (the recipe's ``model.gdn_kernels``) sets the choice; when nothing did, MEGATRON_MUON_GDN_KERNELS
seeds it at the first op call. The ops read it inside their kernels, so it never becomes a guard in a compiled graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KERNELS_ENV_VAR = "MEGATRON_MUON_GDN_KERNELS"
STATE_KERNELS = ("gluon", "triton", "fla", "segments")
OUTPUT_GRAD_KERNELS = ("ours", "fused", "one-pass", "fla")
OUTPUT_TERM_KERNELS = ("fla", "fused", "backward")
INTRA_KERNELS = ("fla", "ours")


@dataclass(frozen=True)
class GdnKernels:
    """The kernel family of each stage (see the module docstring)."""

    states: str = "gluon"
    output_grads: str = "ours"
    output_terms: str = "fla"
    intra: str = "fla"

    def __post_init__(self):
        if self.states not in STATE_KERNELS:
            raise ValueError(f"GDN state kernels {self.states!r}; valid choices: {STATE_KERNELS}")
        if self.output_grads not in OUTPUT_GRAD_KERNELS:
            raise ValueError(f"GDN output-gradient kernels {self.output_grads!r}; valid choices: {OUTPUT_GRAD_KERNELS}")
        if self.output_terms not in OUTPUT_TERM_KERNELS:
            raise ValueError(f"GDN output-term kernels {self.output_terms!r}; valid choices: {OUTPUT_TERM_KERNELS}")
        if self.intra not in INTRA_KERNELS:
            raise ValueError(f"GDN intra-chunk forward kernels {self.intra!r}; valid choices: {INTRA_KERNELS}")

    @classmethod
    def named(cls, name: str, where: str = "gdn_kernels") -> GdnKernels:
        if name not in PRESETS:
            raise ValueError(f"{where}={name!r}; valid choices: {tuple(PRESETS)}")
        return PRESETS[name]

    @property
    def name(self) -> str | None:
        """The preset's name, or None for a per-stage mix."""
        return next((name for name, preset in PRESETS.items() if preset == self), None)


PRESETS = {
    "ours": GdnKernels("gluon", "ours"),
    "fused": GdnKernels("gluon", "ours", "fused"),
    "triton": GdnKernels("triton", "ours"),
    "segments": GdnKernels("segments", "ours"),
    "fla": GdnKernels("fla", "fla"),
}
KERNEL_CHOICES = tuple(PRESETS)

_chosen: GdnKernels | None = None


def set_gdn_kernels(choice: str | GdnKernels | None) -> None:
    """Choose the GDN kernels for this process: a preset name, a `GdnKernels`, or None to seed again from
    MEGATRON_MUON_GDN_KERNELS at the next op call. Takes effect at the next op call."""
    global _chosen
    _chosen = GdnKernels.named(choice) if isinstance(choice, str) else choice


def gdn_kernels() -> GdnKernels:
    """The current choice (seeded from MEGATRON_MUON_GDN_KERNELS, default "ours", when nothing set it)."""
    global _chosen
    if _chosen is None:
        _chosen = GdnKernels.named(os.environ.get(KERNELS_ENV_VAR, "ours"), where=KERNELS_ENV_VAR)
    return _chosen
