"""What structured output costs a decode step: the same batch of decoding sequences with and
without a grammar, measured side by side (rounds alternate, so machine drift hits both).

    python -m bench.structured_output --batch 32 --rounds 3 [--grammar json|tools-auto|tools-required]

Unconstrained rows generate with ignore_eos; constrained rows follow a JSON schema of an
unbounded integer array (so they never finish early either), or a tool-call grammar (service/
tool_grammar.py, Hermes layout): tools-auto is free text under the lazy trigger (what every
auto-mode request pays until it calls), tools-required a call whose arguments hold an unbounded
integer array. Prints the median decode-step time of each, their ratio, and the grammar mask's
own time per step.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from engine import LLM, SamplingParams, StructuredOutput
from engine.processing.structured_output import GrammarMask

logger = logging.getLogger("bench.structured_output")

SCHEMA = {"type": "array", "items": {"type": "integer"}}


def decode_step_times(llm: LLM, prompts: list[list[int]], params: SamplingParams, num_steps: int) -> list[float]:
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        _, stats = engine.step()
        elapsed = time.perf_counter() - t0
        if stats.num_prefill_tokens == 0 and stats.num_decode_tokens == len(prompts):
            times.append(elapsed)
        if len(times) >= num_steps:
            break
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # deliver the aborts
    return times[2:]  # the first decode steps still warm caches


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=24, help="decode steps measured per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--grammar", choices=("json", "tools-auto", "tools-required"), default="json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    llm = LLM(args.model, max_num_seqs=args.batch, enable_time_budget=False)
    chat = llm.engine.apply_chat_template([{"role": "user", "content": "List some integers as a JSON array."}])
    prompts = [chat for _ in range(args.batch)]
    free = SamplingParams(temperature=0.8, seed=1, max_tokens=args.steps + 8, ignore_eos=True)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    if args.grammar != "json":
        from service.chat.tool_grammar import FunctionSpec, tool_call_grammar
        from service.chat.tool_parsers import get_tool_parser

        function = FunctionSpec("record", "", {"type": "object", "properties": {"values": SCHEMA}, "required": ["values"]})
        spec = StructuredOutput("grammar", tool_call_grammar(get_tool_parser("hermes"), [function],
                                                             required=args.grammar == "tools-required", parallel=True))
    constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=args.steps + 8, structured_output=spec,
                                 ignore_eos=args.grammar == "tools-auto")
    mask_times: list[float] = []
    sampler = llm.engine.runner.sampler
    sampler.grammar_mask = GrammarMask(llm.engine.vocab_size, args.batch, sampler.kernels)
    apply = sampler.grammar_mask.apply

    def timed_apply(*a: object) -> object:
        t0 = time.perf_counter()
        try:
            return apply(*a)
        finally:
            mask_times.append(time.perf_counter() - t0)

    sampler.grammar_mask.apply = timed_apply
    free_times, constrained_times = [], []
    decode_step_times(llm, prompts, free, 4)  # warm-up (kernels, allocator)
    for _ in range(args.rounds):
        free_times += decode_step_times(llm, prompts, free, args.steps)
        constrained_times += decode_step_times(llm, prompts, constrained, args.steps)
    f, c = statistics.median(free_times), statistics.median(constrained_times)
    logger.info("batch %d, %d decode steps each: unconstrained %.1f ms, %s constrained %.1f ms "
                "(x%.3f); grammar mask %.2f ms per step (median)", args.batch, len(free_times), f * 1e3, args.grammar,
                c * 1e3, c / f, statistics.median(mask_times) * 1e3)


if __name__ == "__main__":
    main()
