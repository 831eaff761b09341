"""The prefill/decode trade-off as numbers: a mixed workload (many short chats plus a few very
long prompts, Poisson arrivals) replayed through the engine with chunked prefill on and off.
Prints TTFT and inter-token latency p50/p99 for both.

    python -m bench.scheduling [--num-short 48 --num-long 3 --long-len 1536 --rate 4]
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import time

from bench.latency_stats import summarize
from engine import EngineConfig, LLMEngine, SamplingParams

logger = logging.getLogger("bench.scheduling")


def make_workload(args: argparse.Namespace, vocab: int) -> list[tuple[float, list[int], SamplingParams]]:
    """(arrival offset s, prompt ids, params), sorted by arrival; long prompts land mid-run."""
    rng = random.Random(args.seed)
    items, t = [], 0.0
    for _ in range(args.num_short):
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(16, 96))]
        items.append((t, prompt, SamplingParams(temperature=0, max_tokens=args.short_output, ignore_eos=True)))
    span = t
    for i in range(args.num_long):
        prompt = [rng.randrange(100, vocab) for _ in range(args.long_len)]
        items.append((span * (i + 1) / (args.num_long + 1), prompt,
                      SamplingParams(temperature=0, max_tokens=args.long_output, ignore_eos=True)))
    return sorted(items, key=lambda x: x[0])


def replay(engine: LLMEngine, workload: list[tuple[float, list[int], SamplingParams]]) -> dict[str, dict]:
    ttfts, itls, pending = [], [], list(workload)
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            offset, prompt, params = pending.pop(0)
            engine.add_request(prompt, params, arrival_time=start + offset)
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        _, stats = engine.step()
        ttfts.extend(stats.times_to_first_token)
        itls.extend(stats.inter_token_latencies)
    return {"ttft_s": summarize(ttfts), "itl_s": summarize(itls), "duration_s": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-short", type=int, default=48)
    parser.add_argument("--short-output", type=int, default=32)
    parser.add_argument("--num-long", type=int, default=3)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--rate", type=float, default=4.0, help="short-chat arrivals per second (Poisson)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    results = {}
    engine = LLMEngine(EngineConfig(model=args.model, max_num_batched_tokens=args.max_num_batched_tokens,
                                    enable_prefix_caching=False))
    for chunked in (True, False):
        engine.reconfigure(enable_chunked_prefill=chunked)  # same loaded model, another policy
        workload = make_workload(args, engine.vocab_size)
        engine.add_request(workload[0][1][:8], SamplingParams(max_tokens=2))  # warm-up
        while engine.has_unfinished_requests():
            engine.step()
        results["chunked" if chunked else "unchunked"] = replay(engine, workload)
    print(f"workload: {args.num_short} short chats (16-96 tokens in, {args.short_output} out, {args.rate}/s) + "
          f"{args.num_long} prompts of {args.long_len} tokens; budget {args.max_num_batched_tokens} tokens/step")
    print(f"{'mode':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} {'wall':>7}")
    for mode, r in results.items():
        print(f"{mode:<10} {r['ttft_s']['median']:9.3f} {r['ttft_s']['p99']:9.3f} {r['itl_s']['median']:9.3f} "
              f"{r['itl_s']['p99']:9.3f} {r['duration_s']:7.1f}  (seconds)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
