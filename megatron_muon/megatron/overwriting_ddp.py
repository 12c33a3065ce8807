"""megatron's DistributedDataParallel whose gradient buffers are overwritten by each step's first gradient.

`zero_grad_buffer()` then leaves DDP's fp32 gradient buffers as they are (one pass over them per step less), each
parameter's first gradient of the step is a cast copy into its `main_grad` instead of an add to zeros
(`main_grad_add`'s hook), and the parameters that got no gradient are zeroed before DDP reduces them: a bucket with
such a parameter never reports ready during the backward, so its reduction starts in `start_grad_sync` or
`finish_grad_sync`, after this class zeroes them. A class the plugin builds in place of megatron's (the owner
engine's path), with the behaviour `main_grad_add.install_first_grad_overwrite` gives megatron's own DDP objects.
Where something else writes `main_grad` (TE's wgrad fusion, CUDA graphs, extra main grads) it zeroes as megatron.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel

from megatron_muon.megatron.main_grad_add import (
    first_grad_overwrite_possible,
    install_main_grad_add,
    mark_first_grads_pending,
    zero_gradless,
)


class OverwritingDistributedDataParallel(DistributedDataParallel):
    """DDP without the per-step zeroing of its gradient buffers (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install_main_grad_add(self)
        self.overwrites_first_gradient = first_grad_overwrite_possible(self)

    def zero_grad_buffer(self):
        if not self.overwrites_first_gradient:
            return super().zero_grad_buffer()
        for param in self.params_with_grad:  # as megatron: the hook sets it when it has added the gradient
            param.grad_added_to_main_grad = False
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()
        mark_first_grads_pending(self.params_with_grad)

    def start_grad_sync(self, *args, **kwargs):
        zero_gradless(self.params_with_grad)
        return super().start_grad_sync(*args, **kwargs)

    def finish_grad_sync(self, *args, **kwargs):
        zero_gradless(self.params_with_grad)
        return super().finish_grad_sync(*args, **kwargs)
