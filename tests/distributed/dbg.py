import torch
from tests.distributed.dist_training import OVERLAP, build, owner_optimizers, train_step
from tests.megatron.muon_training import one_thread
def probe(rank, world_size):
    from megatron.core.optimizer import clip_grads
    with one_thread():
        model, optimizer = build(1, 1, "dist_muon", "fp32", "gpt", clip_grad=1e-3, ddp_overrides=OVERLAP)
        owner = owner_optimizers(optimizer)[0]
        owner.newton_schulz_start = "backward_end"
        info = {"chain": type(optimizer).__name__, "children": [type(c).__name__ for c in optimizer.chained_optimizers],
                "tensor_impl": clip_grads.multi_tensor_scale_tensor_impl is not None,
                "clip": owner.config.clip_grad}
        try:
            info["shared"] = optimizer.grads_states_parallel_group_is_shared()
            info["carriers"] = len(optimizer._clip_carriers())
        except Exception as e:
            info["err"] = repr(e)
        return info
