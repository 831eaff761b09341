"""Where a long prompt's prefill time goes: each chunk's forward split by part (the four
projections, the experts of a MoE layer, attention with its KV writes, the norms, the LM head, and
the rest: embedding, RoPE, activations, residual adds, Python), each part's arithmetic rate, and
that rate against the machine's GEMM peak measured here by a micro-benchmark (oneDNN's torch.mm
on a compute-bound square product in the run's dtype; torch._int_mm for int8 where it runs), not
a datasheet. The steps' host-side input building and sampling are printed beside the forward.

    python -m bench.prefill_split --prompt-len 1000
    python -m bench.prefill_split --prompt-len 4000 --dtype bfloat16
    python -m bench.prefill_split --model FILE.gguf --quantization gguf --prompt-len 1000

How: forward hooks time every projection and norm module, and the attention and KV-write calls
of the decoder layers are wrapped, while one prompt's prefill runs with the prefix cache off
(rounds: --rounds, the median round printed). The CPU runs each op before the next starts, so
the wall-clock intervals are the parts' own; the hooks' own cost (a few microseconds a call) lands
in the parts. A step that runs the fused decode layers (a chunk of at most max_fused_tokens) is
not split: use a chunk above it (the default 2,048-token chunks are).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.runs import make_prompts
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.execution.backends import cpu_fused
from engine.execution.models import layers as layers_module
from engine.execution.models import llama as llama_module

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The fused layers' two calls around attention (engine/execution/backends/cpu_fused.py): what each holds.
FUSED_CALLS = {"layer_attention_inputs": "attn inputs", "layer_attention_outputs": "attn outputs"}
PARTS = (*PROJECTIONS, "experts", "attn inputs", "attention", "attn outputs", "norms", "lm_head")
FUSED_NOTE = {"attn inputs": "norm, QKV, q/k norms, RoPE, KV write", "attn outputs": "o, residual, norm, gate/up, act, down"}


class PartTimer:
    """Seconds and FLOPs per part, accumulated while installed on a model."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)
        self._starts: dict[int, float] = {}

    def timed_module(self, module: torch.nn.Module, part: str) -> list[Any]:
        """Hooks that add the module's forward time (and a projection's 2*T*in*out) to `part`."""
        def before(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
            self._starts[id(mod)] = time.perf_counter()

        def after(mod: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            self.seconds[part] += time.perf_counter() - self._starts.pop(id(mod))
            if part in PROJECTIONS:
                x = args[0]  # [T, in]
                self.flops[part] += 2.0 * x.shape[0] * x.shape[-1] * out.shape[-1]

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def timed_call(self, fn: Callable[..., Any], part: str, flops: Callable[..., float] | None = None) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - t0
            if flops is not None:
                self.flops[part] += flops(*args, **kwargs)
            return out

        return wrapper


def attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn: Any, *args: Any, **kwargs: Any) -> float:
    """QK^T and PV of a step's prefill chunks, causal over each chunk's cached context (a
    window's saving not counted): 4 * heads * head_dim per (query, key) pair."""
    heads, head_dim = q.shape[1], q.shape[2]
    pairs = 0
    for meta in attn.prefill or []:
        context, length = meta.context_len - meta.query_len, meta.query_len
        pairs += length * context + length * (length + 1) // 2
    return 4.0 * heads * head_dim * pairs


def _prefill(llm: LLM, prompt: list[int]) -> tuple[float, list[Any]]:
    """One prompt to its first token, every step's stats kept."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step()[1])
    return time.perf_counter() - start, steps


@contextlib.contextmanager
def installed(llm: LLM, timer: PartTimer) -> Iterator[None]:
    model = llm.engine.runner.model
    handles: list[Any] = []
    for layer in model.layers:
        for name in PROJECTIONS:
            module = getattr(layer, name, None)
            if module is not None:
                handles += timer.timed_module(module, name)
        if getattr(layer, "moe", None) is not None:
            handles += timer.timed_module(layer.moe, "experts")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.q_norm, layer.k_norm,
                     layer.attn_output_norm, layer.mlp_output_norm):
            if norm is not None:
                handles += timer.timed_module(norm, "norms")
    handles += timer.timed_module(model.norm, "norms")
    saved = llama_module.attention, layers_module.write_kv, model.compute_logits, cpu_fused.attention
    llama_module.attention = timer.timed_call(saved[0], "attention", attention_flops)
    layers_module.write_kv = timer.timed_call(saved[1], "attention")
    model.compute_logits = timer.timed_call(saved[2], "lm_head")
    cpu_fused.attention = timer.timed_call(saved[3], "attention", attention_flops)
    fused = getattr(llm.engine.runner.backend, "fused", None)
    kernels = fused.kernels if fused is not None else None
    if fused is not None:  # the fused layers' calls, timed through a stand-in for the kernels module
        fused.kernels = _TimedKernels(kernels, timer, model.config)
    try:
        yield
    finally:
        llama_module.attention, layers_module.write_kv, cpu_fused.attention = saved[0], saved[1], saved[3]
        del model.compute_logits  # back to the class's method
        if fused is not None:
            fused.kernels = kernels
        for handle in handles:
            handle.remove()


class _TimedKernels:
    """The kernels module with the fused layers' two calls timed; every other name passed through."""

    def __init__(self, kernels: Any, timer: PartTimer, cfg: Any) -> None:
        self._kernels = kernels
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_row = {"layer_attention_inputs": cfg.hidden_size * (q + 2 * kv),  # QKV
                   "layer_attention_outputs": q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size}
        for name, part in FUSED_CALLS.items():
            macs = per_row[name]
            setattr(self, name, timer.timed_call(getattr(kernels, name), part,
                                                 lambda x, *a, _m=macs, **k: 2.0 * x.shape[0] * _m))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernels, name)


