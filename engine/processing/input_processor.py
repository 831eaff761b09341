"""From what a client sends to prompt token ids: tokenization, chat templates, input checks.

Kept apart from the engine loop: it runs off the engine thread (tokenizing a long prompt must
not stall a step), with a tokenizer of its own.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import FieldError, LimitExceededError, PromptTooLongError
from engine.processing.pooling_params import PoolingParams
from engine.processing.sampling_params import SamplingParams
from engine.processing.structured_output import GrammarCompiler

VALID_ROLES = ("system", "user", "assistant", "tool")
# Arguments the template call sets itself: chat_template_kwargs may not name them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "add_generation_prompt", "tokenize", "return_dict",
                                       "continue_final_message", "tokenizer_kwargs"})


class InputProcessor:
    """Owns its tokenizer: the engine thread detokenizes with another instance, so tokenizing
    here can run on a worker thread without sharing one (not thread-safe) tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, config: EngineConfig,
                 eos_token_ids: frozenset[int] = frozenset(), context_note: str = "") -> None:
        """context_note: why the context is max_model_len, where that is not the model's plain
        length (an encoder's prompt must fit one step), said when a prompt does not fit."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.context_note = context_note
        self.config = config
        self.grammar = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.max_token_chars = max_token_chars(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.chat_template is not None

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        _check_encodable(prompt, "prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int] | None]:
        """Each text prompt's ids as tokenize gives them, in one batch call (the tokenizer's threads
        share it, where one call a prompt ran on the caller's alone); None for token ids, and for a
        text that tokenize would refuse or that cannot fit (prompt_token_ids checks it on its own)."""
        batch = [i for i, text in enumerate(prompts) if isinstance(text, str) and 0 < len(text) <= self.config.max_prompt_chars
                 and not self._cannot_fit(len(text)) and encoding_error(text) is None]
        encoded: list[list[int] | None] = [None] * len(prompts)
        if batch:
            ids = self.tokenizer([prompts[i] for i in batch], add_special_tokens=True)["input_ids"]
            for i, row in zip(batch, ids, strict=True):
                encoded[i] = row
        return encoded

    def tokenize_texts(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids without special tokens, in one batch call."""
        for text in texts:
            _check_encodable(text, "prompt")
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def encode_pairs(self, pairs: list[tuple[str, str]], with_token_types: bool) -> list[tuple[list[int], list[int] | None]]:
        """Each (text, text_pair)'s ids by the tokenizer's pair encoding (its special tokens and
        separators: a cross-encoder's input), with the token types it assigns when asked (zeros
        where the tokenizer has none), in one batch call."""
        if not pairs:
            return []
        for first, second in pairs:
            _check_encodable(first, "prompt")
            _check_encodable(second, "prompt")
        encoded = self.tokenizer([p[0] for p in pairs], [p[1] for p in pairs], return_token_type_ids=with_token_types)
        ids = encoded["input_ids"]
        if not with_token_types:
            return [(row, None) for row in ids]
        return list(zip(ids, encoded.get("token_type_ids") or [[0] * len(row) for row in ids], strict=True))

    def check_in_vocabulary(self, token_ids: Iterable[int], field: str) -> None:
        """FieldError naming field and the first id outside [0, vocab_size)."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise FieldError(field, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def check_request(self, params: SamplingParams | PoolingParams, request_id: str | None = None,
                      priority: int = 0) -> None:
        """The cheap checks, before any tokenizing: request-size limits of the parameters, the id
        and the priority (the client's id; None for the engine's own)."""
        cfg = self.config
        if request_id is not None:
            if not request_id:
                raise FieldError("request_id", "must not be empty")
            if len(request_id) > cfg.max_request_id_chars:
                raise LimitExceededError("request_id", f"{len(request_id)} characters, "
                                         f"at most {cfg.max_request_id_chars}")
        if not -cfg.max_priority <= priority <= cfg.max_priority:
            raise FieldError("priority", f"{priority} is outside [{-cfg.max_priority}, {cfg.max_priority}]")
        if isinstance(params, PoolingParams):
            return  # validated at construction; its dimensions against the model as it is resolved
        if len(params.stop) > cfg.max_stop_strings:
            raise LimitExceededError("stop", f"{len(params.stop)} strings, at most {cfg.max_stop_strings}")
        if params.max_stop_len > cfg.max_stop_string_chars:
            raise LimitExceededError("stop", f"a string of {params.max_stop_len} characters, "
                                     f"at most {cfg.max_stop_string_chars}")
        if len(params.stop_token_ids) > cfg.max_stop_token_ids:
            raise LimitExceededError("stop_token_ids", f"{len(params.stop_token_ids)} ids, "
                                     f"at most {cfg.max_stop_token_ids}")
        self.check_in_vocabulary(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias is not None:
            if len(params.logit_bias) > cfg.max_logit_bias:
                raise LimitExceededError("logit_bias", f"{len(params.logit_bias)} entries, at most {cfg.max_logit_bias}")
            self.check_in_vocabulary(params.logit_bias, "logit_bias")
        if params.max_tokens is not None and params.max_tokens >= self.max_model_len:
            raise LimitExceededError("max_tokens", f"{params.max_tokens} does not fit the context of "
                                     f"{self.max_model_len} tokens")

    def apply_chat_template(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The chat's token ids by the model's template. Given the request's params, a chat whose
        text cannot fit the context is refused before it is tokenized (as a prompt is).
        Messages may carry more than role and content (an assistant's tool_calls, a tool
        result's tool_call_id); chat_template_kwargs go to the template (tools=..., enable_thinking=...)."""
        if not messages:
            raise FieldError("messages", "must not be empty")
        for i, m in enumerate(messages):
            if m.get("role") not in VALID_ROLES:
                raise FieldError(f"messages[{i}].role", f"{m.get('role')!r} is not one of {VALID_ROLES}")
            if not isinstance(m.get("content"), str):
                raise FieldError(f"messages[{i}].content", "must be a string")
            _check_encodable(m["content"], f"messages[{i}].content")
        num_chars = sum(len(m["content"]) for m in messages)
        if num_chars > self.config.max_prompt_chars:
            raise LimitExceededError("messages", f"{num_chars} characters, at most {self.config.max_prompt_chars}")
        if not self.has_chat_template:
            raise FieldError("messages", "this model has no chat template; send a prompt instead")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise FieldError("chat_template_kwargs", f"{reserved[0]!r} is set by the server")
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except TemplateError as exc:  # a template's raise_exception: the chat breaks its rules
            raise FieldError("messages", f"the chat template refused them: {exc}") from None
        _check_encodable(text, "messages")  # a tool call's arguments, a template variable...
        if params is not None:
            self._check_fits_before_tokenizing(len(text), params, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _cannot_fit(self, num_chars: int) -> bool:
        """Whether a text of num_chars characters makes at least max_model_len tokens whatever they
        are (each token covers at most max_token_chars characters)."""
        return self.max_token_chars is not None and -(-num_chars // self.max_token_chars) >= self.max_model_len

    def _check_fits_before_tokenizing(self, num_chars: int, params: SamplingParams, field: str = "prompt") -> None:
        """Refuse a text that cannot fit the context whatever its tokens: each token covers at most
        max_token_chars characters, so it makes at least num_chars / max_token_chars tokens.
        Tokenizing a huge text takes a core that the engine's step threads need (running streams'
        gaps grow several-fold on a small machine) only to refuse it."""
        if params.truncate_prompt_tokens is not None or not self._cannot_fit(num_chars):
            return
        min_tokens = -(-num_chars // self.max_token_chars)
        raise PromptTooLongError(field, f"{num_chars} characters make at least {min_tokens} tokens (none is "
                                 f"longer than {self.max_token_chars} characters), which do not fit the context "
                                 f"of {self.max_model_len} tokens (at least one must be generated)")

    def prompt_token_ids(self, params: SamplingParams, prompt: str | list[int] | None = None,
                         messages: list[dict[str, Any]] | None = None,
                         chat_template_kwargs: dict[str, Any] | None = None, is_pooling: bool = False,
                         encoded: list[int] | None = None) -> list[int]:
        """The prompt's (or the chat's) token ids, checked against the limits, the vocabulary and
        the context length; a structured-output spec is compiled (and cached) here too, off the
        engine thread. The parameters' own checks (check_request) come first, once. encoded: a
        string prompt's ids from encode_prompts (checked here as its own tokenizing would be)."""
        if messages is not None:
            token_ids = self.apply_chat_template(messages, params, chat_template_kwargs)
        elif isinstance(prompt, str):
            if not prompt:
                raise FieldError("prompt", "must not be empty")
            if len(prompt) > self.config.max_prompt_chars:
                raise LimitExceededError("prompt", f"{len(prompt)} characters, at most {self.config.max_prompt_chars}")
            self._check_fits_before_tokenizing(len(prompt), params)
            token_ids = list(encoded) if encoded is not None else self.tokenize(prompt)
        elif prompt is not None:
            token_ids = [int(t) for t in prompt]
            if not token_ids:
                raise FieldError("prompt_token_ids", "must not be empty")
            self.check_in_vocabulary(token_ids, "prompt_token_ids")
        else:
            raise FieldError("prompt", "a prompt, token ids or messages are required")
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        if params.structured_output is not None:
            self.grammar.compile(params.structured_output)
        if len(token_ids) > self.max_model_len - (not is_pooling):  # a pooling request generates nothing
            raise PromptTooLongError("prompt", f"{len(token_ids)} tokens do not fit the context of "
                                     f"{self.max_model_len} tokens{self.context_note}" + (
                                         "" if is_pooling else " (at least one must be generated)"))
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise LimitExceededError("max_tokens", f"the prompt's {len(token_ids)} tokens + {{0}} "
                                     f"{params.max_tokens} exceed the context of {self.max_model_len} tokens",
                                     mentions=("max_tokens",))
        return token_ids


def encoding_error(text: str) -> UnicodeEncodeError | None:
    """Why the tokenizer cannot take text, or None: a lone surrogate ("\\ud800", which JSON can
    spell) has no UTF-8 form, and the tokenizer would fail on it with a TypeError."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc
    return None


def is_encodable(text: str) -> bool:
    return encoding_error(text) is None


def _check_encodable(text: str, field: str) -> None:
    exc = encoding_error(text)
    if exc is not None:
        raise FieldError(field, f"is not valid Unicode text: {exc.object[exc.start:exc.end]!a} at character "
                         f"{exc.start} (a lone surrogate) cannot be encoded as UTF-8")


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input text one token can cover, or None where that is not known.

    A token's vocabulary string is at least as long as the text it stands for (byte-level
    tokens spell each byte as one character, SentencePiece its space as one, a byte-fallback
    token one character as six). That bounds the input only when no normalizer may delete input
    characters before the model splits them (NFKD accent stripping, control-character removal),
    so a tokenizer with a normalizer, or without a fast backend, gets None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocab = tokenizer.get_vocab()
    return max(map(len, vocab), default=0) or None


def load_eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (a list for chat models), else config.json, plus the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    ids = {int(v) for v in (eos if isinstance(eos, list) else [eos]) if v is not None}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
