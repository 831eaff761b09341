"""The batch-1 machinery of `bench.offline_throughput --single-stream`: rounds held to the memory
bandwidth around them, paired read rates, the decode under load, and the per-token split."""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from bench.kernels import load_bench_kernels
from bench.latency_stats import timed
from bench.runs import run_minivllm
from engine import LLM, SamplingParams, StepStats
from engine.execution.backends.cpu_linear import PackedLinear
from engine.execution.backends.cpu_moe import PackedExperts
from engine.execution.huge_pages import huge_page_tensor
from engine.execution.models.layers import Linear
from engine.execution.models.moe import Experts


def weight_bytes_per_token(llm: LLM) -> int:
    """Bytes of weights one decode step reads: every projection and the LM head (a packed linear
    counts its packed copy; a tied LM head reads the embedding matrix), plus the norms. The
    embedding lookup reads one row, which is left out. A mixture-of-experts layer's token runs k
    of its E experts: k/E of the experts' bytes (their panels, or their float weights)."""
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear | PackedLinear)]
    total = 0
    for module in linears:
        if isinstance(module, PackedLinear) and module.uses_panels(1):  # what a batch-1 step reads
            total += module.panels.num_bytes
            continue
        packed = getattr(module, "packed_weight", None)
        weight = packed if packed is not None else module.weight
        total += weight.numel() * weight.element_size()
        if module.bias is not None:
            total += module.bias.numel() * module.bias.element_size()
    counted = {id(p) for m in linears for p in m.parameters()} | {id(p) for p in model.embed_tokens.parameters()}
    for module in model.modules():
        if isinstance(module, PackedExperts | Experts):
            counted |= {id(p) for p in module.parameters()}  # a GGUF file's are left on the meta device
            total += _routed_expert_bytes(module)
    total += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in counted)  # the norms
    return total


def _routed_expert_bytes(experts: PackedExperts | Experts) -> int:
    """The bytes one token's k routed experts read: k/E of every expert's (the experts are alike)."""
    cfg = experts.cfg
    if isinstance(experts, PackedExperts):
        stored = sum(w.num_bytes for w in (*experts.gate_up_panels, *experts.down_panels))
    else:
        stored = sum(p.numel() * p.element_size() for p in experts.parameters())
    return stored * cfg.num_experts_per_tok // cfg.num_experts


def read_bandwidths(x: torch.Tensor, repeats: int) -> list[float]:
    """This machine's memory read bandwidth as torch sees it: `repeats` sums over x (B/s each),
    a buffer from `bandwidth_buffer`. On a shared VM the bandwidth swings (for seconds at a time
    far above its usual rate), which the hundred-odd steps of a decode may or may not see:
    callers sample it around the very run they compare with."""
    return [x.numel() * x.element_size() / timed(x.sum) for _ in range(repeats)]


