"""GDN config validation: every mistake a user can make is a ValueError that says what to change."""

from types import SimpleNamespace

import pytest

from megatron_muon.layers.gdn_config import gdn_shape_from_config

VALID = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=64,
             linear_conv_kernel_dim=4, context_parallel_size=1)


def _config(**overrides):
    values = dict(VALID)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_valid_config_gives_megatron_section_sizes():
    shape = gdn_shape_from_config(_config(), tp_size=2)
    assert shape.in_proj_sections == (128, 128, 512, 512, 8, 8)  # q | k | v | z | beta | alpha
    assert shape.conv_sections == (128, 128, 512)
    assert shape.in_proj_dim == 1296


def test_reference_workload_in_proj_matches_design():
    # hybrid-1.5B: 6 heads, key dim 256, value dim 512 -> in_proj 9228 x 2048 (DESIGN.md)
    shape = gdn_shape_from_config(_config(linear_num_key_heads=6, linear_num_value_heads=6, linear_key_head_dim=256,
                                          linear_value_head_dim=512))
    assert shape.in_proj_dim == 9228


@pytest.mark.parametrize(
    "overrides,tp,needle",
    [
        (dict(linear_num_value_heads=6), 1, "multiple of linear_num_key_heads"),
        (dict(linear_num_key_heads=3, linear_num_value_heads=6), 2, "divisible by the tensor-parallel size"),
        (dict(linear_num_value_heads=12, linear_num_key_heads=4), 8, "divisible by the tensor-parallel size"),
        (dict(linear_key_head_dim=None), 1, "linear_key_head_dim"),
        (dict(linear_conv_kernel_dim=0), 1, "positive integers"),
        (dict(context_parallel_size=2), 1, "context parallelism"),
    ],
    ids=["value-not-multiple", "key-heads-vs-tp", "value-heads-vs-tp", "missing", "zero", "cp"],
)
def test_invalid_configs_raise_with_the_fix(overrides, tp, needle):
    with pytest.raises(ValueError, match=needle):
        gdn_shape_from_config(_config(**overrides), tp_size=tp)
