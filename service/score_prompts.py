"""A query and a document as one score request's prompt, for every door's rerank and score.

A sequence classifier (a BERT cross-encoder, a converted Qwen3 reranker) reads the pair as its
tokenizer's pair encoding puts it together: its special tokens and separators, and the token
types that tell the two apart where the model reads them (sentence-transformers' CrossEncoder and
vLLM tokenize so). A causal LM scored by its label tokens (ModelInfo.score_label_tokens, the
original Qwen3-Reranker) reads the pair in the prompt it was trained on, as its model card builds
it: a system turn asking for "yes" or "no", the user turn `<Instruct>: ...\\n<Query>: ...\\n
<Document>: ...`, and an opened assistant turn with an empty thinking block; the three parts are
tokenized apart and joined, as the card does. A query that starts with the chat's `<|im_start|>`
is taken as formatted already (vLLM's examples format query and document themselves): its
pair is the two texts' tokens, joined.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from service.async_engine import AsyncEngine

MAX_DOCUMENTS = 1000  # documents (pairs) per call at most: Cohere's rerank limit

QWEN3_RERANKER_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
                         "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                         "<|im_start|>user\n")
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_FORMATTED_MARK = "<|im_start|>"


def relevance_score(logits: list[float]) -> float:
    """A pair's score: the sigmoid of its one logit (sentence-transformers' CrossEncoder.predict),
    in the form whose exp cannot overflow."""
    logit = logits[0]
    if logit >= 0:
        return 1.0 / (1.0 + math.exp(-logit))
    return math.exp(logit) / (1.0 + math.exp(logit))


def reranker_user_turn(query: str, document: str, instruction: str | None = None) -> str:
    """The user turn of Qwen3-Reranker's prompt: the task's instruction, the query, the document."""
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


@dataclass(slots=True)
class ScorePrompt:
    token_ids: list[int]
    token_type_ids: list[int] | None  # the model's token types, where it reads them


async def score_prompts(engine: AsyncEngine, pairs: list[tuple[str, str]],
                        instruction: str | None = None) -> list[ScorePrompt]:
    """Each (query, document) pair as the served model reads it (see the module's docstring), in
    one pass on the tokenizer thread. instruction: a label-token reranker's task (its default:
    web search); other models have no place for one."""
    if not engine.model_info().score_label_tokens:
        return [ScorePrompt(ids, types) for ids, types in await engine.encode_pairs(pairs)]
    texts = [QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX]
    for query, document in pairs:
        texts += [query, document] if query.startswith(_FORMATTED_MARK) else \
            [reranker_user_turn(query, document, instruction)]
    encoded = await engine.tokenize_texts(texts)
    prefix, suffix, parts = encoded[0], encoded[1], iter(encoded[2:])
    prompts = []
    for query, _ in pairs:
        if query.startswith(_FORMATTED_MARK):
            prompts.append(ScorePrompt(next(parts) + next(parts), None))
        else:
            prompts.append(ScorePrompt(prefix + next(parts) + suffix, None))
    return prompts
