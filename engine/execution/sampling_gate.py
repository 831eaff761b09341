"""Async scheduling's one hand-off between the engine thread and the step worker.

Step n+1 runs its forward while the engine processes step n's tokens; it must not sample before
that processing is done: a grammar's matcher advances over step n's token there (the mask of
step n+1 is that matcher's next), and its state is the engine thread's until then. The engine
opens the gate once step n is processed; the runner waits on it between forward and sampling.
A request that step n ended is still sampled in step n+1 (a complete grammar allows only EOS),
and its token dropped.
"""
from __future__ import annotations

import threading


class SamplingGate:
    def __init__(self, is_open: bool = False) -> None:
        self._opened = threading.Event()
        if is_open:
            self._opened.set()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()

    def open(self) -> None:
        self._opened.set()

    def wait(self) -> None:
        self._opened.wait()
