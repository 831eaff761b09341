"""The Triton paged-attention kernels (engine/execution/triton) agree with a dense torch
reference and with the C++ CPU kernels, run on this CPU in Triton's interpreter.

Interpreter setup: Triton picks the interpreter when @triton.jit decorates a function, reading
TRITON_INTERPRET then, and triton.language decorates its own helpers (tl.zeros, tl.max) when
triton is first imported. So this module sets TRITON_INTERPRET=1 only while it imports triton
and the kernel modules (re-importing the latter if something imported them earlier without it),
then restores the variable: the kernels stay interpreted. Each test of this module sets it again
(monkeypatch, undone after the test), since a launch can import more of triton, which reads it
then. So no other test, nor a subprocess one starts, sees it. That needs triton not imported before this module: nothing
else in the suite imports it (test_only_the_triton_package_imports_triton keeps it so), and if
something did, the import fails loudly rather than running compiled-mode kernels on the CPU.
Without triton installed the whole module is skipped.

On a GPU (bench/gpu_check.sh) the same cases run natively: MINIVLLM_TEST_TRITON_NATIVE=1 skips
the interpreter, and each kernel call moves its tensors to the GPU and copies `out` back, so the
references and assertions are this file's own; the C++ comparisons stay with the interpreter run.

Shapes are small for the interpreter: contexts up to ~130 tokens, head_dim 16 (tl.dot's smallest)
and 24 (padded to 32), several splits via a 32-token partition. Block tables are shuffled, and
their padding entries point at a poison block (huge keys and values) that a wrong table walk
would read."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.execution.kernels import load_cpu_kernels

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")


def _import_interpreted() -> tuple[object, object, object]:
    """Imports triton and the kernel modules under TRITON_INTERPRET=1, then restores the variable."""
    if "triton" in sys.modules and _INTERPRET_BEFORE != "1":
        # triton.language's own jit helpers (tl.zeros, tl.max) were decorated for the GPU then
        raise RuntimeError("triton was imported before tests/engine/execution/triton/test_triton_attention.py, without TRITON_INTERPRET=1: "
                           "its kernels cannot run in the interpreter in this process")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.runtime

        from engine.execution import triton as package
        from engine.execution.triton import _tiles, decode, pointwise, prefill

        if isinstance(decode._decode_partition_kernel, triton.runtime.JITFunction) or \
                isinstance(prefill._prefill_kernel, triton.runtime.JITFunction) or \
                isinstance(pointwise._rms_norm_kernel, triton.runtime.JITFunction):
            # imported earlier without the interpreter: decorate again, the shared helpers first
            for module in (_tiles, decode, prefill, pointwise):
                importlib.reload(module)
        return package, decode, prefill, pointwise
    finally:
        if _INTERPRET_BEFORE is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE


class _OnTheGpu:
    """The kernels compiled for the GPU, called as the tests call them: tensor arguments copied to
    the GPU, `out` copied back into the caller's CPU tensor."""

    def __init__(self, package: object) -> None:
        self._package = package

    def __getattr__(self, name: str) -> object:
        kernel = getattr(self._package, name)

        def on_gpu(*args: object, **kwargs: object) -> object:
            bound = inspect.signature(kernel).bind(*args, **kwargs)
            out = bound.arguments["out"]
            moved = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in bound.arguments.items()}
            kernel(**moved)
            out.copy_(moved["out"].cpu())
            return out

        return on_gpu


IS_NATIVE = os.environ.get("MINIVLLM_TEST_TRITON_NATIVE") == "1"
if IS_NATIVE:
    if not torch.cuda.is_available():
        pytest.skip("MINIVLLM_TEST_TRITON_NATIVE=1 needs a CUDA GPU", allow_module_level=True)
    from engine.execution import triton as _package
    from engine.execution.triton import decode as _decode_module
    from engine.execution.triton import pointwise as _pointwise_module
    from engine.execution.triton import prefill as _prefill_module

    triton_attention = _OnTheGpu(_package)
else:
    triton_attention, _decode_module, _prefill_module, _pointwise_module = _import_interpreted()
