"""The cuDNN check for Transformer Engine: the export line it names and when it refuses."""

import pytest

from megatron_muon.training import te_cudnn


def test_the_loader_environment_puts_torchs_cudnn_first_once(tmp_path, monkeypatch):
    folder = tmp_path / "nvidia" / "cudnn"
    (folder / "lib").mkdir(parents=True)
    monkeypatch.setattr(te_cudnn, "torch_cudnn_dir", lambda: folder)
    lib = str(folder / "lib")
    env = te_cudnn.loader_environment({"LD_LIBRARY_PATH": f"/usr/lib:{lib}:/opt/x"})
    assert env == {"CUDNN_HOME": str(folder), "LD_LIBRARY_PATH": f"{lib}:/usr/lib:/opt/x"}
    assert te_cudnn.loader_environment({})["LD_LIBRARY_PATH"] == lib


def test_no_wheel_cudnn_means_nothing_to_export(monkeypatch):
    monkeypatch.setattr(te_cudnn, "torch_cudnn_dir", lambda: None)
    assert te_cudnn.loader_environment({"LD_LIBRARY_PATH": "/usr/lib"}) == {}


def test_different_versions_raise_with_the_export_line(tmp_path, monkeypatch):
    folder = tmp_path / "cudnn"
    (folder / "lib").mkdir(parents=True)
    monkeypatch.setattr(te_cudnn, "torch_cudnn_dir", lambda: folder)
    monkeypatch.setattr(te_cudnn, "cudnn_versions", lambda: ((9, 19), (9, 14)))
    with pytest.raises(RuntimeError, match=r"cuDNN 9\.14 but torch runs 9\.19") as caught:
        te_cudnn.check_same_cudnn()
    assert f"CUDNN_HOME={folder}" in str(caught.value)
    assert f"LD_LIBRARY_PATH={folder / 'lib'}" in str(caught.value)


@pytest.mark.parametrize("versions", [((9, 19), (9, 19)), ((9, 19), None)])
def test_same_version_or_no_te_passes(monkeypatch, versions):
    monkeypatch.setattr(te_cudnn, "cudnn_versions", lambda: versions)
    te_cudnn.check_same_cudnn()


def test_torchs_version_is_decoded_as_major_minor():
    torch_version, _ = te_cudnn.cudnn_versions()
    assert torch_version[0] >= 8 and 0 <= torch_version[1] < 100


def _fake_transformer_engine(monkeypatch, reason):
    """A stand-in for TE's packages: `utils` holds the reason its custom-op registration recorded."""
    import sys
    import types

    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.dynamo",
             "transformer_engine.pytorch.dynamo.custom_op", "transformer_engine.pytorch.utils"]
    modules = {name: types.ModuleType(name) for name in names}
    modules["transformer_engine.pytorch.utils"]._compile_disabled_reason = reason
    for parent, child in zip(names, names[1:3]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    modules["transformer_engine.pytorch"].utils = modules["transformer_engine.pytorch.utils"]
    modules["transformer_engine.pytorch.dynamo"].custom_op = modules["transformer_engine.pytorch.dynamo.custom_op"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("reason", ["could not register OpaqueValueBundle as an opaque type", None])
def test_tes_compile_path_reports_the_reason_te_recorded(monkeypatch, reason):
    _fake_transformer_engine(monkeypatch, reason)
    assert te_cudnn.transformer_engine_compile_disabled() == reason


def test_without_te_its_compile_path_has_no_reason(monkeypatch):
    monkeypatch.setattr(te_cudnn, "transformer_engine_usable", lambda: False)
    assert te_cudnn.transformer_engine_compile_disabled() is None
