"""Backend choice: correct kernels only, the right one on Hopper + old Triton, and messages that say what to install."""

from importlib import metadata

import pytest
from packaging.version import Version

from megatron_muon.ops import backend, kernel_choice
from megatron_muon.ops.backend import Hardware


def _hw(capability, triton):
    return Hardware(True, capability, "test GPU", Version(triton))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV_VAR, raising=False)
    monkeypatch.delenv(kernel_choice.KERNELS_ENV_VAR, raising=False)
    monkeypatch.setattr(kernel_choice, "_chosen", None)
    monkeypatch.setattr(backend, "_require_fla", lambda hw: None)
    monkeypatch.setattr(backend, "_selected", None)
    monkeypatch.setattr(backend, "_requested", None)


def _tilelang(monkeypatch, usable):
    monkeypatch.setattr(backend, "_fla_will_use_tilelang", lambda: usable)


def test_cpu_only_machine_uses_torch(monkeypatch):
    assert backend._choose(Hardware(False, None, None, None)) == "torch"
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "fla-triton")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        backend._choose(Hardware(False, None, None, None))


@pytest.mark.parametrize("triton", ["3.4.0", "3.6.0", "3.7.0"])
def test_hopper_with_miscompiling_triton_picks_tilelang(monkeypatch, triton):
    _tilelang(monkeypatch, True)
    assert not _hw((9, 0), triton).fla_triton_correct
    assert backend._choose(_hw((9, 0), triton)) == "fla-tilelang"


def test_hopper_with_miscompiling_triton_and_no_tilelang_runs_triton_with_our_kernel(monkeypatch, caplog):
    """Our output-gradient kernel replaces the miscompiled one, so dense batches need no TileLang; the warning
    says what packed sequences still need."""
    _tilelang(monkeypatch, False)
    with caplog.at_level("WARNING", logger=backend.__name__):
        assert backend._choose(_hw((9, 0), "3.6.0")) == "fla-triton"
    assert "pip install tilelang" in caplog.text and "Packed sequences" in caplog.text


def test_hopper_with_miscompiling_triton_without_our_kernels_says_what_to_install(monkeypatch):
    _tilelang(monkeypatch, False)
    monkeypatch.setenv(kernel_choice.KERNELS_ENV_VAR, "fla")
    with pytest.raises(RuntimeError, match=r"3\.7\.1.*MEGATRON_MUON_GDN_KERNELS.*states='fla'.*pip install tilelang") \
            as info:
        backend._choose(_hw((9, 0), "3.6.0"))
    assert f"{backend.BACKEND_ENV_VAR}=torch" in str(info.value)


def test_forcing_triton_where_it_is_known_wrong_raises_without_our_kernels(monkeypatch):
    _tilelang(monkeypatch, False)  # TileLang absent, or turned off with FLA_TILELANG=0
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "fla-triton")
    kernel_choice.set_gdn_kernels("fla")
    with pytest.raises(RuntimeError, match="known to be wrong"):
        backend._choose(_hw((9, 0), "3.6.0"))
    kernel_choice.set_gdn_kernels(kernel_choice.GdnKernels(states="fla", output_grads="ours"))  # ours replaces it
    assert backend._choose(_hw((9, 0), "3.6.0")) == "fla-triton"


@pytest.mark.parametrize("capability, triton", [((9, 0), "3.7.1"), ((8, 0), "3.6.0"), ((10, 0), "3.6.0"),
                                                ((9, 0), "3.3.1")])
def test_triton_where_it_is_correct(monkeypatch, capability, triton):
    _tilelang(monkeypatch, False)
    assert backend._choose(_hw(capability, triton)) == "fla-triton"


def test_forced_triton_while_fla_routes_to_tilelang_says_how_to_turn_that_off(monkeypatch):
    """FLA reads FLA_TILELANG itself at every call; the plugin writes no environment, so it names the setting."""
    import os

    _tilelang(monkeypatch, True)
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "fla-triton")
    before = dict(os.environ)
    with pytest.raises(ValueError, match="FLA_TILELANG=0"):
        backend._choose(_hw((9, 0), "3.7.1"))
    assert dict(os.environ) == before
    _tilelang(monkeypatch, False)  # what FLA_TILELANG=0 makes FLA's own switch say
    assert backend._choose(_hw((9, 0), "3.7.1")) == "fla-triton"


def test_forced_tilelang_without_tilelang_raises(monkeypatch):
    _tilelang(monkeypatch, False)
    backend.set_backend("fla-tilelang")
    with pytest.raises(RuntimeError, match="pip install tilelang"):
        backend._choose(_hw((9, 0), "3.7.1"))


def test_torch_can_be_forced_on_a_gpu(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "torch")
    assert backend._choose(_hw((9, 0), "3.6.0")) == "torch"


def test_missing_fla_names_the_packages(monkeypatch):
    monkeypatch.undo()  # restore the real _require_fla
    real_version = metadata.version

    def version(name):
        if name == "fla-core":
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(backend.metadata, "version", version)
    with pytest.raises(RuntimeError, match=r"pip install .*flash-linear-attention>=0.6,<0.7.* tilelang"):
        backend._require_fla(_hw((9, 0), "3.6.0"))


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="unknown GDN backend"):
        backend.set_backend("cuda")


def test_selection_is_made_once_and_reported(monkeypatch):
    calls = []
    monkeypatch.setattr(backend, "_choose", lambda hw: calls.append(hw) or "torch")
    assert backend.selected_backend() == "torch"
    assert backend.selected_backend() == "torch"
    assert len(calls) == 1


@pytest.mark.parametrize("capability, triton, tilelang, refused", [
    ((9, 0), "3.6.0", False, True),   # Hopper, miscompiling Triton, no TileLang: FLA stops in its first backward
    ((9, 0), "3.6.0", True, False),   # FLA routes the backward to TileLang
    ((9, 0), "3.7.1", False, False),  # fixed Triton
    ((8, 0), "3.6.0", False, False),  # not Hopper
])
def test_flas_own_backward_refusal_is_named_before_a_run(monkeypatch, capability, triton, tilelang, refused):
    """What megatron-core's GatedDeltaNet (FLA called directly, none of our kernels) meets on this machine."""
    _tilelang(monkeypatch, tilelang)
    monkeypatch.setattr(backend, "hardware", lambda: _hw(capability, triton))
    reason = backend.fla_own_backward_refusal()
    assert (reason is not None) == refused
    if refused:
        assert "Triton 3.6.0" in reason and "pip install tilelang==0.1.15" in reason
