"""Glue into megatron-core. Nothing outside this package imports megatron internals for registration."""


def register_into_megatron() -> None:
    """Install the plugin's entries into megatron-core's registries (optimizers, specs).

    Each feature adds its own call here; every call must be idempotent.
    """
    from megatron_muon.megatron import optimizer_registry

    optimizer_registry.register_optimizers()
    from megatron_muon.megatron import tensor_fallbacks

    tensor_fallbacks.install_foreach_fallbacks()
    from megatron_muon.megatron import viewless

    viewless.install_compile_aware_viewless_tensor()
