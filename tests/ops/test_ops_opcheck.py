"""torch.library.opcheck on every custom op: schema, fake kernel, autograd registration, AOT dispatch."""

from pathlib import Path

import pytest
import torch

from megatron_muon.ops import conv, gdn, norm
from tests.interpreter import run_under_interpreter
from tests.ops.helpers import gdn_inputs


def _grad(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _gdn_cases():
    q, k, v, g, beta, h0 = gdn_inputs(2, 70, 1, 2, 8, 8, seed=11)
    yield "fixed", (*_grad(q, k, v, g, beta), 0.5, _grad(h0)[0], True, None, True)
    yield "no-state", (*_grad(q, k, v, g, beta), 0.5, None, False, None, False)
    q, k, v, g, beta, h0 = gdn_inputs(1, 50, 1, 1, 8, 8, num_states=2, seed=12)
    yield "varlen", (*_grad(q, k, v, g, beta), 1.0, _grad(h0)[0], True, torch.tensor([0, 20, 50]), True)


@pytest.mark.parametrize("case", list(_gdn_cases()), ids=lambda case: case[0])
def test_gdn_chunk_ops(case):
    _, args = case
    torch.library.opcheck(gdn.gdn_chunk_fwd, args)
    q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, keep_states = [
        a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    o, ht, *private = gdn.gdn_chunk_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, keep_states)
    dht = torch.randn_like(ht) if output_final_state else None
    torch.library.opcheck(
        gdn.gdn_chunk_bwd, (q, k, v, g, beta, *private, scale, h0, cu_seqlens, torch.randn_like(o), dht))


def test_gdn_chunk_ops_on_the_kernel_path_under_the_interpreter():
    """The same ops on the CUDA path's kernels (ours throughout, run by Triton's interpreter on CPU, no FLA): opcheck
    with the chunk states kept, and the op compiled with fullgraph equal to eager and to the fp64 recurrence."""
    run_under_interpreter(Path(__file__).with_name("_gdn_op_interpret_check.py"))


@pytest.mark.parametrize("use_bias, activation, varlen", [(True, "silu", False), (False, None, True)])
def test_causal_conv1d_ops(use_bias, activation, varlen):
    x, weight = torch.randn(1, 19, 6), torch.randn(6, 4)
    bias = torch.randn(6) if use_bias else None
    cu_seqlens = torch.tensor([0, 7, 19]) if varlen else None
    torch.library.opcheck(conv.causal_conv1d_fwd, (*_grad(x, weight), *(_grad(bias) if use_bias else [None]),
                                                   activation, cu_seqlens))
    torch.library.opcheck(conv.causal_conv1d_bwd, (x, weight, bias, activation, cu_seqlens, torch.randn_like(x)))


def test_norm_ops():
    x, gate, weight = torch.randn(3, 4, 8), torch.randn(3, 4, 8), torch.randn(8)
    torch.library.opcheck(norm.l2norm_fwd, (*_grad(x), 1e-6))
    y, rstd = norm.l2norm_fwd(x, 1e-6)
    torch.library.opcheck(norm.l2norm_bwd, (y, rstd, torch.randn_like(x), 1e-6))
    torch.library.opcheck(norm.gated_rms_norm_fwd, (*_grad(x, gate, weight), 1e-6))
    _, rstd = norm.gated_rms_norm_fwd(x, gate, weight, 1e-6)
    torch.library.opcheck(norm.gated_rms_norm_bwd, (x, gate, weight, rstd, torch.randn_like(x), 1e-6))
