"""Tool calling on /v1/chat/completions: the request fields, the prompt the template writes, and the reply."""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import openai
import pytest
import torch
from falcon import testing
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from model_helpers import OurModel
from tiny_model import byte_tokenizer, write_tiny_model
from tc.generation import Completion, CompletionText, Generator, Step
from tc.head.api import create_app
from tc.head.api_requests import MessageToolCall, RequestError, ToolChoice, parse_chat_request
from tc.head.http_server import start_http_server
from tc.head.service import GenerationService, Readiness
from tc.head.streaming import ChatReply, ReplyContext, TokenText, ToolCalling, new_call_id
from tc.head.tool_calls import marker_tokens, parse_tool_calls
from tc.model.chat_template import ChatTemplates
from tc.model.tokenizer import TextTokenizer

QWEN_TEMPLATE = (Path(__file__).parent / "qwen25_chat_template.jinja").read_text(encoding="utf-8")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = {"role": "user", "content": "What's the weather like in Paris today?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18}'}


# --- the request -------------------------------------------------------------------------------------------------

def test_tools_default_to_auto_and_none_without_tools():
    request = parse_chat_request({"model": "m", "messages": [ASK], "tools": [WEATHER, TIME]})
    assert request.tool_choice == ToolChoice("auto") and request.parallel_tool_calls
    assert [t.name for t in request.offered_tools] == ["get_weather", "get_time"]
    assert request.tools[0].as_template_input() == WEATHER
    assert parse_chat_request({"model": "m", "messages": [ASK]}).tool_choice == ToolChoice("none")


@pytest.mark.parametrize(("choice", "offered"), [
    ("none", []), ("auto", ["get_weather", "get_time"]), ("required", ["get_weather", "get_time"]),
    ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
])
def test_tool_choice_decides_the_tools_shown(choice, offered):
    request = parse_chat_request({"model": "m", "messages": [ASK], "tools": [WEATHER, TIME], "tool_choice": choice,
                                  "parallel_tool_calls": False})
    assert [t.name for t in request.offered_tools] == offered
    assert not request.parallel_tool_calls


def test_allowed_tools_hold_auto_and_required_to_the_tools_named():
    """OpenAI's allowed_tools: the tools list stays whole (a client's prompt cache holds) and a request allows some;
    it was a 400. Only the allowed are shown, and "required" calls one of them."""
    def allowed(mode, *names):
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
            {"type": "function", "function": {"name": name}} for name in names]}}

    request = parse_chat_request({"model": "m", "messages": [ASK], "tools": [WEATHER, TIME],
                                  "tool_choice": allowed("auto", "get_time")})
    assert request.tool_choice == ToolChoice("auto", allowed=("get_time",))
    assert [t.name for t in request.offered_tools] == ["get_time"]
    request = parse_chat_request({"model": "m", "messages": [ASK], "tools": [WEATHER, TIME],
                                  "tool_choice": allowed("required", "get_weather", "get_time")})
    assert request.tool_choice.mode == "required" and len(request.offered_tools) == 2
    for choice, said in [(allowed("auto", "launch"), "names the function \"launch\", which is not in 'tools'"),
                         (allowed("none", "get_time"), "use \"auto\" or \"required\""),
                         ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "non-empty")]:
        with pytest.raises(RequestError, match=re.escape(said)):
            parse_chat_request({"model": "m", "messages": [ASK], "tools": [WEATHER, TIME], "tool_choice": choice})


def test_assistant_calls_and_tool_results_reach_the_template_as_transformers_expects():
    request = parse_chat_request({"model": "m", "messages": [ASK, CALLED, ANSWERED]})
    assistant, tool = (m.as_template_input() for m in request.messages[1:])
    assert request.messages[1].tool_calls == (MessageToolCall("call_1", "get_weather", '{"location": "Paris"}'),)
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]}
    assert tool == {"role": "tool", "content": '{"temperature_c": 18}', "tool_call_id": "call_1"}


def test_a_message_object_sent_back_by_the_openai_client_is_accepted():
    echoed = {**CALLED, "refusal": None, "function_call": None, "audio": None, "annotations": []}
    assert parse_chat_request({"model": "m", "messages": [ASK, echoed, ANSWERED]}).messages[1].tool_calls