def projection_rates(llm: LLM, num_rows: int, repeats: int = 3) -> dict[str, tuple[float, float]]:
    """Each projection kind's seconds over every layer on num_rows rows (one chunk's worth), timed
    one by one through its module (panels, blocks or oneDNN, as the steps multiply), and its
    GFLOP/s: the fused calls' split by product."""
    model = llm.engine.runner.model
    dtype = llm.engine.runner.dtype
    out: dict[str, tuple[float, float]] = {}
    with torch.inference_mode():
        for name in PROJECTIONS:
            modules = [getattr(layer, name) for layer in model.layers if getattr(layer, name, None) is not None]
            if not modules:
                continue
            x = torch.randn(num_rows, modules[0].in_features, dtype=dtype)
            seconds = min(_timed(lambda: [m(x) for m in modules]) for _ in range(repeats))  # noqa: B023
            flops = sum(2.0 * num_rows * m.in_features * m.out_features for m in modules)
            out[name] = (seconds, flops / seconds / 1e9)
    return out


def gemm_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of the best of `repeats` size^3 products in dtype (int8: torch._int_mm), or 0 when
    the op does not run here."""
    try:
        if dtype == torch.int8:
            a = torch.randint(-64, 64, (size, size), dtype=torch.int8)
            b = torch.randint(-64, 64, (size, size), dtype=torch.int8)
            op = lambda: torch._int_mm(a, b)  # noqa: E731
        else:
            a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
            op = lambda: torch.mm(a, b)  # noqa: E731
        op()
    except RuntimeError:
        return 0.0
    best = min(_timed(op) for _ in range(repeats))
    return 2.0 * size**3 / best / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint directory or GGUF file (default: the default model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=EngineConfig().max_num_batched_tokens,
                        help="max_num_batched_tokens: the prefill chunk (default: the engine's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from engine.config import usable_cpus

    threads = args.threads or usable_cpus()
    torch.set_num_threads(threads)
    options: dict[str, Any] = {"dtype": args.dtype, "num_threads": threads, "max_num_batched_tokens": args.chunk,
                               "enable_prefix_caching": False, "max_model_len": max(2048, args.prompt_len + 16)}
    if args.quantization:
        options["quantization"] = args.quantization
    llm = LLM(args.model, **options)
    vocab = llm.engine.runner.model_config.vocab_size
    prompt = make_prompts(1, args.prompt_len, args.prompt_len, min(vocab, 32000), args.seed)[0]

    _print_round(args, llm, measure(llm, prompt, args.rounds), threads)


def measure(llm: LLM, prompt: list[int], num_rounds: int) -> dict[str, Any]:
    """The prompt's prefill `num_rounds` times with the parts timed; the median round (by wall
    time): its PartTimer, its steps' stats, and every round's wall seconds."""
    llm.generate([prompt[:64]], SamplingParams(max_tokens=2))  # warm-up: first calls' one-time costs
    rounds = []
    for _ in range(num_rounds):
        timer = PartTimer()
        with installed(llm, timer):
            wall, steps = _prefill(llm, prompt)
        rounds.append({"timer": timer, "steps": steps, "wall": wall})
    median = dict(sorted(rounds, key=lambda r: r["wall"])[len(rounds) // 2])
    median["walls"] = [r["wall"] for r in rounds]
    median["forward"] = sum(s.forward_time for s in median["steps"] if s.num_prefill_tokens > 0)
    return median


def _print_round(args: argparse.Namespace, llm: LLM, rnd: dict[str, Any], threads: int) -> None:
    walls = rnd["walls"]
    timer: PartTimer = rnd["timer"]
    steps = [s for s in rnd["steps"] if s.num_prefill_tokens > 0]
    forward = rnd["forward"]
    prepare = sum(s.prepare_time for s in steps)
    sample = sum(s.sample_time for s in steps)
    runner = llm.engine.runner
    dtype = runner.dtype
    peak_dtype = torch.int8 if args.quantization in ("int8", "gguf") else dtype
    peak = gemm_peak(peak_dtype)
    float_peak = gemm_peak(dtype) if peak_dtype != dtype else peak
    print(f"prefill of {args.prompt_len} tokens in chunks of {args.chunk} ({len(steps)} steps), {args.dtype}"
          f"{', ' + args.quantization if args.quantization else ''}, {threads} threads; wall {1e3 * rnd['wall']:.0f} ms "
          f"(rounds {', '.join(f'{1e3 * w:.0f}' for w in walls)}): {args.prompt_len / rnd['wall']:.0f} prompt tok/s")
    print(f"GEMM peak here (torch.mm {str(dtype).removeprefix('torch.')} 2048^3): {float_peak:.0f} GFLOP/s"
          + (f"; torch._int_mm int8: {peak:.0f} GOP/s" if peak_dtype != dtype and peak else ""))
    print(f"{'part':14s} {'ms':>8s} {'share':>6s} {'GFLOP/s':>8s} {'of peak':>8s}")
    accounted = 0.0
    for part in PARTS:
        seconds = timer.seconds.get(part, 0.0)
        if seconds == 0.0:
            continue
        accounted += seconds
        flops = timer.flops.get(part, 0.0)
        rate = flops / seconds / 1e9 if flops else 0.0
        part_peak = peak if part in PROJECTIONS and peak_dtype != dtype and peak else float_peak
        print(f"{part:14s} {1e3 * seconds:8.1f} {seconds / forward:6.1%} "
              + (f"{rate:8.0f} {rate / part_peak:8.1%}" if rate and part_peak else f"{'':8s} {'':8s}")
              + (f"   ({FUSED_NOTE[part]})" if part in FUSED_NOTE else ""))
    rest = max(0.0, forward - accounted)
    print(f"{'rest':14s} {1e3 * rest:8.1f} {rest / forward:6.1%}   (embedding, RoPE, activations, residuals, Python)")
    print(f"{'forward':14s} {1e3 * forward:8.1f}  + input building {1e3 * prepare:.1f} ms, sampling {1e3 * sample:.1f} ms")
    rows = min(args.chunk, args.prompt_len)
    print(f"projections one by one on {rows} rows, every layer (the fused calls' products):")
    for name, (seconds, rate) in projection_rates(llm, rows).items():
        part_peak = peak if peak_dtype != dtype and peak else float_peak
        print(f"  {name:12s} {1e3 * seconds:8.1f} ms {rate:8.0f} GFLOP/s {rate / part_peak:8.1%} of peak")


if __name__ == "__main__":
    main()
