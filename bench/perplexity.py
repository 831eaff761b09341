"""Perplexity of each weight mode on a fixed text that ships with the repository
(bench/data/perplexity.txt, about 1,000 tokens), side by side in one run: what quantization
costs in quality.

    python -m bench.perplexity --modes float32,bfloat16,int8
"""
from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from bench.runs import WEIGHT_MODES as MODES
from engine import LLM, SamplingParams

logger = logging.getLogger("bench.perplexity")

TEXT = Path(__file__).with_name("data") / "perplexity.txt"


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens 1..n-1, each given all before it."""
    out = llm.generate([token_ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [entry[token] for token, entry in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True)]
    return math.exp(-sum(logprobs) / len(logprobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--modes", default="float32,bfloat16,int8", help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    results = {}
    for mode in modes:
        llm = LLM(args.model, **MODES[mode])
        token_ids = llm.tokenizer.encode(TEXT.read_text())
        results[mode] = perplexity(llm, token_ids)
        print(f"{mode:9s}: perplexity {results[mode]:.3f} over {len(token_ids) - 1} tokens of {TEXT.name}")
        del llm
    if "float32" in results:
        for mode, value in results.items():
            print(f"{mode:9s}: x{value / results['float32']:.4f} of float32")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
