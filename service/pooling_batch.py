"""One call's inputs as pooling requests in the engine: each input one request (ids
`<call id>-<i>`), admitted in order and read to their final outputs together. The doors use it for
embeddings (HTTP /v1/embeddings, gRPC Embed) and scores (/rerank, /score: each query-document pair
one request); an input refused at admission ends the ones admitted before it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from engine import FieldError, PoolingParams, RequestOutput
from service.async_engine import AsyncEngine


class PoolingBatch:
    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self._streams: list[AsyncGenerator[RequestOutput, None]] = []

    async def admit(self, params: PoolingParams, prompts: list[str | list[int]], priority: int,
                    input_field: Callable[[int], str], token_type_ids: list[list[int] | None] | None = None) -> None:
        """Admit every input; a FieldError about input i's prompt is renamed to input_field(i).
        token_type_ids: each input's token types (a cross-encoder's pair), when it has them. On any
        refusal the admitted ones are closed (aborted) before it raises."""
        try:
            for i, prompt in enumerate(prompts):
                engine_id = f"{self.request_id}-{i}"
                try:
                    self._streams.append(await self.engine.generate(
                        engine_id, params, prompt=prompt, priority=priority, engine_id=engine_id,
                        token_type_ids=None if token_type_ids is None else token_type_ids[i]))
                except FieldError as exc:
                    field = input_field(i)
                    raise exc.renamed({"prompt": field, "prompt_token_ids": field, "token_type_ids": field}) from exc
        except BaseException:
            await self.aclose()
            raise

    async def finals(self) -> list[RequestOutput]:
        """Each input's final output, in input order (read together: they run in the same steps)."""
        async def final(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
            last = None
            async for out in stream:
                last = out
            return last

        return list(await asyncio.gather(*(final(s) for s in self._streams)))

    async def aclose(self) -> None:
        """Close every stream: an unfinished request is aborted and its KV blocks freed."""
        streams, self._streams = self._streams, []
        for stream in streams:
            await stream.aclose()


def failed_output(outputs: list[RequestOutput]) -> RequestOutput | None:
    """The first input that ended without its vector or scores (an engine fault, an abort), or None."""
    return next((out for out in outputs if out.embedding is None and out.scores is None), None)
