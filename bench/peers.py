"""The peers `bench.offline_throughput --compare` runs beside minivllm on the same prompts:
llama.cpp (llama-cpp-python) and vLLM's CPU build, each in a venv of its own."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch

from bench.batch1 import decode_tok_s, weight_bytes_per_token
from bench.runs import WEIGHT_MODES, make_prompts, resolve_dir, run_minivllm
from engine import LLM


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
        # the same file minivllm's gguf mode serves: the default model's Q4_1, or the .gguf given as --model
        gguf = Path(args.model) if args.model and args.model.endswith(".gguf") else fetch_default_gguf()
        peer = run_llama_cpp(python, gguf, prompts, args.output_len)
        figures = {"output_tok_s": peer["output_tokens"] / peer["seconds"],
                   "decode_tok_s": peer["decode_tok_s"] if args.num_prompts == 1 else None}
        result["systems"][f"llama.cpp {gguf.name}"] = figures
        rows.append((f"llama.cpp {gguf.name}", figures))
    vllm = args.vllm_python or os.environ.get("MINIVLLM_VLLM_PYTHON")
    if vllm:
        for mode in args.compare.split(","):
            if set(WEIGHT_MODES[mode]) - {"dtype", "quantization"} or WEIGHT_MODES[mode].get("quantization") != "none":
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