def bandwidth_buffer(num_bytes: int = 1 << 30) -> torch.Tensor:
    """1 GiB of random floats to sum. They lie on 2 MiB pages, as the engine's weights do: on
    4 KiB pages the sums read slower, and the bound would flatter us."""
    x = huge_page_tensor((num_bytes // 4,), torch.float32).normal_()
    x.sum()
    return x


def decode_tok_s(steps: list[StepStats]) -> float | None:
    """A batch-1 run's decode speed: one over its median decode-only step; None without one."""
    decode = [s.total_time for s in steps if s.num_prefill_tokens == 0]
    return 1.0 / statistics.median(decode) if decode else None


def run_single_stream_rounds(llm: LLM, prompts: list[list[int]], output_lens: list[int], num_rounds: int,
                             buffer_bytes: int = 1 << 30) -> tuple[float, list[StepStats], list[dict]]:
    """The batch-1 run `num_rounds` times, with two sums over 1 GiB (buffer_bytes) before each round and after
    the last: each round's decode steps are held to the bandwidth of the seconds around them.
    On a shared VM the bandwidth swings within a minute, so one bound sampled around one short
    run compared different seconds (the same build's ratio moved widely within an hour).
    Returns the seconds of all rounds, the steps of all rounds, and per round its samples
    (GB/s), their median, and its decode tok/s."""
    buffer = bandwidth_buffer(buffer_bytes)
    samples = [read_bandwidths(buffer, 2)]
    seconds, steps, rounds = 0.0, [], []
    for _ in range(num_rounds):
        elapsed, round_steps = run_minivllm(llm, prompts, output_lens)
        samples.append(read_bandwidths(buffer, 2))
        around = samples[-2] + samples[-1]
        rounds.append({"read_bandwidth_samples_gb_s": [b / 1e9 for b in around],
                       "read_bandwidth_gb_s": statistics.median(around) / 1e9,
                       "achieved_decode_tok_s": decode_tok_s(round_steps)})
        seconds += elapsed
        steps += round_steps
    return seconds, steps, rounds


PAIRED_BANDS = ((0.0, 40.0), (40.0, 50.0), (50.0, float("inf")))  # GB/s of the sums


def step_weights(llm: LLM) -> list[torch.Tensor]:
    """The packed weights a fused batch-1 decode step reads, in its order (each layer's QKV,
    output, gate/up and down projections, then the LM head); [] when the model runs without the
    C++ kernels' one-call step."""
    model = llm.engine.runner.model
    if getattr(llm.engine.runner.backend, "fused", None) is None:
        return []
    projections = [p for layer in model.layers for p in layer.projections]
    return [p.panels.data for p in [*projections, model.lm_head]]


def paired_read_rates(llm: LLM, prompt: list[int], output_len: int, weight_bytes: int, seconds: float,
                      buffer_bytes: int = 1 << 28) -> list[dict]:
    """Alternate a sum over 256 MiB and 8 batch-1 decode steps (then a sum again) for `seconds`,
    the context kept within the prompt plus output_len tokens, as in the rounds;
    per band of the two sums' mean rate, the decode's median weight-read rate (weight_bytes per
    step) and its ratio to the sums. Pairs whose two sums differ by 10 % or more are left out:
    the bandwidth moved within the pair.

    With the C++ kernels each pair also reads the step's own weights plainly, in its order and
    split, the threads waiting at each weight's end as the step's do at each part's
    (`stream_weights`): per band its rate, its ratio to the sums (the most the step's memory
    pattern allows against the sums' bound) and the decode's ratio to it; and, on two or more
    threads, how long a cache line takes to pass between two threads' cores (`core_handoff_ns`,
    per band its median): it tells whether the band's pairs ran on one chiplet or on two."""
    buffer = bandwidth_buffer(buffer_bytes)
    engine = llm.engine
    weights = step_weights(llm)
    kernels = load_bench_kernels() if weights else None
    stream_bytes = sum(w.numel() * w.element_size() for w in weights)

    def bandwidth() -> float:
        return buffer.numel() * buffer.element_size() / timed(buffer.sum)

    def start() -> None:
        for request_id in list(engine.scheduler.requests):
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=output_len + 16, ignore_eos=True))
        engine.step()  # the prefill

    handoffs = bool(weights) and torch.get_num_threads() >= 2
    start()
    pairs = []  # (sums' mean GB/s, decode's GB/s, the plain read's GB/s or None, hand-over ns or None)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if next(iter(engine.scheduler.requests.values())).num_tokens + 8 > len(prompt) + output_len:
            start()
        before = bandwidth()
        steps = [engine.step()[1].total_time for _ in range(8)]
        streams = [kernels.stream_weights(weights, True, engine.runner.backend.isa)[0] for _ in range(2)] if weights else []
        handoff = kernels.core_handoff_ns(200) if handoffs else None
        after = bandwidth()
        if abs(before - after) < 0.1 * max(before, after):
            stream = stream_bytes / statistics.median(streams) / 1e9 if streams else None
            pairs.append(((before + after) / 2e9, weight_bytes / statistics.median(steps) / 1e9, stream, handoff))
    bands = []
    for low, high in PAIRED_BANDS:
        chosen = [p for p in pairs if low <= p[0] < high]
        if not chosen:
            continue
        ratios = sorted(d / b for b, d, _, _ in chosen)
        band = {"band": f"{low:.0f}-{high:.0f}", "pairs": len(chosen),
                "sum_gb_s": statistics.median(b for b, _, _, _ in chosen),
                "decode_gb_s": statistics.median(d for _, d, _, _ in chosen), "ratio": statistics.median(ratios),
                "ratio_p10": ratios[len(ratios) // 10], "ratio_p90": ratios[len(ratios) * 9 // 10]}
        if weights:
            band |= {"stream_gb_s": statistics.median(r for _, _, r, _ in chosen),
                     "stream_ratio": statistics.median(r / b for b, _, r, _ in chosen),
                     "decode_over_stream": statistics.median(d / r for _, d, r, _ in chosen)}
        if handoffs:
            band["handoff_ns"] = statistics.median(h for _, _, _, h in chosen)
        bands.append(band)
    return bands


def busy_decode_tok_s(llm: LLM, prompts: list[list[int]], output_lens: list[int], num_rounds: int,
                      num_busy: int) -> list[float]:
    """Each round's decode tok/s (median step) while num_busy processes spin, a core each."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(num_busy)]
    try:
        time.sleep(0.2)  # let them start
        speeds = []
        for _ in range(num_rounds):
            _, steps = run_minivllm(llm, prompts, output_lens)
            speeds.append(decode_tok_s(steps))
        return speeds
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


PROJECTION_PARTS = ("qkv", "o_proj", "gate_up", "down", "lm_head")


def decode_split_batch1(llm: LLM, steps: list[StepStats], context: int) -> dict[str, Any]:
    """Per-token split of a batch-1 decode step: projections (LM head included), attention, the
    rest (norms, SiLU, argmax, the step's inputs, host), against the measured forward time.

    With the fused decode step the parts are its own, timed inside the steps just run (a part
    from the one before's completion to its own, so waits count where they fall); call
    `take_decode_part_seconds` before the run. Without it, the projections and attention are
    timed one by one afterwards (every Linear on one row; every layer's decode attention at
    `context`)."""
    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    forwards = [s.forward_time for s in steps if s.num_prefill_tokens == 0 and s.num_decode_seqs == 1]
    forward = statistics.median(forwards)
    fused = getattr(runner.backend, "fused", None)
    parts = fused.take_part_seconds() if fused is not None else None
    if parts is not None and parts["steps"] > 0:
        per_step = {name: 1e3 * seconds / parts["steps"] for name, seconds in parts.items() if name != "steps"}
        projections = sum(per_step[name] for name in PROJECTION_PARTS)
        attn = per_step["attention"]
        forward = statistics.mean(forwards)  # the parts are means too: a median could undercut their sum
        return {"source": "fused step's parts", "forward_ms": 1e3 * forward, "projections_ms": projections,
                "attention_ms": attn, "rest_ms": max(0.0, 1e3 * forward - projections - attn),
                "parts_ms": per_step, "steps": parts["steps"]}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    inputs = {m.in_features: torch.randn(1, m.in_features, dtype=runner.dtype) for m in linears}
    mc = runner.model_config
    bs = runner.block_size
    num_blocks = (context + bs - 1) // bs
    q = torch.randn(1, mc.num_heads, mc.head_dim, dtype=runner.dtype)
    tables = torch.arange(num_blocks, dtype=torch.int64).unsqueeze(0)
    lens = torch.tensor([context], dtype=torch.int64)
    k_cache, v_cache = runner.kv_caches[0]

    def attention() -> None:
        for _ in range(mc.num_layers):
            if runner.backend.kernels is not None:
                runner.backend.kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, bs, mc.head_dim**-0.5,
                                                              0, runner.backend.isa)
            else:
                k = k_cache[:context].unsqueeze(0).transpose(1, 2)  # the torch path's gathered context
                torch.nn.functional.scaled_dot_product_attention(
                    q.unsqueeze(2), k.repeat_interleave(mc.num_heads // mc.num_kv_heads, 1),
                    k.repeat_interleave(mc.num_heads // mc.num_kv_heads, 1))

    with torch.inference_mode():
        projections = statistics.median(timed(lambda: [m(inputs[m.in_features]) for m in linears]) for _ in range(20))
        attn = statistics.median(timed(attention) for _ in range(20))
    return {"source": "timed one by one", "forward_ms": 1e3 * forward, "projections_ms": 1e3 * projections,
            "attention_ms": 1e3 * attn, "rest_ms": 1e3 * max(0.0, forward - projections - attn)}
