"""The speculative proposers' cost per step on the engine thread, alone: propose() for one
request growing a token at a time, with suffix decoding's shared history full (32k tokens of
earlier outputs) and prompt lookup over the same request; prints microseconds per call.

    python -m bench.suffix_propose --history-tokens 32768 --prompt-tokens 1024 --steps 2000
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from engine.execution.speculative import NgramProposer, Proposer, SuffixProposer


def text(rng: random.Random, phrases: list[list[int]], num_tokens: int, vocab: int) -> np.ndarray:
    """Tokens that repeat phrases (as outputs restating earlier ones do) among fresh ones."""
    out: list[int] = []
    while len(out) < num_tokens:
        out += phrases[rng.randrange(len(phrases))] if rng.random() < 0.5 else [rng.randrange(vocab)]
    return np.array(out[:num_tokens], dtype=np.int64)


def time_proposer(proposer: Proposer, request: np.ndarray, prompt_tokens: int, steps: int, repeats: int
                  ) -> tuple[float, int]:
    """Median over repeats of the mean microseconds per propose() as the request grows."""
    means = []
    for _ in range(repeats):
        num_proposed = 0
        start = time.perf_counter()
        for end in range(prompt_tokens, prompt_tokens + steps):
            num_proposed += len(proposer.propose(request[:end]))
        means.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(means), num_proposed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history-tokens", type=int, default=32768)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    rng = random.Random(0)
    phrases = [[rng.randrange(args.vocab) for _ in range(rng.randrange(4, 16))] for _ in range(200)]
    suffix = SuffixProposer(8)
    num_history = 0
    while num_history < args.history_tokens:
        output = text(rng, phrases, rng.randrange(200, 800), args.vocab)
        suffix.observe_finished(output)
        num_history += len(output)
    request = text(rng, phrases, args.prompt_tokens + args.steps, args.vocab)
    for name, proposer in (("suffix", suffix), ("ngram", NgramProposer(8, 1, 4))):
        micros, num_proposed = time_proposer(proposer, request, args.prompt_tokens, args.steps, args.repeats)
        print(f"{name:6s} propose(): {micros:7.1f} us/step (history {num_history} tokens, request "
              f"{args.prompt_tokens}..{args.prompt_tokens + args.steps} tokens, {num_proposed} tokens proposed)",
              flush=True)


if __name__ == "__main__":
    main()
