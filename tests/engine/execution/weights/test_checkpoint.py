"""Model resolution: default, local directory, GGUF file, hub id, and clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.execution.weights.checkpoint import DEFAULT_MODEL_NAME, model_display_name, resolve_model


def test_local_directory_is_used_as_is(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    assert model_display_name(str(tiny_model_dir)) == tiny_model_dir.name
    assert model_display_name(None) == DEFAULT_MODEL_NAME


def test_bad_model_values_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model: GGUF file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="neither a local directory"):
        resolve_model("./nope/not/here")


@pytest.mark.real_model
def test_default_model_is_cached_after_conversion(real_llm) -> None:
    path = resolve_model(None)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert (path / "tokenizer.json").exists() and path == real_llm.engine.model_dir
