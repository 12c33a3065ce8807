"""Local (non-TE) linear layers that torch.compile can trace in one graph."""

from megatron.core.tensor_parallel.layers import RowParallelLinear


class CompilableRowParallelLinear(RowParallelLinear):
    """megatron-core 0.19's RowParallelLinear hands `tp_group=None` to its matmul, which then calls
    `warnings.warn` on rank 0 (a graph break under torch.compile); pass the layer's own group instead.

    Same parameters, state dict and math: the group is unused by the matmul here (no sequence-parallel gather,
    no dgrad all-reduce), the output reduction still happens in `forward`.
    """

    def _forward_impl(self, input, weight, *args, **kwargs):
        kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)
