"""The o200k_base vocabulary file openai-harmony needs, written from the model's own tokenizer
so a gpt-oss model is served offline (openai-harmony otherwise downloads the file on first use).

openai-harmony reads `o200k_base.tiktoken` from $TIKTOKEN_ENCODINGS_BASE and checks its SHA-256
against the published file's, so the file is written exactly as tiktoken writes it (each
token's bytes in standard base64, a space, its rank, a newline; by rank) and checked against the
same hash before openai-harmony sees it: a tokenizer that is not gpt-oss's is refused with the
hash named, not half-served. gpt-oss's tokenizer (tokenizer.json, or a GGUF file's token list)
holds the 199,998 ranked tokens at ids 0..199,997, spelled byte-level (GPT-2's byte-to-character
map); Harmony's special tokens follow and are not part of the file.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine import default_cache_dir

logger = logging.getLogger(__name__)

FILE_NAME = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # the published file's
NUM_RANKS = 199_998  # ranked (non-special) tokens: ids 0..199,997
ENCODINGS_BASE_VAR = "TIKTOKEN_ENCODINGS_BASE"


class VocabularyMismatchError(ValueError):
    """The tokenizer's ranked tokens are not o200k_base's."""


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level spelling: character -> byte. Printable Latin-1 bytes stand for
    themselves; the other 68 bytes are shifted to 256 and up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    decoder = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in decoder.values():
            decoder[chr(256 + shifted)] = b
            shifted += 1
    return decoder


def tiktoken_text(tokens: Sequence[bytes]) -> bytes:
    """tokens (index = rank) in tiktoken's file format."""
    return b"".join(base64.b64encode(token) + b" " + str(rank).encode() + b"\n" for rank, token in enumerate(tokens))


def _from_byte_level(spellings: Sequence[str], source: str) -> list[bytes]:
    decoder = byte_level_decoder()
    try:
        return [bytes(decoder[c] for c in spelling) for spelling in spellings]
    except KeyError as exc:
        raise VocabularyMismatchError(f"{source}: a token is not spelled byte-level ({exc}); not o200k") from None


def ranked_tokens_from_tokenizer_json(path: Path) -> list[bytes]:
    """The ranked tokens of a Hugging Face tokenizer.json (model.vocab: spelling -> id)."""
    vocab = json.loads(path.read_text(encoding="utf-8")).get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        raise VocabularyMismatchError(f"{path}: no BPE vocabulary (model.vocab); not o200k")
    by_id = {i: s for s, i in vocab.items() if i < NUM_RANKS}
    if len(by_id) != NUM_RANKS:
        raise VocabularyMismatchError(f"{path}: {len(by_id)} tokens below id {NUM_RANKS}, o200k has {NUM_RANKS}")
    return _from_byte_level([by_id[i] for i in range(NUM_RANKS)], str(path))


def ranked_tokens_from_gguf(path: Path) -> list[bytes]:
    """The ranked tokens of a GGUF file's tokenizer (tokenizer.ggml.tokens, id order)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise VocabularyMismatchError(f"{path}: the file has no tokenizer.ggml.tokens")
    if len(field.data) < NUM_RANKS:
        raise VocabularyMismatchError(f"{path}: {len(field.data)} tokens, o200k has {NUM_RANKS} ranked ones")
    spellings = [bytes(field.parts[i]).decode("utf-8") for i in field.data[:NUM_RANKS]]
    return _from_byte_level(spellings, str(path))


def write_vocabulary(tokens: Sequence[bytes], directory: Path) -> Path:
    """directory/o200k_base.tiktoken from the ranked tokens, after checking the published hash
    (VocabularyMismatchError naming both hashes otherwise); written whole or not at all."""
    text = tiktoken_text(tokens)
    digest = hashlib.sha256(text).hexdigest()
    if digest != SHA256:
        raise VocabularyMismatchError(f"the tokenizer's {len(tokens)} ranked tokens are not o200k_base's: "
                                      f"their file hashes to {digest}, openai-harmony expects {SHA256}")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / FILE_NAME
    with tempfile.NamedTemporaryFile(dir=directory, delete=False, prefix=".o200k-") as tmp:
        tmp.write(text)
    os.replace(tmp.name, target)
    return target


def _is_published_file(path: Path) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256


def vocabulary_dir(sources: Sequence[Path], cache_dir: Path | None = None) -> Path:
    """A directory holding a verified o200k_base.tiktoken: $TIKTOKEN_ENCODINGS_BASE's when it has
    one, else minivllm's cache (written there once from the first source that holds gpt-oss's
    tokenizer: a tokenizer.json, a directory with one, or a GGUF file). FileNotFoundError when
    no source has a tokenizer; VocabularyMismatchError when one is not o200k."""
    given = os.environ.get(ENCODINGS_BASE_VAR)
    if given and _is_published_file(Path(given) / FILE_NAME):
        return Path(given)
    directory = (cache_dir or default_cache_dir()) / "tiktoken"
    if _is_published_file(directory / FILE_NAME):
        return directory
    for source in sources:
        if source.is_dir():
            source = source / "tokenizer.json"
        if not source.is_file():
            continue
        tokens = ranked_tokens_from_gguf(source) if source.suffix == ".gguf" else \
            ranked_tokens_from_tokenizer_json(source)
        path = write_vocabulary(tokens, directory)
        logger.info("wrote %s from %s (hash checked)", path, source)
        return directory
    raise FileNotFoundError(f"no {FILE_NAME} in ${ENCODINGS_BASE_VAR} or {directory}, and no gpt-oss tokenizer "
                            f"among {', '.join(map(str, sources)) or 'no sources'} to write it from")


def load_harmony_encoding(sources: Sequence[Path], cache_dir: Path | None = None):  # -> HarmonyEncoding
    """openai-harmony's gpt-oss encoding, its vocabulary from vocabulary_dir (never downloaded)."""
    from openai_harmony import HarmonyEncodingName
    from openai_harmony import load_harmony_encoding as load

    directory = vocabulary_dir(sources, cache_dir)
    # openai-harmony takes the directory only from the environment (its loader reads the variable
    # each time); the file there is the published one, so any later reader gets the same vocabulary.
    os.environ[ENCODINGS_BASE_VAR] = str(directory)
    return load(HarmonyEncodingName.HARMONY_GPT_OSS)
