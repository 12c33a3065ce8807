"""Which megatron-core releases the plugin is written against, and a check that says what to install."""

from importlib import metadata

from packaging.version import Version

SUPPORTED_MEGATRON_CORE = (">=0.19.2", "<0.20")
_LOWEST, _BELOW = Version("0.19.2"), Version("0.20")


def installed_megatron_core_version() -> str | None:
    """The installed megatron-core version string, or None when it is not installed."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def check_megatron_core(version: str | None = None) -> str:
    """Return the megatron-core version, or raise one sentence naming the fix."""
    found = installed_megatron_core_version() if version is None else version
    fix = 'install a supported one with `pip install "megatron-core>=0.19.2,<0.20"`'
    if found is None:
        raise RuntimeError(f"megatron_muon needs megatron-core 0.19.x (>=0.19.2) but it is not installed; {fix}.")
    parsed = Version(found)
    if not (_LOWEST <= Version(parsed.base_version) < _BELOW):
        raise RuntimeError(
            f"megatron_muon supports megatron-core >=0.19.2,<0.20 but megatron-core {found} is installed; {fix}."
        )
    return found
