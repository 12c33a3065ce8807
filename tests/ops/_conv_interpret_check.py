"""Run under TRITON_INTERPRET=1 in a subprocess: the causal conv's Triton backward on CPU against the torch version."""

import torch

from megatron_muon.ops import conv_triton
from megatron_muon.ops.conv import _torch_backward


def main():
    g = torch.Generator().manual_seed(0)
    # a strided input (a slice of a wider projection, as the GDN layer passes it), partial tiles in T and D, batches
    for batch, seq, channels, width, with_bias, dtype in [
        (2, 37, 40, 4, True, torch.bfloat16), (1, 16, 16, 3, False, torch.float32),
        (1, 50, 33, 4, False, torch.float16), (1, 5, 24, 4, True, torch.float32),  # the last: fewer tokens than taps
    ]:
        wide = torch.randn(batch, seq, channels + 7, generator=g).to(dtype)
        x = wide[..., 3 : 3 + channels]
        weight = torch.randn(channels, width, generator=g).to(dtype)
        bias = torch.randn(channels, generator=g).to(dtype) if with_bias else None
        dy = torch.randn(batch, seq, channels, generator=g).to(dtype)
        assert conv_triton.qualifies(x, weight, dy, None, None)
        got = conv_triton.conv_backward(x, weight, bias, dy)
        want = _torch_backward(x, weight, bias, None, None, dy)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        if with_bias:
            torch.testing.assert_close(got[2], want[2])
        else:
            assert got[2] is None
    x = torch.randn(1, 8, 4, generator=g)
    assert not conv_triton.qualifies(x, torch.randn(4, 4), x, "silu", None)  # activations stay with FLA
    assert not conv_triton.qualifies(x, torch.randn(4, 4), x, None, torch.tensor([0, 8]))  # so do packed sequences
    assert not conv_triton.qualifies(x.mT.contiguous().mT, torch.randn(4, 4), x, None, None)  # channel stride != 1
    print("interpreter ok")


if __name__ == "__main__":
    main()
