"""Speculative decoding, side by side in one run: the same requests without speculation and with
each method, at batch 1 and batch 32, in each weight mode; prints output tokens/s, the decode
steps' tokens/s, the mean tokens a verification accepted, and the ratio to no speculation.

    python -m bench.speculative --modes float32,int8 --methods ngram,suffix

Workloads, from texts the repository ships:
- grounded: input-grounded work: quote a document word for word, edit a module (repeat it with a
  rename), answer from a document by quoting it. SmolLM2-135M copies a text it has seen when a
  completion prompt starts restating it.
- chat: free chat through the chat template (proposals are chance there).
- random: random token ids.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from bench.runs import WEIGHT_MODES
from engine import LLM, SamplingParams, StepStats

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "bench" / "data" / "perplexity.txt"
CODE = ROOT / "engine" / "core" / "block_manager.py"


def grounded_prompts() -> list[str]:
    prose, code = TEXT.read_text()[:2000], CODE.read_text()[:1800]
    return ["Document:\n" + prose + "\n\nQuote the document word for word:\n" + prose[:100],
            "# original\n" + code + "\n\n# the same module with the class renamed to BlockPool\n" + code[:120],
            "Document:\n" + prose[1000:] + "\n\nQuestion: what does the document say? Answer with its own words:\n"
            + prose[1000:1080]]


def chat_prompts(llm: LLM) -> list[list[int]]:
    questions = ["Tell me about the history of jazz.", "How do I bake sourdough bread?",
                 "Explain how a refrigerator works."]
    return [llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


def random_prompts(vocab: int, num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(200)] for _ in range(num)]


def run(llm: LLM, prompts: list, output_len: int, batch: int) -> dict[str, float]:
    """Every prompt (repeated to `batch` in flight), greedy, `output_len` tokens each, from a
    cold prefix cache and proposers that have not seen these prompts' answers."""
    engine = llm.engine
    engine.reset_prefix_cache()
    engine.reset_speculative_history()
    work = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps: list[StepStats] = []
    start = time.perf_counter()
    pending = list(reversed(work))
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_running + engine.num_waiting < batch:
            engine.add_request(pending.pop(), params)
        outputs, stats = engine.step()
        steps.append(stats)
    seconds = time.perf_counter() - start
    decode = [s for s in steps if s.num_prefill_tokens == 0]
    tokens = sum(s.num_generated_tokens for s in decode)
    verified = sum(len(s.accepted_lengths) for s in steps)
    return {"output_tok_s": len(work) * output_len / seconds,
            "decode_tok_s": tokens / sum(s.total_time for s in decode) if decode else 0.0,
            "mean_accepted": sum(s.num_accepted_tokens for s in steps) / verified if verified else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="float32,int8", help=f"weight modes: {', '.join(WEIGHT_MODES)}")
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--workloads", default="grounded,chat,random")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--output-len", type=int, default=256, help="tokens per request at batch 1 (half at 32)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the median is reported")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows, result = [], []
    for mode in args.modes.split(","):
        engines = {method: LLM(None, speculative_method=method, num_speculative_tokens=args.num_speculative_tokens,
                               max_num_seqs=32, **WEIGHT_MODES[mode]) for method in ["none", *args.methods.split(",")]}
        base = engines["none"]
        workloads = {"grounded": grounded_prompts(), "chat": chat_prompts(base),
                     "random": random_prompts(base.engine.vocab_size, 3)}
        warm_up = random_prompts(base.engine.vocab_size, 3, seed=1)
        for batch in map(int, args.batches.split(",")):  # untimed: kernels built, the KV pool touched
            for llm in engines.values():
                run(llm, warm_up, 16, batch)
        for workload in args.workloads.split(","):
            for batch in map(int, args.batches.split(",")):
                output_len = args.output_len if batch == 1 else args.output_len // 2
                figures = {m: [] for m in engines}
                for _ in range(args.rounds):
                    for method, llm in engines.items():
                        figures[method].append(run(llm, workloads[workload], output_len, batch))
                medians = {m: {k: statistics.median(f[k] for f in runs) for k in runs[0]} for m, runs in figures.items()}
                for method, f in medians.items():
                    ratio = f["output_tok_s"] / medians["none"]["output_tok_s"]
                    rows.append((mode, workload, batch, method, f, ratio))
                    result.append({"mode": mode, "workload": workload, "batch": batch, "method": method, **f,
                                   "ratio": ratio})
                    print(f"{mode:8s} {workload:9s} batch {batch:2d} {method:7s}: {f['output_tok_s']:7.1f} tok/s "
                          f"(decode steps {f['decode_tok_s']:7.1f}), accepted {f['mean_accepted']:4.2f}/verification,"
                          f" {ratio:5.2f}x", flush=True)
        del engines
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
