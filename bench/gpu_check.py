"""The GPU check: what a CUDA machine runs to show the CUDA backend works and how fast, in one go.

    python -m bench.gpu_check --out gpu_check.json [--model DIR_OR_GGUF | --random-weights DIR]

Sections (each one's result, or its error, lands in the JSON as it ends):
- kernels: tests/engine/execution/triton/test_triton_attention.py with the kernels compiled for the GPU
  (MINIVLLM_TEST_TRITON_NATIVE=1), the same cases and references as the interpreter run on CI.
- greedy: the engine on CUDA against transformers on CUDA for the test prompts: float32 token for
  token (prompts equal, of all), bfloat16 by the mean common prefix (the CPU's bf16 criterion).
- offline: the 32-prompt workload (16-256 prompt tokens, 128 output tokens each) through the
  engine (synchronous and with async scheduling) and through transformers' generate() in one
  static batch, output tokens/s.
- batch1: one stream, 128 tokens after a 100-token prompt, CUDA graphs on and off, graphs with
  async scheduling, and transformers; each engine decode step's bytes (weights + KV read) over
  its wall time against the device's HBM bandwidth, the step's parts, the decode graph's own
  device time (replayed alone) and its kernels (a profile: how many a step, their summed time):
  whether a step is bound by the host, by the kernels' count, or by the reads.
- big (--big): batch 1 and graphs on/off on a random-weight model of Llama-3.2-1B's layers.

--random-weights DIR takes a config.json and tokenizer there and writes random weights of that
shape (speed depends on shapes, not values; greedy equality is checked on the same weights on
both sides).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.async_scheduling import step_period
from bench.batch1 import decode_tok_s, weight_bytes_per_token
from bench.runs import make_prompts, run_minivllm
from bench.workloads import GREEDY_PROMPTS
from engine import LLM, SamplingParams

logger = logging.getLogger("gpu_check")
ROOT = Path(__file__).resolve().parents[1]
HBM_TB_S = {"H200": 4.8, "H100": 3.35, "A100": 2.0}  # the datasheets' peak


class Report:
    """The JSON written after every section, so a run cut short keeps what it measured."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def section(self, name: str, fn: Any, *args: Any) -> Any:
        start = time.monotonic()
        try:
            result = fn(*args)
            self.data[name] = result
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            result = None
            self.data[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            logger.exception("section %s failed", name)
        self.data.setdefault("seconds", {})[name] = round(time.monotonic() - start, 1)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        logger.info("%s: %s", name, json.dumps(self.data[name], default=str)[:2000])
        return result


def environment() -> dict[str, Any]:
    from importlib.metadata import version

    x = torch.empty(2**30, dtype=torch.float32, device="cuda")  # 4 GiB: a copy reads and writes 8
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    torch.cuda.synchronize()
    copy_tb_s = 5 * 2 * x.numel() * 4 / (time.perf_counter() - start) / 1e12
    del x, y
    torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": version("triton"),
            "transformers": version("transformers"), "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "copy_tb_s": copy_tb_s}


def kernel_tests() -> dict[str, Any]:
    env = dict(os.environ, MINIVLLM_TEST_TRITON_NATIVE="1")
    workers = ["-n", "8"] if shutil.which("pytest") and _has_xdist() else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "--noconftest", "-q", "-p", "no:cacheprovider", *workers,
                           "tests/engine/execution/triton/test_triton_attention.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"returncode": proc.returncode, "summary": tail, "output_tail": (proc.stdout + proc.stderr)[-2500:]}


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def random_model(src: Path, dst: Path, overrides: dict[str, Any] | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str = "cuda") -> Path:
    """A model directory with src's config (plus overrides) and tokenizer and random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(src))
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(dtype).save_pretrained(str(dst), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "special_tokens_map.json"):
        if (src / name).exists() and not (dst / name).exists():
            shutil.copy(src / name, dst / name)
    del model
    torch.cuda.empty_cache()
    return dst


def engine(model: str, device: str, **options: Any) -> LLM:
    if device == "cuda":
        options = {"backend": "cuda", "gpu_memory_utilization": 0.2, **options}
    else:  # a dry run of this script's own logic on a CPU
        options = {"num_kv_blocks": 512, **{k: v for k, v in options.items() if k != "enforce_eager"}}
    return LLM(model, **{"max_num_seqs": 32, **options})


def release() -> None:
    """Free the GPU memory of engines and models the caller has dropped (an engine freezes the
    collector's view at start-up, so its cycles wait for an unfreeze)."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_model(model: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager").to(device).eval()


def greedy(model: str, num_tokens: int, device: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        hf = hf_model(model, dtype, device)
        llm = engine(model, device, dtype=name)
        prompts = [llm.engine.tokenize(p) for p in GREEDY_PROMPTS]
        refs = []
        for prompt in prompts:
            with torch.inference_mode():
                ids = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=num_tokens,
                                  min_new_tokens=num_tokens, do_sample=False)
            refs.append(ids[0, len(prompt):].tolist())
        greedy_params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        ours = [o.token_ids for o in llm.generate(prompts, greedy_params)]
        del llm
        release()
        overlapped = engine(model, device, dtype=name, async_scheduling=True)
        ours_async = [o.token_ids for o in overlapped.generate(prompts, greedy_params)]
        prefixes = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                    for x, y in zip(ours, refs, strict=True)]
        results[name] = {"prompts_equal": sum(x == y for x, y in zip(ours, refs, strict=True)),
                         "prompts": len(prompts), "common_prefixes": prefixes,
                         "mean_common_prefix": statistics.mean(prefixes), "tokens": num_tokens,
                         "async_scheduling_equal": ours_async == ours,
                         "sample_text": overlapped.engine.tokenizer.decode(ours[1])}
        del hf, overlapped
        release()
    return results


def offline(model: str, device: str, num_prompts: int = 32, output_len: int = 128) -> dict[str, Any]:
    rates = {}
    for is_async in (False, True):
        llm = engine(model, device, async_scheduling=is_async)
        prompts = make_prompts(num_prompts, 16, 256, llm.engine.vocab_size, seed=0)
        run_minivllm(llm, prompts, 4)  # Triton compiles each prefill specialization once: not in the timed run
        seconds, _ = run_minivllm(llm, prompts, output_len)
        rates[is_async] = num_prompts * output_len / seconds
        del llm
        release()
    ours = rates[False]
    hf = hf_model(model, torch.bfloat16 if device == "cuda" else torch.float32, device)
    pad = hf.generation_config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    lens = torch.tensor([len(p) for p in prompts], device=device)
    mask = (torch.arange(width, device=device) >= width - lens.unsqueeze(1)).long()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                  do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        hf.generate(**{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        synchronize(device)
        start = time.perf_counter()
        hf.generate(**kwargs)
        synchronize(device)
        theirs = num_prompts * output_len / (time.perf_counter() - start)
    del hf
    release()
    return {"engine_tok_s": ours, "engine_async_tok_s": rates[True], "transformers_tok_s": theirs,
            "ratio": ours / theirs, "async_ratio": rates[True] / theirs,
            "workload": f"{num_prompts} prompts of 16-256 tokens, {output_len} output tokens each, bf16"}


def _decode_bytes(llm: LLM, context: int) -> int:
    """What one batch-1 decode step reads: its weights (bench.batch1's count) and the context's K/V."""
    runner = llm.engine.runner
    mc = runner.model_config
    kv = 2 * mc.num_layers * context * mc.num_kv_heads * mc.head_dim * runner.kv_cache.element_size()
    return weight_bytes_per_token(llm) + kv


def step_parts_ms(steps: list[Any]) -> dict[str, float]:
    """The decode-only steps' median parts (ms): where a step's host time goes (the sync for the
    sampled ids falls in sample)."""
    decode = [s for s in steps if s.kind == "decode"]
    return {part: 1e3 * statistics.median(getattr(s, f"{part}_time") for s in decode)
            for part in ("schedule", "prepare", "forward", "sample", "process")} if decode else {}


def graph_replay_ms(llm: LLM, num_replays: int = 50) -> float | None:
    """The batch-1 decode graph's own device time (ms), replayed back to back between CUDA events:
    the step's wall time less this is what the host costs. Its padded row writes the scratch slot."""
    graphs = llm.engine.runner.backend.graphs
    if graphs is None or 1 not in graphs.graphs:
        return None
    graphs.group_slot_mapping[:, :1] = graphs.scratch_slot  # touch nobody's cache
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.graphs[1].replay()
    start.record()
    for _ in range(num_replays):
        graphs.graphs[1].replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / num_replays


def decode_profile(llm: LLM, prompt: list[int], num_steps: int = 8) -> dict[str, float]:
    """What the GPU runs in a decode step (torch.profiler, CUPTI): kernels a step and their summed
    device time, against the steps' wall time. Many kernels of a few microseconds each mean a step
    bound by the kernels' count (fusion pays), few and short ones a step bound by the host."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=num_steps + 4, ignore_eos=True))
    for _ in range(3):  # the prefill and the first decode steps
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels_per_step": len(kernels) / num_steps,
            "kernel_ms_per_step": sum(getattr(e, "device_time_total", 0.0) for e in kernels) / num_steps / 1e3,
            "wall_ms_per_step_profiled": 1e3 * wall / num_steps}


def batch1(model: str, device: str, output_len: int = 128, prompt_len: int = 100) -> dict[str, Any]:
    results: dict[str, Any] = {}
    prompt: list[list[int]] = []
    name = torch.cuda.get_device_name() if device == "cuda" else ""
    hbm = next((v for k, v in HBM_TB_S.items() if k in name), None)
    for label, eager, is_async in (("graphs", False, False), ("graphs_async", False, True), ("eager", True, False)):
        llm = engine(model, device, enforce_eager=eager, max_num_seqs=4, async_scheduling=is_async)
        prompt = prompt or make_prompts(1, prompt_len, prompt_len, min(1000, llm.engine.vocab_size), seed=1)
        seconds, steps = run_minivllm(llm, prompt, output_len)
        # The whole step by the wall clock, from one decode step's start to the next: an eager
        # step's forward returns before the GPU is done, and with async scheduling a step's parts
        # overlap the next one's, so only the steps' starts say the pace.
        step = step_period(steps) or 1 / decode_tok_s(steps)
        decode = 1 / step
        step_bytes = _decode_bytes(llm, prompt_len + output_len // 2)
        results[label] = {"tok_s": output_len / seconds, "median_decode_step_ms": 1e3 * step, "decode_tok_s": decode,
                          "step_bytes": step_bytes, "achieved_tb_s": step_bytes / step / 1e12, "hbm_peak_tb_s": hbm,
                          "parts_ms": step_parts_ms(steps)}
        if label == "graphs" and device == "cuda":
            results[label]["graph_replay_ms"] = graph_replay_ms(llm)
            results[label]["profile"] = decode_profile(llm, prompt[0])
        del llm
        release()
    hf = hf_model(model, torch.bfloat16 if device == "cuda" else torch.float32, device)
    ids = torch.tensor(prompt, device=device)
    with torch.inference_mode():
        hf.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        synchronize(device)
        start = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        synchronize(device)
    results["transformers_tok_s"] = output_len / (time.perf_counter() - start)
    results["graphs_over_eager"] = results["graphs"]["decode_tok_s"] / results["eager"]["decode_tok_s"]
    results["async_over_sync"] = results["graphs_async"]["decode_tok_s"] / results["graphs"]["decode_tok_s"]
    del hf
    release()
    return results


def prepare_model(args: argparse.Namespace, work: Path) -> str:
    if args.random_weights:
        return str(random_model(Path(args.random_weights), work / "random", device=args.device))
    if args.model and args.model.endswith(".gguf"):
        from engine.execution.weights.checkpoint import resolve_model

        return str(resolve_model(args.model))
    return args.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--model", help="an HF directory or a .gguf file")
    parser.add_argument("--random-weights", help="a directory with config.json and a tokenizer: random weights")
    parser.add_argument("--sections", default="environment,kernels,greedy,offline,batch1",
                        help="comma-separated: environment, kernels, greedy, offline, batch1, big")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=32, help="the offline workload's prompts")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (offline, batch 1)")
    parser.add_argument("--work", default="/tmp/gpu_check")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run of this script's logic on the CPU backend (no GPU figures)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU")
    sections = set(args.sections.split(","))
    report = Report(Path(args.out))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if "environment" in sections:
        report.section("environment", environment)
    if "kernels" in sections:
        report.section("kernels", kernel_tests)
    model = report.section("model", prepare_model, args, work) if sections & {"greedy", "offline", "batch1"} else None
    if model:
        for name, fn in (("greedy", lambda: greedy(model, args.greedy_tokens, args.device)),
                         ("offline", lambda: offline(model, args.device, args.num_prompts, args.output_len)),
                         ("batch1", lambda: batch1(model, args.device, args.output_len))):
            if name in sections:
                report.section(name, fn)
    if "big" in sections and args.random_weights:
        big = report.section("big_model", random_model, Path(args.random_weights), work / "big", LLAMA_1B_LAYERS, 1,
                             torch.bfloat16, args.device)
        if big:
            report.section("big_batch1", batch1, str(big), args.device, args.output_len)


# Llama-3.2-1B's layers (the vocabulary stays the tokenizer's: a random model of this shape).
LLAMA_1B_LAYERS = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 8192, "tie_word_embeddings": True}


if __name__ == "__main__":
    main()
