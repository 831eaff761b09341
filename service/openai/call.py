"""One admitted OpenAI-API call: the engine's output stream rendered as server-sent events or as
one JSON body, one choice per sample (of each prompt); a client that goes away aborts the
request (its KV blocks are freed at once)."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from engine import RequestOutput, SamplingParams
from service.async_engine import AsyncEngine
from service.chat.output import ChoiceOutput
from service.chat.tools import ChatPlan
from service.observability.request_observer import RequestObserver
from service.openai.protocol import (
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionRequest,
    EchoedPrompt,
    error_body,
    finish_reason,
    now,
    ranked,
    usage_body,
)

T = TypeVar("T")


class OpenAICall:
    """One admitted call (one engine request, or one per prompt of a completions batch): its
    outputs rendered as SSE chunks or as one JSON body, one choice per sample of each prompt
    (`index` tells them apart; usage counts each prompt once)."""

    def __init__(self, model_name: str, observer: RequestObserver, engine: AsyncEngine,
                 stream: AsyncIterator[RequestOutput], body: CompletionRequest | ChatCompletionRequest,
                 params: SamplingParams, request_id: str, handle: Any, plan: ChatPlan | None = None) -> None:
        self.model_name, self.observer = model_name, observer
        self.engine, self.stream, self.body = engine, stream, body
        self.params, self.request_id, self.handle = params, request_id, handle
        self.is_chat = isinstance(body, ChatCompletionRequest)
        self.top_n = (body.top_logprobs or 0) if self.is_chat else (body.logprobs or 0)
        self.created = now()
        # Completions take a batch of prompts: choice i * n + j is sample j of prompt i.
        self.prompts = [] if self.is_chat else body.prompt_inputs()
        self.num_choices = params.n * max(1, len(self.prompts))
        self.text_offsets = [0] * self.num_choices
        self.finals: dict[int, RequestOutput] = {}
        # echo (completions): every choice starts with its prompt, and with logprobs its tokens'.
        self.is_echo = not self.is_chat and body.echo
        self.echoes: dict[int, EchoedPrompt] = {}  # by prompt
        # The prompt_logprobs field only when asked for (echo may ask the engine for more).
        self.num_prompt_logprobs = body.prompt_logprobs
        # Chat: each choice's reasoning and tool calls parsed out of its text (a pass-through without parsers).
        self.is_reasoning = plan is not None and plan.has_reasoning
        self.choice_outputs = [plan.new_output(engine.stop_sample) if plan else ChoiceOutput(None, None)
                               for _ in range(self.num_choices if self.is_chat else 0)]

    def _usage(self) -> dict[str, Any]:
        reasoning = sum(o.num_reasoning_tokens for o in self.choice_outputs) if self.is_reasoning else None
        return usage_body(list(self.finals.values()), reasoning)

    @contextlib.contextmanager
    def _observed(self) -> Iterator[list[Any]]:
        """Reports the outcome to the observer whatever happens; yields a [final output] cell."""
        final: list[Any] = [None]
        error_type, message, status = None, "", 200
        try:
            yield final
            out = final[0]
            if out is not None and out.finish_reason == "error":
                error_type, message, status = "500", out.error or "engine error", 500
        except asyncio.CancelledError:
            error_type, message, status = "499", "client disconnected", 499
            raise
        except BaseException as exc:
            error_type, message, status = "500", type(exc).__name__, 500
            raise
        finally:
            self.observer.finish(self.handle, final[0], error_type, message, {"http.response.status_code": status})

    async def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        if self.params.logprobs is None or not out.new_logprobs:
            return None
        ids = ChoiceLogprobs.ids(out, self.top_n)
        texts = dict(zip(ids, await self.engine.token_texts(ids), strict=True))
        if self.is_chat:
            return ChoiceLogprobs.chat(out, self.top_n, texts)
        entry = ChoiceLogprobs.completion(out.new_token_ids, out.new_logprobs, self.top_n, texts,
                                          self.text_offsets[out.index])
        # Offsets run over the tokens' own texts, so they do not depend on how a slow reader's
        # outputs were merged (a token that ends inside a character adds to new_text later).
        if entry["tokens"]:
            self.text_offsets[out.index] = entry["text_offset"][-1] + len(entry["tokens"][-1])
        return entry

    async def _prompt_logprobs(self, out: RequestOutput) -> list[Any] | None:
        """vLLM's layout: per prompt token, None for the first, else token id -> {logprob, rank,
        decoded_token}: the top prompt_logprobs and the prompt's own token."""
        if not out.prompt_logprobs or self.num_prompt_logprobs is None:
            return None
        ids = sorted({t for entry in out.prompt_logprobs if entry for t in entry})
        texts = dict(zip(ids, await self.engine.token_texts(ids), strict=True))
        result: list[Any] = []
        for position, entry in enumerate(out.prompt_logprobs):
            if entry is None:
                result.append(None)
                continue
            actual = out.prompt_token_ids[position]
            result.append({str(t): {"logprob": v, "rank": r + 1, "decoded_token": texts[t]}
                           for r, (t, v) in enumerate(ranked(entry)) if r < self.num_prompt_logprobs or t == actual})
        return result

    def _prompt_of(self, out: RequestOutput) -> int:
        return out.index // self.params.n

    async def _echo(self, out: RequestOutput, is_last: bool = False) -> EchoedPrompt | None:
        """The prompt out's choices start with, once the output that carries what it needs has come
        (its token ids; with logprobs, its prompt logprobs: one sample's first output has them;
        is_last: the request ended without them, echo the text alone)."""
        key = self._prompt_of(out)
        if key not in self.echoes and (self.params.logprobs is None or out.prompt_logprobs or is_last):
            prompt = self.prompts[key]
            text = prompt if isinstance(prompt, str) and self.params.truncate_prompt_tokens is None else \
                await self.engine.detokenize(out.prompt_token_ids)
            logprobs = None
            if self.params.logprobs is not None and out.prompt_logprobs:
                ids = list(out.prompt_token_ids) + [t for entry in out.prompt_logprobs if entry for t in entry]
                texts = dict(zip(ids, await self.engine.token_texts(ids), strict=True))
                logprobs = ChoiceLogprobs.completion(out.prompt_token_ids, out.prompt_logprobs, self.top_n, texts)
            self.echoes[key] = EchoedPrompt(text, logprobs)
        return self.echoes.get(key)

    def _chunk(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> str:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        payload: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created,
                                   "model": self.model_name, "choices": [choice] if choice else []}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events; the client going away cancels this generator, which aborts the request."""
        with self._observed() as final:
            try:
                if self.is_chat:
                    for index in range(self.num_choices):
                        yield self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None})
                held: dict[int, list[RequestOutput]] = {}  # echo, by prompt: outputs before its logprobs
                async for arrived in self.stream:
                    if arrived.finish_reason == "error":
                        final[0] = arrived
                        yield f"data: {json.dumps(error_body(arrived.error or 'engine error', 'server_error'))}\n\n"
                        return
                    if arrived.is_finished:
                        final[0] = arrived
                        self.finals[arrived.index] = arrived
                    key = self._prompt_of(arrived)
                    if self.is_echo and key not in self.echoes:
                        held.setdefault(key, []).append(arrived)
                        if await self._echo(arrived) is not None:
                            for event in await self._release(key, held.pop(key)):
                                yield event
                        continue
                    if (event := await self._output_event(arrived)) is not None:
                        yield event
                for key, outs in held.items():  # the prompt's logprobs never came (its request ended first)
                    await self._echo(outs[-1], is_last=True)
                    for event in await self._release(key, outs):
                        yield event
                if self.body.include_usage and self.finals:
                    yield self._chunk({}, self._usage())
                yield "data: [DONE]\n\n"
            finally:
                await self.stream.aclose()  # aborts an unfinished request: frees its KV blocks now

    def _echo_chunks(self, key: int) -> Iterator[str]:
        """The first chunk of each choice of prompt key: the echoed prompt, which the generated
        text's offsets follow."""
        echo = self.echoes[key]
        for index in range(key * self.params.n, (key + 1) * self.params.n):
            self.text_offsets[index] = len(echo.text)
            yield self._chunk({"index": index, "text": echo.text, "logprobs": echo.logprobs, "finish_reason": None})

    async def _release(self, key: int, outs: list[RequestOutput]) -> list[str]:
        """Prompt key's echo chunks, then the events of its outputs held until the echo was known."""
        events = list(self._echo_chunks(key))
        for out in outs:
            if (event := await self._output_event(out)) is not None:
                events.append(event)
        return events

    async def _output_event(self, out: RequestOutput) -> str | None:
        """The chunk of one output (None when it carries nothing to send)."""
        logprobs = await self._logprobs(out)
        prompt_logprobs = await self._prompt_logprobs(out)
        if self.is_chat:
            output = self.choice_outputs[out.index]
            # Text a parser holds back (it may open a call or close a thinking block) comes later.
            delta = output.delta(output.feed(out))
        if (delta if self.is_chat else out.new_text) or logprobs or prompt_logprobs or out.is_finished:
            if self.is_chat:
                choice = {"index": out.index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": output.finish_reason(finish_reason(out))}
            else:
                choice = {"index": out.index, "text": out.new_text, "logprobs": logprobs,
                          "finish_reason": finish_reason(out)}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            return self._chunk(choice)
        return None

    async def whole(self, request: Request) -> JSONResponse:
        """Collects the whole answer; a client that disconnects first aborts the request."""
        response = await until_disconnected(self._collect(), request.receive)
        return response if response is not None else JSONResponse(error_body("client disconnected"),
                                                                   status_code=499)

    async def _collect(self) -> JSONResponse:
        n = self.num_choices
        with self._observed() as final:
            texts: list[list[str]] = [[] for _ in range(n)]
            prompt_logprobs: dict[int, list[Any]] = {}  # by prompt, on its first choice
            lasts: dict[int, RequestOutput] = {}  # echo: by prompt, its latest output
            chat_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
            completion_logprobs: list[dict[str, list[Any]]] = [{} for _ in range(n)]
            try:
                async for out in self.stream:
                    if out.finish_reason == "error":
                        final[0] = out
                        return JSONResponse(error_body(out.error or "engine error", "server_error"), status_code=500)
                    texts[out.index].append(out.new_text)
                    if self.is_chat:
                        self.choice_outputs[out.index].feed(out)
                    key = self._prompt_of(out)
                    if key not in prompt_logprobs and (entries := await self._prompt_logprobs(out)) is not None:
                        prompt_logprobs[key] = entries
                    if self.is_echo:
                        lasts[key] = out
                        await self._echo(out)
                    logprobs = await self._logprobs(out)
                    if logprobs is not None and self.is_chat:
                        chat_logprobs[out.index].extend(logprobs["content"])
                    elif logprobs is not None:
                        for key, values in logprobs.items():
                            completion_logprobs[out.index].setdefault(key, []).extend(values)
                    if out.is_finished:
                        final[0] = out
                        self.finals[out.index] = out
            finally:
                await self.stream.aclose()
            for out in lasts.values():  # a prompt whose logprobs never came (its request ended first)
                await self._echo(out, is_last=True)
            choices = []
            for index in range(n):
                logprobs_body: Any = None
                if self.params.logprobs is not None:
                    logprobs_body = {"content": chat_logprobs[index]} if self.is_chat else completion_logprobs[index]
                key, sample = divmod(index, self.params.n)
                if (echo := self.echoes.get(key)) is not None:
                    texts[index].insert(0, echo.text)
                    if logprobs_body is not None:
                        logprobs_body = _after_echo(echo, logprobs_body)
                reason = finish_reason(self.finals[index]) if index in self.finals else None
                if self.is_chat:
                    output = self.choice_outputs[index]
                    choice = {"index": index, "message": output.message(), "logprobs": logprobs_body,
                              "finish_reason": output.finish_reason(reason)}
                else:
                    choice = {"index": index, "text": "".join(texts[index]), "logprobs": logprobs_body,
                              "finish_reason": reason}
                if sample == 0 and key in prompt_logprobs:
                    choice["prompt_logprobs"] = prompt_logprobs[key]
                choices.append(choice)
            kind = "chat.completion" if self.is_chat else "text_completion"
            return JSONResponse({"id": self.request_id, "object": kind, "created": self.created,
                                 "model": self.model_name, "choices": choices, "usage": self._usage()})


def _after_echo(echo: EchoedPrompt, generated: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A choice's completions-layout logprobs with the echoed prompt's first; the generated tokens'
    offsets (counted from the generated text's start) move past the prompt's text."""
    prompt = echo.logprobs or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    shift = len(echo.text)
    return {"tokens": prompt["tokens"] + generated.get("tokens", []),
            "token_logprobs": prompt["token_logprobs"] + generated.get("token_logprobs", []),
            "top_logprobs": prompt["top_logprobs"] + generated.get("top_logprobs", []),
            "text_offset": prompt["text_offset"] + [o + shift for o in generated.get("text_offset", [])]}


class AbortingStreamingResponse(StreamingResponse):
    """Stops the event generator (which aborts the request) as soon as the client disconnects,
    even while no token is due (a long prefill), and always closes it: never left to the GC."""

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        respond = asyncio.ensure_future(super().__call__(scope, receive, send))
        disconnect = asyncio.ensure_future(disconnected(receive))
        try:
            done, _ = await asyncio.wait({respond, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if respond not in done:
                respond.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await respond
            else:
                with contextlib.suppress(ClientDisconnect, OSError):
                    respond.result()
        finally:
            disconnect.cancel()
            await self.body_iterator.aclose()


async def until_disconnected(work: Awaitable[T], receive: Callable) -> T | None:
    """work's result, or None when the client disconnects first: work is cancelled then (an
    engine stream it reads is closed, which aborts the request and frees its KV blocks)."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(disconnected(receive))
    try:
        done, _ = await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
        return task.result()
    finally:
        disconnect.cancel()


async def disconnected(receive: Callable) -> None:
    """Returns when the client has gone away (the body is already read, so only that can arrive)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
