"""Structured output and forced tool calls by constrained decoding, on a tiny random model.

A random model follows no instructions, so whatever it writes that is valid comes from the grammar alone.
"""
from __future__ import annotations

import json
import sys

import jsonschema
import openai
import pytest
import torch
from falcon import testing

from model_helpers import OurModel
from tiny_model import write_tiny_model
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.http_server import start_http_server
from tc.constraint import GrammarEngine, GrammarError
from tc.head.api_requests import Tool
from tc.head.service import GenerationService, Readiness
from tc.head.structured_output import call_schema, placed
from tc.model.tokenizer import TextTokenizer

CHAT = "/v1/chat/completions"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "tags", "active"], "additionalProperties": False}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["id"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.fixture(scope="module")
def generator(tmp_path_factory) -> Generator:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("structured"), seed=0, max_position_embeddings=1024)
    model = OurModel(model_dir)
    return Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32)


def make_client(generator) -> testing.TestClient:
    service = GenerationService("tiny", generator.tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    return testing.TestClient(create_app(service))


@pytest.fixture(scope="module")
def client(generator) -> testing.TestClient:
    return make_client(generator)


def chat(client, **body) -> dict:
    reply = client.simulate_post(CHAT, json={"model": "tiny", "max_tokens": 300,
                                             "messages": [{"role": "user", "content": "Describe someone."}], **body})
    assert reply.status_code == 200, reply.text
    return reply.json


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize(("temperature", "seed"), [(0, None), (0.7, 1), (1.0, 2), (1.3, 3), (2.0, 4)])
def test_json_schema_replies_validate(client, temperature, seed):
    body = chat(client, response_format=schema_format(PERSON), temperature=temperature, seed=seed)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_object_replies_are_objects(client):
    for seed in range(3):
        body = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=600)
        content = body["choices"][0]["message"]["content"]
        if body["choices"][0]["finish_reason"] == "stop":  # any object: a random model may write a long one
            assert isinstance(json.loads(content), dict)
        else:
            assert content.startswith("{")


def test_a_continued_message_s_continuation_is_what_the_schema_constrains(client, generator):
    """response_format beside continue_final_message, as vLLM takes them: the grammar constrains what is generated,
    which is the reply's content, not the prefilled text it goes on from."""
    messages = [{"role": "user", "content": "Describe someone."}, {"role": "assistant", "content": "Here it is:"}]
    tokenizer = generator.tokenizer
    prompt = tokenizer.apply_chat_template(messages[:1]) + messages[1]["content"]
    body = chat(client, messages=messages, continue_final_message=True, response_format=schema_format(PERSON),
                temperature=0)
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))
    assert body["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)


def events(client, body: dict) -> list[dict]:
    reply = client.simulate_post(CHAT, json={"model": "tiny", "stream": True, **body})
    assert reply.status_code == 200, reply.text
    data = [line[6:] for line in reply.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_streamed_structured_reply_equals_the_whole_one(client):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 300, "temperature": 0.9, "seed": 7,
            "response_format": schema_format(PERSON)}
    whole = chat(client, **body)["choices"][0]["message"]["content"]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events(client, body))
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_always_returns_calls_with_valid_arguments(client, seed):
    body = chat(client, tools=[LOOKUP, PING], tool_choice="required", temperature=1.0, seed=seed)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    for call in choice["message"]["tool_calls"]:
        tool = {"lookup": LOOKUP, "ping": PING}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


def test_named_tool_choice_calls_that_tool_once(client):
    body = chat(client, tools=[LOOKUP, PING], tool_choice={"type": "function", "function": {"name": "lookup"}},
                temperature=1.0, seed=5)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup"
    jsonschema.validate(json.loads(call["function"]["arguments"]), LOOKUP["function"]["parameters"])


def test_required_without_parallel_calls_makes_one_call(client):
    for seed in range(3):
        body = chat(client, tools=[LOOKUP, PING], tool_choice="required", parallel_tool_calls=False,
                    temperature=1.0, seed=seed)
        assert len(body["choices"][0]["message"]["tool_calls"]) == 1


