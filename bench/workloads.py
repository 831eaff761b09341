"""Benchmark workloads, deterministic for a given seed."""
from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = ("the model serves many users at once while a scheduler balances prefill and decode so that "
          "first tokens arrive quickly and streams keep a steady pace under load every request "
          "matters latency throughput cache block token batch").split()
_TOPICS = ("gardening", "the history of Rome", "sorting algorithms", "black holes", "bread baking", "jazz",
           "chess openings", "rust ownership", "coral reefs", "the printing press")


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int] | list[dict[str, str]]  # text, token ids or chat messages
    prompt_len: int  # tokens (known exactly for token ids; estimated from words otherwise)
    output_len: int
    ignore_eos: bool
    session: int | None = None  # requests of one session go one after another, in list order

# The prompts greedy output is held to transformers' on, token for token (tests/engine/test_real_model.py
# on the CPU, bench/gpu_check.py on a GPU): short and long, prose, code, lists.
GREEDY_PROMPTS = [
    "Hello",
    "The quick brown fox",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "The meaning of life is",
    "Write a poem about the sea. " * 3,
    "Once upon a time in a land far away, there lived " * 8,
    "Explain quantum computing in simple terms. " * 20,
    "List three primary colors, then explain why:",
]


def random_tokens(num: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                  range_ratio: float = 0.0) -> list[BenchRequest]:
    """Random token-id prompts; lengths vary by +-range_ratio around the given ones."""
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    reqs = []
    for _ in range(num):
        n_in = length(input_len)
        reqs.append(BenchRequest([rng.randrange(100, vocab_size) for _ in range(n_in)], n_in, length(output_len), True))
    return reqs


def random_text(num: int, input_words: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Plain-text prompts of random words, sent as text to any backend (servers that take no
    token ids, like llama.cpp's, get the very same requests); prompt_len is corrected from usage."""
    rng = random.Random(seed)
    return [BenchRequest(" ".join(rng.choice(_WORDS) for _ in range(input_words)), int(input_words * 1.3),
                         output_len, True) for _ in range(num)]


def synthetic_chat(num: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Chat requests of varied length: a question, sometimes with a long pasted context."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num):
        words = rng.choice((8, 24, 64, 160, 320))
        context = " ".join(rng.choice(_WORDS) for _ in range(words))
        question = f"Given this text: {context}\nTell me something about {rng.choice(_TOPICS)}."
        reqs.append(BenchRequest([{"role": "user", "content": question}], int(len(question.split()) * 1.3),
                                 output_len, False))
    return reqs


def shared_prefix(num: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                  vocab_size: int, seed: int) -> list[BenchRequest]:
    """Many requests over a few long common prefixes (system prompts, documents): prefix caching's case."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    reqs = []
    for i in range(num):
        prompt = prefixes[i % num_prefixes] + [rng.randrange(100, vocab_size) for _ in range(suffix_len)]
        reqs.append(BenchRequest(prompt, len(prompt), output_len, True))
    return reqs


def conversations(num_conversations: int, num_turns: int, context_words: int, turn_words: int, output_len: int,
                  seed: int) -> list[BenchRequest]:
    """Multi-turn chats, each over its own long system prompt (a document, a persona) and its own
    growing history: turn k sends the system prompt, the k - 1 earlier turns (with fixed assistant
    replies, so the prefix is the same wherever the turn runs) and a new question. A session's
    turns run in order; a replica that served turn k - 1 holds all of turn k's prompt but the
    question: cache-aware routing's case."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    reqs = []
    for c in range(num_conversations):
        messages = [{"role": "system", "content": f"Conversation {c} about {rng.choice(_TOPICS)}. {words(context_words)}"}]
        for turn in range(num_turns):
            messages.append({"role": "user", "content": f"Question {turn}: {words(turn_words)}?"})
            length = sum(len(m["content"].split()) for m in messages)
            reqs.append(BenchRequest(list(messages), int(length * 1.3), output_len, True, session=c))
            messages.append({"role": "assistant", "content": words(turn_words)})
    return reqs


def shared_prefix_chat(num_groups: int, requests_per_group: int, document_words: int, question_words: int,
                       output_len: int, seed: int) -> list[BenchRequest]:
    """Chat requests over a few long shared system prompts (a document each), each with its own
    short question: request i belongs to group i % num_groups, so the groups come round in a fixed
    cycle. The chat text of a group's system message is the same in every request, so the prompts of
    one group share its tokens up to the question (the gateway applies the template). A replica
    that holds a group's document serves all but the question from its cache; one that must hold
    every document in a pool too small for them all evicts each before it comes round again."""
    for name, value in (("num_groups", num_groups), ("requests_per_group", requests_per_group),
                        ("document_words", document_words), ("question_words", question_words)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    documents = [f"Document {g} about {rng.choice(_TOPICS)}. Answer questions about it. {words(document_words)}"
                 for g in range(num_groups)]
    reqs = []
    for r in range(requests_per_group):
        for document in documents:
            question = f"Question {r}: {words(question_words)}?"
            messages = [{"role": "system", "content": document}, {"role": "user", "content": question}]
            reqs.append(BenchRequest(messages, int((len(document.split()) + len(question.split())) * 1.3),
                                     output_len, True))
    return reqs
