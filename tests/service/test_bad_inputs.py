"""Abusive and careless input at every front door of one tiny-model server (the tool model: a
template that knows tools): each case is refused fast, in the door's own error shape, naming the
request's own field, while an ordinary stream keeps streaming beside them; the server records no
server error and every KV block is free again afterwards."""
from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from engine import EngineConfig
from service.grpc.minivllm_client import build_request
from service.observability.metrics import ServiceMetrics
from service.observability.wiring import MetricsInterceptor
from service.openai.http_guard import MAX_JSON_DEPTH, json_depth
from service.pb import inference_pb2 as pb
from service.pb import inference_pb2_grpc as pb_grpc
from tests.server_harness import ServerThread, poll

MAX_BODY = 64 * 1024
LONE = "\ud800"  # a lone surrogate: JSON spells it "\ud800"; it has no UTF-8 form
USER = {"role": "user", "content": "hi"}
CYCLE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"], "$defs": {
    "node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}}
SELF = {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}
# Recursive but with a way out (an alternative, an optional property): accepted.
TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
LIST = {"type": "object", "properties": {"head": {"type": "integer"}, "tail": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["head", "tail"]}


def _tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": parameters}}


def _chat(**fields: object) -> dict:
    return {"model": "tiny", "messages": [USER], "max_tokens": 4} | fields


def _deep(levels: int) -> bytes:
    return b'{"model": "tiny", "input": "hi", "metadata": {"a": ' + b"[" * levels + b"]" * levels + b"}}"


# (name, path, body: a dict (sent as ASCII JSON), raw bytes, or a list of chunks sent chunked;
#  expected status, expected param)
HTTP_CASES = [
    ("chat: a lone surrogate in content", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "hi " + LONE}]), 400, "messages[0].content"),
    ("chat: a lone surrogate in a text part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]), 400, "messages[0].content[0].text"),
    ("chat: a lone surrogate in a tool's description", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f", "description": LONE}}]), 400,
     "tools[0].function.description"),
    ("chat: a lone surrogate in a call's arguments (JSON inside JSON)", "/v1/chat/completions",
     _chat(messages=[USER, {"role": "assistant", "content": "", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": LONE})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]), 400, "messages[1].tool_calls[0].function.arguments"),
    ("completions: a lone surrogate in the prompt", "/v1/completions",
     {"model": "tiny", "prompt": LONE, "max_tokens": 2}, 400, "prompt"),
    ("responses: a lone surrogate in input", "/v1/responses", {"model": "tiny", "input": "a" + LONE}, 400, "input"),
    ("responses: a lone surrogate in an input item", "/v1/responses",
     {"model": "tiny", "input": [{"type": "message", "role": "user", "content": LONE}]}, 400, "input[0].content"),
    ("tokenize: a lone surrogate", "/tokenize", {"prompt": LONE}, 400, "prompt"),
    ("chunked body over --max-message-bytes", "/v1/chat/completions", [b" " * 16 * 1024] * 5 + [json.dumps(
        _chat()).encode()], 413, None),
    ("Content-Length over --max-message-bytes", "/v1/chat/completions",
     json.dumps(_chat(user="x" * MAX_BODY)).encode(), 413, None),
    ("chat: a $ref cycle with no way out", "/v1/chat/completions",
     _chat(tools=[_tool(CYCLE)], tool_choice="required"), 400, "tools[0].function.parameters"),
    ("chat: a schema that needs itself", "/v1/chat/completions",
     _chat(tools=[_tool({"type": "object"}, "g"), _tool(SELF)]), 400, "tools[1].function.parameters"),
    ("responses: a $ref cycle with no way out", "/v1/responses",
     {"model": "tiny", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": CYCLE}]}, 400,
     "tools[0].parameters"),
    ("chat: a response_format schema no finite value matches", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": CYCLE}}), 400,
     "response_format.json_schema.schema"),
    ("responses: a text.format schema no finite value matches", "/v1/responses", {"model": "tiny", "input": "hi",
     "text": {"format": {"type": "json_schema", "name": "a", "schema": SELF}}}, 400, "text.format.schema"),
    ("chat: parameters not an object schema", "/v1/chat/completions",
     _chat(tools=[_tool({"type": "string"})], tool_choice="required"), 400, "tools[0].function.parameters"),
    ("chat: a tool message without tool_call_id", "/v1/chat/completions",
     _chat(messages=[USER, {"role": "tool", "content": "Sunny"}]), 400, "messages[1].tool_call_id"),
    ("responses: truncation 'sometimes'", "/v1/responses", {"model": "tiny", "input": "hi", "truncation": "sometimes"},
     400, "truncation"),
    ("responses: truncation 'auto' (not served)", "/v1/responses", {"model": "tiny", "input": "hi", "truncation": "auto"},
     400, "truncation"),
    ("a body that is not UTF-8", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", '
     b'"content": "caf\xe9"}]}', 400, None),
    ("JSON nested 1,000 levels deep", "/v1/responses", _deep(1000), 400, None),
    ("JSON nested 200 levels deep (parses, but deeper than any request)", "/v1/responses", _deep(200), 400, None),
    ("a body that is not JSON", "/v1/chat/completions", b"messages=hi", 400, None),
    ("a JSON list as the body", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("chat: an invalid response_format schema", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}), 400,
     "response_format.json_schema.schema"),
    ("completions: an invalid structured_outputs.json", "/v1/completions",
     {"model": "tiny", "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": {"type": "objekt"}}}, 400,
     "structured_outputs.json"),
    ("responses: an invalid text.format schema", "/v1/responses", {"model": "tiny", "input": "hi", "text": {
        "format": {"type": "json_schema", "name": "a", "schema": {"type": "objekt"}}}}, 400, "text.format.schema"),
]

# (name, request, a tool's parameters to add (JSON text), the field the message must name first)
GRPC_CASES = [
    ("parameters not an object schema", build_request([USER], max_tokens=2), '{"type": "string"}',
     "messages.tools[0].parameters"),
    ("a $ref cycle with no way out", build_request([USER], max_tokens=2), json.dumps(CYCLE),
     "messages.tools[0].parameters"),
    ("a lone surrogate in parameters (JSON text)", build_request([USER], max_tokens=2),
     json.dumps({"type": "object", "description": LONE}), "messages.tools[0].parameters"),
    ("a json_schema no finite value matches", build_request("hi", max_tokens=2, json_schema=json.dumps(CYCLE)), "",
     "structured_output.json_schema"),
    ("a tool message without tool_call_id",
     build_request([USER, {"role": "tool", "content": "Sunny"}], max_tokens=2), "", "messages[1].tool_call_id"),
    ("a lone surrogate in a call's arguments (JSON text)",
     build_request([USER, {"role": "assistant", "content": ""}, {"role": "tool", "tool_call_id": "c", "content": "x"}],
                   max_tokens=2), "", "messages[1].tool_calls[0].arguments"),
]


@pytest.fixture(scope="module")
def server(tiny_tool_model_dir: Path) -> Iterator[ServerThread]:
    metrics = ServiceMetrics("tiny")
    srv = ServerThread(EngineConfig(model=str(tiny_tool_model_dir), num_kv_blocks=1024, block_size=4),
                       stats_listeners=[metrics.on_step], interceptors=[MetricsInterceptor(metrics)],
                       on_http_call=metrics.on_api_call, http_port=0, served_model_name="tiny",
                       max_message_bytes=MAX_BODY)
    srv.metrics = metrics
    yield srv
    srv.stop()


def _send(server: ServerThread, path: str, body: dict | bytes | list[bytes]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if isinstance(body, list):  # no Content-Length: the body arrives in chunks
            conn.request("POST", path, body=iter(body), headers=headers, encode_chunked=True)
        else:
            conn.request("POST", path, body=body if isinstance(body, bytes) else json.dumps(body).encode(),
                         headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:  # a server error's plain text
            return resp.status, {"raw": data.decode(errors="replace")}
    finally:
        conn.close()


class OrdinaryStreams:
    """Streams one ordinary completion after another on a thread until stopped; each must run to
    its max_tokens (finish_reason length), and the arrival time of every chunk is kept."""

    def __init__(self, server: ServerThread, max_tokens: int = 200) -> None:
        self.client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.max_tokens, self.arrivals, self.problems, self.num_streams = max_tokens, [], [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                finish, usage = None, None
                for chunk in self.client.completions.create(
                        model="tiny", prompt="the ordinary stream", max_tokens=self.max_tokens, temperature=0,
                        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                    self.arrivals.append(time.monotonic())
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
                    usage = chunk.usage or usage
                if finish != "length" or usage is None or usage.completion_tokens != self.max_tokens:
                    self.problems.append(f"stream {self.num_streams}: {finish}, {usage}")
                self.num_streams += 1
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.problems.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


def _server_errors(metrics: ServiceMetrics) -> list[str]:
    """Calls the server answered with a server error (HTTP 5xx, or a gRPC code a server fault gives)."""
    bad = []
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "minivllm_api_requests_total" and s.value and (
                    s.labels["code"].startswith("5") or s.labels["code"] in ("UNKNOWN", "INTERNAL", "DATA_LOSS")):
                bad.append(f"{s.labels['protocol']} {s.labels['method']} {s.labels['code']}: {s.value}")
    return bad


def test_every_bad_input_is_refused_fast_and_named_while_a_stream_goes_on(server: ServerThread) -> None:
    streams = OrdinaryStreams(server)
    assert poll(lambda: len(streams.arrivals) > 5, 30), streams.problems
    problems, start = [], time.monotonic()
    for name, path, body, status, param in HTTP_CASES:
        began = time.monotonic()
        got, reply = _send(server, path, body)
        took = time.monotonic() - began
        error = reply.get("error") if isinstance(reply, dict) else None
        if got != status or "detail" in reply or not isinstance(error, dict) \
                or set(error) != {"message", "type", "param", "code"} or error["type"] != "invalid_request_error" \
                or error["param"] != param or not error["message"]:
            problems.append(f"{name}: {got} {reply}")
        if took > 2.0:
            problems.append(f"{name}: {took:.2f} s")
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for name, request, parameters, field in GRPC_CASES:
            if parameters:
                request.messages.tools.append(pb.FunctionTool(name="f", description="d", parameters=parameters))
            if "arguments" in name:
                request.messages.messages[1].tool_calls.append(
                    pb.ToolCall(id="c", name="f", arguments=json.dumps({"a": LONE})))
            began = time.monotonic()
            try:
                list(stub.Generate(request, timeout=30))
                problems.append(f"gRPC {name}: accepted")
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT or not (err.details() or "").startswith(field):
                    problems.append(f"gRPC {name}: {err.code().name} {err.details()!r}")
            if time.monotonic() - began > 2.0:
                problems.append(f"gRPC {name}: {time.monotonic() - began:.2f} s")
    end = time.monotonic()
    # The stream kept going through the abuse: chunks arrived all along, with no long gap.
    assert poll(lambda: streams.arrivals[-1] > end, 30), "the stream stopped"
    streams.stop()
    assert not problems, "\n".join(problems)
    assert not streams.problems and streams.num_streams >= 1, streams.problems
    during = [t for t in streams.arrivals if start <= t <= end]
    gaps = [b - a for a, b in zip([start, *during], [*during, end], strict=True)]
    assert max(gaps) < 2.0, f"the stream paused {max(gaps):.2f} s"
    # Nothing leaked: every KV block is free and the usage metric says so; no call was a server error.
    assert poll(lambda: server.engine.block_manager.num_used_blocks == 0, 10)
    assert poll(lambda: server.metrics.registry.get_sample_value("minivllm_kv_cache_usage_ratio",
                                                                 {"model_name": "tiny"}) == 0, 10)
    assert not _server_errors(server.metrics), _server_errors(server.metrics)


def test_recursive_schemas_with_a_way_out_are_served(server: ServerThread) -> None:
    """Recursion with a way out is served, and the grammar brings the call to its end (closed
    objects: an open one lets the random model add properties until max_tokens)."""
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for schema in (TREE, LIST):
            closed = {**schema, "additionalProperties": False}
            out = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=300, temperature=0,
                                                 tools=[_tool(closed)], tool_choice="required")
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "f", out
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), closed)


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert json_depth(b'{"a": [1]}') == 0  # fewer brackets than the limit: not scanned
    assert json_depth(b'{"a": "' + b"[" * 500 + b'"}') == 1
    assert json_depth(b'{"a": "\\"' + b"[" * 500 + b'", "b": [[1]]}') == 3  # an escaped quote ends no string
    nested = b"[" * (MAX_JSON_DEPTH + 5) + b'"]]]\\""' + b"]" * (MAX_JSON_DEPTH + 5)
    assert json_depth(nested) == MAX_JSON_DEPTH + 5