def test_streamed_forced_call_arrives_as_deltas(client):
    chunks = events(client, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 300, "seed": 3,
                             "tools": [LOOKUP], "tool_choice": "required", "parallel_tool_calls": False})
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert deltas[0]["function"]["name"] == "lookup" and len(deltas[0]["id"]) == 9
    jsonschema.validate(json.loads("".join(d["function"]["arguments"] for d in deltas)),
                        LOOKUP["function"]["parameters"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
])
def test_unsupported_schema_features_are_refused_by_name(client, schema, named):
    reply = client.simulate_post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                             "response_format": schema_format(schema)})
    assert reply.status_code == 400, reply.text
    error = reply.json["error"]
    assert error["param"] == "response_format.json_schema.schema" and error["code"] == "invalid_value"
    assert named in error["message"]


BROKEN_TOOL = {"type": "function", "function": {"name": "broken", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}


@pytest.mark.parametrize("fields", [
    {"tool_choice": "auto", "response_format": {"type": "json_object"}},
    {"tool_choice": "auto", "response_format": schema_format(PERSON)},
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "broken"}}},
], ids=["auto+json_object", "auto+json_schema", "required", "named"])
def test_a_tool_schema_the_engine_refuses_is_blamed_on_that_tool(client, fields):
    """The grammar joins the tools' calls and the reply's format into one schema; a broken tool's parameters
    were blamed on 'response_format.json_schema.schema' (a field a json_object request does not even have),
    and for several calls the message quoted the engine's whole grammar rather than what is wrong."""
    reply = client.simulate_post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                             "tools": [LOOKUP, BROKEN_TOOL], **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json["error"]
    assert error["param"] == "tools" and error["code"] == "invalid_value"
    assert "'tools[1].function.parameters'" in error["message"] and "uniqueItems" in error["message"]
    assert "start:" not in error["message"]  # not the engine's grammar


INVALID_TOOL = {"type": "function", "function": {"name": "invalid", "parameters": {
    "type": "object", "properties": {"a": {"type": "text"}}}}}


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "invalid"}}],
                         ids=["auto", "required", "named"])
def test_a_tool_schema_that_is_no_json_schema_is_refused_whatever_the_tool_choice(generator, choice):
    """Under "auto" no grammar follows the tools' parameters, so a schema that is none (a type JSON does not have)
    went to the model unchecked, served; the same request with a forced call was a 400."""
    service = GenerationService("tiny", generator.tokenizer, generator, lambda: Readiness(1, ("w",), ()))
    server = start_http_server(create_app(service), "127.0.0.1", 0, threads=2)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                           tools=[LOOKUP, INVALID_TOOL], tool_choice=choice)
        assert info.value.body["param"] == "tools" and info.value.code == "invalid_value"
        assert "'tools[1].function.parameters'" in info.value.message and "text" in info.value.message
        # what only a grammar needs is not asked of a schema no grammar follows: a keyword the engine does not
        # implement, a pattern in ECMAScript's regex dialect (look-ahead) that the engine's does not read
        unforced = {"type": "function", "function": {"name": "unforced", "parameters": {
            "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True},
                                             "b": {"type": "string", "pattern": "^(?!x)"}}}}}
        if choice == "auto":
            # ignore_eos: an unseeded draw of the random model may otherwise end the reply before its one token
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=1, tools=[LOOKUP, unforced], tool_choice=choice,
                                                   extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 1
    finally:
        server.stop()


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("levels", [150, 300, 450])
def test_a_schema_nested_past_what_the_engine_reads_is_a_400(client, levels):
    """However deep a schema nests (the body parser takes far more than the engine), the answer is a 400 that
    says why, for a reply's format and for a tool's parameters alike; 300 levels was once a RecursionError, a 500."""
    reply = client.simulate_post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                             "response_format": schema_format(_nested(levels))})
    assert reply.status_code == 400, reply.text
    error = reply.json["error"]
    assert error["param"] == "response_format.json_schema.schema" and error["code"] == "invalid_value"
    assert "levels deep" in error["message"] or "recursion limit" in error["message"]
    deep_tool = {"type": "function", "function": {"name": "deep", "parameters": _nested(levels)}}
    for parallel in (True, False):  # one call (json_schema) or several (json_sequence)
        reply = client.simulate_post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                 "tools": [deep_tool], "tool_choice": "required",
                                                 "parallel_tool_calls": parallel})
        assert reply.status_code == 400, reply.text
        assert reply.json["error"]["param"] == "tools" and reply.json["error"]["code"] == "invalid_value"


