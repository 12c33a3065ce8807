"""megatron-core's `muon_*` options as one value, `MuonConfig`, read once and handed to `Muon`, the owner engine and
the owner plan's cost model.

Every `muon_*` option keeps its megatron meaning: coefficient names resolve to the same schedules (and iteration
modes) as megatron-core's emerging-optimizers backend, `muon_fp32_matmul_prec` picks the Newton–Schulz dtype,
`muon_tp_mode` picks blockwise or TP-invariant gathering, `muon_split_qkv` the fused-projection split (and this
plugin's `muon_split_heads` a split of those sections per head). The same names
are read from megatron's `OptimizerConfig`, Megatron-LM's parsed arguments and the training recipe's optimizer
section, so all three paths build the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_muon.kernels.coefficients import COEFFICIENT_SETS, resolve_coefficients, warn_if_unsafe
from megatron_muon.kernels.settings import Orthogonalizer
from megatron_muon.optimizer.routing import MatrixLayout, matrix_layout, tag_fused_in_proj

# This plugin's options where the job's options object does not carry them (Megatron-LM's parsed arguments and
# OptimizerConfig have no field for them): the launcher's flags set these process defaults (`set_plugin_default`).
_PLUGIN_DEFAULTS: dict[str, Any] = {"muon_split_heads": False}


def set_plugin_default(name: str, value: Any) -> None:
    """The value of plugin option `name` for options objects that do not carry it (the launcher's flags)."""
    if name not in _PLUGIN_DEFAULTS:
        raise ValueError(f"unknown plugin option {name!r}; valid choices: {sorted(_PLUGIN_DEFAULTS)}")
    _PLUGIN_DEFAULTS[name] = value


def _plugin_option(options, name: str) -> Any:
    return getattr(options, name, _PLUGIN_DEFAULTS[name])


# muon_fp32_matmul_prec → Newton–Schulz iteration dtype ("medium": the kernel's bf16/fp16 choice).
_MATMUL_PRECISION_DTYPES = {"medium": None, "high": torch.float32, "highest": torch.float32}
MEGATRON_COEFFICIENT_TYPE = "quintic"  # OptimizerConfig.muon_coefficient_type's default


def megatron_coefficient_schedule(name: str, steps: int) -> list[tuple[float, float, float]]:
    """Exactly `steps` (a, b, c) triples for a megatron `muon_coefficient_type` name (the package's one table)."""
    if not isinstance(name, str) or name.lower() not in COEFFICIENT_SETS:
        raise ValueError(f"unknown muon_coefficient_type {name!r}; valid choices: {sorted(COEFFICIENT_SETS)}")
    if steps < 1:
        raise ValueError(f"muon_num_ns_steps must be >= 1, got {steps}")
    warn_if_unsafe(name)
    return resolve_coefficients(name, steps)


@dataclass(frozen=True)
class MuonConfig:
    """The Muon-specific settings of one training job (megatron's defaults; lr and weight decay stay megatron's)."""

    orthogonalizer: Orthogonalizer = field(default_factory=lambda: Orthogonalizer(
        5, tuple(megatron_coefficient_schedule(MEGATRON_COEFFICIENT_TYPE, 5))))
    momentum: float = 0.95
    nesterov: bool = False
    scale_mode: str = "spectral"
    extra_scale: float = 1.0
    split_fused: bool = True
    split_heads: bool = False  # this plugin's: fused sections orthogonalized per head
    tp_mode: str = "blockwise"
    graph_newton_schulz: bool = False  # the step's stacks and NS (and the owners' speculation) from CUDA graphs

    @classmethod
    def from_options(cls, options) -> MuonConfig:
        """From anything carrying megatron's `muon_*` names: an OptimizerConfig, Megatron-LM's args, the recipe's
        optimizer section (a missing name keeps megatron's default). `muon_ns_method`, `muon_split_heads` and
        `muon_graph_newton_schulz` are this plugin's additions."""
        defaults = cls()
        precision = getattr(options, "muon_fp32_matmul_prec", "medium")
        if precision not in _MATMUL_PRECISION_DTYPES:
            raise ValueError(
                f"unknown muon_fp32_matmul_prec {precision!r}; valid choices: {sorted(_MATMUL_PRECISION_DTYPES)}")
        steps = getattr(options, "muon_num_ns_steps", defaults.orthogonalizer.steps)
        schedule = megatron_coefficient_schedule(getattr(options, "muon_coefficient_type", MEGATRON_COEFFICIENT_TYPE), steps)
        return cls(
            orthogonalizer=Orthogonalizer(steps, tuple(schedule), getattr(options, "muon_ns_method", "auto"),
                                          compute_dtype=_MATMUL_PRECISION_DTYPES[precision]),
            momentum=getattr(options, "muon_momentum", defaults.momentum),
            nesterov=getattr(options, "muon_nesterov", defaults.nesterov),
            scale_mode=getattr(options, "muon_scale_mode", defaults.scale_mode),
            extra_scale=getattr(options, "muon_extra_scale_factor", defaults.extra_scale),
            split_fused=getattr(options, "muon_split_qkv", defaults.split_fused),
            split_heads=bool(_plugin_option(options, "muon_split_heads")),
            tp_mode=getattr(options, "muon_tp_mode", defaults.tp_mode),
            graph_newton_schulz=bool(getattr(options, "muon_graph_newton_schulz", defaults.graph_newton_schulz)),
        )

    def muon_kwargs(self) -> dict[str, Any]:
        """`Muon` / `WaveMuon` keyword arguments for these settings."""
        return dict(momentum=self.momentum, nesterov=self.nesterov, scale_mode=self.scale_mode,
                    extra_scale=self.extra_scale, split_fused=self.split_fused, split_heads=self.split_heads,
                    tp_mode=self.tp_mode,
                    graph_newton_schulz=self.graph_newton_schulz,
                    **self.orthogonalizer.muon_kwargs())


def tp_group_fn_for(pg_collection):
    """Which TP group shards a parameter: expert TP for expert weights, TP otherwise."""
    if pg_collection is None:
        return None

    def tp_group(param: torch.Tensor):
        if getattr(param, "expert_tp", False):
            return getattr(pg_collection, "expt_tp", None)
        return getattr(pg_collection, "tp", None)

    return tp_group


class MainParamLayouts:
    """Layouts of fp32 master copies, read from the model parameter they were copied from.

    Megatron's mixed-precision wrapper copies only its own attributes onto master weights, so plugin attributes
    (e.g. `muon_num_experts`) are looked up on the model parameter through its `main_param` link.
    """

    def __init__(self, model_chunks, split_fused: bool, split_heads: bool = False):
        self.model_chunks = model_chunks
        self.split_fused = split_fused
        self.split_heads = split_heads
        self._source: dict[int, torch.Tensor] = {}

    def _refresh(self) -> None:
        self._source = {}
        for chunk in self.model_chunks:
            for param in chunk.parameters():
                self._source[id(param)] = param
                main = getattr(param, "main_param", None)
                if main is not None:
                    self._source[id(main)] = param

    def __call__(self, param: torch.Tensor) -> MatrixLayout:
        if id(param) not in self._source:
            self._refresh()
        source = self._source.get(id(param), param)
        if source.shape != param.shape:
            source = param
        return matrix_layout(source, split_fused=self.split_fused, split_heads=self.split_heads)


def muon_kwargs_from_config(config, model_chunks, pg_collection) -> dict[str, Any]:
    """Constructor arguments of `Muon` for an OptimizerConfig (megatron's `config_to_kwargs` hook)."""
    for chunk in model_chunks:
        tag_fused_in_proj(chunk)
    muon = MuonConfig.from_options(config)
    return dict(
        lr=config.lr,
        weight_decay=config.weight_decay,
        weight_decay_mode="decoupled" if config.decoupled_weight_decay else "l2",
        tp_group_fn=tp_group_fn_for(pg_collection),
        layout_fn=MainParamLayouts(model_chunks, muon.split_fused, muon.split_heads),
        # Megatron's mixed-precision wrapper owns found-inf skipping; a per-step host sync here would only cost.
        check_finite=False,
        **muon.muon_kwargs(),
    )