def test_prompt_cache_hints_are_taken_and_change_nothing():
    """Anthropic's cache_control on a message, a text part and a tool (Roo Code, Cline, qwen-code, LiteLLM): a 400
    before; the request reads as it does without them."""
    hint = {"type": "ephemeral"}
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": hint}]}
    plain = {"model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                        ASK, CALLED, ANSWERED], "tools": [WEATHER]}
    hinted = {**plain, "messages": [system, {**ASK, "cache_control": hint}, CALLED, ANSWERED],
              "tools": [{**WEATHER, "cache_control": hint}]}
    got, want = parse_chat_request(hinted), parse_chat_request(plain)
    assert [m.as_template_input() for m in got.messages] == [m.as_template_input() for m in want.messages]
    assert got.offered_tools == want.offered_tools


# --- the prompt, through the API on the tiny model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def generator(tmp_path_factory) -> Generator:
    # a byte-level vocabulary spells a prompt with tools in about a thousand tokens
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tools"), seed=0, max_position_embeddings=2048)
    model = OurModel(model_dir)
    tokenizer = TextTokenizer.load(model_dir)
    # the tiny model with Qwen2.5's own template, which shows tools and renders calls and results
    tokenizer = dataclasses.replace(tokenizer, chat_templates=ChatTemplates({"default": QWEN_TEMPLATE}, "qwen"))
    return Generator(model.head, tokenizer, model.pipeline(), torch.float32)


@pytest.fixture(scope="module")
def client(generator) -> testing.TestClient:
    service = GenerationService("tiny", generator.tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    return testing.TestClient(create_app(service))


@pytest.fixture(scope="module")
def openai_client(generator):
    service = GenerationService("tiny", generator.tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    server = start_http_server(create_app(service), "127.0.0.1", 0, threads=2)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    server.stop()


def prompt_tokens(client, **body) -> int:
    reply = client.simulate_post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, **body})
    assert reply.status_code == 200, reply.text
    return reply.json["usage"]["prompt_tokens"]


def rendered_length(generator, messages, tools=None) -> int:
    return len(generator.tokenizer.encode(generator.tokenizer.apply_chat_template(messages, tools=tools)))


def test_the_template_shows_the_offered_tools(client, generator):
    assert prompt_tokens(client, messages=[ASK], tools=[WEATHER, TIME]) == rendered_length(
        generator, [ASK], [WEATHER, TIME])
    assert prompt_tokens(client, messages=[ASK], tools=[WEATHER, TIME], tool_choice="none") == rendered_length(
        generator, [ASK])
    named = {"type": "function", "function": {"name": "get_time"}}
    assert prompt_tokens(client, messages=[ASK], tools=[WEATHER, TIME], tool_choice=named) == rendered_length(
        generator, [ASK], [TIME])


def test_a_conversation_with_calls_and_results_renders(client, generator):
    template_input = [ASK, {**CALLED, "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]},
        ANSWERED]
    prompt = generator.tokenizer.apply_chat_template(template_input, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n{\"temperature_c\": 18}\n</tool_response>" in prompt
    assert prompt_tokens(client, messages=[ASK, CALLED, ANSWERED], tools=[WEATHER]) == rendered_length(
        generator, template_input, [WEATHER])


def test_required_among_allowed_tools_calls_an_allowed_one(openai_client):
    reply = openai_client.chat.completions.create(
        model="tiny", messages=[ASK], tools=[WEATHER, TIME], max_tokens=60, temperature=1.0, seed=3,
        parallel_tool_calls=False, tool_choice={"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and reply.choices[0].finish_reason == "tool_calls"


def test_an_assistant_turn_with_no_calls_and_no_content_is_an_empty_turn(openai_client, generator):
    """Servers that answer "tool_calls": [] on every reply (vLLM does) send a reply without text as content null; a
    client sends that message back as it got it, and it was refused for its missing content."""
    empty = {"role": "assistant", "content": None, "tool_calls": []}
    again = {"role": "user", "content": "And tomorrow?"}
    reply = openai_client.chat.completions.create(model="tiny", messages=[ASK, empty, again], max_tokens=1)
    assert reply.usage.prompt_tokens == rendered_length(generator, [ASK, {"role": "assistant", "content": ""}, again])


class Lookup(BaseModel):
    id: int


def test_the_openai_clients_parsed_messages_sent_back_as_they_are_continue_the_conversation(openai_client):
    # parse() and stream() add their own readings to the message (parsed, parsed_arguments, a streamed call's
    # index); the client sends them back with it. The forced call (by the grammar) makes the random model call.
    tools = [openai.pydantic_function_tool(Lookup)]
    asked = [{"role": "user", "content": "Look up item 7."}]
    forced = dict(model="tiny", tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                  seed=1)
    whole = openai_client.chat.completions.parse(messages=asked, **forced).choices[0].message
    with openai_client.chat.completions.stream(messages=asked, **forced) as stream:
        streamed = stream.get_final_completion().choices[0].message
    for message in (whole, streamed):
        (call,) = message.tool_calls
        assert isinstance(call.function.parsed_arguments, Lookup)
        answered = [*asked, message, {"role": "tool", "tool_call_id": call.id, "content": "found"}]
        follow = openai_client.chat.completions.create(model="tiny", messages=answered, tools=tools, max_tokens=2)
        assert follow.choices[0].message.role == "assistant"
    formatted = openai_client.chat.completions.parse(model="tiny", messages=asked, response_format=Lookup,
                                                     max_tokens=200, seed=1).choices[0].message
    assert isinstance(formatted.parsed, Lookup)
    follow = openai_client.chat.completions.create(
        model="tiny", messages=[*asked, formatted, {"role": "user", "content": "And item 8?"}], max_tokens=2)
    assert follow.choices[0].message.role == "assistant"


# --- the reply, from what the model wrote ---------------------------------------------------------------------------

def completion(text: str, finish: str = "stop") -> Completion:
    return Completion((), text, finish, 10, 0.0, 0.0)


def chat_reply(tiny_model_dir, names=("get_weather", "get_time"), parallel=True) -> ChatReply:
    counter = itertools.count()
    tools = ToolCalling(dict.fromkeys(names), parallel, new_id=lambda: f"call_{next(counter)}")
    return ChatReply(ReplyContext("chatcmpl-1", 0, "tiny"), TokenText(TextTokenizer.load(tiny_model_dir)),
                     logprobs=None, tools=tools)


CALL_TEXT = '{"name": "get_weather", "arguments": {"location": "Paris"}}'
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_whole_reply_carries_the_call(tiny_model_dir):
    body = chat_reply(tiny_model_dir).whole(completion(CALL_TEXT))
    message = ChatCompletion.model_validate(body).choices[0].message
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message.content is None
    (call,) = message.tool_calls
    assert (call.id, call.type, call.function.name, json.loads(call.function.arguments)) == (
        "call_0", "function", "get_weather", {"location": "Paris"})


def test_whole_reply_without_a_call_is_text_as_written(tiny_model_dir):
    text = "The weather in Paris is sunny."
    body = chat_reply(tiny_model_dir).whole(completion(text, "length"))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == "length"


def test_parallel_tool_calls_false_keeps_the_first_call(tiny_model_dir):
    body = chat_reply(tiny_model_dir, parallel=False).whole(completion(TWO_CALLS))
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    body = chat_reply(tiny_model_dir).whole(completion(TWO_CALLS))
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["get_weather", "get_time"]


def stream_chunks(reply: ChatReply, text: str, piece: int) -> list[dict]:
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    chunks = reply.opening(Step("", ()))
    for part in pieces[:-1]:
        chunks += reply.deltas(Step(part, ()))
    done = completion(text)
    chunks += reply.deltas(Step(pieces[-1], (), done))
    return chunks + reply.closing(done)


XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</function>\n"
            "</tool_call>")


@pytest.mark.parametrize("text", [CALL_TEXT, TWO_CALLS, "Let me check.\n" + TWO_CALLS, "No calls here.",
                                  "[]\n" + CALL_TEXT, "Let me check.\n" + XML_CALL + "\n" + XML_CALL])
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_streamed_deltas_join_into_the_whole_reply(tiny_model_dir, text, piece):
    whole = ChatCompletion.model_validate(chat_reply(tiny_model_dir).whole(completion(text)))
    state = ChatCompletionStreamState()
    for chunk in stream_chunks(chat_reply(tiny_model_dir), text, piece):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    streamed = state.get_final_completion()
    assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason
    assert (streamed.choices[0].message.content or None) == whole.choices[0].message.content
    assert [(c.id, c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []] == \
        [(c.id, c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]


def test_each_streamed_call_is_a_header_then_its_arguments(tiny_model_dir):
    chunks = stream_chunks(chat_reply(tiny_model_dir), CALL_TEXT, 5)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert deltas == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"location": "Paris"}'}}]},
    ]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


# --- the deprecated form: functions, function_call and function messages -------------------------------------------

FUNCTIONS = [WEATHER["function"], TIME["function"]]
LEGACY_CALLED = {"role": "assistant", "content": None,
                 "function_call": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}
LEGACY_ANSWERED = {"role": "function", "name": "get_weather", "content": '{"temperature_c": 18}'}


def test_functions_are_tools_with_one_call_a_turn():
    request = parse_chat_request({"model": "m", "messages": [ASK], "functions": FUNCTIONS})
    assert request.legacy_functions and not request.parallel_tool_calls
    assert request.tool_choice == ToolChoice("auto") and request.tools == parse_chat_request(
        {"model": "m", "messages": [ASK], "tools": [WEATHER, TIME]}).tools
    assert parse_chat_request({"model": "m", "messages": [ASK], "functions": FUNCTIONS,
                               "function_call": {"name": "get_time"}}).tool_choice == ToolChoice("function", "get_time")
    assert parse_chat_request({"model": "m", "messages": [ASK], "functions": FUNCTIONS,
                               "function_call": "none"}).offered_tools == ()
    assert not parse_chat_request({"model": "m", "messages": [ASK], "tools": [WEATHER]}).legacy_functions
    # an empty list is none (clients send [] for none), beside tools too; "auto" with no functions offers none
    assert not parse_chat_request({"model": "m", "messages": [ASK], "tools": [WEATHER], "functions": []}
                                  ).legacy_functions
    assert parse_chat_request({"model": "m", "messages": [ASK], "function_call": "auto"}).offered_tools == ()


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"functions": FUNCTIONS, "tools": [WEATHER]}, "functions", "cannot be combined with 'tools'"),
    ({"functions": FUNCTIONS, "tool_choice": "auto"}, "functions", "cannot be combined with 'tool_choice'"),
    ({"tools": [WEATHER], "function_call": "auto"}, "function_call", "cannot be combined with 'tools'"),
    ({"functions": FUNCTIONS, "function_call": "required"}, "function_call", '"none", "auto" or {"name": ...}'),
    ({"functions": FUNCTIONS, "function_call": {"name": "nope"}}, "function_call.name", "not in 'functions'"),
    ({"tools": [WEATHER], "function_call": "none"}, "function_call", "cannot be combined with 'tools'"),
    ({"functions": FUNCTIONS, "parallel_tool_calls": True}, "parallel_tool_calls", "one function_call"),
    ({"functions": FUNCTIONS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ({"functions": [WEATHER]}, "functions[0].type", "unsupported field"),
    ({"functions": [WEATHER["function"], WEATHER["function"]]}, "functions[1].name", "repeats the function name"),
])
def test_the_deprecated_form_is_refused_where_it_says_two_things(extra, param, words):
    with pytest.raises(RequestError) as caught:
        parse_chat_request({"model": "m", "messages": [ASK], **extra})
    assert caught.value.param == param and words in str(caught.value), caught.value


def test_function_messages_answer_the_call_before_them():
    later = {"role": "assistant", "content": None,
             "function_call": {"name": "get_weather", "arguments": '{"location": "Rome"}'}}
    request = parse_chat_request({"model": "m", "messages": [
        ASK, LEGACY_CALLED, LEGACY_ANSWERED, later, {**LEGACY_ANSWERED, "content": None},
        {"role": "function", "name": "get_time", "content": "noon"}]})
    first, second = request.messages[1].tool_calls[0], request.messages[3].tool_calls[0]
    assert (first, second.id) == (MessageToolCall("000000001", "get_weather", '{"location": "Paris"}'), "000000003")
    assert [(m.role, m.tool_call_id, m.name, m.content) for m in (request.messages[i] for i in (2, 4, 5))] == [
        ("tool", "000000001", "get_weather", '{"temperature_c": 18}'), ("tool", "000000003", "get_weather", ""),
        ("tool", None, "get_time", "noon")]  # a result of no call stays as it came
    # what a template that pairs them by id (Mistral's) is handed
    assert request.messages[1].as_template_input()["tool_calls"][0]["id"] == "000000001"
    assert request.messages[2].as_template_input() == {"role": "tool", "content": '{"temperature_c": 18}',
                                                       "name": "get_weather", "tool_call_id": "000000001"}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "function", "content": "x"}, "messages[1].name"),
    ({"role": "function", "name": "f", "content": "x", "tool_call_id": "c"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}, "messages[1].function_call"),
    ({**CALLED, "function_call": {"name": "f", "arguments": "{}"}}, "messages[1].function_call"),
    ({**LEGACY_CALLED, "function_call": {"name": "f"}}, "messages[1].function_call.arguments"),
])
def test_malformed_function_messages_are_refused_by_name(message, param):
    with pytest.raises(RequestError) as caught:
        parse_chat_request({"model": "m", "messages": [ASK, message]})
    assert caught.value.param == param, caught.value