def test_a_schema_as_deep_as_the_engine_reads_is_served(client):
    """The nesting bound refuses nothing the engine would take: 60 levels (121 objects within one another)."""
    reply = chat(client, max_tokens=4, response_format=schema_format(_nested(60)))
    assert reply["choices"][0]["message"]["content"].startswith('{"a"')


def test_without_the_grammar_engine_response_format_names_the_package(generator, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # what an absent package looks like to `import`
    client = make_client(generator)
    reply = client.simulate_post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                             "response_format": {"type": "json_object"}})
    assert reply.status_code == 400, reply.text
    assert reply.json["error"]["param"] == "response_format"
    assert "pip install llguidance" in reply.json["error"]["message"]
    # a forced call is still served, steered by the template alone
    reply = client.simulate_post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                             "tools": [PING], "tool_choice": "required", "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    assert reply.json["choices"][0]["message"]["content"] is not None  # a random model's text is no call


def test_a_number_the_schema_leaves_unbounded_cannot_run_on_for_ever(generator):
    """The grammar stops an unbounded number at NUMBER_BOUND: a model that only writes digits must close it."""
    from tc.constraint import NUMBER_BOUND, bound_numbers
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "k": {"type": "integer", "maximum": 7}},
              "required": ["n", "k"], "additionalProperties": False}
    assert bound_numbers(schema)["properties"]["n"] == {"type": "number", "minimum": -NUMBER_BOUND,
                                                        "maximum": NUMBER_BOUND}
    assert bound_numbers(schema)["properties"]["k"] == {"type": "integer", "minimum": -NUMBER_BOUND, "maximum": 7}
    tokenizer = generator.tokenizer
    engine = GrammarEngine.load(tokenizer.tokenizer, generator.head.config.vocab_size,
                                tokenizer.eos_token_ids)
    state = engine.json_schema(schema).start()
    digits = {str(d): tokenizer.encode(str(d))[0] for d in range(10)}
    for token in tokenizer.encode('{"n": 1'):
        assert state.allowed()[token]
        state.advance(token)
    written = 1
    while written < 100 and state.allowed()[digits["9"]]:  # a model that wants only nines
        state.advance(digits["9"])
        written += 1
    assert written <= len(str(NUMBER_BOUND))  # the grammar closed the number before it passed the bound


# A tool's parameters as pydantic writes them for a nested model (openai.pydantic_function_tool, MCP servers, agent
# frameworks): the nested model in $defs, referred to from the document's root.
SHIP = {"type": "function", "function": {"name": "ship", "parameters": {
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
    "required": ["to"], "additionalProperties": False}}}


@pytest.mark.parametrize("fields", [
    {"tool_choice": "auto", "max_tokens": 1},
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": {"type": "function", "function": {"name": "ship"}}},
    {"tool_choice": "auto", "response_format": schema_format(SHIP["function"]["parameters"])},
], ids=["auto", "required", "named", "auto+json_schema"])
def test_tool_parameters_that_refer_to_their_own_definitions_are_served(client, fields):
    """A call's schema holds the tool's parameters under its "arguments", so a "$ref": "#/$defs/Address" written
    for the parameters' own root pointed into the call's schema, at nothing: every such request was a 400, under
    "auto" too, and beside a response_format the error blamed the format."""
    # one call where calls are forced: a sampled run of parallel calls may run to max_tokens and be cut, as text
    body = chat(client, tools=[LOOKUP, SHIP], temperature=1.0, seed=2, **fields)
    message = body["choices"][0]["message"]
    if "response_format" in fields and not message.get("tool_calls"):
        jsonschema.validate(json.loads(message["content"]), SHIP["function"]["parameters"])
    for call in message.get("tool_calls") or []:
        tool = {"lookup": LOOKUP, "ship": SHIP}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    if fields["tool_choice"] != "auto":
        assert message["tool_calls"], message