_INTERPRET_AFTER_IMPORT = os.environ.get("TRITON_INTERPRET")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton reads the variable again when a launch first imports some of its modules (the
    interpreter's argument handling imports triton.experimental.gluon, which checks it)."""
    if not IS_NATIVE:
        monkeypatch.setenv("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[4]
POISON = 0  # block 0 of every cache: huge keys and values, the target of every padding entry


def _cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # k, v: [num_blocks * block_size, KVH, D]
    k = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    k[:block_size], v[:block_size] = 40.0, 1e3  # a key here would take all the weight
    return k.to(dtype), v.to(dtype)


def _tables(seq_lens: list[int], block_size: int, max_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """[B, max_blocks] int32: each sequence's blocks drawn shuffled from 1.., padding -> POISON."""
    needed = [-(-n // block_size) for n in seq_lens]
    pool = (torch.randperm(sum(needed), generator=gen) + 1).tolist()
    tables = torch.full((len(seq_lens), max_blocks), POISON, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    return tables


def _dense(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, seq_len: int,
           block_size: int, scale: float, window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's last q.shape[0] positions over its whole context, gathered densely: causal
    and window mask, softmax in float32 (with sinks [H]: each head's sink logit one more column of
    the softmax, with no value). q: [n, H, D] -> [n, H, D] float32. q is rounded to the cache's
    dtype first, as the kernels multiply in it."""
    n, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    positions = torch.arange(seq_len)
    slots = table[positions // block_size].long() * block_size + positions % block_size
    k = k_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.to(k_cache.dtype).float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, L]
    rows = torch.arange(seq_len - n, seq_len).unsqueeze(1)
    visible = positions.unsqueeze(0) <= rows
    if window:
        visible &= positions.unsqueeze(0) > rows - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().view(heads, 1, 1).expand(heads, n, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :seq_len]
    return (probs @ v).transpose(0, 1)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _cpp_kernels() -> object:
    if IS_NATIVE:
        pytest.skip("the C++ comparison runs with the interpreter, on the CPU")
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ CPU kernels do not build here")
    return kernels


FP32, BF16 = torch.float32, torch.bfloat16
_NAMES = {FP32: "fp32", BF16: "bf16"}


def _cases(rows: list[tuple[int, int, torch.dtype, torch.dtype, int]]) -> list[object]:
    """(block size, group, cache dtype, q dtype, window) rows as pytest params with readable ids."""
    return [pytest.param(*row, id=f"bs{row[0]}-g{row[1]}-{_NAMES[row[2]]}cache-{_NAMES[row[3]]}q-w{row[4]}")
            for row in rows]


# Every pair of (block size, GQA group, dtypes, window) values meets in some row: the full product
# would take the interpreter 3x as long for little. q float32 over a bfloat16 cache is what the
# fused CPU layers hand over.
DECODE_CASES = _cases([
    (4, 1, FP32, FP32, 0), (16, 3, FP32, FP32, 20), (4, 4, FP32, FP32, 20),
    (16, 1, BF16, BF16, 20), (4, 3, BF16, BF16, 0), (16, 4, BF16, BF16, 0),
    (4, 1, BF16, FP32, 20), (16, 3, BF16, FP32, 0), (4, 4, BF16, FP32, 20),
])
# windows: 5 is shorter than the chunks, 40 cuts the cached contexts
PREFILL_CASES = _cases([
    (4, 1, FP32, FP32, 5), (16, 3, FP32, FP32, 0), (4, 4, FP32, FP32, 40),
    (16, 1, BF16, BF16, 40), (4, 3, BF16, BF16, 5), (16, 4, BF16, BF16, 0),
    (4, 1, BF16, FP32, 0), (16, 3, BF16, FP32, 40), (16, 4, BF16, FP32, 5),
])


def _decode_case(block_size: int, group: int, cache_dtype: torch.dtype, q_dtype: torch.dtype, lens: list[int],
                 seed: int, kv_heads: int = 2, dim: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size) + 2  # two padding entries past the longest
    k, v = _cache(sum(-(-n // block_size) for n in lens) + 1, block_size, kv_heads, dim, cache_dtype, gen)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen).to(q_dtype)  # [B, H, D]
    return q, k, v, _tables(lens, block_size, max_blocks, gen), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("block_size,group,cache_dtype,q_dtype,window", DECODE_CASES)
def test_decode_matches_dense_and_cpp(block_size: int, group: int, cache_dtype: torch.dtype, q_dtype: torch.dtype,
                                      window: int) -> None:
    """Four sequences of different lengths (none a multiple of the block size but 16) in one
    call; a 32-token partition splits the longest into 4 partitions and the shortest into 1."""
    lens = [1, 13, 50, 97] if block_size == 4 else [1, 16, 50, 97]
    q, k, v, tables, context_lens = _decode_case(block_size, group, cache_dtype, q_dtype, lens, seed=group)
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    triton_attention.decode_attention(q, k, v, tables, context_lens, block_size, scale, window, out,
                                      partition_size=32, block_n=16)
    assert out.dtype == q_dtype
    for b, n in enumerate(lens):
        expected = _dense(q[b : b + 1], k, v, tables[b], n, block_size, scale, window)[0]
        torch.testing.assert_close(out[b].float(), expected, **_tol(cache_dtype), msg=lambda m, b=b: f"seq {b}: {m}")
    kernels = _cpp_kernels()
    cpp = kernels.paged_decode_attention(q.to(k.dtype), k, v, tables.long(), context_lens.long(), block_size, scale,
                                         window, kernels.best_isa()).to(q.dtype)
    torch.testing.assert_close(out.float(), cpp.float(), **_tol(cache_dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_split_k_over_a_long_context(cache_dtype: torch.dtype) -> None:
    """One 170-token context, partitions of 32 (6 of them, merged) and the default (one, the direct path),
    with and without a window that cuts a partition in two, and a context_len-0 padding row
    (output 0); a max_context_len bound below the real length still attends the whole context."""
    lens = [170, 0]
    q, k, v, tables, context_lens = _decode_case(16, 3, cache_dtype, cache_dtype, lens, seed=7, kv_heads=1)
    scale = 0.3
    for window in (0, 45):
        expected = _dense(q[:1], k, v, tables[0], lens[0], 16, scale, window)[0]
        for partition, bound in ((32, None), (None, None), (32, 100)):
            out = torch.full_like(q, float("nan"))
            triton_attention.decode_attention(q, k, v, tables, context_lens, 16, scale, window, out,
                                              max_context_len=bound, partition_size=partition,
                                              block_n=16)
            msg = f"window {window}, partition {partition}, bound {bound}"
            torch.testing.assert_close(out[0].float(), expected, **_tol(cache_dtype), msg=lambda m, s=msg: f"{s}: {m}")
            assert torch.equal(out[1], torch.zeros_like(out[1])), msg


def _prefill_case(block_size: int, group: int, cache_dtype: torch.dtype, q_dtype: torch.dtype,
                  chunks: list[tuple[int, int]], seed: int, kv_heads: int = 2,
                  dim: int = 16) -> tuple[torch.Tensor, ...]:
    """chunks: (cached tokens, new tokens) per sequence, packed in that order."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in chunks]
    max_blocks = -(-max(seq_lens) // block_size) + 1
    k, v = _cache(sum(-(-n // block_size) for n in seq_lens) + 1, block_size, kv_heads, dim, cache_dtype, gen)
    starts = torch.tensor([0] + [n for _, n in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(starts[-1]), kv_heads * group, dim, generator=gen).to(q_dtype)  # [T, H, D]
    return (q, k, v, _tables(seq_lens, block_size, max_blocks, gen), starts,
            torch.tensor(seq_lens, dtype=torch.int32))


# A whole prompt; a chunk after a cached context; a speculative 4-query check after 100 cached
# tokens; a one-token chunk.
CHUNKS = [(0, 23), (37, 11), (100, 4), (6, 1)]


@pytest.mark.parametrize("block_size,group,cache_dtype,q_dtype,window", PREFILL_CASES)
def test_prefill_matches_dense_and_cpp(block_size: int, group: int, cache_dtype: torch.dtype, q_dtype: torch.dtype,
                                       window: int) -> None:
    """The four CHUNKS packed in one call, in 16-row tiles (several query tiles per chunk: 16, 5
    or 4 tokens each)."""
    q, k, v, tables, starts, seq_lens = _prefill_case(block_size, group, cache_dtype, q_dtype, CHUNKS, seed=group)
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    triton_attention.prefill_attention(q, k, v, tables, starts, seq_lens, block_size, scale, window, out,
                                       max_query_len=max(n for _, n in CHUNKS), block_m=16)
    assert out.dtype == q_dtype
    kernels = _cpp_kernels()
    cpp = torch.empty(q.shape, dtype=torch.float32)
    for i, (cached, n) in enumerate(CHUNKS):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected = _dense(q[rows], k, v, tables[i], cached + n, block_size, scale, window)
        torch.testing.assert_close(out[rows].float(), expected, **_tol(cache_dtype),
                                   msg=lambda m, i=i: f"chunk {CHUNKS[i]}: {m}")
        # as attention.py's _kernel_prefill calls it: float32 q rows, one sequence at a time
        kernels.paged_prefill_attention(q[rows].float(), k, v, tables[i].long(), cached, block_size, scale, window,
                                        kernels.best_isa(), cpp[rows])
    torch.testing.assert_close(out.float(), cpp.to(q.dtype).float(), **_tol(cache_dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_default_tiles_and_head_dim_24(cache_dtype: torch.dtype) -> None:
    """The default tile height (64 rows: 16 tokens of a group of 4) and a head size that is not a
    power of two (24, padded to 32) over a 130-token prompt and a chunk after a cached prefix."""
    chunks = [(0, 130), (60, 20)]
    q, k, v, tables, starts, seq_lens = _prefill_case(16, 4, cache_dtype, cache_dtype, chunks, seed=3, dim=24)
    out = torch.full_like(q, float("nan"))
    triton_attention.prefill_attention(q, k, v, tables, starts, seq_lens, 16, 0.2, 0, out, max_query_len=130)
    for i, (cached, n) in enumerate(chunks):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        torch.testing.assert_close(out[rows].float(), _dense(q[rows], k, v, tables[i], cached + n, 16, 0.2, 0),
                                   **_tol(cache_dtype))


@pytest.mark.parametrize("dim", [128, 256])
def test_the_head_sizes_of_qwen3_and_gemma3(dim: int) -> None:
    """Qwen3's head_dim 128 and Gemma 3's 256 (with its softmax scale, query_pre_attn_scalar
    256 ** -0.5, and a sliding window shorter than the contexts): decode over several partitions
    and a prefill chunk after a cached context, against the dense reference."""
    scale = 256**-0.5
    for window in (0, 12):
        lens = [1, 13, 40]
        q, k, v, tables, context_lens = _decode_case(4, 2, FP32, FP32, lens, seed=dim + window, dim=dim)
        out = torch.full_like(q, float("nan"))
        triton_attention.decode_attention(q, k, v, tables, context_lens, 4, scale, window, out, partition_size=32,
                                          block_n=16)
        for b, n in enumerate(lens):
            expected = _dense(q[b : b + 1], k, v, tables[b], n, 4, scale, window)[0]
            torch.testing.assert_close(out[b].float(), expected, **_tol(FP32), msg=lambda m, b=b: f"seq {b}: {m}")
        chunks = [(0, 9), (20, 5)]
        q, k, v, tables, starts, seq_lens = _prefill_case(4, 2, FP32, FP32, chunks, seed=dim + window, dim=dim)
        out = torch.full_like(q, float("nan"))
        triton_attention.prefill_attention(q, k, v, tables, starts, seq_lens, 4, scale, window, out,
                                           max_query_len=9, block_m=16)
        for i, (cached, n) in enumerate(chunks):
            rows = slice(int(starts[i]), int(starts[i + 1]))
            torch.testing.assert_close(out[rows].float(), _dense(q[rows], k, v, tables[i], cached + n, 4, scale, window),
                                       **_tol(FP32), msg=lambda m, c=chunks[i]: f"chunk {c}: {m}")


@pytest.mark.parametrize("window", [0, 50], ids=["full", "window50"])
def test_speculative_chunk_matches_decode_one_query_at_a_time(window: int) -> None:
    """The k + 1 = 4 query check after 100 cached tokens: query j of the chunk agrees with the
    decode kernel run for it alone over the context up to it (context_len = 101 + j)."""
    q, k, v, tables, starts, seq_lens = _prefill_case(4, 3, torch.float32, torch.float32, [(100, 4)], seed=5)
    out = torch.empty_like(q)
    triton_attention.prefill_attention(q, k, v, tables, starts, seq_lens, 4, 0.25, window, out, max_query_len=4)
    decoded = torch.empty_like(q)
    triton_attention.decode_attention(q, k, v, tables.expand(4, -1).contiguous(),
                                      torch.arange(101, 105, dtype=torch.int32), 4, 0.25, window, decoded,
                                      partition_size=32, block_n=16)
    torch.testing.assert_close(out, decoded, atol=2e-5, rtol=2e-5)


def _sinks(heads: int, seed: int) -> torch.Tensor:
    """[H] sink logits around the scores' scale (gpt-oss): some heads give the sink most of their weight."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2.0 + 1.0


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 20], ids=["full", "window20"])
def test_sinks_in_decode_and_prefill(cache_dtype: torch.dtype, window: int) -> None:
    """Per-head sink logits (gpt-oss) in the softmax's denominator: decode split into partitions
    (the merge adds the sink once) and direct (the partition kernel adds it), and packed prefill
    chunks, against the dense reference and the C++ kernels; the same calls without the sinks
    differ by far more than the tolerance, so a dropped sink fails."""
    lens = [1, 13, 50, 97]
    q, k, v, tables, context_lens = _decode_case(4, 3, cache_dtype, cache_dtype, lens, seed=21)
    sinks = _sinks(q.shape[1], seed=21)
    scale = q.shape[-1] ** -0.5
    expected = torch.stack([_dense(q[b : b + 1], k, v, tables[b], n, 4, scale, window, sinks)[0]
                            for b, n in enumerate(lens)])
    plain = torch.stack([_dense(q[b : b + 1], k, v, tables[b], n, 4, scale, window)[0] for b, n in enumerate(lens)])
    assert (expected - plain).abs().max() > 0.1
    for partition in (32, None):
        out = torch.full_like(q, float("nan"))
        triton_attention.decode_attention(q, k, v, tables, context_lens, 4, scale, window, out,
                                          partition_size=partition, block_n=16, sinks=sinks)
        torch.testing.assert_close(out.float(), expected, **_tol(cache_dtype),
                                   msg=lambda m, p=partition: f"partition {p}: {m}")
    q, k, v, tables, starts, seq_lens = _prefill_case(4, 3, cache_dtype, cache_dtype, CHUNKS, seed=22)
    out = torch.full_like(q, float("nan"))
    triton_attention.prefill_attention(q, k, v, tables, starts, seq_lens, 4, scale, window, out,
                                       max_query_len=max(n for _, n in CHUNKS), block_m=16, sinks=sinks)
    for i, (cached, n) in enumerate(CHUNKS):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        torch.testing.assert_close(out[rows].float(), _dense(q[rows], k, v, tables[i], cached + n, 4, scale, window,
                                                             sinks), **_tol(cache_dtype),
                                   msg=lambda m, i=i: f"chunk {CHUNKS[i]}: {m}")
    kernels = _cpp_kernels()
    cpp = torch.empty(q.shape, dtype=torch.float32)
    for i, (cached, _) in enumerate(CHUNKS):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        kernels.paged_prefill_attention(q[rows].float(), k, v, tables[i].long(), cached, 4, scale, window,
                                        kernels.best_isa(), cpp[rows], sinks)
    torch.testing.assert_close(out.float(), cpp.to(q.dtype).float(), **_tol(cache_dtype))


def test_default_partition_fills_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long partitions while the grid has a program per SM, shorter ones when it would not."""
    monkeypatch.setattr(_decode_module, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert _decode_module.default_partition_size(64, 8, 2048, 64, cpu) == 1024  # 1024 programs
    assert _decode_module.default_partition_size(1, 8, 32768, 64, cpu) == 1024  # 256 programs
    assert _decode_module.default_partition_size(1, 8, 4096, 64, cpu) == 128  # 256 programs; 256-key partitions give 128 < 132
    assert _decode_module.default_partition_size(1, 2, 4096, 16, cpu) == 32  # down to two tiles


def _valid_decode_args() -> dict[str, object]:
    q, k, v, tables, lens = _decode_case(4, 2, torch.float32, torch.float32, [5, 9], seed=0)
    return {"q": q, "k_cache": k, "v_cache": v, "block_tables": tables, "context_lens": lens, "block_size": 4,
            "scale": 0.25, "window": 0, "out": torch.empty_like(q)}


@pytest.mark.parametrize("name,bad", [
    ("block_tables", lambda a: a["block_tables"].long()),
    ("context_lens", lambda a: a["context_lens"][:1]),
    ("context_lens", lambda a: a["context_lens"].float()),
    ("q", lambda a: a["q"][0]),
    ("q", lambda a: a["q"].half()),
    ("q", lambda a: a["q"][:, :3]),  # 3 heads over 2 KV heads
    ("out", lambda a: a["out"].bfloat16()),
    ("v_cache", lambda a: a["v_cache"].bfloat16()),
    ("k_cache", lambda a: a["k_cache"][..., :8]),
    ("window", lambda a: -1),
    ("block_size", lambda a: 0),
    ("scale", lambda a: "0.25"),
])
def test_decode_rejects_bad_arguments_by_name(name: str, bad: object) -> None:
    args = _valid_decode_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=f"^{name}:"):
        triton_attention.decode_attention(**args)


def test_prefill_rejects_bad_arguments_by_name() -> None:
    q, k, v, tables, starts, seq_lens = _prefill_case(4, 2, torch.float32, torch.float32, [(0, 3), (2, 2)], seed=0)
    good = {"q": q, "k_cache": k, "v_cache": v, "block_tables": tables, "query_start_loc": starts,
            "seq_lens": seq_lens, "block_size": 4, "scale": 0.25, "window": 0, "out": torch.empty_like(q),
            "max_query_len": 3}
    for name, bad in [("query_start_loc", starts[:2]), ("query_start_loc", starts.long()),
                      ("seq_lens", seq_lens.long()), ("block_tables", tables[:1]), ("max_query_len", -1),
                      ("block_m", 24), ("out", torch.empty_like(q)[:2])]:
        with pytest.raises(ValueError, match=f"^{name}:"):
            triton_attention.prefill_attention(**{**good, name: bad})


def test_package_imports_without_triton() -> None:
    """The package imports where triton does not, and says it is unavailable."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import engine.execution.triton as t\n"
            "assert t.is_available() is False\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


def _python_files() -> Iterator[Path]:
    for package in ("engine", "service", "bench", "minivllm", "tests"):
        yield from (ROOT / package).rglob("*.py")


def test_only_the_triton_package_imports_triton() -> None:
    """What keeps this module's interpreter setup from leaking: no other module imports triton,
    so none depends on TRITON_INTERPRET's value or on when triton was first imported."""
    allowed = {ROOT / "engine" / "execution" / "triton", Path(__file__).resolve()}
    pattern = re.compile(r"^\s*(import triton|from triton\b)", re.MULTILINE)
    offenders = [str(p.relative_to(ROOT)) for p in _python_files()
                 if pattern.search(p.read_text()) and not any(a == p or a in p.parents for a in allowed)]
    assert not offenders, offenders


def test_kernels_are_interpreted_and_the_variable_restored() -> None:
    if IS_NATIVE:
        pytest.skip("a native run compiles the kernels")
    import triton.runtime

    for kernel in (_decode_module._decode_partition_kernel, _decode_module._merge_partitions_kernel,
                   _prefill_module._prefill_kernel, _pointwise_module._rms_norm_kernel,
                   _pointwise_module._rotary_kernel, _pointwise_module._silu_and_mul_kernel):
        assert not isinstance(kernel, triton.runtime.JITFunction), kernel
    assert _INTERPRET_AFTER_IMPORT == _INTERPRET_BEFORE


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the bucket's forward."""

    def __init__(self, graphs: object, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs.logits[self.bucket], self.graphs.argmax[self.bucket] = self.graphs._forward(self.bucket)


@pytest.mark.skipif(IS_NATIVE, reason="the GPU check runs the CUDA backend itself")
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen2-sliding"])
def test_the_cuda_backends_host_code_generates_what_the_reference_backend_does(
        family: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA backend's own code on the CPU, its kernels interpreted: Triton prefill over packed
    chunks (chunked, beside decodes), the KV pool with its scratch block, and decode steps through
    the graphs' static buffers, padded to their bucket (3 streams in a bucket of 4), replayed by
    running the bucket's forward instead of a captured graph. Greedy tokens equal the pure-torch
    reference backend's: on the tiny Llama, and on Qwen3's and Gemma 3's layers (per-head q/k
    norms, output norms, GeGLU, scaled embeddings, windowed layers with their own rope; Gemma 3's
    window and full layers are three KV-cache groups of one layer). qwen2-sliding: two KV-cache groups (a full
    layer, a window-8 layer whose out-of-window blocks go back to the pool), each read through its
    own tables and slots, against the reference with one group."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.execution import model_runner
    from engine.execution.backends import cuda_graphs
    from engine.execution.backends.cuda_backend import CudaBackend
    from tests.tiny_model import build_tiny_family_model, family_config

    model = tiny_model_dir if family == "llama" else build_tiny_family_model(
        tmp_path_factory.mktemp(family) / "model", family_config(family))
    options = dict(model=str(model), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                   max_num_seqs=4, enable_time_budget=False)
    prompts = [[5, 9, 200, 31, 7, 11, 13], [44] * 23, list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def generate(config: EngineConfig) -> list[list[int]]:
        engine = LLMEngine(config)
        ids = [engine.add_request(p, params) for p in prompts]
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step()[0]:
                outputs[out.request_id] = out.token_ids
        return [outputs[i] for i in ids], engine

    reference, _ = generate(EngineConfig(backend="torch", enable_hybrid_kv_cache=False, **options))

    def on_the_cpu(config: EngineConfig, model_config: object) -> CudaBackend:
        return CudaBackend(config, model_config, torch.device("cpu"), torch.float32)

    def capture(graphs: cuda_graphs.DecodeGraphs) -> None:
        for bucket in graphs.buckets:
            graphs.graphs[bucket] = _EagerReplay(graphs, bucket)

    monkeypatch.setattr(model_runner, "select_backend", on_the_cpu)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "capture", capture)
    batches = []
    step = cuda_graphs.DecodeGraphs.step
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "step",
                        lambda self, tokens, *a: batches.append(len(tokens)) or step(self, tokens, *a))
    ours, engine = generate(EngineConfig(**options))
    # Gemma 3's window, window, full: groups of one layer each, as its one full layer sizes them.
    assert engine.runner.kv_layout.num_groups == {"qwen2-sliding": 2, "gemma3": 3}.get(family, 1)
    backend = engine.runner.backend
    assert backend.name == "cuda" and backend.graphs.buckets == [1, 2, 4] and backend.max_decode_rows == 4
    # The elementwise layers ran on the Triton kernels (interpreted): every norm and rotation, the
    # SiLU gated MLPs (Gemma 3's GeGLU stays torch's).
    from engine.execution.backends.cuda_pointwise import TritonRMSNorm, TritonRotation, TritonSiluAndMul
    from engine.execution.models.layers import GatedActivation, RMSNorm, Rotation

    modules = list(engine.runner.model.modules())
    assert not any(type(m) in (RMSNorm, Rotation) for m in modules)
    assert sum(isinstance(m, TritonRMSNorm) for m in modules) >= 5 and any(isinstance(m, TritonRotation) for m in modules)
    assert any(isinstance(m, TritonSiluAndMul) for m in modules) == (family != "gemma3")
    assert any(type(m) is GatedActivation for m in modules) == (family == "gemma3")
    assert ours == reference
    assert 3 in batches  # three streams decoded in the bucket of 4: one padded row
    scratch_slot = backend.graphs.scratch_slot
    assert scratch_slot == engine.runner.kv_cache.shape[2]  # the first slot past the pool's view
    assert backend.graphs.kv_caches[0][0][scratch_slot].abs().sum() > 0  # the padded row wrote there


def _pointwise_call(fn: object, *tensors: torch.Tensor, **kwargs: object) -> object:
    """A pointwise kernel on the tests' CPU tensors: interpreted, or (native) on GPU copies, its
    result and its in-place arguments brought back."""
    if not IS_NATIVE:
        return fn(*tensors, **kwargs)
    moved = [t.cuda() for t in tensors]
    result = fn(*moved, **kwargs)
    for t, m in zip(tensors, moved, strict=True):
        t.copy_(m.cpu())
    if isinstance(result, tuple):
        return tuple(r.cpu() for r in result)
    return result.cpu() if isinstance(result, torch.Tensor) else result


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units of their dtype's last place."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return int((a.view(bits).long() - b.view(bits).long()).abs().max())


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_rms_norm_kernel_is_the_modules_norm(dtype: torch.dtype) -> None:
    """Rows of a 2-D tensor and the heads of q/k views of a QKV row (Qwen3's per-head norms): the
    sum of squares is the kernel's own order, which moves a float32 result by a few ulps (4 here)
    and a bfloat16 one, rounded after, by one at most."""
    max_ulps = 8 if dtype == FP32 else 2 if IS_NATIVE else 1  # (a GPU's rsqrt is its own too)
    from engine.execution.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(3)
    for shape in ((5, 96), (1, 40)):
        norm = RMSNorm(shape[1], 1e-5)
        norm.weight.data = (torch.randn(shape[1], generator=gen) * 0.3 + 1).to(dtype)
        x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
        got = _pointwise_call(_pointwise_module.rms_norm, x, norm.weight, eps=norm.eps)
        assert got.dtype == dtype and got.shape == x.shape
        assert _ulps(got, norm(x)) <= max_ulps
    qkv = (torch.randn(3, (4 + 2 + 2) * 16, generator=gen)).to(dtype)
    q = qkv[:, : 4 * 16].view(3, 4, 16)  # strides (128, 16, 1): rows of heads, not one stride
    norm = RMSNorm(16, 1e-6)
    norm.weight.data = torch.rand(16, generator=gen).to(dtype)
    assert _ulps(_pointwise_call(_pointwise_module.rms_norm, q, norm.weight, eps=norm.eps), norm(q)) <= max_ulps


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_rotary_kernel_rotates_q_and_k_in_place_as_the_module_does(dtype: torch.dtype) -> None:
    """Bit for bit: each product and the sum rounded where torch's ops round them."""
    from engine.execution.models.layers import Rotation

    gen = torch.Generator().manual_seed(4)
    num_tokens, heads, kv_heads, dim = 5, 6, 2, 32
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    angles = torch.randn(num_tokens, 1, dim // 2, generator=gen) * 3
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    want_q, want_k = Rotation()(q, k, cos, sin)
    _pointwise_call(_pointwise_module.rotary, q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_silu_and_mul_kernel_is_the_gated_activation(dtype: torch.dtype) -> None:
    """SiLU(gate) rounded to the dtype, then times up, as torch's two ops round."""
    from engine.execution.models.layers import GatedActivation

    gen = torch.Generator().manual_seed(5)
    act = GatedActivation("silu", 40)
    gate_up = (torch.randn(3, 80, generator=gen) * 3).to(dtype)
    got = _pointwise_call(_pointwise_module.silu_and_mul, gate_up, block=16)  # 3 blocks a row, the last partial
    assert got.shape == (3, 40) and got.dtype == dtype
    # exp is the kernel's own (numpy's here, the GPU's exp2 of a rounded g log2(e) there): float32
    # moves by an ulp or two here, up to about 10 on a GPU; bfloat16, rounded after, by one at most
    assert _ulps(got, act(gate_up)) <= ((16 if IS_NATIVE else 4) if dtype == FP32 else 1)


def test_pointwise_kernels_refuse_what_they_do_not_take() -> None:
    with pytest.raises(ValueError, match="rms_norm"):
        _pointwise_module.rms_norm(torch.zeros(2, 3, 4, 5), torch.ones(5), 1e-5)
    with pytest.raises(ValueError, match="rotary"):
        _pointwise_module.rotary(torch.zeros(2, 3, 5), torch.zeros(2, 1, 5), torch.zeros(2, 1, 5), torch.zeros(2, 1, 5))
    with pytest.raises(ValueError, match="silu_and_mul"):
        _pointwise_module.silu_and_mul(torch.zeros(2, 7))
    q, k = torch.zeros(2, 3, 4), torch.zeros(2, 1, 4)
    cos = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="slot_mapping"):  # float slots: the kernel would read them as ints
        _pointwise_module.rotary(q, k, cos, cos, k.clone(), torch.zeros(8, 1, 4), torch.zeros(8, 1, 4),
                                 torch.zeros(2))
    with pytest.raises(ValueError, match="k_cache"):
        _pointwise_module.rotary(q, k, cos, cos, k.clone(), torch.zeros(8, 2, 4), torch.zeros(8, 2, 4),
                                 torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(FP32, FP32), (BF16, BF16), (FP32, BF16)])
def test_rotary_kernel_writes_k_and_v_at_their_slots_as_write_kv_does(dtype: torch.dtype,
                                                                       cache_dtype: torch.dtype) -> None:
    """One launch: q and k rotated in place, the rotated k and v copied to each token's slot (a
    float32 model's into a bfloat16 cache rounded there), bit for bit what the rotation and
    attention.write_kv do; no other slot touched."""
    from engine.execution.models.layers import Rotation

    gen = torch.Generator().manual_seed(6)
    num_tokens, heads, kv_heads, dim, num_slots = 4, 4, 2, 16, 24
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.randn(num_tokens, 1, dim // 2, generator=gen)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    caches = [torch.randn(num_slots, kv_heads, dim, generator=gen).to(cache_dtype) for _ in range(2)]

    def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = rows[:, : heads * dim].view(num_tokens, heads, dim)
        k = rows[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
        return q, k, rows[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)

    want_caches = [c.clone() for c in caches]
    want_q, want_k = Rotation().rotate_and_cache(*split(qkv.clone()), cos, sin, *want_caches, slots)
    q, k, v = split(qkv)
    _pointwise_call(_pointwise_module.rotary, q, k, cos, sin, v, *caches, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_add_rms_norm_kernel_is_the_add_then_the_norm(dtype: torch.dtype) -> None:
    """The residual add exactly (rounded to the dtype as torch's add), its norm as rms_norm's."""
    from engine.execution.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = (torch.randn(96, generator=gen) * 0.3 + 1).to(dtype)
    residual, x = ((torch.randn(5, 96, generator=gen) * 3).to(dtype) for _ in range(2))
    want_total, want = norm.add_and_norm(residual, x)
    total, got = _pointwise_call(_pointwise_module.add_rms_norm, residual, x, norm.weight, eps=norm.eps)
    assert torch.equal(total, want_total)
    assert _ulps(got, want) <= (8 if dtype == FP32 else 2 if IS_NATIVE else 1)
