"""Registration of the plugin's optimizers into megatron-core's optimizer factory."""


def register_optimizers() -> None:
    """Filled by the Muon optimizer: puts `muon`/`dist_muon` entries into megatron-core's registry."""