TREE = {"type": "object", "properties": {"label": {"type": "string"},
                                         "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["label", "children"], "additionalProperties": False}


def test_a_tool_s_own_references_keep_pointing_into_its_parameters_wherever_they_are_placed():
    """Placed under a call's "arguments", and the calls under an anyOf, each reference into the parameters' own
    document (recursive "#" included) is rewritten to where that document sits, and only those: an anchor, another
    document's, and "$ref" keys in data (a const) or naming a property are left as written."""
    tree = Tool(name="tree", parameters=TREE)
    tree_call = {"name": "tree", "arguments": {"label": "a", "children": [{"label": "b", "children": []}]}}
    call_as_child = {"name": "tree", "arguments": {"label": "a", "children": [tree_call]}}
    calls = [call_schema(Tool(name="x", parameters=None)), call_schema(tree)]
    for schema in (call_schema(tree), {"anyOf": [placed(call, f"/anyOf/{i}") for i, call in enumerate(calls)]}):
        jsonschema.validate(tree_call, schema)
        with pytest.raises(jsonschema.ValidationError):  # "#" is the tree, not the call around it
            jsonschema.validate(call_as_child, schema)
    kept = {"properties": {"$ref": {"const": {"$ref": "#/x"}}, "b": {"$ref": "#anchor"},
                           "c": {"$ref": "other.json#/a"}}, "items": [{"$ref": "#/$defs/A"}]}
    assert placed(kept, "/p") == {**kept, "items": [{"$ref": "#/p/$defs/A"}]}
    # a subschema with an $id is a document of its own: its references read from it, by "#" or by that $id
    with_ids = {"$id": "https://e/p.json", "properties": {"a": {"$ref": "#/$defs/A"},
                                                          "b": {"$ref": "https://e/p.json#/$defs/A"}},
                "$defs": {"A": {"type": "string"}, "a/b~": {"$id": "inner", "properties": {"c": {"$ref": "#"}}}}}
    assert placed(with_ids, "/p") == {"properties": {"a": {"$ref": "#/p/$defs/A"}, "b": {"$ref": "#/p/$defs/A"}},
                                      "$defs": {"A": {"type": "string"},
                                                "a/b~": {"properties": {"c": {"$ref": "#/p/$defs/a~1b~0"}}}}}


def test_tools_whose_parameters_carry_the_same_id_keep_their_own_definitions(client):
    """An `$id` makes a tool's parameters a document of their own, whose references the engine reads from it; kept
    under a call's schema, it sent a rewritten reference back into the parameters (a 400), and two tools with the
    same `$id` (one generator's output) read each other's definitions."""
    def tool(name: str, kind: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "$id": "urn:tool", "$defs": {"V": {"type": kind}}, "type": "object",
            "properties": {"v": {"$ref": "#/$defs/V"}}, "required": ["v"], "additionalProperties": False}}}
    tools = {"text": tool("text", "string"), "count": tool("count", "integer")}
    for seed in range(3):
        body = chat(client, tools=list(tools.values()), tool_choice="required", parallel_tool_calls=False,
                    temperature=1.0, seed=seed)
        for call in body["choices"][0]["message"]["tool_calls"]:
            value = json.loads(call["function"]["arguments"])["v"]
            assert isinstance(value, str if call["function"]["name"] == "text" else int), call


def test_a_one_of_whose_branches_overlap_is_read_as_any_of(client):
    """A number is also an integer's kind: the engine refused such a oneOf unless told to read it as anyOf, as
    OpenAI does and docs/api.md says tc does."""
    either = {"type": "function", "function": {"name": "either", "parameters": {
        "type": "object", "properties": {"v": {"oneOf": [{"type": "number"}, {"type": "integer"}]}},
        "required": ["v"], "additionalProperties": False}}}
    body = chat(client, tools=[either], tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=1)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert isinstance(json.loads(call["function"]["arguments"])["v"], (int, float))


# What pydantic writes for a set (uniqueItems) and what hand-written schemas hold (not, a format of their own):
# keywords the engine does not implement
LOOSE = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3, "uniqueItems": True},
    "note": {"type": "string", "maxLength": 10, "format": "no-such-format", "not": {"const": "x"}}},
    "required": ["tags", "note"], "additionalProperties": False}
FOLLOWED = {**LOOSE, "properties": {
    "tags": {key: value for key, value in LOOSE["properties"]["tags"].items() if key != "uniqueItems"},
    "note": {"type": "string", "maxLength": 10}}}


