"""The prefill/decode trade-off as numbers: a mixed workload (short chats arriving as a Poisson
stream plus a few very long prompts) replayed through one loaded engine under three policies,
side by side in one run:
- time:      chunked prefill sized by the learned step-time target (the default)
- fixed:     chunked prefill sized by the token budget alone
- unchunked: a long prompt runs whole in one step
For each: inter-token latency p50/p99 of the running streams as a multiple of the run's median
decode-only step, the worst gap while a long prompt was prefilling, the long prompts' TTFT and
output tokens/s. Then the cost of one prefill chunk: projections, attention and the rest, for a
first chunk and for a chunk over a cached context.

    python -m bench.scheduling [--num-short 48 --num-long 3 --long-len 1536 --rate 2]
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time

import torch

from bench.latency_stats import percentile, summarize, timed
from engine import EngineConfig, LLMEngine, SamplingParams

logger = logging.getLogger("bench.scheduling")

POLICIES = {"time": {"enable_time_budget": True, "enable_chunked_prefill": True},
            "fixed": {"enable_time_budget": False, "enable_chunked_prefill": True},
            "unchunked": {"enable_time_budget": False, "enable_chunked_prefill": False}}


def make_workload(args: argparse.Namespace, vocab: int) -> list[tuple[float, list[int], SamplingParams, bool]]:
    """(arrival offset s, prompt ids, params, is_long), sorted by arrival; long prompts land mid-run."""
    rng = random.Random(args.seed)
    items, t = [], 0.0
    for _ in range(args.num_short):
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(16, 96))]
        items.append((t, prompt, SamplingParams(temperature=0, max_tokens=args.short_output, ignore_eos=True), False))
    span = t
    for i in range(args.num_long):
        prompt = [rng.randrange(100, vocab) for _ in range(args.long_len)]
        items.append((span * (i + 1) / (args.num_long + 1), prompt,
                      SamplingParams(temperature=0, max_tokens=args.long_output, ignore_eos=True), True))
    return sorted(items, key=lambda x: x[0])


def replay(engine: LLMEngine, workload: list[tuple[float, list[int], SamplingParams, bool]]) -> dict:
    ttfts, itls, long_ttfts, long_gaps, decode_steps, errors = [], [], [], [], [], []
    long_ids: set[str] = set()
    pending = list(workload)
    num_tokens = 0
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            offset, prompt, params, is_long = pending.pop(0)
            rid = engine.add_request(prompt, params, arrival_time=start + offset)
            if is_long:
                long_ids.add(rid)
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        _, stats = engine.step()
        num_tokens += stats.num_generated_tokens
        ttfts.extend(stats.times_to_first_token)
        itls.extend(stats.inter_token_latencies)
        if stats.kind == "decode":
            decode_steps.append(stats.total_time)
        if stats.predicted_step_time:
            errors.append(stats.total_time / stats.predicted_step_time)
        if long_ids.intersection(stats.prefill_request_ids):
            long_gaps.extend(stats.inter_token_latencies)
        long_ttfts += [m.time_to_first_token for m in stats.finished if m.request_id in long_ids]
    duration = time.monotonic() - start
    step = statistics.median(decode_steps)
    return {"ttft_s": summarize(ttfts), "itl_s": summarize(itls), "median_decode_step_s": step,
            "itl_p50_x": summarize(itls)["median"] / step, "itl_p99_x": summarize(itls)["p99"] / step,
            "worst_gap_during_long_prefill_s": max(long_gaps, default=0.0),
            "worst_gap_x": max(long_gaps, default=0.0) / step,
            "long_ttft_s": summarize(long_ttfts), "output_tokens_per_s": num_tokens / duration,
            "measured_over_predicted": summarize(errors),
            "duration_s": duration}


def chunk_split(engine: LLMEngine, chunk: int, contexts: tuple[int, ...], repeats: int = 9) -> dict[int, dict]:
    """Time of one prefill chunk of `chunk` tokens after each of `contexts` cached tokens, split
    into projections (every Linear on the chunk's rows), attention (the prefill attention of every
    layer) and the rest; and the projections' GFLOP/s beside plain torch GEMMs of the same shapes.
    Every part of every context is measured once per round, `repeats` rounds, and each figure is
    the median over rounds. The machine's speed drifts within minutes, so the shares and the
    later/first ratio are taken within each round, from parts timed seconds apart, and their
    medians printed: medians of parts timed separately scattered far more than the builds they
    compared differed."""
    from engine.execution.attention import AttentionMetadata, PrefillSeqMeta

    runner = engine.runner
    model, mc = runner.model, runner.model_config
    linears = [m for m in model.modules() if hasattr(m, "in_features") and m is not model.lm_head]
    shapes = [(m.in_features, m.out_features) for m in linears]
    x = {n: torch.randn(chunk, n, dtype=runner.dtype) for n in {i for i, _ in shapes}}
    weights = {s: torch.randn(s[1], s[0], dtype=runner.dtype) for s in set(shapes)}
    q = torch.randn(chunk, mc.num_heads, mc.head_dim, dtype=runner.dtype)
    k = torch.randn(chunk, mc.num_kv_heads, mc.head_dim, dtype=runner.dtype)
    k_cache, v_cache = runner.kv_caches[0]
    engine.reconfigure(max_num_batched_tokens=chunk)

    def metadata(context: int) -> AttentionMetadata:
        slots = torch.arange(context + chunk)
        block_table = torch.arange((context + chunk + runner.block_size - 1) // runner.block_size)
        meta = [PrefillSeqMeta(0, chunk, context + chunk, slots if context else None, 0 if context else None,
                               block_table=block_table)]
        return AttentionMetadata(slot_mapping=slots[context:], num_prefill_tokens=chunk, prefill=meta,
                                 block_size=runner.block_size, backend=runner.backend.attention)

    def engine_chunk(context: int) -> float:
        """The engine's own step: a prompt of context + chunk tokens, chunked; the last chunk's forward."""
        engine.add_request(list(range(100, 100 + context + chunk)), SamplingParams(max_tokens=1))
        times = []
        while engine.has_unfinished_requests():
            stats = engine.step()[1]
            if stats.num_prefill_tokens:
                times.append(stats.forward_time)
        return times[-1]

    attns = {c: metadata(c) for c in contexts}
    prefill = runner.backend.attention.prefill
    rounds: list[dict[str, float]] = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up and is dropped
            r = {"projections": timed(lambda: [m(x[m.in_features]) for m in linears]),
                 "gemm": timed(lambda: [torch.nn.functional.linear(x[i], weights[(i, o)]) for i, o in shapes])}
            for c in contexts:
                r[f"forward{c}"] = engine_chunk(c)
                r[f"attention{c}"] = timed(lambda c=c: [prefill(q, k, k, k_cache, v_cache, attns[c], mc.head_dim**-0.5,
                                                                None) for _ in range(mc.num_layers)])
            rounds.append(r)
    rounds = rounds[1:]

    def per_round(key: str, per: str | None = None) -> list[float]:
        """r[key] of every round, or r[key] / r[per] (a ratio within each round)."""
        return [r[key] / (r[per] if per else 1.0) for r in rounds]

    def med(key: str, per: str | None = None) -> float:
        return statistics.median(per_round(key, per))

    def quartiles(key: str, per: str) -> tuple[float, float]:
        """25th and 75th percentiles over rounds of r[key] / r[per]: how far the machine's hour moves a ratio."""
        ratios = per_round(key, per)
        return percentile(ratios, 25), percentile(ratios, 75)

    flops = 2 * chunk * sum(i * o for i, o in shapes)
    proj, first = med("projections"), f"forward{contexts[0]}"
    out = {}
    for c in contexts:
        fwd, attn = med(f"forward{c}"), med(f"attention{c}")
        # Two products (q.k and p.v) of 2 FLOPs per dimension for every (query row, key it sees).
        attn_flops = 4 * mc.head_dim * mc.num_heads * mc.num_layers * (chunk * c + chunk * (chunk + 1) // 2)
        out[c] = {"forward_s": fwd, "projections_s": proj, "attention_s": attn, "rest_s": max(0.0, fwd - proj - attn),
                  "attention_share": med(f"attention{c}", f"forward{c}"),
                  "attention_share_quartiles": quartiles(f"attention{c}", f"forward{c}"),
                  "over_first": med(f"forward{c}", first), "over_first_quartiles": quartiles(f"forward{c}", first),
                  "projections_gflops": flops / proj / 1e9, "torch_gemm_gflops": flops / med("gemm") / 1e9,
                  "attention_gflops": attn_flops / attn / 1e9, "attention_over_projection_flops": attn_flops / flops}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (bfloat16: the fast CPU mode)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's dtype (auto: the engine's)")
    parser.add_argument("--num-short", type=int, default=48)
    parser.add_argument("--short-output", type=int, default=32)
    parser.add_argument("--num-long", type=int, default=3)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--rate", type=float, default=2.0, help="short-chat arrivals per second (Poisson)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig().max_num_batched_tokens)
    parser.add_argument("--policies", default="time,fixed,unchunked",
                        help=f"comma list of {list(POLICIES)}; empty: only the prefill-chunk split")
    parser.add_argument("--step-time-ratio", type=float, default=None, help="the time policy's step_time_ratio")
    parser.add_argument("--max-step-ms", type=float, default=None, help="the time policy's max_step_ms")
    parser.add_argument("--no-split", action="store_true", help="skip the prefill-chunk split")
    parser.add_argument("--chunk", type=int, default=504, help="prefill chunk size for the split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                    max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False))
    workload = make_workload(args, engine.vocab_size)
    engine.add_request(workload[0][1][:8], SamplingParams(max_tokens=2))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    results = {}
    for name in [p for p in args.policies.split(",") if p]:
        options = dict(POLICIES[name])
        if name == "time":
            options |= {k: v for k, v in (("step_time_ratio", args.step_time_ratio), ("max_step_ms", args.max_step_ms))
                        if v is not None}
        engine.reconfigure(**options)  # same loaded model (and learned costs), another policy
        results[name] = replay(engine, workload)
    if results:
        print_policies(args, results)
    splits = {}
    if not args.no_split:
        engine.reconfigure(**POLICIES["fixed"])
        splits = chunk_split(engine, args.chunk, (0, 2 * args.chunk))
    for ctx, s in splits.items():
        print(f"prefill chunk of {args.chunk} tokens after {ctx:5d} cached: forward {1e3 * s['forward_s']:6.1f} ms = "
              f"projections {1e3 * s['projections_s']:6.1f} + attention {1e3 * s['attention_s']:5.1f} "
              f"({100 * s['attention_share']:4.1f}% of the forward, median of rounds, quartiles "
              f"{100 * s['attention_share_quartiles'][0]:.1f}-{100 * s['attention_share_quartiles'][1]:.1f}%) + rest "
              f"{1e3 * s['rest_s']:5.1f}; "
              f"projections at {s['projections_gflops']:.0f} GFLOP/s, torch GEMM {s['torch_gemm_gflops']:.0f} GFLOP/s, "
              f"attention at {s['attention_gflops']:.0f} GFLOP/s ({s['attention_over_projection_flops']:.3f}x the "
              f"projections' FLOPs)")
    if splits:
        first, later = splits[0], splits[2 * args.chunk]
        # With attention at the projections' FLOP rate, the later chunk costs this much of the first (no rest).
        at_par = (1 + later["attention_over_projection_flops"]) / (1 + first["attention_over_projection_flops"])
        low, high = later["over_first_quartiles"]
        print(f"chunk over {2 * args.chunk} cached tokens / first chunk: {later['over_first']:.3f}x "
              f"(median of rounds, quartiles {low:.3f}-{high:.3f}; {at_par:.3f}x with attention at the projections' "
              f"FLOP rate)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": vars(args), "results": results, "chunk_split": splits}, f, indent=2)


