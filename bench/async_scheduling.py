"""The synchronous loop against async scheduling, side by side on one model and workload.

    python -m bench.async_scheduling [--model M] [--num-prompts 1] [--output-len 128]
                                     [--device-latency-ms 0] [--rounds 3]

Each round runs the same greedy workload through an engine of each kind, alternating, and prints
per mode: output tokens/s, the median wall time between the engine's decode-only steps (what a
stream's pace is), and the host's share of a step (scheduling and processing the tokens). The
first round also checks the two modes' tokens are equal.

--device-latency-ms N makes every runner call wait N ms first, as a GPU keeps the host waiting
for its forward: on a CPU the forward itself runs on the host's cores, so this is how the
overlap's effect on a device can be shown here. Without it the figures are the CPU's own.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

from bench.runs import make_prompts, run_minivllm
from engine import LLM, SamplingParams
from engine.outputs import StepStats

logger = logging.getLogger("bench.async_scheduling")


def with_device_latency(llm: LLM, seconds: float) -> None:
    """Every runner call sleeps `seconds` first (the sleep releases the GIL, as a device's wait does)."""
    execute = llm.engine.runner.execute

    def delayed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return execute(*args, **kwargs)

    llm.engine.runner.execute = delayed


def step_period(steps: list[StepStats]) -> float | None:
    """The median wall time between consecutive decode-only steps (seconds): with async
    scheduling a step's own parts overlap the next, so only the wall clock says the pace."""
    intervals = [b.start_time - a.start_time for a, b in zip(steps, steps[1:], strict=False)
                 if a.kind == "decode" and b.kind == "decode"]
    return statistics.median(intervals) if intervals else None


def host_time(steps: list[StepStats]) -> float:
    """The median of a decode step's scheduling and token processing (seconds)."""
    decode = [s.schedule_time + s.process_time for s in steps if s.kind == "decode"]
    return statistics.median(decode) if decode else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device-latency-ms", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engines = {}
    for mode in ("sync", "async"):
        engines[mode] = LLM(args.model, dtype=args.dtype, quantization=args.quantization, backend=args.backend,
                            max_num_seqs=max(1, args.num_prompts), async_scheduling=mode == "async")
        if args.device_latency_ms:
            with_device_latency(engines[mode], args.device_latency_ms / 1e3)
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.prompt_len, engines["sync"].engine.vocab_size, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {mode: [o.token_ids for o in llm.generate(prompts, greedy)] for mode, llm in engines.items()}
    print(f"greedy tokens equal: {tokens['sync'] == tokens['async']}")
    figures: dict[str, list[tuple[float, float, float]]] = {"sync": [], "async": []}
    for round_index in range(args.rounds):
        for mode in ("sync", "async") if round_index % 2 == 0 else ("async", "sync"):
            seconds, steps = run_minivllm(engines[mode], prompts, args.output_len)
            period = step_period(steps) or float("nan")
            figures[mode].append((args.num_prompts * args.output_len / seconds, period, host_time(steps)))
            print(f"round {round_index + 1} {mode:5s}: {figures[mode][-1][0]:8.1f} output tok/s, "
                  f"decode step {1e3 * period:6.2f} ms, host {1e3 * figures[mode][-1][2]:5.2f} ms")
    print(f"\n{args.num_prompts} prompt(s) of {args.prompt_len} tokens, {args.output_len} output tokens each, "
          f"device latency {args.device_latency_ms} ms; medians of {args.rounds} rounds")
    for mode in ("sync", "async"):
        rate, period, host = (statistics.median(f[i] for f in figures[mode]) for i in range(3))
        print(f"{mode:5s}: {rate:8.1f} output tok/s, decode step {1e3 * period:6.2f} ms, host {1e3 * host:5.2f} ms")
    ratio = statistics.median(a[0] / s[0] for a, s in zip(figures["async"], figures["sync"], strict=True))
    print(f"async / sync output tok/s: {ratio:.3f}x")


if __name__ == "__main__":
    main()
