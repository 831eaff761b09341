"""The prefix cache's events, numbered and fanned out to SubscribeKvEvents streams, with the
engine's load on every batch (what a cache-aware gateway routes by).

Each step's events become one batch with the next sequence number (1, 2, ...), kept in a
bounded history: a subscriber that reconnects with its last sequence number gets the batches
it missed, and one that starts at 0 while the history still reaches back to batch 1 gets the
whole history, so it learns what the cache already holds. Batches are built on the engine
thread (a list append under a lock) and turned into messages on the event loop, per stream.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from smg_grpc_proto.generated import common_pb2

from engine import KvCacheEvent, StepStats
from service.grpc.vllm_protocol import kv_event_to_proto

# A stream's load record goes out at most this often between batches, and at least this often
# (a heartbeat) while nothing changes.
_MIN_LOAD_INTERVAL_S = 0.2
_HEARTBEAT_S = 1.0
_THROUGHPUT_WINDOW_S = 10.0


@dataclass(frozen=True, slots=True)
class _Batch:
    sequence_number: int
    timestamp: float  # wall clock, seconds
    events: tuple[KvCacheEvent, ...]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's queue and KV use after its latest step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    gen_throughput: float = 0.0  # generated tokens per second over the last few seconds
    prefix_hit_rate: float = 0.0  # prompt tokens served from the prefix cache / looked up, over the server's life


class KvEventHub:
    def __init__(self, max_running_requests: int = 0, max_history: int = 4096) -> None:
        self.max_running_requests = max_running_requests
        self._lock = threading.Lock()
        self._history: collections.deque[_Batch] = collections.deque(maxlen=max_history)
        self._last_sequence = 0
        self._load = EngineLoad()
        self._generated: collections.deque[tuple[float, int]] = collections.deque()
        self._num_prefix_queried = self._num_prefix_hits = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the streams run on (wake-ups are posted to it)."""
        self._loop = loop
        self._changed = asyncio.Event()

    @property
    def last_sequence(self) -> int:
        return self._last_sequence

    @property
    def load(self) -> EngineLoad:
        return self._load

    # ---- engine thread ------------------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        now = time.monotonic()
        window = self._generated
        window.append((now, stats.num_generated_tokens))
        while window and window[0][0] < now - _THROUGHPUT_WINDOW_S:
            window.popleft()
        span = max(now - window[0][0], 1.0)
        self._num_prefix_queried += stats.num_prefix_queried_tokens
        self._num_prefix_hits += stats.num_prefix_hit_tokens
        self._load = EngineLoad(stats.num_running, stats.num_waiting, stats.kv_cache_usage,
                                sum(n for _, n in window) / span,
                                self._num_prefix_hits / self._num_prefix_queried if self._num_prefix_queried else 0.0)
        if stats.kv_events:
            self.on_kv_events(stats.kv_events)
        else:
            self._wake()

    def on_kv_events(self, events: list[KvCacheEvent]) -> None:
        if events:
            with self._lock:
                self._last_sequence += 1
                self._history.append(_Batch(self._last_sequence, time.time(), tuple(events)))
        self._wake()

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._notify)

    # ---- event loop ---------------------------------------------------------------------

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _batches_after(self, cursor: int) -> list[_Batch]:
        with self._lock:
            return [b for b in self._history if b.sequence_number > cursor]

    def _start_cursor(self, start_sequence_number: int) -> int:
        """Where a new stream starts: after its own cursor, or (0) at batch 1 if the history
        still holds it, else at the live edge."""
        if start_sequence_number > 0:
            return min(start_sequence_number, self._last_sequence)
        with self._lock:
            return 0 if self._history and self._history[0].sequence_number == 1 else self._last_sequence

    def load_proto(self, sample: int, load_only: bool) -> common_pb2.EngineLoad:
        load = self._load
        return common_pb2.EngineLoad(
            running_requests=load.num_running, waiting_requests=load.num_waiting,
            token_usage=load.kv_cache_usage, gen_throughput=load.gen_throughput,
            max_running_requests=self.max_running_requests, sample=sample, load_only=load_only,
            cache_hit_rate=load.prefix_hit_rate)

    async def subscribe(self, start_sequence_number: int, load_before_first_batch: bool,
                        is_cancelled: Callable[[], bool]) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Batches after the cursor, then live ones, each with the load; load-only records when
        the load changes between batches (coalesced) and as a heartbeat."""
        if self._changed is None:
            raise RuntimeError("KvEventHub.bind() was not called")
        cursor = self._start_cursor(start_sequence_number)
        sent_any = cursor > 0
        sample, sent_load, last_load_time, event_id = 0, None, 0.0, 0
        while not is_cancelled():
            changed = self._changed
            batches = self._batches_after(cursor)
            for batch in batches:
                sample += 1
                msg = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp,
                                              load=self.load_proto(sample, load_only=False))
                for event in batch.events:
                    event_id += 1
                    msg.events.append(kv_event_to_proto(event, event_id))
                cursor, sent_any = batch.sequence_number, True
                sent_load, last_load_time = self._load, time.monotonic()
                yield msg
            now = time.monotonic()
            is_due = (self._load != sent_load and now - last_load_time >= _MIN_LOAD_INTERVAL_S) or \
                now - last_load_time >= _HEARTBEAT_S
            if not batches and is_due and (sent_any or load_before_first_batch):
                sample += 1
                sent_load, last_load_time = self._load, now
                yield common_pb2.KvEventBatch(sequence_number=cursor, timestamp=time.time(),
                                              load=self.load_proto(sample, load_only=True))
            try:
                await asyncio.wait_for(changed.wait(), _MIN_LOAD_INTERVAL_S if self._load != sent_load
                                       else _HEARTBEAT_S)
            except TimeoutError:
                pass
