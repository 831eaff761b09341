"""Serving benchmark: drive a server with a workload at a fixed concurrency or a Poisson rate,
then report TTFT / TPOT / ITL / E2EL percentiles, throughput and goodput, as text, JSON and PNGs.

    minivllm bench --workload random --num-requests 64 --input-len 128 --output-len 128 --concurrency 32
    minivllm bench --backend openai --base-url http://localhost:8000 --model NAME ...   # vLLM, llama.cpp, TGI
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import math
import os
import random
import time
from pathlib import Path

from bench.backends import GrpcBackend, OpenAIBackend, RequestResult
from bench.latency_stats import goodput, summarize
from bench.workloads import BenchRequest, conversations, random_text, random_tokens, shared_prefix, synthetic_chat
from service.pb import inference_pb2 as pb

logger = logging.getLogger("bench.serving")


def parse_slos(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] (milliseconds) -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput: expected ttft|tpot|e2el:MILLISECONDS, got {item!r}")
        slos[name] = float(value) / 1000
    return slos


async def run_load(backend: GrpcBackend | OpenAIBackend, requests: list[BenchRequest], concurrency: int | None,
                   request_rate: float, burstiness: float, seed: int, progress: bool = True
                   ) -> tuple[list[RequestResult], float, float]:
    """Send every request; arrivals are gamma-distributed (Poisson when burstiness is 1)."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or len(requests))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req")

    async def one(req: BenchRequest) -> RequestResult:
        async with limit:
            result = await backend.send(req)
        if bar is not None:
            bar.update(1)
        return result

    async def session(reqs: list[BenchRequest]) -> list[RequestResult]:
        return [await one(req) for req in reqs]  # a conversation's next turn waits for its answer

    # Requests of one session run in order (one task per session, arriving as its first request).
    units: dict[object, list[BenchRequest]] = {}
    for i, req in enumerate(requests):
        units.setdefault(("session", req.session) if req.session is not None else i, []).append(req)
    start = time.monotonic()
    tasks = []
    for unit in units.values():
        tasks.append(asyncio.create_task(session(unit)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
    by_request = {id(req): result for unit, done in zip(units.values(), await asyncio.gather(*tasks), strict=True)
                  for req, result in zip(unit, done, strict=True)}
    results = [by_request[id(req)] for req in requests]
    end = time.monotonic()
    if bar is not None:
        bar.close()
    return list(results), start, end


def report(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda values: {k: v * 1000 for k, v in summarize(values).items()}  # noqa: E731
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    out = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration, "total_token_throughput": (input_tokens + output_tokens) / duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": ms([g for r in ok for g in r.itls]),
        "e2el_ms": ms([r.e2el for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:10],
    }
    if slos:
        per_request = [{"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el} for r in ok]
        out["goodput"] = goodput(per_request, slos, duration)
        out["slos_ms"] = {k: v * 1000 for k, v in slos.items()}
    return out


def write_plots(results: list[RequestResult], start: float, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in (("TTFT", [r.ttft for r in ok if r.ttft is not None]),
                          ("TPOT", [r.tpot for r in ok if r.tpot is not None]),
                          ("ITL", [g for r in ok for g in r.itls]), ("E2EL", [r.e2el for r in ok])):
        if values:
            xs = sorted(v * 1000 for v in values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    ax.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of requests / gaps", title="Latency CDFs")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    times = sorted(t - start for r in ok for t in r.token_times)
    if times:
        width = max(times[-1] / 40, 0.25)
        bins = [i * width for i in range(int(times[-1] / width) + 2)]
        ax.hist(times, bins=bins, weights=[1 / width] * len(times), color="tab:blue")
    ax.set(xlabel="time since start (s)", ylabel="output tokens/s", title="Output throughput over time")
    ax.grid(True, alpha=0.3)
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([r.prompt_len for r in ok if r.ttft is not None], [r.ttft * 1000 for r in ok if r.ttft is not None],
               s=12, alpha=0.7)
    ax.set(xlabel="prompt length (tokens)", ylabel="TTFT (ms)", title="Time to first token vs prompt length")
    ax.grid(True, alpha=0.3)
    paths.append(_save(fig, out_dir / "ttft_vs_prompt_len.png"))
    return paths


def _save(fig: object, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    p.add_argument("--target", default="localhost:50051",
                   help="gRPC host:port; several as ip:port,ip:port or dns:///name:port (round-robin over replicas)")
    p.add_argument("--tls-ca", default=None, help="CA (PEM) of a TLS server")
    p.add_argument("--token", default=os.environ.get("MINIVLLM_TOKEN"), help="bearer token (or MINIVLLM_TOKEN)")
    p.add_argument("--base-url", default="http://localhost:8000", help="OpenAI-compatible server")
    p.add_argument("--model", default="", help="model name for the OpenAI backend")
    p.add_argument("--workload", choices=("random", "text", "chat", "shared-prefix", "conversations"),
                   default="random",
                   help="random: token ids; text: random words as text (for servers without token-id prompts); "
                        "conversations: multi-turn chats over long system prompts (--num-requests conversations "
                        "of --num-turns turns, each turn after the previous answer)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by +- this fraction")
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-turns", type=int, default=4, help="conversations: turns per conversation")
    p.add_argument("--context-words", type=int, default=300, help="conversations: words of each system prompt")
    p.add_argument("--turn-words", type=int, default=24, help="conversations: words of each question and answer")
    p.add_argument("--chat", action="store_true",
                   help="openai backend: send chat messages to /v1/chat/completions (the server applies the "
                        "template) instead of joining them into a /v1/completions prompt")
    p.add_argument("--vocab-size", type=int, default=0, help="token-id range (default: ask the server)")
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS", help="SLOs, e.g. ttft:2000 tpot:200")
    p.add_argument("--result-dir", default="bench/results")
    p.add_argument("--no-progress", action="store_true")
    return p


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    if args.workload == "random":
        return random_tokens(args.num_requests, args.input_len, args.output_len, vocab_size, args.seed,
                             args.range_ratio)
    if args.workload == "text":
        return random_text(args.num_requests, args.input_len, args.output_len, args.seed)
    if args.workload == "chat":
        return synthetic_chat(args.num_requests, args.output_len, args.seed)
    if args.workload == "conversations":
        return conversations(args.num_requests, args.num_turns, args.context_words, args.turn_words,
                             args.output_len, args.seed)
    return shared_prefix(args.num_requests, args.num_prefixes, args.prefix_len, args.suffix_len, args.output_len,
                         vocab_size, args.seed)


async def _main(args: argparse.Namespace) -> dict:
    slos = parse_slos(args.goodput)
    if args.num_requests <= 0:
        raise ValueError("--num-requests must be positive")
    if args.backend == "grpc":
        backend = GrpcBackend(args.target, tls_ca_file=args.tls_ca, token=args.token)
        vocab = args.vocab_size or (await backend.stub.GetModelInfo(pb.GetModelInfoRequest())).vocab_size
    else:
        backend = OpenAIBackend(args.base_url, args.model, chat=args.chat)
        vocab = args.vocab_size or 32000
    try:
        requests = make_requests(args, vocab)
        results, start, end = await run_load(backend, requests, args.concurrency, args.request_rate, args.burstiness,
                                             args.seed, progress=not args.no_progress)
    finally:
        await backend.close()
    summary = report(results, end - start, slos)
    summary["config"] = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf") for k, v in vars(args).items()}
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary["plots"] = [str(p) for p in write_plots(results, start, out_dir)]
    (out_dir / "result.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_summary(s: dict) -> None:
    lines = [f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s",
             f"request throughput {s['request_throughput']:.2f} req/s   output {s['output_throughput']:.1f} tok/s   "
             f"input {s['input_throughput']:.1f} tok/s"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        v = s[key]
        lines.append(f"{key[:-3].upper():<5} ms  mean {v['mean']:9.1f}  median {v['median']:9.1f}  "
                     f"p90 {v['p90']:9.1f}  p99 {v['p99']:9.1f}")
    if "goodput" in s:
        lines.append(f"goodput {s['goodput']:.2f} req/s under {s['slos_ms']} (ms)")
    for line in lines:
        print(line)  # noqa: T201 - the benchmark's report


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    missing = [name for name in ("matplotlib", "aiohttp") if importlib.util.find_spec(name) is None]
    if missing:  # found before the run, not when its plots are drawn
        raise SystemExit(f"minivllm bench needs {', '.join(missing)}: pip install 'minivllm[bench]'")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print_summary(asyncio.run(_main(args)))


if __name__ == "__main__":
    main()
