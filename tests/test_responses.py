"""POST /v1/responses, OpenAI's Responses API, with the openai client against a live server of a tiny random model.

Each reply is held against what /v1/chat/completions gives for the same conversation on the same server: the
Responses endpoint is a translation of it, so the text, the prompt's tokens and the forced calls must be the same.
"""
from __future__ import annotations

import http.client
import json
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from model_helpers import LosesWorkerAtDecode, OurModel
from tiny_model import write_tiny_model
from tc.generation import Generator, LocalPipeline
from tc.head.api import create_app
from tc.head.http_server import start_http_server
from tc.head.service import GenerationService, Readiness
from tc.model.tokenizer import TextTokenizer

MODEL = "tiny"
EVENT = TypeAdapter(ResponseStreamEvent)
LOOKUP_PARAMETERS = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
                     "required": ["id"], "additionalProperties": False}
LOOKUP = {"type": "function", "name": "lookup", "description": "Look a record up by its id",
          "parameters": LOOKUP_PARAMETERS, "strict": True}
CHAT_LOOKUP = {"type": "function", "function": {k: v for k, v in LOOKUP.items() if k != "type"}}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "label": {"enum": ["a", "b"]}},
         "required": ["x", "label"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("responses"), seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model(model_dir) -> OurModel:
    return OurModel(model_dir)


def serve(model: OurModel, model_dir: Path, pipeline: LocalPipeline):
    generator = Generator(model.head, TextTokenizer.load(model_dir), pipeline, torch.float32)
    service = GenerationService(MODEL, generator.tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    return start_http_server(create_app(service), "127.0.0.1", 0, threads=2)


@pytest.fixture(scope="module")
def server(model, model_dir):
    running = serve(model, model_dir, model.pipeline())
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def create(client: openai.OpenAI, **body) -> Response:
    """client.responses.create, its reply validated whole by the SDK's own model (the client only constructs it)."""
    raw = client.responses.with_raw_response.create(model=MODEL, **body)
    Response.model_validate(json.loads(raw.text))
    return raw.parse()


def chat(client: openai.OpenAI, messages: list[dict], **body):
    return client.chat.completions.create(model=MODEL, messages=messages, **body)


def post(server, body: dict) -> tuple[int, str, str]:
    """POST /v1/responses as sent, on a connection of its own: the status, the Content-Type and the body."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        connection.request("POST", "/v1/responses", body=json.dumps(body).encode(),
                           headers={"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, reply.getheader("Content-Type") or "", reply.read().decode()
    finally:
        connection.close()


def stream_events(server, body: dict) -> list[dict]:
    """The events of a streamed response as sent: each `event:` line names its data's type, and every event is one
    the SDK's ResponseStreamEvent union validates."""
    events = []
    status, content_type, text = post(server, {"model": MODEL, "stream": True, **body})
    assert status == 200, text
    assert content_type.startswith("text/event-stream")
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2, block
        data = json.loads(lines[1][len("data: "):])
        assert data["type"] == lines[0][len("event: "):]
        EVENT.validate_python(data)
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_string_input_is_one_user_message(client):
    asked = dict(temperature=0)
    reply = create(client, input="Hello there", max_output_tokens=12, **asked)
    expected = chat(client, [{"role": "user", "content": "Hello there"}], max_completion_tokens=12, **asked)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == MODEL
    assert reply.output_text == expected.choices[0].message.content
    (item,) = reply.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert reply.usage.input_tokens == expected.usage.prompt_tokens
    assert reply.usage.output_tokens == expected.usage.completion_tokens
    assert reply.usage.total_tokens == expected.usage.total_tokens
    assert reply.max_output_tokens == 12 and reply.temperature == 0 and reply.tools == [] and reply.error is None


def test_the_stream_tells_the_same_text_in_order(server, client):
    body = {"input": "Hello there", "max_output_tokens": 12, "temperature": 0, "metadata": {"run": "1"}}
    whole = create(client, **body)
    events = stream_events(server, body)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                                "response.output_text.done", "response.content_part.done",
                                "response.output_item.done", kinds[-1]]
    text = "".join(e["delta"] for e in deltas)
    assert text == whole.output_text
    assert events[-4]["text"] == text and events[-3]["part"]["text"] == text
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    assert final["status"] == whole.status and final["metadata"] == {"run": "1"}
    assert final["output"] == [events[-2]["item"]] and final["output"][0]["content"][0]["text"] == text
    assert final["usage"] == whole.usage.model_dump(exclude_none=True)
    # the SDK's own stream reading gives the same text
    streamed = client.responses.create(model=MODEL, stream=True, **body)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == text


def test_instructions_and_input_items_are_the_chat_conversation(client):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"type": "message", "role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again"},
                                                              {"type": "input_text", "text": "please"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Again\nplease"}]
    reply = create(client, instructions="Be brief.", input=items, max_output_tokens=8, temperature=0)
    expected = chat(client, messages, max_tokens=8, temperature=0)
    assert reply.usage.input_tokens == expected.usage.prompt_tokens
    assert reply.output_text == expected.choices[0].message.content
    assert reply.instructions == "Be brief."


def test_a_reply_cut_at_max_output_tokens_is_incomplete(client):
    expected = chat(client, [{"role": "user", "content": "Hello there"}], max_tokens=3, temperature=0)
    assert expected.choices[0].finish_reason == "length"  # what the reply is held against
    reply = create(client, input="Hello there", max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 3 and reply.output[-1].status == "incomplete"


def test_a_forced_call_is_a_function_call_item_and_its_output_goes_back(server, client):
    ask = [{"role": "user", "content": "Find record 7."}]
    reply = create(client, input=ask, tools=[LOOKUP], tool_choice={"type": "function", "name": "lookup"},
                   temperature=0, max_output_tokens=200)
    expected = chat(client, ask, tools=[CHAT_LOOKUP], tool_choice={"type": "function", "function": {"name": "lookup"}},
                    temperature=0, max_tokens=200)
    calls = [item for item in reply.output if item.type == "function_call"]
    (call,), (expected_call,) = calls, expected.choices[0].message.tool_calls
    assert call.name == "lookup" and call.id.startswith("fc_") and call.status == "completed"
    assert call.arguments == expected_call.function.arguments
    jsonschema.validate(json.loads(call.arguments), LOOKUP_PARAMETERS)
    assert reply.tool_choice.name == "lookup" and reply.tools[0].name == "lookup"

    streamed = stream_events(server, {"input": ask, "tools": [LOOKUP], "temperature": 0, "max_output_tokens": 200,
                                      "tool_choice": {"type": "function", "name": "lookup"}})
    added = next(e["item"] for e in streamed if e["type"] == "response.output_item.added"
                 and e["item"]["type"] == "function_call")
    deltas = "".join(e["delta"] for e in streamed if e["type"] == "response.function_call_arguments.delta")
    (done,) = [e for e in streamed if e["type"] == "response.function_call_arguments.done"]
    assert added["name"] == "lookup" and deltas == done["arguments"] == call.arguments
    assert streamed[-1]["type"] == "response.completed"

    # the next turn: the call as the client got it, then its output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"name": "Ada"}'}
    follow = create(client, input=[*ask, *reply.output, result], tools=[LOOKUP],
                    max_output_tokens=4, temperature=0)
    messages = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "lookup", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"name": "Ada"}'}]
    expected = chat(client, messages, tools=[CHAT_LOOKUP], max_tokens=4, temperature=0)
    assert follow.usage.input_tokens == expected.usage.prompt_tokens
    # ... or as a client keeps a conversation as JSON: the items dumped, the SDK's null fields and all
    dumped = [item.model_dump(by_alias=True, mode="json") for item in reply.output]
    again = create(client, input=[*ask, *dumped, result], tools=[LOOKUP], max_output_tokens=4, temperature=0)
    assert again.usage.input_tokens == expected.usage.prompt_tokens


def test_required_tool_choice_always_calls(client):
    # one call: the grammar of parallel calls lets an unseeded random model write call after call until
    # max_output_tokens cuts the last one (about 1 run in 100), and a cut call is text, whatever the API
    reply = create(client, input="Do something.", tools=[LOOKUP], tool_choice="required", temperature=1.0,
                   max_output_tokens=200, parallel_tool_calls=False)
    assert reply.output and all(item.type == "function_call" for item in reply.output)


def test_required_among_allowed_tools_calls_the_allowed_one(client):
    """The Responses API's flat allowed_tools form (a 400 before)."""
    other = {**LOOKUP, "name": "other"}
    reply = create(client, input="Do something.", tools=[LOOKUP, other], temperature=1.0, max_output_tokens=200,
                   parallel_tool_calls=False, tool_choice={"type": "allowed_tools", "mode": "required",
                                                           "tools": [{"type": "function", "name": "other"}]})
    assert reply.output and [item.name for item in reply.output if item.type == "function_call"] == ["other"]
    assert reply.tool_choice.type == "allowed_tools" and reply.tool_choice.mode == "required"


def test_a_json_schema_text_format_gives_json_of_the_schema(client):
    fmt = {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}
    reply = create(client, input="Give a point.", text={"format": fmt}, temperature=0, max_output_tokens=200)
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), POINT)
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "point"


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include[1]"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"frequency": 1}, "frequency"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "narrator", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "function", "name": "missing"}, "tools": [LOOKUP]}, "tool_choice.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": POINT}}}, "text.format.name"),
    ({"model": "other"}, "model"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema"),
    ({"reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "bogus"}}, "reasoning.summary"),
    ({"store": "yes"}, "store"),
    ({"background": "no"}, "background"),
    ({"truncation": 5}, "truncation"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"prompt_cache_key": 5}, "prompt_cache_key"),
    ({"safety_identifier": {"id": "u"}}, "safety_identifier"),
    ({"text": {"verbosity": "terse"}}, "text.verbosity"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": False}, "top_logprobs"),
    ({"stream": "yes", "stream_options": {"include_obfuscation": False}}, "stream"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # only beside "stream": true
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_1"}]}, "input[1].type"),
])
def test_refusals_name_the_responses_field(server, fields, param):
    status, _, text = post(server, {"model": MODEL, "input": "Hi", **fields})
    assert 400 <= status < 500, text
    error = json.loads(text)["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["type"] == "invalid_request_error"
    for chat_field in ("max_completion_tokens", "response_format", "messages", ".function."):
        assert chat_field not in error["message"], error  # what the client sent, not the chat request it became


def test_an_item_reference_is_refused_with_what_to_send_instead(server):
    """The AI SDK refers to earlier output items by id unless told its responses are not stored."""
    status, _, text = post(server, {"model": MODEL, "input": [
        {"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_1"}]})
    assert status == 400 and '"store": false' in json.loads(text)["error"]["message"], text


def test_what_clients_send_that_changes_nothing_here_leaves_the_response_as_it_is(server):
    """Settings OpenAI's models read and tc's have no use for, sent by clients on every request (Wave Terminal's
    stream_options and text.verbosity, Codex's verbosity), nulls for fields tc does not implement (what a wrapper
    passes for its unset settings), and the extra readings openai's responses.parse() sends back with its output
    items: the same output; verbosity is echoed as OpenAI echoes it."""
    def output(stream: bool = False, **fields) -> tuple[list, dict]:
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 6, "temperature": 0, **fields}
        if stream:
            done = stream_events(server, body)[-1]
            assert done["type"] == "response.incomplete", done  # cut at max_output_tokens, as unstreamed
            response = done["response"]
        else:
            status, _, text = post(server, body)
            assert status == 200, text
            response = json.loads(text)
        return [item["content"] for item in response["output"]], response["text"]

    plain, text = output()
    assert text == {"format": {"type": "text"}}
    assert output(text={"verbosity": "low"}) == (plain, {"format": {"type": "text"}, "verbosity": "low"})
    assert output(max_tool_calls=None, stream_options=None, top_logprobs=None, top_p=None) == (plain, text)
    assert output(top_logprobs=0) == (plain, text)
    # what clients that keep no state on the server (store false: Codex-style agents, OpenHands) ask for every time
    assert output(include=["reasoning.encrypted_content"], store=False) == (plain, text)
    assert output(include=[]) == (plain, text)
    for obfuscation in (False, True):
        assert output(True, stream_options={"include_obfuscation": obfuscation}) == (plain, text)
    earlier = [{"role": "user", "content": "Hi"},
               {"type": "message", "role": "assistant", "content": [
                   {"type": "output_text", "text": "{}", "annotations": [], "parsed": {}}]},
               {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"id": 1}',
                "parsed_arguments": {"id": 1}},
               {"type": "function_call_output", "call_id": "c1", "output": "none"}]
    bare = [{k: v for k, v in item.items() if k not in ("parsed_arguments",)} for item in earlier]
    bare[1]["content"] = [{"type": "output_text", "text": "{}", "annotations": []}]
    assert output(input=earlier, tools=[LOOKUP]) == output(input=bare, tools=[LOOKUP])


def test_the_routing_and_abuse_hints_a_client_sends_leave_the_response_as_it_is(server):
    """OpenAI's prompt_cache_key and safety_identifier (Codex sends the first), and the default service tier."""
    def output(**fields) -> list:
        status, _, text = post(server, {"model": MODEL, "input": "Hi", "max_output_tokens": 6, "temperature": 0,
                                        **fields})
        assert status == 200, text
        return [item["content"] for item in json.loads(text)["output"]]

    assert output(prompt_cache_key="conversation-1", safety_identifier="user-7f3a", service_tier="auto") == output()


@pytest.mark.parametrize("field, value", [("min_p", 0.05), ("top_k", 20), ("seed", 1), ("stop", "x")])
def test_chat_s_own_sampling_fields_are_refused_with_where_they_are_taken(server, field, value):
    """Chat takes them and the Responses API has no name for them: the refusal says where to send them, not that
    the server does not implement them."""
    status, _, text = post(server, {"model": MODEL, "input": "Hi", field: value})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == field and error["code"] == "unsupported_parameter", error
    assert "/v1/chat/completions does" in error["message"] and "does not implement" not in error["message"], error


def test_the_openai_client_raises_on_a_refusal(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert "send the whole conversation in 'input'" in raised.value.message


def test_a_stream_that_fails_midway_ends_with_response_failed(model, model_dir):
    failing = serve(model, model_dir, LosesWorkerAtDecode(model.stages))
    try:
        events = stream_events(failing, {"input": "Hello there", "max_output_tokens": 10, "temperature": 0})
    finally:
        failing.stop()
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_error" and "w1" in last["response"]["error"]["message"]
    assert not any(e["type"] == "response.completed" for e in events)
