"""/v1/responses with the official `openai` SDK: text, a function tool (the call, then its
output fed back), streamed events that add up to the response, previous_response_id through
the bounded store, JSON text.format, reasoning items, and errors in OpenAI's shape."""
from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from engine import EngineConfig
from service.observability.request_observer import RequestObserver
from service.openai.response_store import ResponseStore, StoredResponse
from tests.server_harness import ServerThread
from tests.service.chat.test_reasoning_parser import ANSWER
from tests.service.tool_cases import END_THINK, SCHEMAS, TOOL_CALL_TOKEN, WEATHER

FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER,
            "strict": True}


@pytest.fixture()
def client(tool_server: ServerThread) -> Iterator[openai.OpenAI]:  # noqa: F811
    with openai.OpenAI(base_url=tool_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _calls(response: object) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_text_response_and_stream_events_agree(client: openai.OpenAI) -> None:
    request = dict(model="tiny", input="Say hi", instructions="Be brief.", max_output_tokens=12, temperature=0.8,
                   extra_body={"seed": 1})
    whole = client.responses.create(**request)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 0
    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_loop_with_previous_response_id(client: openai.OpenAI, stream: bool) -> None:
    request = dict(model="tiny", input=[{"role": "user", "content": "Weather in Paris?"}], tools=[FUNCTION],
                   tool_choice="required", parallel_tool_calls=False, temperature=0.8, max_output_tokens=150,
                   extra_body={"seed": 2})
    if stream:
        events = list(client.responses.create(**request, stream=True))
        first = events[-1].response
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done and done[0].arguments == arguments == _calls(first)[0].arguments
    else:
        first = client.responses.create(**request)
    calls = _calls(first)
    assert first.status == "completed" and len(calls) >= 1
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.call_id.startswith("call_")
    # The tool's output goes back as an item, naming the stored response before it.
    second = client.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny"}
                                            for c in calls])
    assert second.output_text and not _calls(second) and second.previous_response_id == first.id
    # The same conversation sent whole gives the same prompt.
    replay = [{"role": "user", "content": "Weather in Paris?"}] + [
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls] + [
        {"type": "function_call_output", "call_id": c.call_id, "output": "Sunny"} for c in calls]
    whole = client.responses.create(model="tiny", input=replay, max_output_tokens=8, temperature=0)
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text
    assert client.responses.retrieve(first.id).id == first.id


def test_auto_tool_choice_and_json_format(client: openai.OpenAI) -> None:
    steered = client.responses.create(model="tiny", input="Weather?", tools=[FUNCTION], temperature=0.8,
                                      max_output_tokens=150, parallel_tool_calls=False,
                                      extra_body={"seed": 1, "logit_bias": {str(TOOL_CALL_TOKEN): 15}})
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    formatted = client.responses.create(model="tiny", input="Answer in JSON", temperature=0.8, max_output_tokens=60,
                                        text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    jsonschema.validate(json.loads(formatted.output_text), schema)
    calls = _calls(steered)
    assert calls, "the steered model was meant to call"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_reasoning_items(reasoning_server: ServerThread) -> None:  # noqa: F811
    with openai.OpenAI(base_url=reasoning_server.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        request = dict(model="tiny", input="2+2?", temperature=0.8, max_output_tokens=200,
                       text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER}},
                       extra_body={"seed": 0, "logit_bias": {str(END_THINK): 15}})
        whole = c.responses.create(**request)
        events = list(c.responses.create(**request, stream=True))
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"], kinds
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    jsonschema.validate(json.loads(whole.output_text), ANSWER)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == whole.output[0].content[0].text and thought


def test_errors_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_unknown")
    assert info.value.body["param"] == "previous_response_id" and "resp_unknown" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input=[{"type": "image_generation_call"}])
    assert info.value.body["param"] == "input[0].type"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="again", previous_response_id=unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"max_output_tokens": 10**7}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format.schema"),
    ({"tools": [FUNCTION], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x" * 40_000}, "input"),
])
def test_errors_name_the_responses_api_fields(client: openai.OpenAI, body: dict, param: str) -> None:
    """The request runs as a chat completion inside; its errors still name this API's fields."""
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**({"model": "tiny", "input": "hi"} | body))
    error = info.value.body
    assert error["param"] == param and error["message"].startswith(param + ":"), error
    assert not {"max_tokens", "response_format", "messages"} & set(error["message"].replace(":", " ").split())


