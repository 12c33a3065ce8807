"""megatron's master-to-model copy for our Muon, written by Muon's own update pass.

After each optimizer step megatron's mixed-precision wrapper copies every fp32 master weight into its bf16 model
parameter: one more read of 4 bytes and write of 2 per element (docs/design/optimizer_passes.md). Our Muon's fused
decay+update pass already holds each new master value in registers, so it writes the rounded copy too (2 more bytes
per element) and the wrapper's copy is skipped for that step. Where the pass is not fused, Muon copies after its
update, as the wrapper would have.
"""

from __future__ import annotations

from megatron_muon.megatron.master_adamw import model_copies_of
from megatron_muon.megatron.muon_wrappers import fused_muon_wrappers
from megatron_muon.patches import replace_method


def install_muon_model_copy(optimizer) -> int:
    """Let every Muon (ours) inside megatron's mixed-precision wrappers whose update pass is fused on the
    parameters' device write its model copies; returns how many wrappers were newly given this (a second call
    gives none)."""
    installed = 0
    for wrapper, muon in fused_muon_wrappers(optimizer):  # unfused, Muon would copy after its update: no gain
        if getattr(wrapper, "muon_writes_model_copies", False) or wrapper.is_stub_optimizer:
            continue
        if getattr(wrapper.config, "reuse_grad_buf_for_mxfp8_param_ag", False):
            continue  # megatron stages the masters into its param buffer instead of the model copies
        _attach(wrapper, muon)
        installed += 1
    return installed


def _attach(wrapper, muon) -> None:
    muon.model_copies = model_copies_of(wrapper)
    original_step = wrapper.step_with_ready_grads

    def step_with_ready_grads():
        # megatron's step, minus the copy Muon's step just made (the instance attribute shadows the method)
        replace_method(wrapper, "_copy_main_params_to_model_params", _copied_by_muon)
        try:
            return original_step()
        finally:
            del wrapper._copy_main_params_to_model_params

    replace_method(wrapper, "step_with_ready_grads", step_with_ready_grads)
    wrapper.muon_writes_model_copies = True


def _copied_by_muon() -> None:
    """Nothing to copy: Muon wrote every master it updated into its model copy (masters without a gradient did not
    change, so their copies are current)."""
