"""The engine runs the benchmarks share: the prompts, the offline loop that keeps every step's
stats, and the weight modes they compare."""
from __future__ import annotations

import random
import time

from engine import LLM, SamplingParams, StepStats

# mode (weights, and the KV cache where it differs) -> engine options
# (a .gguf model is served as its blocks only in gguf mode; the others dequantize it)
WEIGHT_MODES = {"float32": {"dtype": "float32", "quantization": "none"},
                "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
                "int8": {"dtype": "float32", "quantization": "int8"},
                "float32-kv-bfloat16": {"dtype": "float32", "kv_cache_dtype": "bfloat16", "quantization": "none"},
                "gguf": {"dtype": "float32", "quantization": "gguf"},
                # llama.cpp's own default: its KV cache is float16
                "gguf-kv-bfloat16": {"dtype": "float32", "kv_cache_dtype": "bfloat16", "quantization": "gguf"}}


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids from a mid range of the vocabulary avoid special tokens at the start.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def run_minivllm(llm: LLM, prompts: list[list[int]], output_len: int | list[int],
                 concurrency: int | None = None) -> tuple[float, list[StepStats]]:
    """The same loop as LLM.generate, keeping every step's stats (output_len: one for all
    prompts, or one per prompt). With `concurrency`, a closed loop as a serving client runs it:
    at most that many requests in the engine, the next one added as soon as one finishes."""
    output_lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
    engine = llm.engine
    pending = list(zip(prompts, output_lens, strict=True))[::-1]  # popped from the end, in order
    num_in_flight = concurrency or len(pending)
    start = time.perf_counter()

    def add(count: int) -> None:
        for _ in range(min(count, len(pending))):
            prompt, n = pending.pop()
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    add(num_in_flight)
    steps = []
    while engine.has_unfinished_requests():
        outputs, stats = engine.step()
        steps.append(stats)
        add(sum(out.is_finished for out in outputs))
    return time.perf_counter() - start, steps


def resolve_dir(model: str | None) -> str:
    from engine import resolve_model

    return str(resolve_model(model))


def resident_memory(llm: LLM) -> dict[str, float]:
    """The process's resident memory (GB) beside what it must hold: the weights in the form the
    backend runs them (each tensor once) and the KV pool; `other` is the rest (libraries,
    tokenizers, buffers), which issue 47 holds to 0.5 GB."""
    import os

    seen: set[int] = set()

    def nbytes(t: object) -> int:
        if t is None or t.data_ptr() in seen:
            return 0
        seen.add(t.data_ptr())
        return t.numel() * t.element_size()

    runner = llm.engine.runner
    weights = 0
    for module in runner.model.modules():
        # panels: PackedWeight or a GGUF file's QuantizedWeight (no scales); weight_blocks: a quantized embedding's
        for panels in (getattr(module, "panels", None), getattr(module, "weight_blocks", None)):
            if panels is not None:
                weights += sum(nbytes(t) for t in (panels.data, getattr(panels, "scales", None), panels.bias))
        # PackedExperts: each expert's gate_up and down panels (float, int8 or the file's blocks)
        for panels in (*getattr(module, "gate_up_panels", ()), *getattr(module, "down_panels", ())):
            weights += sum(nbytes(t) for t in (panels.data, getattr(panels, "scales", None), panels.bias))
        packed = getattr(module, "packed_weight", None)
        if packed is not None:
            weights += packed.numel() * packed.element_size()  # oneDNN's opaque copy: no shared data pointer
        weights += sum(nbytes(p) for p in module.parameters(recurse=False))
    kv = runner.kv_cache.numel() * runner.kv_cache.element_size()
    with open(f"/proc/{os.getpid()}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open(f"/proc/{os.getpid()}/status") as f:  # VmHWM: the most ever resident (loading's peak)
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return {"rss_gb": rss / 1e9, "peak_rss_gb": peak / 1e9, "weights_gb": weights / 1e9, "kv_cache_gb": kv / 1e9,
            "other_gb": (rss - weights - kv) / 1e9}
