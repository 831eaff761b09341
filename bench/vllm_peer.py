"""Runs the offline workload through vLLM's CPU build, in vLLM's own environment:
`bench.offline_throughput --compare --vllm-python PYTHON` starts this file with that Python
and reads one JSON line back. Imports nothing from minivllm.

stdin: {"model_dir": str, "prompts": [[token ids]], "output_len": int, "dtype": str, "max_num_seqs": int}
stdin may add "prefill_prompts": [[token ids]]: each timed alone to its first token after the
warm-up, prefix caching off (RESULT then adds "ttft_s", their median, and "ttft_rounds_s").
stdout (last line): RESULT {"seconds": float, "output_tokens": int}
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this file's folder (bench/) leads sys.path, and its bench/kernels package would
# stand in for the `kernels` package transformers probes for: drop it.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main() -> None:
    job = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # both cores compute, as ours do
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as our default pool
    from vllm import LLM, SamplingParams

    prefill_prompts = job.get("prefill_prompts")
    longest = max(len(p) for p in job["prompts"] + (prefill_prompts or []))
    # Timing prefills, no prompt may be served from the prefix cache: off.
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"], seed=0,
              max_model_len=longest + job["output_len"] + 16, enable_prefix_caching=not prefill_prompts)
    params = SamplingParams(temperature=0, max_tokens=job["output_len"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    if prefill_prompts:
        ttfts = []
        for p in prefill_prompts:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            ttfts.append(time.perf_counter() - start)
        result = {"seconds": sum(ttfts), "output_tokens": len(ttfts) * job["output_len"],
                  "ttft_s": statistics.median(ttfts), "ttft_rounds_s": ttfts}
        print("RESULT " + json.dumps(result), flush=True)
        return
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"seconds": seconds, "output_tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
