"""Run under TRITON_INTERPRET=1 in a subprocess: the GVA group-sum kernel on CPU against the fp64 sum."""

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.ops import group_sum as module  # noqa: E402


def main():
    gen = torch.Generator().manual_seed(0)
    # (batch, tokens, query/key heads, group, key dim): rows not a multiple of the program's, groups of 1, 2, 3,
    # key dims that are and are not a power of two
    cases = [(1, 37, 2, 2, 64), (2, 20, 3, 3, 128), (1, 9, 1, 1, 256), (1, 33, 2, 4, 96)]
    for dtype in (torch.float32, torch.float16):
        for batch, tokens, heads, group, key_dim in cases:
            x = torch.randn(batch, tokens, heads * group, key_dim, generator=gen).to(dtype)
            other = torch.randn(x.shape, generator=gen).to(dtype)
            for extra in (None, other):
                got = module.group_sum(x, heads, extra)
                both = x.double() if extra is None else x.double() + extra.double()
                want = both.view(batch, tokens, heads, group, key_dim).sum(3)
                assert got.dtype == dtype and got.shape == want.shape
                # fp32 accumulation of at most eight terms, one rounding to the dtype
                tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
                torch.testing.assert_close(got.double(), want.to(dtype).double(), **tolerance)
    print("interpreter ok")


if __name__ == "__main__":
    main()
