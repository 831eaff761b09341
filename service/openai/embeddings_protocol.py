"""OpenAI's /v1/embeddings body (validated by pydantic) and its answer.

`input` is a text, a list of texts, a list of token ids or a list of token-id lists (each one
engine request, answered in order); `encoding_format` float or base64 (little-endian float32,
as the OpenAI SDKs decode it); `dimensions` the Matryoshka truncation. Unknown fields are
ignored as on the other routes; vLLM's extras: `normalize`, `priority`.
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from engine import PoolingParams, RequestOutput
from service.openai.protocol import UnsupportedFieldError

MAX_INPUTS = 2048  # OpenAI's limit of inputs per call
ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None  # vLLM's: None keeps the model's own (its Normalize module)
    priority: int = 0

    def inputs(self) -> list[str | list[int]]:
        """One prompt per engine request: the text, each text, the ids, or each id list."""
        value = self.input
        prompts = value if isinstance(value, list) and value and isinstance(value[0], (str, list)) else [value]
        if not value:
            raise UnsupportedFieldError("input", "must not be empty")
        if len(prompts) > MAX_INPUTS:
            raise UnsupportedFieldError("input", f"{len(prompts)} inputs, at most {MAX_INPUTS}")
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty:
            raise UnsupportedFieldError(self.input_field(empty[0], len(prompts)), "must not be empty")
        return prompts

    @staticmethod
    def input_field(index: int, num_inputs: int) -> str:
        return f"input[{index}]" if num_inputs > 1 else "input"

    def pooling_params(self) -> PoolingParams:
        if self.encoding_format not in ENCODING_FORMATS:
            raise UnsupportedFieldError("encoding_format", f"must be one of {list(ENCODING_FORMATS)}, "
                                        f"got {self.encoding_format!r}")
        return PoolingParams(normalize=self.normalize, dimensions=self.dimensions)

    def answer(self, model_name: str, outputs: list[RequestOutput]) -> dict[str, Any]:
        """OpenAI's list of embeddings, in input order, with the prompt tokens as usage."""
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return {"object": "list", "model": model_name,
                "data": [{"object": "embedding", "index": i, "embedding": self._encode(out.embedding)}
                         for i, out in enumerate(outputs)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    def _encode(self, vector: list[float]) -> list[float] | str:
        if self.encoding_format == "base64":
            return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        return vector
