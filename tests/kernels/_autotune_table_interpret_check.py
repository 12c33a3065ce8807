"""Run under TRITON_INTERPRET=1 in a subprocess: a key pinned from a table runs its config without timing any."""

import torch
import triton

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.kernels import autotune_table  # noqa: E402
from tests.kernels import _autotuned  # noqa: E402


def main():
    x = torch.arange(100, dtype=torch.float32)
    y = torch.empty_like(x)
    tuner = _autotuned.double
    key = (100, "torch.float32", "torch.float32")
    table = {"format": autotune_table.FORMAT, "device": "cpu", "triton": triton.__version__,
             "kernels": {"tests.kernels._autotuned:double": [{"key": list(key), "config": {
                 "BLOCK": 32, "num_warps": 2, "num_ctas": 1, "num_stages": 3}}]}}
    assert autotune_table.pin(table, device_name="cpu") == {"pinned": 1, "stale": 0, "other_machine": 0}

    def no_timing(*args, **kwargs):
        raise AssertionError("a pinned key was timed")

    tuner._bench = no_timing
    tuner[(triton.cdiv(100, 32),)](x, y, 100)
    assert tuner.best_config is _autotuned.CONFIGS[1] and torch.equal(y, 2 * x)
    print("interpreter ok")


if __name__ == "__main__":
    main()
