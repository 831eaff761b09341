"""The rerank and score bodies (validated by pydantic) and their answers.

/rerank (also /v1/rerank, /v2/rerank): Cohere's and Jina's shape, as vLLM serves it: a `query`,
`documents` as strings or {"text": ...} objects, `top_n` (the best N; unset: all) and
`return_documents`; the answer's `results` sorted by `relevance_score`, best first, each with the
document's `index` in the request. /score (also /v1/score): vLLM's: `text_1` and `text_2`, each a
string or a list, paired 1:1 (two lists of one length) or 1:N (one text_1 against every text_2);
the answer's `data` in pair order. Either score is the sigmoid of the model's one logit for the
pair (sentence-transformers' CrossEncoder.predict; for Qwen3-Reranker the softmax of "yes" over
"no"). Unknown fields are ignored as on the other routes; extras: `instruction` (a label-token
reranker's task) and `priority`.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from engine import RequestOutput
from service.openai.protocol import UnsupportedFieldError, now
from service.score_prompts import MAX_DOCUMENTS, relevance_score


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str


def relevance(output: RequestOutput) -> float:
    return relevance_score(output.scores)


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


def _check_texts(field: str, texts: list[str]) -> None:
    if not texts:
        raise UnsupportedFieldError(field, "must not be empty")
    if len(texts) > MAX_DOCUMENTS:
        raise UnsupportedFieldError(field, f"{len(texts)} texts, at most {MAX_DOCUMENTS}")
    empty = next((i for i, text in enumerate(texts) if not text), None)
    if empty is not None:
        raise UnsupportedFieldError(f"{field}[{empty}]", "must not be empty")


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    instruction: str | None = None
    priority: int = 0

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def pairs(self) -> list[tuple[str, str]]:
        """The query against each document, in order (FieldError naming a bad field)."""
        if not self.query:
            raise UnsupportedFieldError("query", "must not be empty")
        texts = self.texts
        _check_texts("documents", texts)
        if self.top_n is not None and self.top_n < 1:
            raise UnsupportedFieldError("top_n", f"must be at least 1, got {self.top_n}")
        return [(self.query, text) for text in texts]

    @staticmethod
    def pair_field(index: int) -> str:
        return f"documents[{index}]"

    def answer(self, request_id: str, model_name: str, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The documents by relevance, best first (ties in request order), the best top_n of them."""
        texts = self.texts
        scores = [relevance(out) for out in outputs]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: self.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if self.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return {"id": request_id, "model": model_name, "results": results, "usage": _usage(outputs)}


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None
    priority: int = 0

    def pairs(self) -> list[tuple[str, str]]:
        """1:1 (two lists of one length) or 1:N (one text_1, as a string or a list of one)."""
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        for field, texts in (("text_1", firsts), ("text_2", seconds)):
            if isinstance(getattr(self, field), str) and not texts[0]:
                raise UnsupportedFieldError(field, "must not be empty")
            _check_texts(field, texts)
        if len(firsts) == 1:
            return [(firsts[0], second) for second in seconds]
        if len(firsts) != len(seconds):
            raise UnsupportedFieldError("text_2", f"{len(seconds)} texts for text_1's {len(firsts)}: pair them one "
                                        "to one, or give one text_1 to score against every text_2")
        return list(zip(firsts, seconds, strict=True))

    def pair_field(self, index: int) -> str:
        return "text_2" if isinstance(self.text_2, str) else f"text_2[{index}]"

    def answer(self, request_id: str, model_name: str, outputs: list[RequestOutput]) -> dict[str, Any]:
        """Each pair's score, in pair order."""
        return {"id": request_id, "object": "list", "created": now(), "model": model_name,
                "data": [{"index": i, "object": "score", "score": relevance(out)} for i, out in enumerate(outputs)],
                "usage": _usage(outputs) | {"completion_tokens": 0}}
