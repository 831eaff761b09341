"""CPU tensors on 2 MiB pages, for the memory the decode step streams: weight panels and KV cache.

Why: a batch-1 decode step reads every weight once, 269 MB in bfloat16, as 121 panel tensors
(0.7-3.5 MB a layer's). On 4 KiB pages that is 65,000 pages a token: a TLB miss every 4 KiB,
and the hardware prefetchers stop at each page's end. In THP's `madvise` mode (the common
default) only advised memory gets 2 MiB pages, and a tensor under 2 MiB could not fill one.
So the panels are copied into one advised region (`place_on_huge_pages`).

Where THP is off (`never`) or the OS is not Linux, the advice is a no-op and these are plain
zero-filled tensors.
"""
from __future__ import annotations

import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor starting on a 2 MiB boundary in its own anonymous mapping,
    advised MADV_HUGEPAGE. Pages are faulted in (zeroed by the kernel) on first touch."""
    num_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    # Private: a shared anonymous mapping is shmem, which follows shmem_enabled, not THP.
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # a kernel built without THP: plain pages
            logger.debug("MADV_HUGEPAGE refused (%s)", exc)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive while any view lives
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[offset:offset + num_bytes].view(dtype).view(shape)
