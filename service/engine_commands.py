"""What the asyncio side asks of the engine thread (through its inbox), and the engine
thread's test hook for faults."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from engine import EngineRequest, LLMEngine


@dataclass(slots=True)
class Add:
    request: EngineRequest  # named by its engine id
    admitted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class StopSample:
    request_id: str
    index: int


@dataclass(slots=True)
class ResetPrefixCache:
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True, slots=True)
class Stop:
    """Ends the engine thread's loop."""


class EngineDeadError(RuntimeError):
    """The engine thread is gone; no request can be served."""


class FaultInjector:
    """Test hook, from MINIVLLM_FAULT: "raise@N" makes the forward of step N raise (that step's
    requests fail, the engine goes on); "die@N" kills the engine thread before step N."""

    def __init__(self, spec: str | None) -> None:
        self.mode, self.step = None, 0
        if spec:
            mode, _, step = spec.partition("@")
            if mode not in ("raise", "die") or not step.isdigit():
                raise ValueError(f"MINIVLLM_FAULT: expected raise@N or die@N, got {spec!r}")
            self.mode, self.step = mode, int(step)

    def before_step(self, engine: LLMEngine, step: int) -> None:
        if step != self.step:
            return
        if self.mode == "die":
            raise SystemExit(f"injected engine death at step {step}")
        if self.mode == "raise":
            engine.fail_next_step(f"injected fault at step {step}")
