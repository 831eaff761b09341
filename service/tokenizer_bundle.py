"""The tokenizer's files as one zip, as the engine gRPC contract's GetTokenizer hands them to a
gateway that tokenizes for the workers (the file set the gateway's tokenizer loader reads)."""
from __future__ import annotations

import io
import zipfile
from pathlib import Path

CHUNK_BYTES = 64 * 1024  # per GetTokenizerChunk, within the gateway client's message limit
_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
          "chat_template.json")
_PATTERNS = ("*.tiktoken", "*.jinja", "*.model")


def build_tokenizer_zip(tokenizer_dir: Path) -> bytes:
    """FileNotFoundError when the directory holds no tokenizer file."""
    names = [name for name in _FILES if (tokenizer_dir / name).is_file()]
    for pattern in _PATTERNS:
        names += sorted(p.name for p in tokenizer_dir.glob(pattern) if p.is_file() and p.name not in names)
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {tokenizer_dir}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.write(tokenizer_dir / name, name)
    return buffer.getvalue()
