"""Embeds passages through vLLM's CPU build (its pooling runner), in vLLM's own environment:
`bench.embeddings --vllm-python PYTHON` starts this file with that Python, keeps it loaded, and
asks it for one timed round at a time, so its rounds alternate with minivllm's and
sentence-transformers'. Imports nothing from minivllm.

stdin, first line: {"model_dir": str, "dtype": str, "max_model_len": int}; then one line of
{"texts": [str]} per round (an empty line ends it).
stdout: READY once loaded; then per round RESULT {"seconds": float, "head": [[float]]} (the first
vectors, for the cosine check).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Run as a script, this file's folder (bench/) leads sys.path, and its bench/kernels package would
# stand in for the `kernels` package transformers probes for: drop it.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main() -> None:
    job = json.loads(sys.stdin.readline())
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # both cores compute, as ours do
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    kwargs = {"model": job["model_dir"], "dtype": job["dtype"], "max_model_len": job["max_model_len"], "seed": 0}
    try:
        llm = LLM(runner="pooling", **kwargs)
    except TypeError:  # releases before the runner option named the task
        llm = LLM(task="embed", **kwargs)
    llm.embed(["warm up"], use_tqdm=False)
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        texts = json.loads(line)["texts"]
        start = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        seconds = time.perf_counter() - start
        head = [list(map(float, o.outputs.embedding)) for o in outs[:8]]
        print("RESULT " + json.dumps({"seconds": seconds, "head": head}), flush=True)


if __name__ == "__main__":
    main()
