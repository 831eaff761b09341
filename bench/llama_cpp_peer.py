"""Runs the offline workload through llama.cpp (llama-cpp-python), in llama.cpp's own
environment: `bench.offline_throughput --compare` starts this file with that environment's
Python and reads one JSON line back. Imports nothing from minivllm, so the peer's venv needs
only `llama-cpp-python`.

stdin: one job a line, {"model_path": str, "prompts": [[token ids]], "output_len": int, "threads": int}
stdout: a line RESULT {"seconds": float, "decode_tok_s": float | None, "ttft_s": float, "output_tokens": int}
a job (decode_tok_s: the median over prompts with two tokens or more; ttft_s: the median time to a
prompt's first token). The model stays loaded between jobs of the same file, so `--compare-rounds`
alternates short runs with minivllm's without reloading either. Note that llama-cpp-python reuses
the KV of the prefix a prompt shares with the one before it (as minivllm's prefix cache does): a
round that repeats a prompt skips most of its prefill, so `--prefill-len` gives each round a new one.
"""
from __future__ import annotations

import json
import statistics
import sys
import time


def run_job(llm: object, prompts: list[list[int]], output_len: int) -> dict[str, float | None]:
    decode_rates, first_token_times, total, produced = [], [], 0.0, 0
    for prompt in prompts:  # llama-cpp-python serves one sequence at a time
        start = time.perf_counter()
        first = start
        count = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # greedy; EOS is ignored by the count
            count += 1
            if count == 1:
                first = time.perf_counter()
            if count >= output_len:
                break
        end = time.perf_counter()
        total += end - start
        produced += count
        first_token_times.append(first - start)
        if count > 1:
            decode_rates.append((count - 1) / (end - first))
    return {"seconds": total, "output_tokens": produced, "ttft_s": statistics.median(first_token_times),
            "decode_tok_s": statistics.median(decode_rates) if decode_rates else None}


def main() -> None:
    from llama_cpp import Llama

    llm, loaded = None, None
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        prompts, output_len = job["prompts"], job["output_len"]
        n_ctx = max(len(p) for p in prompts) + output_len + 8
        key = (job["model_path"], job["threads"], n_ctx)
        if key != loaded:
            llm = Llama(model_path=job["model_path"], n_threads=job["threads"], n_threads_batch=job["threads"],
                        n_ctx=n_ctx, n_batch=512, verbose=False)
            for _ in zip(range(4), llm.generate(prompts[0][:8], temp=0.0, top_k=1), strict=False):  # warm-up
                pass
            loaded = key
        print("RESULT " + json.dumps(run_job(llm, prompts, output_len)), flush=True)


if __name__ == "__main__":
    main()
