"""torch.compile(fullgraph=True) through every op: no graph breaks, and no recompiles across layers."""

import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from megatron_muon.ops import causal_conv1d, chunk_gated_delta_rule, gated_rms_norm


class TinyGatedDeltaMixer(torch.nn.Module):
    """Projection -> conv -> (q, k l2-normed in the kernel) -> GDN -> gated norm -> projection, with tiny sizes."""

    def __init__(self, hidden=16, heads=2, value_heads=4, key_dim=8, value_dim=8, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.key_dim, self.value_dim = key_dim, value_dim
        self.split = [heads * key_dim, heads * key_dim, value_heads * value_dim, value_heads * value_dim,
                      value_heads, value_heads]
        self.in_proj = torch.nn.Linear(hidden, sum(self.split), bias=False)
        self.conv_weight = torch.nn.Parameter(torch.randn(sum(self.split[:3]), 4) * 0.3)
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(value_dim))
        self.out_proj = torch.nn.Linear(value_heads * value_dim, hidden, bias=False)

    def forward(self, x):
        batch, seq_len, _ = x.shape
        q, k, v, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        qkv = causal_conv1d(torch.cat([q, k, v], -1), self.conv_weight, activation="silu")
        q, k, v = qkv.split(self.split[:3], dim=-1)
        q, k = (t.unflatten(-1, (-1, self.key_dim)) for t in (q, k))
        v = v.unflatten(-1, (-1, self.value_dim))
        o, _ = chunk_gated_delta_rule(q, k, v, F.logsigmoid(a.float()), b.sigmoid(), use_qk_l2norm_in_kernel=True)
        o = gated_rms_norm(o, z.unflatten(-1, (-1, self.value_dim)), self.norm_weight)
        return self.out_proj(o.flatten(-2))


def _run_layer(layer, x):
    return layer(x)


def test_compile_fullgraph_no_breaks_no_recompiles_across_layers():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layers = [TinyGatedDeltaMixer(seed=i) for i in range(4)]
    x = torch.randn(2, 70, 16)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_run_layer, backend=counter, fullgraph=True)
    for layer in layers:
        x_eager = x.clone().requires_grad_()
        eager = layer(x_eager)
        eager.square().sum().backward()
        eager_grads = [p.grad.clone() for p in layer.parameters()] + [x_eager.grad]
        layer.zero_grad(set_to_none=True)
        x_compiled = x.clone().requires_grad_()
        out = compiled(layer, x_compiled)
        out.square().sum().backward()
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
        for got, expected in zip([p.grad for p in layer.parameters()] + [x_compiled.grad], eager_grads):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, f"{counter.frame_count} compiled frames for 4 layers: something recompiled"
    assert counter.op_count > 0
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_gated_norm_equals_the_op_on_a_strided_gate():
    """Compiled graphs take the composite gated RMSNorm (Inductor reads the strided gate in place); it must equal the
    custom op: outputs and all three gradients, fp32 to rounding and bf16 to one bf16 rounding of the output."""
    torch._dynamo.reset()
    compiled = torch.compile(gated_rms_norm, backend="inductor", fullgraph=True)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        torch.manual_seed(3)
        x = torch.randn(2, 33, 3, 16, dtype=dtype)
        projected = torch.randn(2, 33, 3 * 16 + 5, dtype=dtype)  # the gate is a column section of a wider tensor
        weight = 1 + 0.1 * torch.randn(16, dtype=dtype)
        results = []
        for fn in (gated_rms_norm, compiled):
            leaves = [t.clone().requires_grad_() for t in (x, projected, weight)]
            gate = leaves[1][..., 5:].unflatten(-1, (3, 16))
            assert not gate.is_contiguous()
            out = fn(leaves[0], gate, leaves[2])
            out.float().square().sum().backward()
            results.append([out, *(leaf.grad for leaf in leaves)])
        for got, expected in zip(results[1], results[0]):
            torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