def print_policies(args: argparse.Namespace, results: dict[str, dict]) -> None:
    print(f"workload: {args.num_short} short chats (16-96 tokens in, {args.short_output} out, {args.rate}/s) + "
          f"{args.num_long} prompts of {args.long_len} tokens; token budget {args.max_num_batched_tokens}/step")
    print(f"{'policy':<10} {'decode step':>11} {'ITL p50':>8} {'ITL p99':>8} {'worst gap':>10} {'long TTFT p50':>14} "
          f"{'TTFT p50':>9} {'out tok/s':>9} {'measured/predicted p50 p90':>27}")
    for name, r in results.items():
        print(f"{name:<10} {1e3 * r['median_decode_step_s']:8.1f} ms {r['itl_p50_x']:7.2f}x {r['itl_p99_x']:7.2f}x "
              f"{r['worst_gap_x']:9.2f}x {r['long_ttft_s']['median']:12.2f} s {r['ttft_s']['median']:7.3f} s "
              f"{r['output_tokens_per_s']:9.1f} {r['measured_over_predicted']['median']:13.2f} "
              f"{r['measured_over_predicted']['p90']:5.2f}")
    if "time" in results and "fixed" in results:
        ratio = results["time"]["long_ttft_s"]["median"] / results["fixed"]["long_ttft_s"]["median"]
        print(f"long-prompt TTFT, time / fixed budget: {ratio:.2f}x   (ITL and gaps are multiples of the same "
              f"policy's median decode-only step)")


if __name__ == "__main__":
    main()
