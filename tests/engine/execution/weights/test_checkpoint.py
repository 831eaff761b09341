"""Model resolution: default, local directory, GGUF file, hub id, and clear errors."""
from __future__ import annotations

import os
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


def test_a_gguf_cache_keeps_only_entries_of_files_that_still_exist(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries are keyed by a file's path, size and time: once the file is replaced or deleted no
    key finds its entry again, so the next conversion removes it (the converted cache had grown to
    43 GB of test files' entries). The conversion itself is stood in for (it needs a real file)."""
    from engine.execution.weights import checkpoint

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    made: list[Path] = []

    def fake_convert(gguf: Path, target: Path) -> None:
        checkpoint._write_model_dir(target, _Config(), _Config(), _Tokenizer(), source=checkpoint._gguf_source(gguf))
        made.append(target)

    monkeypatch.setattr(checkpoint, "convert_gguf", fake_convert)
    kept, replaced, deleted = (tmp_path / f"{name}.gguf" for name in ("kept", "replaced", "deleted"))
    for path in (kept, replaced, deleted):
        path.write_bytes(b"GGUF one")
    entries = {path.stem: resolve_model(str(path)) for path in (kept, replaced, deleted)}
    assert len(made) == 3 and all((entry / "source.json").exists() for entry in entries.values())
    legacy = entries["kept"].parent / "legacy-0123456789abcdef"  # made before sources were recorded
    legacy.mkdir()
    abandoned = entries["kept"].parent / ".half-written-x"
    abandoned.mkdir()
    os.utime(abandoned, (0, 0))
    fresh_tmp = entries["kept"].parent / ".being-written-y"  # another process's conversion, under way
    fresh_tmp.mkdir()
    replaced.write_bytes(b"GGUF two, longer")
    deleted.unlink()
    assert resolve_model(str(kept)) == entries["kept"] and len(made) == 3  # a hit prunes nothing
    new_entry = resolve_model(str(replaced))  # a miss: converted again, the stale entries go
    assert len(made) == 4 and new_entry != entries["replaced"]
    left = {entry.name for entry in entries["kept"].parent.iterdir()}
    assert left == {entries["kept"].name, new_entry.name, fresh_tmp.name}


class _Config:
    def to_dict(self) -> dict:
        return {}

    def save_pretrained(self, path: str) -> None:
        (Path(path) / "generation_config.json").write_text("{}")


class _Tokenizer:
    def save_pretrained(self, path: str) -> None:
        (Path(path) / "tokenizer.json").write_text("{}")
