"""The engine thread ("the heartbeat") and its asyncio front door.

One thread owns the LLMEngine, and builds it too: libgomp gives every thread that starts a
parallel region its own team, and once the process holds more OpenMP threads than cores it
throttles the teams' spin-waits, so every parallel region of a step wakes its workers through
a futex. A model loaded on one thread and run on another ran its steps slower than the same
loop on the thread that loaded it (`bench.offline_throughput`'s closed loop, run both ways;
served, beside the client and the loop, the difference was within the noise).

Commands (add, abort, stop) reach the engine thread through a queue it blocks on when idle, so
an idle server burns no CPU; each step's outputs go back to the asyncio loop
in one call_soon_threadsafe, where they fan out to per-request queues. Step stats go to
listeners on the engine thread (metrics, tracing), never the other way round.

Only the build, admission and the steps run on the engine thread: prompts are tokenized (and
chat templates applied) on a worker thread by the engine's process_inputs, after the cheap
checks (check_request), so a multi-megabyte prompt never stalls other streams. Requests are routed by
an engine id that is unique for the server's life, never by the client's id: a cancelled
request's last output can never reach a new request that reuses its id. If the engine thread dies, every pending and
future call fails at once and `on_death` tells the server.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any

from engine import (
    EngineRequest,
    KvCacheEvent,
    LimitExceededError,
    LLMEngine,
    ModelInfo,
    PoolingParams,
    QueueFullError,
    RequestOutput,
    SamplingParams,
    StepStats,
)
from service.engine_commands import Abort, Add, EngineDeadError, FaultInjector, ResetPrefixCache, Stop, StopSample
from service.request_streams import RequestStreams

__all__ = ["AsyncEngine", "EngineDeadError", "KvEventListener", "StatsListener"]

logger = logging.getLogger(__name__)

StatsListener = Callable[[StepStats], None]
KvEventListener = Callable[[list[KvCacheEvent]], None]


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], LLMEngine], stats_listeners: list[StatsListener] | None = None,
                 on_death: Callable[[], None] | None = None, max_tokenizing: int = 64,
                 kv_event_listeners: list[KvEventListener] | None = None) -> None:
        """engine_factory builds the engine on the engine thread (see the module's docstring);
        kv_event_listeners get prefix-cache changes made outside a step (a flush), on the engine
        thread (a step's own changes travel in its StepStats). With kv_event_listeners the
        engine records those changes from its start; without, it records none."""
        self._engine_factory = engine_factory
        # Set on the engine thread, before start() returns. Private: the service uses this
        # class's methods, never the engine's internals (tests/test_layering.py).
        self._engine: LLMEngine
        self.stats_listeners = list(stats_listeners or [])
        self.kv_event_listeners = list(kv_event_listeners or [])
        self.on_death = on_death
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams = RequestStreams(self.abort)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._is_dead = False
        # One tokenizer thread: the input processor's tokenizer is not shared with any other.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._num_tokenizing = 0
        self._max_tokenizing = max_tokenizing
        self._fault = FaultInjector(os.environ.get("MINIVLLM_FAULT"))
        self._token_texts: dict[int, str] = {}
        self._added_tokens: dict[str, tuple[int, bool]] | None = None

    # ---- asyncio side --------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and wait while it builds the engine (the factory's errors raise here)."""
        self._loop = asyncio.get_running_loop()
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._build_and_run, args=(built,), name="engine", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(built)

    def model_info(self) -> ModelInfo:
        return self._engine.model_info()

    @property
    def num_active_streams(self) -> int:
        return len(self._streams)

    @property
    def is_dead(self) -> bool:
        return self._is_dead

    def new_engine_id(self, request_id: str) -> str:
        """An id unique for the server's life, for routing (the client's id stays readable in it)."""
        return f"{request_id}#{next(self._ids)}"

    async def generate(self, request_id: str, params: SamplingParams | PoolingParams,
                       prompt: str | list[int] | None = None,
                       messages: list[dict[str, Any]] | None = None, priority: int = 0,
                       engine_id: str | None = None,
                       chat_template_kwargs: dict[str, Any] | None = None,
                       token_type_ids: list[int] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Admit a request, then return its output stream (outputs carry engine_id).

        request_id is the client's; engine_id (from new_engine_id, made here when not given)
        routes it. Admission errors (ValueError and subclasses) raise here, before any output, so
        the caller can answer with the right status code. PoolingParams: an embedding or score
        request, whose one output carries the vector or the scores; token_type_ids: its prompt's
        token types (a cross-encoder's pair, from encode_pairs).
        """
        if self._is_dead:
            raise EngineDeadError("the engine thread is not running")
        engine = self._engine
        engine.check_request(params, request_id, priority)
        engine.check_queue()  # fail fast; admission on the engine thread checks it again, at its moment
        if self._num_tokenizing >= self._max_tokenizing:
            raise QueueFullError(f"{self._num_tokenizing} requests are being tokenized already; retry later")
        self._streams.claim(request_id)
        engine_id = engine_id or self.new_engine_id(request_id)
        try:
            request = await self._process_inputs(params, prompt, messages, engine_id, priority, chat_template_kwargs,
                                                 token_type_ids)
            stream = self._streams.open(engine_id)
            cmd = Add(request)
            self._inbox.put(cmd)
            try:
                await asyncio.wrap_future(cmd.admitted)
            except BaseException:
                self._streams.discard(engine_id)
                self.abort(engine_id)  # cancelled while admitting: make sure it ends (no-op otherwise)
                raise
        except BaseException:
            self._streams.release(request_id)
            raise
        num_samples = params.n if isinstance(params, SamplingParams) else 1
        outputs = self._streams.iterate(engine_id, request_id, stream, num_samples)
        await anext(outputs)  # started: its aclose() now runs its cleanup, even if never read
        return outputs

    async def _process_inputs(self, params: SamplingParams | PoolingParams, prompt: str | list[int] | None,
                              messages: list[dict[str, Any]] | None, engine_id: str, priority: int,
                              chat_template_kwargs: dict[str, Any] | None = None,
                              token_type_ids: list[int] | None = None) -> EngineRequest:
        def work() -> EngineRequest:
            return self._engine.process_inputs(params, prompt, messages, request_id=engine_id, priority=priority,
                                               chat_template_kwargs=chat_template_kwargs,
                                               token_type_ids=token_type_ids)

        self._num_tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work)
        finally:
            self._num_tokenizing -= 1

    async def tokenize(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_special_tokens: bool = True,
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt or a chat, as generate would see them (on the tokenizer thread);
        add_special_tokens=False: a prompt's text alone (no BOS where the tokenizer adds one)."""
        engine = self._engine
        max_chars = engine.config.max_prompt_chars
        if prompt is not None and len(prompt) > max_chars:
            raise LimitExceededError("prompt", f"{len(prompt)} characters, at most {max_chars}")
        work = (lambda: engine.apply_chat_template(messages, None, chat_template_kwargs)) if messages is not None else \
            (lambda: engine.tokenize(prompt, add_special_tokens))
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work)

    async def tokenize_texts(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids without special tokens (the parts of a prompt put together
        elsewhere, as a reranker's template), in one pass on the tokenizer thread."""
        engine = self._engine
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool,
                                                                lambda: engine.tokenize_texts(texts))

    async def encode_pairs(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int] | None]]:
        """Each (text, text_pair) by the tokenizer's pair encoding (a cross-encoder's input: its
        special tokens and separators), with its token types where the model reads them, in one
        pass on the tokenizer thread."""
        engine = self._engine
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool,
                                                                lambda: engine.encode_pairs(pairs))

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens kept), on the tokenizer thread."""
        self._engine.check_in_vocabulary(token_ids, "tokens")
        tokenizer = self._engine.tokenizer
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool,
                                                                lambda: tokenizer.decode(token_ids))

    async def added_tokens(self) -> dict[str, tuple[int, bool]]:
        """The tokenizer's added tokens: text -> (id, is_special), read on the tokenizer thread once
        (a tool-call format's markers are often such tokens: a grammar names them by id)."""
        if self._added_tokens is None:
            tokenizer = self._engine.tokenizer

            def read() -> dict[str, tuple[int, bool]]:
                decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
                return {str(t): (int(i), bool(getattr(t, "special", True))) for i, t in decoder.items()}

            self._added_tokens = await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, read)
        return self._added_tokens

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's special tokens and chat template (what a client needs to tokenize alike)."""
        tokenizer = self._engine.tokenizer
        info: dict[str, Any] = {name: getattr(tokenizer, name, None)
                                for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return info | {"chat_template": getattr(tokenizer, "chat_template", None),
                       "model_max_length": self._engine.model_info().max_model_len,
                       "tokenizer_class": type(tokenizer).__name__}

    async def vocabulary_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's string in the vocabulary (byte-level spellings such as "Ġworld" kept)."""
        tokenizer = self._engine.tokenizer
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, lambda: [str(t) for t in tokenizer.convert_ids_to_tokens(token_ids)])

    async def token_texts(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (for logprobs), decoded on the tokenizer thread
        and remembered (the vocabulary bounds the cache)."""
        missing = [t for t in set(token_ids) if t not in self._token_texts]
        if missing:
            tokenizer = self._engine.tokenizer
            texts = await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_pool, lambda: [tokenizer.decode([t]) for t in missing])
            self._token_texts.update(zip(missing, texts, strict=True))
        return [self._token_texts[t] for t in token_ids]

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def stop_sample(self, engine_id: str, index: int) -> None:
        """End one sample of a request as a stop (its answer is over: a repeated tool call); its
        final output, with its usage, still comes through the stream. A no-op once it finished."""
        self._inbox.put(StopSample(engine_id, index))

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache between two steps, preempting nothing; False while any request
        holds blocks."""
        if self._is_dead:
            raise EngineDeadError("the engine thread is not running")
        cmd = ResetPrefixCache()
        self._inbox.put(cmd)
        return await asyncio.wrap_future(cmd.done)

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in the engine (for a graceful drain)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._idle.wait, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(Stop())
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread -------------------------------------------------------------

    def _build_and_run(self, built: concurrent.futures.Future[None]) -> None:
        try:
            self._engine = self._engine_factory()
            if self.kv_event_listeners:
                self._engine.subscribe_kv_events()
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            self._is_dead = True
            built.set_exception(exc)
            return
        built.set_result(None)
        self._run()

    def _run(self) -> None:
        engine = self._engine
        clean_exit = False
        try:
            step = 0
            while True:
                busy = engine.has_unfinished_requests()
                if not busy:
                    self._idle.set()
                    cmd = self._inbox.get()  # block: nothing to do until a command comes
                    if not self._handle(cmd):
                        clean_exit = True
                        return
                while True:  # drain whatever else arrived, without blocking
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(cmd):
                        clean_exit = True
                        return
                if not engine.has_unfinished_requests():
                    continue
                self._idle.clear()
                step += 1
                self._fault.before_step(engine, step)
                try:
                    outputs, stats = engine.step()
                except Exception as exc:  # noqa: BLE001 - keep serving; fail what was in flight
                    logger.exception("engine step failed")
                    outputs, stats = engine.fail_all(f"engine error: {exc}"), None
                if outputs:
                    self._loop.call_soon_threadsafe(self._streams.dispatch, outputs)
                if stats is not None:
                    for listener in self.stats_listeners:
                        try:
                            listener(stats)
                        except Exception:  # noqa: BLE001 - observability must not stop serving
                            logger.exception("stats listener failed")
        except BaseException:
            logger.exception("the engine thread died")
        finally:
            self._is_dead = True
            self._fail_pending_commands()
            outputs = self._engine.fail_all("engine stopped" if clean_exit else "the engine thread died")
            if outputs and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._streams.dispatch, outputs)
            self._idle.set()
            if not clean_exit and self.on_death is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self.on_death)

    def _fail_pending_commands(self) -> None:
        """Nothing queued for a dead engine may wait forever."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            future = cmd.admitted if isinstance(cmd, Add) else cmd.done if isinstance(cmd, ResetPrefixCache) else None
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine thread is not running"))

    def _handle(self, cmd: Any) -> bool:
        if isinstance(cmd, Stop):
            return False
        if isinstance(cmd, Abort):
            self._engine.abort_request(cmd.request_id)
            return True
        if isinstance(cmd, StopSample):
            self._engine.stop_sample(cmd.request_id, cmd.index)
            return True
        if isinstance(cmd, ResetPrefixCache):
            if cmd.done.set_running_or_notify_cancel():
                is_reset = self._engine.reset_prefix_cache()
                events = self._engine.take_kv_events()
                for listener in self.kv_event_listeners:
                    try:
                        listener(events)
                    except Exception:  # noqa: BLE001 - observability must not stop serving
                        logger.exception("KV event listener failed")
                cmd.done.set_result(is_reset)
            return True
        if not cmd.admitted.set_running_or_notify_cancel():
            return True  # the caller gave up before admission
        try:
            self._engine.admit(cmd.request)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller as is
            cmd.admitted.set_exception(exc)
        else:
            cmd.admitted.set_result(None)
        return True
