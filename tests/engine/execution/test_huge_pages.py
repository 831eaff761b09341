"""Weight panels and the KV cache on 2 MiB pages: where they live, that they are advised, and that
the engine's tokens do not depend on it."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from engine.execution.huge_pages import HUGE_PAGE_BYTES, huge_page_tensor
from engine.execution.weights.packed_weight import PackedWeight, place_on_huge_pages


def _thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise or never ('' where there is none)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")]


def _mapping_fields(address: int) -> dict[str, str]:
    """/proc/self/smaps's fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            if inside:
                break
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def test_huge_page_tensor_is_zeroed_aligned_and_outlives_its_mapping_object() -> None:
    t = huge_page_tensor((3, 1000, 7), torch.bfloat16)
    gc.collect()  # only the tensor refers to the mapping now
    assert t.shape == (3, 1000, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert torch.count_nonzero(t) == 0
    t.fill_(1.5)
    assert t.float().sum().item() == 1.5 * 21000


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="THP off on this kernel")
def test_huge_page_tensor_is_advised_for_transparent_huge_pages() -> None:
    t = huge_page_tensor((4 * HUGE_PAGE_BYTES // 4,), torch.float32)
    t.fill_(1.0)  # fault the pages in
    fields = _mapping_fields(t.data_ptr())
    assert fields.get("THPeligible") == "1", fields  # a shared or unadvised mapping reads 0
    if _thp_mode() == "madvise":
        # The control: a mapping of its own, never advised (a small torch tensor may land in
        # whatever heap region the allocator reuses, advised or not).
        import ctypes
        import mmap

        plain = mmap.mmap(-1, 4 * HUGE_PAGE_BYTES)
        plain.write(b"\1" * len(plain))
        address = ctypes.addressof(ctypes.c_char.from_buffer(plain))
        assert _mapping_fields(address).get("THPeligible") == "0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_place_on_huge_pages_moves_every_panel_into_one_region_unchanged(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [PackedWeight.pack(torch.randn(n, k, generator=gen), None, dtype) for n, k in ((40, 33), (16, 64), (7, 5))]
    before = [w.dequantize() for w in weights]
    region = place_on_huge_pages(weights)
    start, end = region.data_ptr(), region.data_ptr() + region.numel()
    assert start % HUGE_PAGE_BYTES == 0
    for weight, expected in zip(weights, before, strict=True):
        assert start <= weight.data.data_ptr() < end and weight.data.data_ptr() % 4096 == 0
        assert weight.data.dtype == dtype
        assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_do_not_depend_on_huge_pages(tiny_model_dir: Path, dtype: str) -> None:
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 200, 31, 7], [44] * 23, list(range(3, 40))]
    outputs = {}
    for huge in (False, True):
        llm = LLM(str(tiny_model_dir), num_kv_blocks=64, dtype=dtype, max_fused_tokens=64, enable_huge_pages=huge)
        runner = llm.engine.runner
        storages = {m.panels.data.untyped_storage().data_ptr() for m in runner.model.modules()
                    if getattr(m, "panels", None) is not None}
        if huge:  # one region for every panel (LM head included), the KV pool in its own
            assert len(storages) == 1 and runner.kv_cache.data_ptr() % HUGE_PAGE_BYTES == 0
            # The pool is faulted in at start-up, not by the first steps that write its blocks.
            resident_kib = int(_mapping_fields(runner.kv_cache.data_ptr())["Rss"].split()[0])
            assert resident_kib * 1024 >= runner.kv_cache.numel() * runner.kv_cache.element_size()
        else:
            assert len(storages) > 1
        outputs[huge] = [list(o.token_ids) for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
