"""Small helpers shared by tests."""
from __future__ import annotations

from engine import LLMEngine, RequestOutput, SamplingParams
from engine.core.sequence import Sequence
from engine.processing.detokenizer import IncrementalDetokenizer


def run_engine(engine: LLMEngine, max_steps: int = 10_000) -> tuple[dict[str, list[RequestOutput]], int]:
    """Step until idle; return every output by request id and the number of steps."""
    outputs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps > max_steps:
            raise AssertionError("engine did not finish")
        for out in engine.step()[0]:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs, steps


def _never_decoded(token_ids: list[int], skip_special_tokens: bool = True) -> str:
    raise AssertionError("a fake sequence's tokens are never decoded")


def fake_seq(request_id: str, num_prompt: int, num_output: int = 0, arrival: float = 0.0,
             priority: int = 0, params: SamplingParams | None = None) -> Sequence:
    """A sequence with made-up tokens, for scheduler and block-manager tests."""
    seq = Sequence(request_id=request_id, prompt_token_ids=list(range(1, num_prompt + 1)),
                   params=params or SamplingParams(), arrival_time=arrival,
                   detokenizer=IncrementalDetokenizer(_never_decoded, []), priority=priority)
    seq.output_token_ids = [7] * num_output
    return seq
