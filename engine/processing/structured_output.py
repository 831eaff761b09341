"""Structured output: decoding constrained to a JSON schema, any JSON, a regex, an EBNF/Lark
grammar or a choice list, through llguidance (a grammar engine vLLM and SGLang also use).

A spec is compiled and validated once per distinct spec (cached) by the input processor, off
the engine thread in the server; an invalid or unsatisfiable one is a ValueError naming the
field. Each constrained sequence gets its own matcher (cheap to make). Per step,
the matchers of the constrained rows fill one preallocated bitmask together (llguidance's
thread pool), which is applied to those rows only, vectorized.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import FieldError
from engine.processing.json_schema_check import unmatchable_schema

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# JSON may be laid out freely, but one run of whitespace is bounded: a weak or sampled model can
# otherwise spend its whole token budget on indentation inside a valid-but-endless document.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,40}"}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must match. `value`: the schema (JSON text), the regex, the grammar
    (Lark or GBNF/EBNF), or the JSON list of choices; ignored for json_object (any JSON).
    `after`: when set, the output is free text up to and including the first occurrence of
    this string (a reasoning model's "</think>"), and the constraint applies from there on.
    `after_opener`: with `after`, that free-text block is optional and opens with this string
    (Qwen3's "<think>": a model that does not think is constrained from its first token)."""

    kind: str
    value: str = ""
    after: str = ""
    after_opener: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FieldError("structured_output", f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.value:
            raise FieldError(f"structured_output.{self.kind}", "must not be empty")

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        if not options or any(not isinstance(o, str) or not o for o in options):
            raise FieldError("structured_output.choice", "a non-empty list of non-empty strings")
        return cls("choice", json.dumps(options))

    @property
    def field(self) -> str:
        return f"structured_output.{self.kind}"


class GrammarCompiler:
    """Owns llguidance's view of the tokenizer and a bounded cache of validated grammars.
    Thread-safe: the tokenizer thread compiles, the engine thread makes matchers."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 max_cached: int = 256) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._cache: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """Built on first use (it takes a while for a large vocabulary), never for unconstrained traffic."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self._eos[0] if self._eos else None)
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> str:
        """The validated llguidance grammar of a spec; ValueError naming the field if invalid."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        from llguidance import LLMatcher, grammar_from

        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is a JSON object")
                problem = unmatchable_schema(schema)  # llguidance would compile it to a grammar nothing completes
                if problem is not None:
                    raise ValueError(problem)
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif spec.kind == "choice":
                choices = json.loads(spec.value)
                if not isinstance(choices, list) or not choices:
                    raise ValueError("a non-empty JSON list of strings")
                grammar = grammar_from("choice", spec.value)
            else:
                grammar = grammar_from("regex" if spec.kind == "regex" else "grammar", spec.value)
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            raise FieldError(spec.field, f"invalid: {exc}") from None
        if spec.after:
            grammar = after_free_text(grammar, spec.after, self._token_id(spec.after), spec.after_opener,
                                      self._token_id(spec.after_opener) if spec.after_opener else None)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise FieldError(spec.field, f"invalid: {error.strip().splitlines()[0]}")
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return grammar

    def _token_id(self, text: str) -> int | None:
        """The id of text when it is an added token llguidance treats as special (a special one,
        or one written <...>, such as Qwen's </think>), else None."""
        for token_id, token in (getattr(self._hf_tokenizer, "added_tokens_decoder", {}) or {}).items():
            if str(token) == text and (getattr(token, "special", True) or (text.startswith("<") and text.endswith(">"))):
                return int(token_id)
        return None

    def matcher(self, spec: StructuredOutput) -> Any:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.compile(spec), log_level=0)
        if matcher.is_error():
            raise FieldError(spec.field, matcher.get_error())
        return matcher


def after_free_text(grammar: str, after: str, token_id: int | None = None, opener: str = "",
                    opener_id: int | None = None) -> str:
    """`grammar` behind a free-text prefix that ends at the first `after`: the prefix is a lazy
    lexeme (llguidance ends it as soon as `after` appears), the grammar a sub-grammar after it.
    token_id: `after` is this added token, which llguidance never matches as text.
    opener (opener_id when it is such a token): the prefix is optional and begins with it."""
    try:
        inner = json.loads(grammar)["grammars"]
    except (ValueError, TypeError, KeyError):  # Lark text, not llguidance's JSON form
        inner = [{"lark_grammar": grammar}]
    inner[0] = dict(inner[0], name="after_prefix_body")
    prefix = f"PREFIX_TEXT <[{token_id}]>" if token_id is not None else "prefix"
    if opener:
        prefix = f"({f'<[{opener_id}]>' if opener_id is not None else json.dumps(opener)} {prefix})?"
    top = f"%llguidance {{}}\nstart: {prefix} @after_prefix_body\n"
    if token_id is None:
        top += f"prefix[lazy]: PREFIX_TEXT {json.dumps(after)}\n"
    top += "PREFIX_TEXT: /(.|\\n)*/\n"
    return json.dumps({"grammars": [{"lark_grammar": top}, *inner]})


class GrammarExecutor:
    """llguidance's executor, made on first use: fills many matchers' bitmasks, or advances
    them over their sampled tokens, in parallel (one call, not one per row)."""

    def __init__(self) -> None:
        self._executor: Any = None

    @property
    def executor(self) -> Any:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor

    def consume(self, matchers: list[tuple[Any, int]]) -> None:
        """Advance each (matcher, sampled token)."""
        self.executor.consume_token_par(matchers)


class GrammarMask:
    """Applies the matchers' allowed-token bitmasks to their rows of the logits."""

    def __init__(self, vocab_size: int, max_rows: int = 64, kernels: Any = None) -> None:
        """kernels: the C++ CPU kernels (an in-place masking op), or None for the torch path."""
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._bitmask = torch.zeros(max_rows, self.num_words, dtype=torch.int32)  # [rows, words]
        self._shifts = torch.arange(32, dtype=torch.int32)  # [32]
        self._grammar = GrammarExecutor()
        self.kernels = kernels if kernels is not None and hasattr(kernels, "apply_token_bitmask_") else None

    @property
    def executor(self) -> Any:
        return self._grammar.executor

    def apply(self, logits: torch.Tensor, matchers: list[tuple[int, Any]]) -> None:
        """Mask, in place, the rows of `matchers` ((row, matcher) pairs); the others are left untouched."""
        # logits: [N, vocab]
        if len(matchers) > self._bitmask.shape[0]:
            self._bitmask = torch.zeros(len(matchers), self.num_words, dtype=torch.int32)
        bitmask = self._bitmask[: len(matchers)]  # [k, words]
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, (_, m) in enumerate(matchers)], bitmask.data_ptr(),
                                              self.num_words * 4, len(matchers))
        self.mask_logits(logits, bitmask, torch.tensor([row for row, _ in matchers], device=logits.device))

    def apply_along(self, logits: torch.Tensor, first_row: int, matcher: Any, drafts: list[int]) -> None:
        """Mask rows first_row.. first_row + len(drafts) of a verification, each by the grammar's
        state after the drafts before it (advanced for the masks, then rolled back: the scheduler
        advances the grammar over the tokens accepted)."""
        num_rows = len(drafts) + 1
        if num_rows > self._bitmask.shape[0]:
            self._bitmask = torch.zeros(num_rows, self.num_words, dtype=torch.int32)
        bitmask = self._bitmask[:num_rows]  # [rows, words]
        for j in range(num_rows):
            self.executor.unsafe_compute_mask_ptr([(matcher, j)], bitmask.data_ptr(), self.num_words * 4, num_rows)
            if j < len(drafts):
                matcher.consume_token(drafts[j])
        if drafts:
            matcher.rollback(len(drafts))
        self.mask_logits(logits, bitmask, torch.arange(first_row, first_row + num_rows, device=logits.device))

    def mask_logits(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Set, in place, -inf wherever row rows[i]'s token is not allowed by bitmask[i] (columns
        past the bitmask's 32 * words are never allowed)."""
        # logits: [N, vocab], bitmask: [k, words] int32, rows: [k] int64
        if self.kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
            self.kernels.apply_token_bitmask_(logits, bitmask, rows)
            return
        # [k, words, 32] bits -> [k, words * 32] allowed
        allowed = ((bitmask.unsqueeze(-1) >> self._shifts) & 1).bool().reshape(len(rows), -1)
        vocab = logits.shape[1]
        if allowed.shape[1] < vocab:
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        allowed = allowed[:, :vocab].to(logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, -float("inf"))
