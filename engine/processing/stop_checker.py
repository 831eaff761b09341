"""When a sequence stops, and how much of its text may be shown yet."""
from __future__ import annotations

from engine.core.sequence import FinishReason, Sequence


def check_token_stop(seq: Sequence, token_id: int, max_model_len: int) -> tuple[FinishReason | None, int | None]:
    """Stop conditions decided by the new token id alone."""
    params = seq.params
    if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete: nothing may follow
        return FinishReason.STOP, None
    if seq.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in seq.eos_token_ids:
            return FinishReason.STOP, None
        if token_id in params.stop_token_set:
            return FinishReason.STOP, token_id
    if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None


def find_stop_string(seq: Sequence, num_new_chars: int) -> tuple[int, str] | None:
    """Earliest stop string that the new text completes: (its start, the string)."""
    if seq.num_output_tokens < seq.params.min_tokens:
        return None
    text = seq.text
    search_from = max(0, len(text) - num_new_chars - seq.params.max_stop_len + 1)
    best: tuple[int, str] | None = None
    for stop in seq.params.stop:
        idx = text.find(stop, search_from)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def num_held_chars(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held
