"""Replicas behind the SMG gateway, one routing policy after another, side by side in one run:
the multi-turn `conversations` workload through the gateway's OpenAI chat API, with each replica's
prefix-cache hit rate (from its own counters), TTFT p50/p99 and output tokens/s per policy.

    minivllm bench gateway-policies --policies cache_aware round_robin --replicas 2
    (or python -m bench.gateway_policies ...)

The replicas start once (`minivllm serve`, real model unless --model); before each policy their
prefix caches are dropped (the engine contract's FlushCache) and a fresh gateway starts, so every
policy meets the same cold fleet. A KV pool smaller than the whole workload's prefixes
(--num-kv-blocks) is the regime where routing matters: a replica cannot hold every conversation.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from bench.backends import OpenAIBackend
from bench.serving import report, run_load
from bench.workloads import conversations

logger = logging.getLogger("bench.gateway_policies")
MODEL_NAME = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)


class Replica:
    """`minivllm serve` on free ports, its gRPC port read back from its log."""

    def __init__(self, args: argparse.Namespace, log_path: Path) -> None:
        self.metrics_port = _free_port()
        self.port = _free_port()
        command = [sys.executable, "-m", "minivllm", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--http-port", "0", "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
                   "--served-model-name", MODEL_NAME, "--num-kv-blocks", str(args.num_kv_blocks),
                   "--num-threads", str(args.threads_per_replica)]
        if args.model:
            command += ["--model", args.model]
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = vpb_grpc.VllmEngineStub(self.channel)

    def is_healthy(self) -> bool:
        try:
            return self.stub.HealthCheck(vpb.HealthCheckRequest(), timeout=2).healthy
        except grpc.RpcError:
            return False

    def counters(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()

        def total(name: str, *labels: str) -> float:
            return sum(float(v) for series, v in re.findall(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M)
                       if all(label in series for label in labels))

        return {"hits": total("minivllm_prefix_cache_hits_total"),
                "queries": total("minivllm_prefix_cache_queries_total"),
                "requests": total("minivllm_api_requests_total", 'protocol="grpc-vllm"', 'method="Generate"')}

    def warm_up_and_flush(self) -> None:
        request = vpb.GenerateRequest(request_id=f"warm-{self.port}-{time.monotonic()}", stream=False,
                                      tokenized=vpb.TokenizedInput(input_ids=list(range(100, 164))),
                                      sampling_params=vpb.SamplingParams(max_tokens=2, temperature=0))
        list(self.stub.Generate(request, timeout=300))
        if not self.stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30), timeout=60).success:
            raise RuntimeError(f"replica :{self.port} did not flush its prefix cache")

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def start_gateway(smg: str, policy: str, replicas: list[Replica], log_path: Path) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    log = log_path.open("w")
    proc = subprocess.Popen([smg, "launch", "--backend", "vllm", "--policy", policy, "--host", "127.0.0.1",
                             "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                             str(_free_port()), "--log-level", "warn",
                             "--worker-urls", *[f"grpc://127.0.0.1:{r.port}" for r in replicas]],
                            stdout=log, stderr=subprocess.STDOUT)

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=2) as resp:
                workers = json.loads(resp.read())["workers"]
        except OSError:
            return False
        return len(workers) == len(replicas) and all(w["is_healthy"] and w["model_id"] == MODEL_NAME for w in workers)

    _wait(ready, 120, f"the gateway ({policy}) did not register its workers")
    _wait(lambda: _answers_chat(port), 120, f"the gateway ({policy}) did not load the tokenizer")
    return proc, port


def _answers_chat(port: int) -> bool:
    """One one-token chat (shorter than a KV block: it leaves nothing in a prefix cache)."""
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status == 200
    except OSError:  # 503 tokenizer_not_ready until the gateway has loaded it
        return False


def run_policy(args: argparse.Namespace, smg: str, policy: str, replicas: list[Replica], out_dir: Path) -> dict:
    for replica in replicas:
        replica.warm_up_and_flush()
    gateway, port = start_gateway(smg, policy, replicas, out_dir / f"smg-{policy}.log")
    before = [r.counters() for r in replicas]
    try:
        requests = conversations(args.num_conversations, args.num_turns, args.context_words, args.turn_words,
                                 args.output_len, args.seed)

        async def drive() -> tuple[list, float, float]:
            backend = OpenAIBackend(f"http://127.0.0.1:{port}", MODEL_NAME, chat=True)
            try:
                return await run_load(backend, requests, args.concurrency, float("inf"), 1.0, args.seed,
                                      progress=False)
            finally:
                await backend.close()

        results, start, end = asyncio.run(drive())
    finally:
        gateway.terminate()
        gateway.wait(30)
    summary = report(results, end - start, {})
    after = [r.counters() for r in replicas]
    per_replica = []
    for b, a in zip(before, after, strict=True):
        queries, hits = a["queries"] - b["queries"], a["hits"] - b["hits"]
        per_replica.append({"requests": a["requests"] - b["requests"], "prefix_queried_tokens": queries,
                            "prefix_hit_tokens": hits, "prefix_hit_rate": hits / queries if queries else 0.0})
    total_queries = sum(r["prefix_queried_tokens"] for r in per_replica)
    summary |= {"policy": policy, "replicas": per_replica,
                "prefix_hit_rate": sum(r["prefix_hit_tokens"] for r in per_replica) / total_queries
                if total_queries else 0.0}
    return summary


def format_table(rows: list[dict]) -> str:
    lines = ["| policy | prefix-cache hit rate (all) | per replica (requests) | TTFT p50 ms | TTFT p99 ms "
             "| output tok/s | completed / failed |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        replicas = ", ".join(f"{r['prefix_hit_rate']:.3f} ({r['requests']:.0f})" for r in row["replicas"])
        lines.append(f"| {row['policy']} | {row['prefix_hit_rate']:.3f} | {replicas} | {row['ttft_ms']['median']:.0f} "
                     f"| {row['ttft_ms']['p99']:.0f} | {row['output_throughput']:.1f} "
                     f"| {row['completed']} / {row['failed']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm bench gateway-policies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--num-kv-blocks", type=int, default=160, help="each replica's KV pool (blocks of 16 tokens)")
    p.add_argument("--threads-per-replica", type=int, default=1)
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--context-words", type=int, default=300)
    p.add_argument("--turn-words", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="bench/results/gateway_policies")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    smg = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
    if not Path(smg).exists():
        raise SystemExit("the smg gateway is not installed: pip install smg==1.13.0")
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    replicas = [Replica(args, out_dir / f"replica-{i}.log") for i in range(args.replicas)]
    try:
        _wait(lambda: all(r.is_healthy() for r in replicas), 600, "the replicas did not load their model")
        rows = []
        for policy in args.policies:
            logger.info("policy %s ...", policy)
            rows.append(run_policy(args, smg, policy, replicas, out_dir))
    finally:
        for replica in replicas:
            replica.close()
    (out_dir / "result.json").write_text(json.dumps({"config": vars(args), "policies": rows}, indent=2))
    print(format_table(rows))  # noqa: T201 - the benchmark's report


if __name__ == "__main__":
    main()
