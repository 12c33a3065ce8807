"""What `model.spec_backend: auto` builds: TE's modules when TE is importable, except a compiled hybrid (TE's linears
are dynamo-disabled, so its layers could not compile whole); an explicit `te` without TE names the fix."""

import pytest

from megatron_muon.training import model as training_model
from megatron_muon.training.recipes import load_recipe


@pytest.mark.parametrize("kind, compiled, te_importable, expected", [
    ("hybrid", True, True, "local"),
    ("hybrid", False, True, "te"),
    ("hybrid", False, False, "local"),
    ("gpt", True, True, "te"),
    ("gpt", True, False, "local"),
])
def test_auto_backend(monkeypatch, kind, compiled, te_importable, expected):
    monkeypatch.setattr(training_model, "transformer_engine_available", lambda: te_importable)
    recipe = load_recipe("tiny-cpu", [f"model.kind={kind}", "model.spec_backend=auto",
                                      f"training.torch_compile={str(compiled).lower()}"])
    assert training_model.spec_backend(recipe) == expected


def test_explicit_te_is_kept_when_compiled_and_refused_without_te(monkeypatch):
    recipe = load_recipe("tiny-cpu", ["model.spec_backend=te", "training.torch_compile=true"])
    monkeypatch.setattr(training_model, "transformer_engine_available", lambda: True)
    assert training_model.spec_backend(recipe) == "te"
    monkeypatch.setattr(training_model, "transformer_engine_available", lambda: False)
    with pytest.raises(Exception, match="model.spec_backend=local"):
        training_model.spec_backend(recipe)
