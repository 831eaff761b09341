"""One gpt-oss answer read as it comes, by openai-harmony's StreamableParser over its token ids:
the analysis channel is reasoning, the final channel (and commentary a model says to no one: a
preamble) is content, and a commentary message addressed to=functions.NAME is a call of NAME
with the message as its JSON arguments.

The same surface as ChoiceOutput (feed, message, delta, finish_reason), so chat completions,
the Responses API and gRPC read both alike. As there, a call goes out whole, once its message
has ended (<|call|>, or <|end|>); a call the answer was cut inside (max_tokens) is no call: its
arguments' text is content and the finish reason is the engine's. Tokens that break the format
(the parser refuses them: a model off its training) end the parse: from there the tokens' text
is content; an answer that never opened a message at all (no header the parser took) is all
content when it ends. Nothing the model wrote is lost.
"""
from __future__ import annotations

import logging
from typing import Any

from engine import RequestOutput
from service.chat.harmony_prompt import FUNCTIONS_NAMESPACE
from service.chat.output import ChoiceDelta, ChoiceOutput
from service.chat.tool_parsers import CutCall, ParsedDelta, ToolCallDelta
from service.chat.tool_parsers.base import new_call_id

logger = logging.getLogger(__name__)

_RECIPIENT_PREFIX = FUNCTIONS_NAMESPACE + "."


class HarmonyOutput(ChoiceOutput):
    def __init__(self, encoding: Any) -> None:
        from openai_harmony import Role, StreamableParser

        super().__init__(None, None)
        self._encoding = encoding
        self._parser = StreamableParser(encoding, Role.ASSISTANT, strict=False)
        self._token_ids: list[int] = []  # the whole answer, for one that never follows the format
        self._has_parsed = False  # some message opened (its content began)
        # The tokens that end a message: <|end|>, <|call|>, <|return|> (the renderer's stop set).
        self._end_ids = frozenset(encoding.stop_tokens())
        self._channel: str | None = None  # the open message's, as of the last token
        self._recipient: str | None = None
        self._call_text = ""  # the open call's arguments so far (held until the message ends)
        self._is_broken = False
        self._cut: list[CutCall] = []

    @property
    def ended_on_repeat(self) -> bool:
        return False

    @property
    def has_cut_call(self) -> bool:
        return bool(self._cut)

    def _is_call(self) -> bool:
        return self._recipient is not None and self._recipient.startswith(_RECIPIENT_PREFIX)

    def feed(self, out: RequestOutput) -> ChoiceDelta:
        reasoning: list[str] = []
        pieces = [ParsedDelta()]  # in the answer's order: content after a call starts a new piece
        if self._is_broken:
            pieces[-1].content += out.new_text
        else:
            self._token_ids += out.new_token_ids
            # One parser step per token: Harmony's headers are tokens, so the parse is token-wise
            # (a decode step brings one token; its work is the Rust parser's).
            for i, token in enumerate(out.new_token_ids):
                if not self._step(token, reasoning, pieces):
                    pieces.append(ParsedDelta(self._text(out.new_token_ids[i:])))
                    break
        if out.is_finished and not self._is_broken:
            self._finish(pieces)
        parsed = ParsedDelta()
        for piece in pieces:
            parsed.extend(piece)
        text = "".join(reasoning)
        self.reasoning += text
        self.answer.add(parsed)
        return ChoiceDelta(text, parsed, [p for p in pieces if p])

    def _step(self, token: int, reasoning: list[str], pieces: list[ParsedDelta]) -> bool:
        """One token into the parse; False once the format broke (the rest is the engine's text)."""
        try:
            self._parser.process(token)
        except Exception as exc:  # openai-harmony's HarmonyError: the answer left the format
            logger.warning("the answer left the Harmony format (%s); the rest is content", exc)
            self._is_broken = True
            return False
        if token in self._end_ids:
            self._end_message(pieces)
            return True
        self._channel, self._recipient = self._parser.current_channel, self._parser.current_recipient
        delta = self._parser.last_content_delta or ""
        self._has_parsed = self._has_parsed or self._channel is not None or bool(delta)
        if self._channel == "analysis" and not self._is_call() and not self._encoding.is_special_token(token):
            self.num_reasoning_tokens += 1  # the message's text, its <|message|> marker not
        if not delta:
            return True
        if self._is_call():
            self._call_text += delta
        elif self._channel == "analysis":
            reasoning.append(delta)
        elif self._recipient is None:  # final, or a preamble on commentary
            if pieces[-1].calls:
                pieces.append(ParsedDelta())
            pieces[-1].content += delta
        return True

    def _end_message(self, pieces: list[ParsedDelta]) -> None:
        self._has_parsed = True
        if self._is_call():
            index = len(self.answer.calls) + sum(len(p.calls) for p in pieces)
            name = self._recipient[len(_RECIPIENT_PREFIX):]
            pieces[-1].calls.append(ToolCallDelta(index, new_call_id(), name, self._call_text.strip() or "{}"))
        self._channel, self._recipient, self._call_text = None, None, ""

    def _finish(self, pieces: list[ParsedDelta]) -> None:
        """The answer ended: a call still open was cut (its arguments are content); an answer
        with no message in it is content as it is."""
        if self._is_call():
            self._cut.append(CutCall(None, self._call_text))
            if self._call_text:
                pieces.append(ParsedDelta(self._call_text))
        elif not self._has_parsed:
            pieces.append(ParsedDelta(self._text(self._token_ids)))
        self._channel, self._recipient, self._call_text = None, None, ""

    def _text(self, token_ids: list[int]) -> str:
        """Tokens' text, Harmony's own markers (specials) left out."""
        return self._encoding.decode([t for t in token_ids if not self._encoding.is_special_token(t)])

    def message(self) -> dict[str, Any]:
        message = super().message()
        message["reasoning_content"] = self.reasoning or None
        return message
