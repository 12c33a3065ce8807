"""The Megatron-LM patch only imports and registers the plugin, and names the commit it fits."""

from pathlib import Path

PATCHES = Path(__file__).resolve().parents[2] / "patches"


def test_patch_adds_only_the_registration():
    patch = (PATCHES / "megatron-lm-core_r0.19.0-register-plugin.patch").read_text()
    added = [line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in patch.splitlines() if line.startswith("-") and not line.startswith("---")]
    code = [line for line in added if line.strip()]
    assert removed == []
    assert [line.split("#")[0].strip() for line in code] == ["import megatron_muon", "megatron_muon.register()"] * 2
    touched = [line.split()[-1] for line in patch.splitlines() if line.startswith("+++")]
    assert touched == ["b/pretrain_gpt.py", "b/pretrain_hybrid.py"]


def test_readme_pins_the_commit():
    readme = (PATCHES / "README.md").read_text()
    assert "f8837c04ef6cbef6cdefb8de001aad63178aebbf" in readme and "core_r0.19.0" in readme
