"""The HTTP door's outermost layer (pure ASGI, before FastAPI parses anything): the body's size
and JSON nesting limits, and every call's metrics.

The size limit counts the bytes actually read, so a body sent with chunked transfer encoding
(no Content-Length) is held to it too; the body is read here once, up to the limit, and replayed
to the app. A body nested deeper than MAX_JSON_DEPTH is refused before it is parsed: Python's
parser and the renderers behind it recurse, and a nesting that gets past the parser could still
exhaust the stack later (a server error) while no real request nests that deep.
"""
from __future__ import annotations

import itertools
import operator
import re
import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from service.openai.protocol import error_body

ApiCallListener = Callable[[str, str, str, float], None]  # (protocol, method, code, seconds)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/health",
          "/tokenize", "/detokenize", "/tokenizer_info")
MAX_JSON_DEPTH = 128  # objects and arrays inside each other; serde_json's default limit too

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# After deleting all but brackets: an opening one counts +1 and a closing one -1 (as 2 and 0, less 1).
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


def json_depth(body: bytes) -> int:
    """How deep the body's arrays and objects nest (brackets inside strings not counted); C-speed
    passes, and none at all for a body with fewer brackets than the limit."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return 0
    brackets = _JSON_STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)
    return max(itertools.accumulate(map(operator.sub, brackets, itertools.repeat(1))), default=0)


class CallMiddleware:
    """Refuses bodies over the size or nesting limit, times every call to its last body byte (a
    stream's whole life) and reports its final status (499: the client left first)."""

    def __init__(self, app: Any, listener: ApiCallListener | None, max_body_bytes: int) -> None:
        self.app, self.listener, self.max_body_bytes = app, listener, max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), [0]
        app = self.app
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            app = _refusal(413, f"body: {int(length)} bytes, at most {self.max_body_bytes}")
        else:
            body, receive = await self._read_body(receive)
            if body is None:
                app = _refusal(413, f"body: more than {self.max_body_bytes} bytes, at most {self.max_body_bytes}")
            elif (depth := json_depth(body)) > MAX_JSON_DEPTH:
                app = _refusal(400, f"body: JSON nested {depth} levels deep, at most {MAX_JSON_DEPTH}")

        async def observed_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, observed_send)
        except BaseException:
            status[0] = status[0] or 500
            raise
        finally:
            if self.listener is not None:
                route = scope["path"] if scope["path"] in ROUTES else "other"
                self.listener("http", route, str(status[0] or 499), time.monotonic() - start)

    async def _read_body(self, receive: Callable) -> tuple[bytes | None, Callable]:
        """The whole body (None once it passes the limit), whatever the transfer encoding, and a
        receive that replays it to the app and then goes on to the client's (a disconnect)."""
        chunks: list[bytes] = []
        size, more, left = 0, True, None
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: the app reads that next
                left = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, receive
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replay = [{"type": "http.request", "body": body, "more_body": left is not None}]
        if left is not None:
            replay.append(left)

        async def replaying_receive() -> dict:
            return replay.pop(0) if replay else await receive()

        return body, replaying_receive


def _refusal(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status)
