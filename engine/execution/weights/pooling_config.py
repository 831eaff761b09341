"""A sentence-transformers model directory's pooling recipe: modules.json names the modules
(Transformer, Pooling, Normalize...), 1_Pooling/config.json the pooling mode.

Both spellings of the pooling config are read: the older flags (`pooling_mode_lasttoken`: true,
as Qwen3-Embedding ships) and the newer single `pooling_mode` ("lasttoken"). write_pooler_config
writes a recipe in that layout (a GGUF file's pooling, into the directory of its config and
tokenizer), so one reader serves both.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.processing.pooling_params import PoolerConfig, PoolingType

logger = logging.getLogger(__name__)

# sentence-transformers' pooling modes -> ours; the others (max, weightedmean...) are refused.
_MODES = {"lasttoken": PoolingType.LAST, "cls": PoolingType.CLS, "cls_token": PoolingType.CLS,
          "mean": PoolingType.MEAN, "mean_tokens": PoolingType.MEAN}


# ours -> the mode a recipe is written with
_WRITTEN_MODES = {PoolingType.LAST: "lasttoken", PoolingType.CLS: "cls", PoolingType.MEAN: "mean"}


def load_pooler_config(model_dir: Path) -> PoolerConfig | None:
    """The model's pooling defaults from its modules.json, or None when it has none (not a
    sentence-transformers model). ValueError for a pooling mode the engine cannot run."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize = PoolingType.LAST, False
    has_pooling = False
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            has_pooling = True
            pooling_type = _pooling_mode(json.loads((Path(model_dir) / module["path"] / "config.json").read_text()))
        elif kind == "Normalize":
            normalize = True
    if not has_pooling:
        return None
    return PoolerConfig(pooling_type, normalize)


def _pooling_mode(config: dict) -> PoolingType:
    mode = config.get("pooling_mode")
    if mode is None:  # the older form: one boolean per mode
        modes = [name for name in _MODES if config.get(f"pooling_mode_{name}")]
        others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v
                  and k.removeprefix("pooling_mode_") not in _MODES]
        if len(modes) != 1 or others:
            raise ValueError(f"pooling config: exactly one of lasttoken, cls or mean pooling is supported, got "
                             f"{sorted(modes + others)}")
        mode = modes[0]
    if mode not in _MODES:
        raise ValueError(f"pooling config: pooling mode {mode!r} is not supported (lasttoken, cls or mean)")
    return _MODES[mode]


def write_pooler_config(model_dir: Path, config: PoolerConfig, hidden_size: int) -> None:
    """config as sentence-transformers saves a model's recipe: modules.json (the transformer at the
    directory's root, its pooling, a Normalize module where config normalises) and
    1_Pooling/config.json; load_pooler_config reads it back as config."""
    model_dir = Path(model_dir)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling")] + ([("2_Normalize", "Normalize")] if config.normalize else [])
    modules = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate(kinds)]
    for path, _ in kinds[1:]:
        (model_dir / path).mkdir(parents=True, exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden_size, "pooling_mode": _WRITTEN_MODES[config.pooling_type]}, indent=2))
    (model_dir / "modules.json").write_text(json.dumps(modules, indent=2))
