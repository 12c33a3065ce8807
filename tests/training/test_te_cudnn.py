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