def test_a_deprecated_conversation_renders_as_its_tools_form(client, generator):
    """Qwen2.5's template writes neither ids nor names of results: the two forms are one prompt."""
    assert prompt_tokens(client, messages=[ASK, LEGACY_CALLED, LEGACY_ANSWERED], functions=[WEATHER["function"]]) == \
        prompt_tokens(client, messages=[ASK, CALLED, ANSWERED], tools=[WEATHER])
    assert prompt_tokens(client, messages=[ASK], functions=FUNCTIONS, function_call={"name": "get_time"}) == \
        rendered_length(generator, [ASK], [TIME])


def legacy_reply(tiny_model_dir) -> ChatReply:
    tools = ToolCalling(dict.fromkeys(("get_weather", "get_time")), parallel=False, legacy=True)
    return ChatReply(ReplyContext("chatcmpl-1", 0, "tiny"), TokenText(TextTokenizer.load(tiny_model_dir)),
                     logprobs=None, tools=tools)


def test_a_reply_to_functions_carries_one_function_call(tiny_model_dir):
    body = legacy_reply(tiny_model_dir).whole(completion(TWO_CALLS))
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '{"location": "Paris"}'}}
    plain = legacy_reply(tiny_model_dir).whole(completion("Sunny."))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
    assert plain["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_a_streamed_function_call_is_its_name_then_its_arguments(tiny_model_dir, piece):
    chunks = stream_chunks(legacy_reply(tiny_model_dir), "Checking.\n" + TWO_CALLS, piece)
    deltas = [c["choices"][0]["delta"]["function_call"] for c in chunks if "function_call" in c["choices"][0]["delta"]]
    assert deltas == [{"name": "get_weather", "arguments": ""}, {"arguments": '{"location": "Paris"}'}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"
    state = ChatCompletionStreamState()  # the openai client's own joining of a stream
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    message = state.get_final_completion().choices[0].message
    whole = ChatCompletion.model_validate(legacy_reply(tiny_model_dir).whole(completion("Checking.\n" + TWO_CALLS)))
    assert message.function_call == whole.choices[0].message.function_call
    assert message.content == whole.choices[0].message.content == "Checking."


def test_the_openai_client_gets_and_sends_back_a_function_call(openai_client):
    """The deprecated form end to end through the openai client: a function_call forced by name (the grammar makes
    the random model call), its result sent back as a function message, and the conversation goes on."""
    asked = [{"role": "user", "content": "Look up item 7."}]
    lookup = {"name": "lookup", "parameters": {"type": "object", "properties": {"id": {"type": "integer"}},
                                               "required": ["id"], "additionalProperties": False}}
    reply = openai_client.chat.completions.create(model="tiny", messages=asked, functions=[lookup],
                                                  function_call={"name": "lookup"}, max_tokens=200, seed=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call.name == "lookup"
    assert isinstance(json.loads(choice.message.function_call.arguments)["id"], int)
    streamed = openai_client.chat.completions.create(model="tiny", messages=asked, functions=[lookup],
                                                     function_call={"name": "lookup"}, max_tokens=200, seed=1,
                                                     stream=True)
    parts = [c.choices[0].delta.function_call for c in streamed if c.choices and c.choices[0].delta.function_call]
    assert parts[0].name == "lookup" and "".join(p.arguments for p in parts) == choice.message.function_call.arguments
    answered = [*asked, choice.message, {"role": "function", "name": "lookup", "content": "found"}]
    follow = openai_client.chat.completions.create(model="tiny", messages=answered, functions=[lookup], max_tokens=2)
    assert follow.choices[0].message.role == "assistant"


# --- call markers that are special tokens ---------------------------------------------------------------------------

SPECIAL_MARKERS = ["[TOOL_CALLS]", "[ARGS]", "<|START_ACTION|>", "<|END_ACTION|>"]  # special in their tokenizers


@pytest.fixture(scope="module")
def marker_model_dir(tmp_path_factory) -> Path:
    """The tiny model with Mistral's and Command R7B's call markers as special tokens (ids 259..262), and
    Hermes' as plain added tokens (263, 264), as Qwen's tokenizer has them."""
    model_dir = write_tiny_model(tmp_path_factory.mktemp("markers"), seed=0, max_position_embeddings=2048)
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens(SPECIAL_MARKERS)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


def decoded_reply(tokenizer: TextTokenizer, text: str, kept: frozenset[int]) -> str:
    """The reply's text as the generation loop decodes it, token by token, from the ids of `text`."""
    reply = CompletionText(tokenizer, (), (), kept)
    for token in tokenizer.encode(text):
        reply.push(token, None)
    return reply.finish()[0]


@pytest.mark.parametrize("text", ['[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}',
                                  'I will check.<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
                                  '"parameters": {"location": "Paris"}}]<|END_ACTION|>'])
def test_a_reply_keeps_the_call_markers_its_tokenizer_marks_special(marker_model_dir, text):
    """Decoding drops special tokens, so a call written with Mistral's [ARGS] form or Command R7B's action block
    reached the parser as `get_weather{"location": "Paris"}`: text, the call lost. Those markers now stay."""
    tokenizer = TextTokenizer.load(marker_model_dir)
    markers = marker_tokens(tokenizer)
    assert markers == {tokenizer.token_id(m) for m in SPECIAL_MARKERS}  # Hermes' are text already
    names = {"get_weather": WEATHER["function"]["parameters"]}
    assert parse_tool_calls(decoded_reply(tokenizer, text, frozenset()), names, new_call_id).calls == ()
    kept = decoded_reply(tokenizer, text, markers)
    assert kept == text
    (call,) = parse_tool_calls(kept, names, new_call_id).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"location": "Paris"})


def test_a_reply_to_a_request_with_tools_keeps_the_markers_through_the_api(marker_model_dir):
    """Through the HTTP API: the model made to write [TOOL_CALLS] (logit_bias) keeps its text where the request
    offers tools; a reply to one without tools leaves special tokens out, as before."""
    model = OurModel(marker_model_dir)
    tokenizer = TextTokenizer.load(marker_model_dir)
    tokenizer = dataclasses.replace(tokenizer, chat_templates=ChatTemplates({"default": QWEN_TEMPLATE}, "qwen"))
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32)
    service = GenerationService("tiny", tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    client = testing.TestClient(create_app(service))
    marker = tokenizer.token_id("[TOOL_CALLS]")
    body = {"model": "tiny", "messages": [ASK], "max_tokens": 2, "logit_bias": {str(marker): 100}}
    with_tools = client.simulate_post("/v1/chat/completions", json={**body, "tools": [WEATHER]})
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json["choices"][0]["message"]["content"] == "[TOOL_CALLS][TOOL_CALLS]"
    without = client.simulate_post("/v1/chat/completions", json=body)
    assert without.json["choices"][0]["message"]["content"] == ""
