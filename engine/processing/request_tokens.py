"""What a request's token ids answer, for both records of a request: the scheduler's Sequence
(engine/core) and the runner's CachedRequestState (engine/execution). The runner keeps its own
record, as vLLM's worker does, so the two layers never share a mutable object; they share these
answers instead of two copies of them."""
from __future__ import annotations


class RequestTokens:
    """A mixin for a slotted dataclass with prompt_token_ids, output_token_ids and block_tables."""

    __slots__ = ()
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_tables: list[list[int]]

    @property
    def block_table(self) -> list[int]:
        """The first KV-cache group's table (the only one of a model with one kind of layer)."""
        return self.block_tables[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