class Recorder(RequestObserver):
    """Each call's outcome as the front door reports it: id -> (error type, engine finish reason)."""

    def __init__(self) -> None:
        self.finished: dict[str, tuple[str | None, str | None]] = {}

    def start(self, request_id: str, engine_id: str, call: object, params: object) -> str:
        return request_id

    def finish(self, handle: str, final: object, error_type: str | None, message: str = "",
               attributes: object = None) -> None:
        self.finished[handle] = (error_type, getattr(final, "finish_reason", None))


@pytest.fixture(scope="module")
def recorded(tiny_tool_model_dir: Path) -> Iterator[tuple[ServerThread, Recorder]]:
    recorder = Recorder()
    srv = ServerThread(EngineConfig(model=str(tiny_tool_model_dir), num_kv_blocks=512, block_size=4), http_port=0,
                       served_model_name="tiny", observer=recorder)
    yield srv, recorder
    srv.stop()


def _long_request(srv: ServerThread) -> dict:
    """A response that runs far longer than the test waits: end of text suppressed."""
    eos = srv.engine.tokenizer.eos_token_id
    return {"model": "tiny", "input": "hi", "max_output_tokens": 1900, "temperature": 0.8,
            "logit_bias": {str(eos): -100}}


def _new_outcome(recorder: Recorder, before: set[str], srv: ServerThread) -> tuple[str | None, str | None]:
    assert srv.wait_until(lambda: set(recorder.finished) - before, timeout=60)
    (key,) = set(recorder.finished) - before
    return recorder.finished[key]


def test_a_client_that_leaves_an_unstreamed_response_aborts_it(recorded: tuple[ServerThread, Recorder]) -> None:
    srv, recorder = recorded
    engine, before = srv.server.async_engine, set(recorder.finished)
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.http.port, timeout=30)
    conn.request("POST", "/v1/responses", json.dumps(_long_request(srv)), {"content-type": "application/json"})
    assert srv.wait_until(lambda: engine.num_active_streams == 1)
    conn.close()  # the client gives up before the answer
    assert _new_outcome(recorder, before, srv) == ("499", None)  # aborted, not run to max_output_tokens
    assert srv.wait_until(lambda: engine.num_active_streams == 0 and not srv.engine.has_unfinished_requests())


def test_an_aborted_response_is_cancelled(recorded: tuple[ServerThread, Recorder]) -> None:
    srv, _ = recorded
    with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        request = _long_request(srv)
        events = c.responses.create(**{k: v for k, v in request.items() if k != "logit_bias"}, stream=True,
                                    extra_body={"logit_bias": request["logit_bias"]})
        first = next(iter(events))
        assert first.type == "response.created"
        srv.loop.call_soon_threadsafe(srv.server.async_engine.abort, first.response.id)  # a drain, an abort by id
        last = list(events)[-1]
        assert last.type == "response.incomplete" and last.response.status == "cancelled", last
        assert last.response.incomplete_details is None
        assert c.responses.retrieve(first.response.id).status == "cancelled"
        cut = c.responses.create(model="tiny", input="hi", max_output_tokens=3, extra_body={
            "logit_bias": request["logit_bias"]})
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
        assert cut.output[-1].status == "incomplete"


def test_admission_failures_keep_their_status(recorded: tuple[ServerThread, Recorder]) -> None:
    """Refused for the server's state (draining): 503, reported as 503, not as a bad request."""
    srv, recorder = recorded
    before = set(recorder.finished)
    srv.server.state.is_draining = True
    try:
        with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c, \
                pytest.raises(openai.InternalServerError) as info:
            c.responses.create(model="tiny", input="hi", max_output_tokens=2)
    finally:
        srv.server.state.is_draining = False
    assert info.value.status_code == 503
    assert _new_outcome(recorder, before, srv) == ("503", None)


def test_store_is_bounded() -> None:
    store = ResponseStore(max_responses=3, max_chars=10_000)
    for i in range(5):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, [{"role": "user", "content": "x"}]))
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # used: kept over r3
    store.put("big", StoredResponse({}, [{"role": "user", "content": "y" * 9_000}]))
    assert store.get("r3") is None and store.get("big") is not None and len(store) <= 3
    with pytest.raises(ValueError, match="max_stored_responses"):
        ResponseStore(0)