@pytest.mark.parametrize("strict", [False, True])
def test_keywords_the_engine_lacks_are_left_out_where_no_schema_is_strict(client, generator, strict):
    """OpenAI refuses what its strict mode lacks only in a strict schema, and holds one that is not to nothing: a
    pydantic set or a `not` in a schema that is not strict was a 400 here. Now such a reply follows the rest of
    the schema; a strict one is still refused, naming the keyword."""
    loose_tool = {"type": "function", "function": {"name": "tag", "parameters": LOOSE, "strict": strict}}
    fmt = {"type": "json_schema", "json_schema": {"name": "tags", "schema": LOOSE, "strict": strict}}
    # one call: a sampled run of parallel calls may run to max_tokens and be cut (the sequence grammar below)
    for fields in ({"response_format": fmt},
                   {"tools": [loose_tool], "tool_choice": "required", "parallel_tool_calls": False}):
        reply = client.simulate_post(CHAT, json={"model": "tiny", "max_tokens": 300, "temperature": 1.0, "seed": 4,
                                                 "messages": [{"role": "user", "content": "x"}], **fields})
        if strict:
            assert reply.status_code == 400 and "uniqueItems" in reply.json["error"]["message"], reply.text
            continue
        assert reply.status_code == 200, reply.text
        message = reply.json["choices"][0]["message"]
        text = message["tool_calls"][0]["function"]["arguments"] if "tools" in fields else message["content"]
        jsonschema.validate(json.loads(text), FOLLOWED)
    # the grammar of parallel calls takes the same leniency
    tokenizer = generator.tokenizer
    engine = GrammarEngine.load(tokenizer.tokenizer, generator.head.config.vocab_size,
                                tokenizer.eos_token_ids)
    calls = [(call_schema(Tool(name="tag", parameters=LOOSE)), not strict)]
    if strict:
        with pytest.raises(GrammarError, match="uniqueItems"):
            engine.json_sequence(calls)
    else:
        engine.json_sequence(calls)


def test_a_strict_schema_holds_only_itself_to_every_keyword(client, generator):
    """A strict tool beside one that is not: the strict one is followed in every keyword, and the other's keywords
    the engine lacks are left out, where one strict schema made the whole grammar strict (a 400 naming the other
    tool's uniqueItems, which OpenAI takes). A strict schema that uses such a keyword is still refused by name."""
    counted = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["n"], "additionalProperties": False}
    count = {"type": "function", "function": {"name": "count", "strict": True, "parameters": counted}}
    tag = {"type": "function", "function": {"name": "tag", "parameters": LOOSE}}
    schemas = {"count": counted, "tag": FOLLOWED}
    ask = {"model": "tiny", "max_tokens": 300, "temperature": 1.0, "messages": [{"role": "user", "content": "x"}]}
    for seed, fields in enumerate(({"tools": [count, tag], "tool_choice": "required", "parallel_tool_calls": False},
                                   {"tools": [tag, count], "response_format": {"type": "json_schema", "json_schema": {
                                       "name": "c", "schema": counted, "strict": True}}})):
        reply = client.simulate_post(CHAT, json={**ask, "seed": seed, **fields})
        assert reply.status_code == 200, reply.text
        message = reply.json["choices"][0]["message"]
        for call in message.get("tool_calls") or []:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        if not message.get("tool_calls"):
            jsonschema.validate(json.loads(message["content"]), counted)
    strict_tag = {"type": "function", "function": {**tag["function"], "strict": True}}
    reply = client.simulate_post(CHAT, json={**ask, "tools": [{**count, "function": {**count["function"],
                                                                                    "strict": False}}, strict_tag],
                                             "tool_choice": "required"})
    assert reply.status_code == 400 and "uniqueItems" in reply.json["error"]["message"], reply.text
    assert "tools[1].function.parameters" in reply.json["error"]["message"], reply.text
    # the grammar of parallel calls holds each call to its own strictness too
    tokenizer = generator.tokenizer
    engine = GrammarEngine.load(tokenizer.tokenizer, generator.head.config.vocab_size,
                                tokenizer.eos_token_ids)
    engine.json_sequence([(call_schema(Tool(name="count", parameters=counted)), False),
                          (call_schema(Tool(name="tag", parameters=LOOSE)), True)])
    for nothing in (engine.json_choice, engine.json_sequence):  # an empty rule would take any text, or none
        with pytest.raises(GrammarError, match="no schema to follow"):
            nothing([])
