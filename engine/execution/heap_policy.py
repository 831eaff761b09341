"""How this process's C heap (glibc malloc) hands memory back: while a model loads, and after.

Why: glibc maps an allocation of at least its mmap threshold on its own and unmaps it when freed,
but after the first such free it raises the threshold to that size (up to 32 MiB), so from then
on the temporaries of loading a model (a layer's, an expert's dequantized or repacked rows) come
from the heap, whose freed middle stays resident around the small objects allocated between
them. Serving a Qwen3-30B-A3B-shaped file, that left 0.1 GB more resident than a threshold held
at 128 KiB through the load does, and a gpt-oss-20b-shaped one 0.2 GB (issue 60's bound allows
0.5 GB beside the weights and the KV pool).

After the load the threshold is held at glibc's own ceiling, 32 MiB: a step's buffers (its
activations, a batch's logits) are then reused from the heap as before. Held lower (4 MiB), each
step mapped and faulted in its larger buffers afresh: 32 prompts of SmolLM2-135M ran at 211-244
output tokens/s against 279-283. (The kernels keep their buffers of 32 MiB and more themselves:
scratch_pool.cpp.) The heap's free top is kept up to 1 GiB while serving: at glibc's 64 MiB
(twice the threshold), a prefill step whose buffers together passed that handed them back at the
end of each layer and faulted them in again in the next (16 passages of Qwen3-Embedding-0.6B's
shape in 2,048-token steps: 1.6 M page faults in 14.5 s and 13 % of the CPU time in the kernel;
the 1 GiB trim threshold alone took 0.9 M of those faults away, the kept buffers the rest). What
the steps leave goes back when the engine falls idle (release_free_memory).
"""
from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
LOAD_MMAP_THRESHOLD_BYTES = 128 << 10
STEP_MMAP_THRESHOLD_BYTES = 32 << 20
STEP_TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim), where there is glibc:
    after packing frees the plain weights it replaced, and when the engine falls idle."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def fix_mmap_threshold(num_bytes: int, trim_bytes: int | None = None) -> bool:
    """Allocations of num_bytes or more mapped on their own and returned when freed, the
    threshold no longer raised by glibc (mallopt M_MMAP_THRESHOLD); the heap's free top kept up to
    trim_bytes (None: twice num_bytes, as glibc's own raise sets it; left at its 128 KiB default,
    each step's buffers were handed back at the heap's top and faulted in again by the next step).
    False where the C library is not glibc, or refuses: nothing changes there."""
    libc = _glibc()
    if libc is None:
        logger.debug("no glibc mallopt: the heap keeps its own mmap threshold")
        return False
    trim = 2 * num_bytes if trim_bytes is None else trim_bytes
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, num_bytes)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim))
