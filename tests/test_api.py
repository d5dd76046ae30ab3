"""The OpenAI-compatible API through Falcon's TestClient, over a real service on a tiny random model."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time

import falcon
import pytest
import torch
from falcon import testing

from model_helpers import OurModel
from tc.generation import Generator
from tc.head.api import DEFAULT_MAX_BODY_BYTES, INTERNAL_ERROR_MESSAGE, create_app, create_loading_app, error_reply
from tc.head.api_requests import (
    ChatMessage,
    CompletionRequest,
    RequestError,
    SamplingFields,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
)
from tc.head.loading import HeadLoading
from tc.head.metrics import Metrics
from tc.head.service import (
    ClusterNotReady,
    GenerationService,
    HeadShuttingDown,
    QueueFull,
    Readiness,
    ServiceError,
    ShuttingDown,
    StageFailed,
    WorkerLost,
)
from tc.model.chat_template import ChatTemplates
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams

MODEL = "tiny"
READY = Readiness(1, ("w1",), ())


def ready() -> Readiness:
    return READY


@pytest.fixture(scope="module")
def generator(tiny_model_dir) -> Generator:
    model = OurModel(tiny_model_dir)
    return Generator(model.head, TextTokenizer.load(tiny_model_dir), model.pipeline(), torch.float32)


def make_service(generator: Generator, **kwargs) -> GenerationService:
    options = {"model_id": MODEL, "tokenizer": generator.tokenizer, "readiness": ready, **kwargs}
    return GenerationService(generator=generator, **options)


@pytest.fixture(scope="module")
def client(generator) -> testing.TestClient:
    return testing.TestClient(create_app(make_service(generator)))


def post(client: testing.TestClient, path: str, body) -> testing.Result:
    if isinstance(body, bytes):
        return client.simulate_post(path, body=body, headers={"Content-Type": "application/json"})
    return client.simulate_post(path, json=body)


def assert_error_shape(result: testing.Result, status: int, type_: str, param=None, code=None) -> dict:
    assert result.status_code == status, result.text
    assert result.headers["content-type"].startswith("application/json")
    body = result.json
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_, error
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def direct(generator: Generator, prompt_ids: list[int], **params) -> object:
    return generator.generate(prompt_ids, SamplingParams(**params))


# --- request parsing, pure -------------------------------------------------------------------------------------

def test_parse_completion_request_fills_defaults_and_keeps_values():
    request = parse_completion_request({"model": "m", "prompt": "hi"})
    assert request == CompletionRequest("m", "hi", SamplingFields())
    assert request.sampling.to_params(16) == SamplingParams(max_tokens=16)
    request = parse_completion_request({"model": "m", "prompt": [[1, 2]], "max_tokens": 3, "temperature": 0,
                                        "top_p": 0.5, "stop": "x", "seed": 9, "n": 1, "stream": False,
                                        "user": "u", "presence_penalty": 0, "logprobs": None, "min_p": 0.05})
    assert request.prompt == (1, 2)
    assert request.sampling.to_params(16) == SamplingParams(max_tokens=3, temperature=0.0, top_p=0.5, stop=("x",),
                                                            seed=9, min_p=0.05)
    chat_request = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "min_p": 1})
    assert chat_request.sampling.to_params(16).min_p == 1.0


def test_logit_bias_is_read_into_token_ids_and_values_by_id():
    request = parse_completion_request({"model": "m", "prompt": "hi", "logit_bias": {"50256": -100, "7": 2.5,
                                                                                     "0": 100, "08": 0}})
    assert request.sampling.logit_bias == ((0, 100.0), (7, 2.5), (8, 0.0), (50256, -100.0))
    assert request.sampling.to_params(16).logit_bias == request.sampling.logit_bias
    chat_request = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       "logit_bias": {"3": -1}})
    assert chat_request.sampling.to_params(16).logit_bias == ((3, -1.0),)
    for neutral in ({}, None):
        assert parse_completion_request({"model": "m", "prompt": "hi", "logit_bias": neutral}).sampling.logit_bias \
            == ()


def test_a_logit_bias_on_the_vocabularys_last_token_and_at_the_limits_is_served(client):
    body = completion(logit_bias={"258": 100, "0": -100, str(ord("a")): 0.5}, max_tokens=2)
    reply = post(client, COMPLETIONS, body)
    assert reply.status_code == 200, reply.text
    reply = post(client, CHAT, chat(logit_bias={str(i): -100 for i in range(259)}, max_tokens=2))  # every token
    assert reply.status_code == 200, reply.text


def test_a_calls_arguments_sent_back_as_an_object_read_as_their_json_text():
    """transformers' examples and some clients send an earlier call's arguments as the object (vLLM takes it); it
    was a 400. The template gets the same object either way."""
    def call(arguments) -> dict:
        request = parse_chat_request({"model": "m", "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
        return request.messages[1].as_template_input()["tool_calls"][0]

    assert call({"city": "Paris", "days": [1, 2]}) == call('{"city": "Paris", "days": [1, 2]}')
    assert call({"city": "Paris"})["function"]["arguments"] == {"city": "Paris"}


def test_parse_chat_request_joins_text_parts_and_keeps_names():
    request = parse_chat_request({"model": "m", "max_completion_tokens": 5, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]})
    assert request.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "a\nb", name="ann"))
    assert request.messages[1].as_template_input() == {"role": "user", "content": "a\nb", "name": "ann"}
    assert request.sampling.max_tokens == 5
    assert parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}).sampling.max_tokens \
        is None


@pytest.mark.parametrize("body", [b"", b"  ", b"{", b"\xff\xfe", b"[1]", b'"text"', b'{"a": NaN}',
                                  b"[" * 5000 + b"]" * 5000, b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_decode_json_body_refuses_what_is_not_a_json_object(body):
    with pytest.raises(RequestError) as info:
        decode_json_body(body)
    assert info.value.param is None and info.value.code in ("invalid_json", "invalid_type")


@pytest.mark.parametrize("body, param", [
    (b'{"model": "\\ud800", "prompt": "a"}', "model"),
    (b'{"model": "m", "prompt": ["a\\udfffb"]}', "prompt[0]"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text"),
    (b'{"model": "m", "stop": {"\\ud800": 1}}', "stop"),
])
def test_decode_json_body_refuses_lone_surrogates_by_path(body, param):
    with pytest.raises(RequestError) as info:
        decode_json_body(body)
    assert info.value.param == param and info.value.code == "invalid_value"
    info.value.message.encode("utf-8")  # the reply can carry its message
    assert decode_json_body(b'{"p": "\\ud83d\\ude00"}') == {"p": "\U0001f600"}  # a pair is one character


# --- bad requests, through the app ------------------------------------------------------------------------------

DROP = object()  # a field to leave out of the body
GOOD_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def completion(**changes) -> dict:
    body = {**GOOD_COMPLETION, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def chat(**changes) -> dict:
    body = {**GOOD_CHAT, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def chat_message(**changes) -> dict:
    message = {"role": "user", "content": "Hi", **changes}
    return chat(messages=[{k: v for k, v in message.items() if v is not DROP}])


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

BAD_REQUESTS = [
    # (path, body, status, type, param, code)
    (COMPLETIONS, b"{", 400, "invalid_request_error", None, "invalid_json"),
    (COMPLETIONS, b"", 400, "invalid_request_error", None, "invalid_json"),
    (COMPLETIONS, b"[1, 2]", 400, "invalid_request_error", None, "invalid_type"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "invalid_request_error", None,
     "invalid_json"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     "invalid_request_error", None, "invalid_json"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', 400, "invalid_request_error",
     "prompt", "invalid_value"),
    (CHAT, b'{"model": "\\ud800", "messages": []}', 400, "invalid_request_error", "model", "invalid_value"),
    (COMPLETIONS, completion(model=DROP), 400, "invalid_request_error", "model", "missing_required_parameter"),
    (COMPLETIONS, completion(model=None), 400, "invalid_request_error", "model", "missing_required_parameter"),
    (COMPLETIONS, completion(model=5), 400, "invalid_request_error", "model", "invalid_type"),
    (COMPLETIONS, completion(model="other"), 404, "invalid_request_error", "model", "model_not_found"),
    (COMPLETIONS, completion(prompt=DROP), 400, "invalid_request_error", "prompt", "missing_required_parameter"),
    (COMPLETIONS, completion(prompt=5), 400, "invalid_request_error", "prompt", "invalid_type"),
    (COMPLETIONS, completion(prompt=[]), 400, "invalid_request_error", "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=["a", "b"]), 400, "invalid_request_error", "prompt", "unsupported_value"),
    (COMPLETIONS, completion(prompt=[1, -2]), 400, "invalid_request_error", "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=[1, "a"]), 400, "invalid_request_error", "prompt[1]", "invalid_type"),
    (COMPLETIONS, completion(prompt=[[]]), 400, "invalid_request_error", "prompt[0]", "invalid_value"),
    (COMPLETIONS, completion(prompt=[10**6]), 400, "invalid_request_error", "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt=""), 400, "invalid_request_error", "prompt", "invalid_value"),
    (COMPLETIONS, completion(prompt="x" * 256), 400, "invalid_request_error", "prompt", "context_length_exceeded"),
    (COMPLETIONS, completion(max_tokens=0), 400, "invalid_request_error", "max_tokens", "invalid_value"),
    (COMPLETIONS, completion(max_tokens=-1, echo=True), 400, "invalid_request_error", "max_tokens",
     "invalid_value"),
    (COMPLETIONS, completion(max_tokens="4"), 400, "invalid_request_error", "max_tokens", "invalid_type"),
    (COMPLETIONS, completion(max_tokens=True), 400, "invalid_request_error", "max_tokens", "invalid_type"),
    (COMPLETIONS, completion(max_tokens=2.5), 400, "invalid_request_error", "max_tokens", "invalid_type"),
    (COMPLETIONS, completion(temperature=2.5), 400, "invalid_request_error", "temperature", "invalid_value"),
    (COMPLETIONS, completion(temperature=-0.1), 400, "invalid_request_error", "temperature", "invalid_value"),
    (COMPLETIONS, completion(temperature="hot"), 400, "invalid_request_error", "temperature", "invalid_type"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', 400, "invalid_request_error",
     "temperature", "invalid_value"),
    (COMPLETIONS, completion(temperature=10**400), 400, "invalid_request_error", "temperature", "invalid_value"),
    (COMPLETIONS, completion(top_p=0), 400, "invalid_request_error", "top_p", "invalid_value"),
    (COMPLETIONS, completion(top_p=1.5), 400, "invalid_request_error", "top_p", "invalid_value"),
    (COMPLETIONS, completion(stop=[f"s{i}" for i in range(33)]), 400, "invalid_request_error", "stop",
     "invalid_value"),
    (COMPLETIONS, completion(stop=5), 400, "invalid_request_error", "stop", "invalid_type"),
    (COMPLETIONS, completion(stop=[""]), 400, "invalid_request_error", "stop", "invalid_value"),
    (COMPLETIONS, completion(stop=["a", 1]), 400, "invalid_request_error", "stop[1]", "invalid_type"),
    (COMPLETIONS, completion(n=0), 400, "invalid_request_error", "n", "invalid_value"),
    (COMPLETIONS, completion(n=17), 400, "invalid_request_error", "n", "invalid_value"),
    (COMPLETIONS, completion(n="1"), 400, "invalid_request_error", "n", "invalid_type"),
    (COMPLETIONS, completion(stream="no"), 400, "invalid_request_error", "stream", "invalid_type"),
    (COMPLETIONS, completion(stream_options={"include_usage": True}), 400, "invalid_request_error",
     "stream_options", "invalid_value"),
    (COMPLETIONS, completion(stream=True, stream_options=True), 400, "invalid_request_error", "stream_options",
     "invalid_type"),
    (COMPLETIONS, completion(stream=True, stream_options={"continuous_usage_stats": True}), 400,
     "invalid_request_error", "stream_options.continuous_usage_stats", "unsupported_parameter"),
    (COMPLETIONS, completion(stream=True, stream_options={"include_usage": 1}), 400, "invalid_request_error",
     "stream_options.include_usage", "invalid_type"),
    (COMPLETIONS, completion(seed=1.5), 400, "invalid_request_error", "seed", "invalid_type"),
    (COMPLETIONS, completion(seed=2**64), 400, "invalid_request_error", "seed", "invalid_value"),
    (COMPLETIONS, completion(user=5), 400, "invalid_request_error", "user", "invalid_type"),
    (COMPLETIONS, completion(logprobs=21), 400, "invalid_request_error", "logprobs", "invalid_value"),
    (COMPLETIONS, completion(logprobs=-1), 400, "invalid_request_error", "logprobs", "invalid_value"),
    (COMPLETIONS, completion(logprobs=True), 400, "invalid_request_error", "logprobs", "invalid_type"),
    (COMPLETIONS, completion(presence_penalty=2.5), 400, "invalid_request_error", "presence_penalty",
     "invalid_value"),
    (COMPLETIONS, completion(frequency_penalty="x"), 400, "invalid_request_error", "frequency_penalty",
     "invalid_type"),
    (COMPLETIONS, completion(repetition_penalty=0), 400, "invalid_request_error", "repetition_penalty",
     "invalid_value"),
    (COMPLETIONS, completion(top_k=-2), 400, "invalid_request_error", "top_k", "invalid_value"),
    (COMPLETIONS, completion(top_k=1.5), 400, "invalid_request_error", "top_k", "invalid_type"),
    (COMPLETIONS, completion(min_p=-0.1), 400, "invalid_request_error", "min_p", "invalid_value"),
    (COMPLETIONS, completion(min_p=1.5), 400, "invalid_request_error", "min_p", "invalid_value"),
    (COMPLETIONS, completion(min_p="x"), 400, "invalid_request_error", "min_p", "invalid_type"),
    (COMPLETIONS, completion(min_p=True), 400, "invalid_request_error", "min_p", "invalid_type"),
    (CHAT, chat(min_p=-0.1), 400, "invalid_request_error", "min_p", "invalid_value"),
    (CHAT, chat(min_p=1.5), 400, "invalid_request_error", "min_p", "invalid_value"),
    (CHAT, chat(min_p="x"), 400, "invalid_request_error", "min_p", "invalid_type"),
    (CHAT, chat(min_p=True), 400, "invalid_request_error", "min_p", "invalid_type"),
    (COMPLETIONS, completion(echo=0), 400, "invalid_request_error", "echo", "invalid_type"),
    (COMPLETIONS, completion(logit_bias=[[50, 1]]), 400, "invalid_request_error", "logit_bias", "invalid_type"),
    (COMPLETIONS, completion(logit_bias={"the": 5}), 400, "invalid_request_error", "logit_bias", "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"-1": 5}), 400, "invalid_request_error", "logit_bias", "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"1.0": 5}), 400, "invalid_request_error", "logit_bias", "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"\u0663": 5}), 400, "invalid_request_error", "logit_bias",
     "invalid_value"),  # a digit, but not an ASCII one
    (COMPLETIONS, completion(logit_bias={"7": 1, "007": 2}), 400, "invalid_request_error", "logit_bias",
     "invalid_value"),
    # the tiny model's tokenizer has 259 tokens; its logits have 320 rows, the rest padding
    (COMPLETIONS, completion(logit_bias={"259": 5}), 400, "invalid_request_error", "logit_bias", "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"1" * 40: 5}), 400, "invalid_request_error", "logit_bias",
     "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"50": 100.5}), 400, "invalid_request_error", "logit_bias",
     "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"50": -101}), 400, "invalid_request_error", "logit_bias", "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"50": 10**400}), 400, "invalid_request_error", "logit_bias",
     "invalid_value"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "logit_bias": {"50": -1e999}}', 400, "invalid_request_error",
     "logit_bias", "invalid_value"),
    (COMPLETIONS, completion(logit_bias={"50": "5"}), 400, "invalid_request_error", "logit_bias", "invalid_type"),
    (COMPLETIONS, completion(logit_bias={"50": True}), 400, "invalid_request_error", "logit_bias", "invalid_type"),
    (COMPLETIONS, completion(logit_bias={"50": None}), 400, "invalid_request_error", "logit_bias", "invalid_type"),
    (COMPLETIONS, completion(logit_bias={str(i): 1 for i in range(301)}), 400, "invalid_request_error",
     "logit_bias", "invalid_value"),
    (COMPLETIONS, completion(best_of=2), 400, "invalid_request_error", "best_of", "unsupported_parameter"),
    (COMPLETIONS, completion(suffix="x"), 400, "invalid_request_error", "suffix", "unsupported_value"),
    (COMPLETIONS, completion(suffix=5), 400, "invalid_request_error", "suffix", "invalid_type"),
    (COMPLETIONS, completion(suffix="x", echo=True), 400, "invalid_request_error", "suffix", "invalid_value"),
    (COMPLETIONS, completion(typical_p=0.9), 400, "invalid_request_error", "typical_p", "unsupported_parameter"),
    (COMPLETIONS, completion(top_logprobs=2), 400, "invalid_request_error", "top_logprobs",
     "unsupported_parameter"),
    (COMPLETIONS, completion(messages=[]), 400, "invalid_request_error", "messages", "unsupported_parameter"),
    (COMPLETIONS, completion(max_token=4), 400, "invalid_request_error", "max_token", "unsupported_parameter"),
    (CHAT, b"null", 400, "invalid_request_error", None, "invalid_type"),
    (CHAT, chat(model="other"), 404, "invalid_request_error", "model", "model_not_found"),
    (CHAT, chat(messages=DROP), 400, "invalid_request_error", "messages", "missing_required_parameter"),
    (CHAT, chat(messages=[]), 400, "invalid_request_error", "messages", "invalid_value"),
    (CHAT, chat(messages="Hi"), 400, "invalid_request_error", "messages", "invalid_type"),
    (CHAT, chat(messages=[5]), 400, "invalid_request_error", "messages[0]", "invalid_type"),
    (CHAT, chat_message(role="robot"), 400, "invalid_request_error", "messages[0].role", "invalid_value"),
    (CHAT, chat_message(role=DROP), 400, "invalid_request_error", "messages[0].role", "missing_required_parameter"),
    (CHAT, chat_message(content=DROP), 400, "invalid_request_error", "messages[0].content",
     "missing_required_parameter"),
    (CHAT, chat_message(content=5), 400, "invalid_request_error", "messages[0].content", "invalid_type"),
    (CHAT, chat_message(content=[]), 400, "invalid_request_error", "messages[0].content", "invalid_value"),
    (CHAT, chat_message(content=[{"type": "image_url", "image_url": {"url": "x"}}]), 400, "invalid_request_error",
     "messages[0].content[0].type", "unsupported_value"),
    (CHAT, chat_message(content=[{"type": "text"}]), 400, "invalid_request_error", "messages[0].content[0].text",
     "missing_required_parameter"),
    (CHAT, chat_message(tool_calls=[]), 400, "invalid_request_error", "messages[0].tool_calls",
     "invalid_value"),
    (CHAT, chat_message(role="tool"), 400, "invalid_request_error", "messages[0].tool_call_id",
     "missing_required_parameter"),
    (CHAT, chat_message(role="assistant", content=None, tool_calls=[{"id": "c", "type": "function",
                                                                     "function": {"name": "f", "arguments": []}}]),
     400, "invalid_request_error", "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    (CHAT, chat_message(role="assistant", content=None, tool_calls=[{"id": "c", "type": "custom",
                                                                     "function": {"name": "f", "arguments": "{}"}}]),
     400, "invalid_request_error", "messages[0].tool_calls[0].type", "unsupported_value"),
    (CHAT, chat_message(content=None), 400, "invalid_request_error", "messages[0].content",
     "missing_required_parameter"),
    (CHAT, chat_message(refusal="no"), 400, "invalid_request_error", "messages[0].refusal", "invalid_value"),
    (CHAT, chat_message(role="assistant", content=None, refusal=3), 400, "invalid_request_error",
     "messages[0].refusal", "invalid_type"),
    (CHAT, chat(max_tokens=4, max_completion_tokens=5), 400, "invalid_request_error", "max_completion_tokens",
     "invalid_value"),
    (CHAT, chat(max_completion_tokens=0), 400, "invalid_request_error", "max_completion_tokens", "invalid_value"),
    (CHAT, chat_message(content="x" * 300), 400, "invalid_request_error", "messages", "context_length_exceeded"),
    (CHAT, chat(stream=1), 400, "invalid_request_error", "stream", "invalid_type"),
    (CHAT, chat(stream=False, stream_options={"include_usage": True}), 400, "invalid_request_error",
     "stream_options", "invalid_value"),
    (CHAT, chat(n=-1), 400, "invalid_request_error", "n", "invalid_value"),
    (CHAT, chat(n=9), 400, "invalid_request_error", "n", "invalid_value"),  # over the service's max_batch
    (CHAT, chat(logprobs=1), 400, "invalid_request_error", "logprobs", "invalid_type"),
    (CHAT, chat(top_logprobs=3), 400, "invalid_request_error", "top_logprobs", "invalid_value"),
    (CHAT, chat(logprobs=False, top_logprobs=3), 400, "invalid_request_error", "top_logprobs", "invalid_value"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "invalid_request_error", "top_logprobs", "invalid_value"),
    (CHAT, chat(echo=True), 400, "invalid_request_error", "echo", "unsupported_parameter"),
    (CHAT, chat(max_tokens=0), 400, "invalid_request_error", "max_tokens", "invalid_value"),
    (CHAT, chat(response_format={"type": "xml"}), 400, "invalid_request_error", "response_format.type",
     "invalid_value"),
    (CHAT, chat(response_format={"type": "json_schema"}), 400, "invalid_request_error",
     "response_format.json_schema", "missing_required_parameter"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), 400,
     "invalid_request_error", "response_format.json_schema.name", "missing_required_parameter"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": []}}), 400,
     "invalid_request_error", "response_format.json_schema.schema", "invalid_type"),
    (CHAT, chat(response_format={"type": "json_object", "json_schema": {"name": "x"}}), 400,
     "invalid_request_error", "response_format.json_schema", "invalid_value"),
    (CHAT, chat(response_format={"type": "json_object"}, min_tokens=3), 400, "invalid_request_error",
     "min_tokens", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "invalid_request_error", "tools[0].function",
     "missing_required_parameter"),
    (CHAT, chat(tools={"type": "function"}), 400, "invalid_request_error", "tools", "invalid_type"),
    (CHAT, chat(tools=[{"type": "code_interpreter"}]), 400, "invalid_request_error", "tools[0].type",
     "unsupported_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "has space"}}]), 400, "invalid_request_error",
     "tools[0].function.name", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), 400,
     "invalid_request_error", "tools[0].function.parameters", "invalid_type"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "returns": {}}}]), 400,
     "invalid_request_error", "tools[0].function.returns", "unsupported_parameter"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400, "invalid_request_error",
     "tools[1].function.name", "invalid_value"),
    (CHAT, chat(tool_choice="required"), 400, "invalid_request_error", "tool_choice", "invalid_value"),
    (CHAT, chat(tool_choice="any"), 400, "invalid_request_error", "tool_choice", "invalid_value"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}}), 400, "invalid_request_error",
     "tool_choice.function.name", "invalid_value"),
    (CHAT, chat(parallel_tool_calls="yes"), 400, "invalid_request_error", "parallel_tool_calls", "invalid_type"),
    (CHAT, chat(prompt="x"), 400, "invalid_request_error", "prompt", "unsupported_parameter"),
    (CHAT, chat(store=True), 400, "invalid_request_error", "store", "unsupported_parameter"),  # nothing is kept
    (CHAT, chat(service_tier="flex"), 400, "invalid_request_error", "service_tier", "unsupported_parameter"),
    (CHAT, chat(modalities=["text", "audio"]), 400, "invalid_request_error", "modalities", "unsupported_parameter"),
    (CHAT, chat(reasoning_effort="lowest"), 400, "invalid_request_error", "reasoning_effort", "invalid_value"),
    (CHAT, chat(reasoning_effort=2), 400, "invalid_request_error", "reasoning_effort", "invalid_value"),
    (CHAT, chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}), 400,
     "invalid_request_error", "reasoning_effort", "invalid_value"),
    (CHAT, chat(stream=True, stream_options={"include_obfuscation": "no"}), 400, "invalid_request_error",
     "stream_options.include_obfuscation", "invalid_type"),
    (CHAT, chat(verbosity="low"), 400, "invalid_request_error", "verbosity", "unsupported_parameter"),
    (CHAT, chat(metadata=["tag"]), 400, "invalid_request_error", "metadata", "invalid_type"),
    (CHAT, chat(metadata={"run": 3}), 400, "invalid_request_error", "metadata.run", "invalid_type"),
    (CHAT, chat(prompt_cache_key=7), 400, "invalid_request_error", "prompt_cache_key", "invalid_type"),
    (CHAT, chat(safety_identifier=["u"]), 400, "invalid_request_error", "safety_identifier", "invalid_type"),
    (CHAT, chat(prediction="def f():"), 400, "invalid_request_error", "prediction", "invalid_type"),
    (CHAT, chat(prediction={"type": "text", "content": "x"}), 400, "invalid_request_error", "prediction.type",
     "invalid_value"),
    (CHAT, chat(prediction={"type": "content"}), 400, "invalid_request_error", "prediction.content",
     "missing_required_parameter"),
    (CHAT, chat(prediction={"type": "content", "content": [{"type": "image_url"}]}), 400, "invalid_request_error",
     "prediction.content[0].type", "unsupported_value"),
    (CHAT, chat(logit_bias={"259": -100}), 400, "invalid_request_error", "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"50": 101}), 400, "invalid_request_error", "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias="ban 50"), 400, "invalid_request_error", "logit_bias", "invalid_type"),
    (CHAT, chat(chat_template_kwargs=["enable_thinking"]), 400, "invalid_request_error", "chat_template_kwargs",
     "invalid_type"),
    (CHAT, chat(chat_template_kwargs={"enable-thinking": False}), 400, "invalid_request_error",
     "chat_template_kwargs", "invalid_value"),
    (CHAT, chat(chat_template_kwargs={"v" * 65: 1}), 400, "invalid_request_error", "chat_template_kwargs",
     "invalid_value"),
    *((CHAT, chat(chat_template_kwargs={name: "x"}), 400, "invalid_request_error", f"chat_template_kwargs.{name}",
       "invalid_value") for name in ("messages", "tools", "add_generation_prompt", "continue_final_message",
                                     "bos_token", "eos_token", "pad_token", "raise_exception", "range")),
    (CHAT, chat(chat_template_kwargs={f"v{i}": i for i in range(33)}), 400, "invalid_request_error",
     "chat_template_kwargs", "invalid_value"),
    (CHAT, chat(chat_template_kwargs={"notes": "x" * 17000}), 400, "invalid_request_error", "chat_template_kwargs",
     "invalid_value"),
    (CHAT, chat(add_generation_prompt="false"), 400, "invalid_request_error", "add_generation_prompt",
     "invalid_type"),
    (CHAT, chat(continue_final_message=1), 400, "invalid_request_error", "continue_final_message", "invalid_type"),
    (CHAT, chat(continue_final_message=True), 400, "invalid_request_error", "continue_final_message",
     "invalid_value"),  # the final message is the user's
    (CHAT, chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}],
                continue_final_message=True, add_generation_prompt=True), 400, "invalid_request_error",
     "continue_final_message", "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " \n"}],
                continue_final_message=True), 400, "invalid_request_error", "continue_final_message",
     "invalid_value"),
    (CHAT, chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Let me look.",
                                                              "tool_calls": [{"id": "c1", "type": "function",
                                                                              "function": {"name": "f",
                                                                                           "arguments": "{}"}}]}],
                continue_final_message=True), 400, "invalid_request_error", "continue_final_message",
     "invalid_value"),
]


@pytest.mark.parametrize("path, body, status, type_, param, code", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_naming_the_field(client, path, body, status, type_, param, code):
    assert_error_shape(post(client, path, body), status, type_, param, code)


@pytest.mark.parametrize("path, body, field", [
    (COMPLETIONS, completion(typical_p=0.9), "typical_p"),
    (CHAT, chat(stream=True, stream_options={"include_usage": True, "extra": 1}), "stream_options.extra"),
])
def test_unsupported_field_is_refused_by_name(client, path, body, field):
    error = assert_error_shape(post(client, path, body), 400, "invalid_request_error", field,
                               "unsupported_parameter")
    assert f"unsupported field '{field}'" in error["message"]


def test_context_length_message_gives_both_numbers(client):
    error = assert_error_shape(post(client, COMPLETIONS, completion(prompt="x" * 300)), 400,
                               "invalid_request_error", "prompt", "context_length_exceeded")
    assert "256" in error["message"] and "300" in error["message"]


def test_neutral_values_of_unimplemented_fields_are_served(client):
    body = completion(presence_penalty=0, frequency_penalty=0.0, logprobs=None, echo=False, best_of=1, n=1,
                      stream=False, user="someone", stop=None, seed=None, logit_bias={}, suffix=None,
                      stream_options=None, top_k=-1, repetition_penalty=1)
    reply = post(client, COMPLETIONS, body)
    assert reply.status_code == 200, reply.text
    assert reply.json["choices"][0]["logprobs"] is None
    body = chat(logprobs=False, top_logprobs=None, response_format={"type": "text"}, tools=None, n=None,
                tool_choice="none", max_completion_tokens=2)
    reply = post(client, CHAT, body)
    assert reply.status_code == 200, reply.text
    assert reply.json["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("fields", [
    {"store": False}, {"service_tier": "auto"}, {"service_tier": "default"}, {"modalities": ["text"]},
    {"audio": None}, {"metadata": {"run": "nightly", "team": "ops"}}, {"prompt_cache_key": "session-42"},
    {"safety_identifier": "user-7f3a"}, {"prediction": {"type": "content", "content": "Hello"}},
    {"prediction": {"type": "content", "content": [{"type": "text", "text": "Hello"}]}},
    {"store": None, "service_tier": None, "modalities": None, "metadata": None, "prompt_cache_key": None,
     "safety_identifier": None, "prediction": None},
    # nulls for fields this server does not implement: as if left out (a wrapper's unset settings)
    {"reasoning_effort": None, "verbosity": None, "web_search_options": None, "functions": None,
     "function_call": None, "stream_options": None},
    # for the chat template, which reads it or not: this one does not
    {"reasoning_effort": "low"}, {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "high"}},
    {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": None}},  # null: no value to clash
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": None}]}]},
])
def test_openai_chat_fields_that_change_no_reply_are_taken_and_change_none(client, fields):
    """Fields OpenAI's chat API has for storing replies, routing, abuse detection and predicted outputs, which
    leave the reply as it is, at values that ask for nothing this server does not do: the same reply."""
    plain = post(client, CHAT, chat(max_tokens=4, temperature=0))
    reply = post(client, CHAT, chat(max_tokens=4, temperature=0, **fields))
    assert reply.status_code == 200, reply.text
    assert reply.json["choices"] == plain.json["choices"]


def test_chat_template_failure_is_a_client_error(generator):
    failing = ChatTemplates({"default": "{{ raise_exception('only one message is supported') }}"}, "test")
    tokenizer = dataclasses.replace(generator.tokenizer, chat_templates=failing)
    client = testing.TestClient(create_app(make_service(generator, tokenizer=tokenizer)))
    error = assert_error_shape(post(client, CHAT, GOOD_CHAT), 400, "invalid_request_error", "messages",
                               "chat_template_error")
    assert "only one message is supported" in error["message"]


def test_refusals_of_the_chat_template_controls_say_what_to_send_instead(client):
    prefilled = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}]
    error = assert_error_shape(post(client, CHAT, chat(chat_template_kwargs={"add_generation_prompt": False})),
                               400, "invalid_request_error", "chat_template_kwargs.add_generation_prompt",
                               "invalid_value")
    assert 'send "add_generation_prompt" beside "chat_template_kwargs"' in error["message"]
    error = assert_error_shape(post(client, CHAT, chat(chat_template_kwargs={"eos_token": "</s>"})), 400,
                               "invalid_request_error", "chat_template_kwargs.eos_token", "invalid_value")
    assert "gives the chat template itself" in error["message"]
    error = assert_error_shape(post(client, CHAT, chat(continue_final_message=True)), 400, "invalid_request_error",
                               "continue_final_message", "invalid_value")
    assert "messages[0] is a user message" in error["message"]
    error = assert_error_shape(post(client, CHAT, chat(messages=prefilled, continue_final_message=True,
                                                       add_generation_prompt=True)),
                               400, "invalid_request_error", "continue_final_message", "invalid_value")
    assert "cannot both be true" in error["message"]


def test_a_template_that_leaves_out_the_text_to_continue_is_a_client_error(generator):
    """continue_final_message needs the final message's text in the prompt, to end the prompt there."""
    roles_only = ChatTemplates({"default": "{% for m in messages %}{{ m.role }}\n{% endfor %}"}, "test")
    tokenizer = dataclasses.replace(generator.tokenizer, chat_templates=roles_only)
    client = testing.TestClient(create_app(make_service(generator, tokenizer=tokenizer)))
    body = chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}],
                continue_final_message=True)
    error = assert_error_shape(post(client, CHAT, body), 400, "invalid_request_error", "messages",
                               "chat_template_error")
    assert "does not write the final message's text" in error["message"]


# --- happy paths -------------------------------------------------------------------------------------------------

def test_models_list_and_retrieve(client, generator):
    result = client.simulate_get("/v1/models")
    assert result.status_code == 200
    assert result.json == {"object": "list",
                           "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "truecluster",
                                     "max_model_len": generator.context_length}]}
    assert client.simulate_get("/v1/models/").json == result.json
    assert client.simulate_get(f"/v1/models/{MODEL}").json == result.json["data"][0]
    assert_error_shape(client.simulate_get("/v1/models/other"), 404, "invalid_request_error", None,
                       "model_not_found")


def test_model_ids_with_slashes_are_retrievable(generator):
    client = testing.TestClient(create_app(make_service(generator, model_id="Qwen/Tiny-0.1B")))
    assert client.simulate_get("/v1/models/Qwen/Tiny-0.1B").json["id"] == "Qwen/Tiny-0.1B"
    assert client.simulate_get("/v1/models/Qwen%2FTiny-0.1B").json["id"] == "Qwen/Tiny-0.1B"
    assert client.simulate_get("/v1/models/Qwen").status_code == 404


def test_greedy_completion_matches_the_generator_and_repeats(client, generator):
    prompt = "Say this is a test"
    body = completion(prompt=prompt, max_tokens=6, temperature=0)
    before = int(time.time())
    first, second = post(client, COMPLETIONS, body), post(client, COMPLETIONS, body)
    assert first.status_code == 200, first.text
    reply = first.json
    expected = direct(generator, generator.tokenizer.encode(prompt), max_tokens=6, temperature=0.0)
    assert set(reply) == {"id", "object", "created", "model", "choices", "usage"}
    assert reply["id"].startswith("cmpl-") and len(reply["id"]) > len("cmpl-")
    assert reply["object"] == "text_completion" and reply["model"] == MODEL
    assert before <= reply["created"] <= int(time.time())
    assert reply["choices"] == [{"text": expected.text, "index": 0, "logprobs": None,
                                 "finish_reason": expected.finish_reason}]
    assert reply["usage"] == {"prompt_tokens": len(generator.tokenizer.encode(prompt)),
                              "completion_tokens": expected.completion_tokens,
                              "total_tokens": len(generator.tokenizer.encode(prompt)) + expected.completion_tokens}
    assert second.json["choices"] == reply["choices"] and second.json["id"] != reply["id"]


def test_token_id_prompts_match_text_prompts(client, generator):
    ids = generator.tokenizer.encode("abc")
    by_text = post(client, COMPLETIONS, completion(prompt="abc", max_tokens=3, temperature=0)).json
    for prompt in (ids, [ids], ["abc"]):
        reply = post(client, COMPLETIONS, completion(prompt=prompt, max_tokens=3, temperature=0)).json
        assert reply["choices"] == by_text["choices"] and reply["usage"] == by_text["usage"]


def test_max_tokens_reached_finishes_with_length(client, generator):
    # ignore_eos: a random model may choose EOS within 4 tokens on one CPU's rounding and not on another's
    expected = direct(generator, generator.tokenizer.encode("Hello"), max_tokens=4, temperature=0.0, ignore_eos=True)
    assert expected.completion_tokens == 4
    reply = post(client, COMPLETIONS, completion(prompt="Hello", max_tokens=4, temperature=0, ignore_eos=True)).json
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 4
    assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + 4


def test_stop_string_truncates_and_finishes_with_stop(client, generator):
    prompt_ids = generator.tokenizer.encode("Say this is a test")
    text = direct(generator, prompt_ids, max_tokens=10, temperature=0.0).text
    # a character whose first appearance is past the start, so the truncated text is non-empty
    cut = next(i for i, ch in enumerate(text) if i > 0 and text.index(ch) == i)
    reply = post(client, COMPLETIONS, completion(prompt="Say this is a test", max_tokens=10, temperature=0,
                                                 stop=[text[cut]])).json
    assert reply["choices"][0]["text"] == text[:cut]
    assert reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path, base", [(COMPLETIONS, completion(prompt="Hello")), (CHAT, GOOD_CHAT)])
def test_min_p_1_samples_only_the_greedy_text(client, path, base):
    """min_p 1 keeps only the most likely token, whatever the temperature; Qwen's suggested settings, min_p 0
    among them, are served as they are."""
    def text(**fields) -> str:
        reply = post(client, path, {**base, "max_tokens": 12, "ignore_eos": True, **fields})
        assert reply.status_code == 200, reply.text
        choice = reply.json["choices"][0]
        return choice["text"] if path == COMPLETIONS else choice["message"]["content"]

    greedy = text(temperature=0)
    assert all(text(temperature=1.5, min_p=1, seed=seed) == greedy for seed in (1, 2, 3))
    assert any(text(temperature=1.5, seed=seed) != greedy for seed in (1, 2, 3))  # those seeds sample without it
    text(temperature=0.6, top_p=0.95, top_k=20, min_p=0, seed=1)


def test_seeded_sampling_repeats(client):
    body = completion(prompt="Hello", max_tokens=5, temperature=1.0, top_p=0.9, seed=1234)
    first, second = post(client, COMPLETIONS, body).json, post(client, COMPLETIONS, body).json
    assert first["choices"] == second["choices"]


def test_a_developer_message_is_a_system_message(client):
    """OpenAI's newer clients send their instructions as role "developer": the same request as "system"."""
    assert parse_chat_request({"model": "m", "messages": [{"role": "developer", "content": "be brief"}]}).messages \
        == (ChatMessage("system", "be brief"),)
    replies = [post(client, CHAT, {"model": MODEL, "max_tokens": 5, "temperature": 0, "messages": [
        {"role": role, "content": "You are terse."}, {"role": "user", "content": "Hello"}]}) for role in
        ("developer", "system")]
    assert all(r.status_code == 200 for r in replies), replies[0].text
    assert replies[0].json["choices"] == replies[1].json["choices"]
    assert replies[0].json["usage"] == replies[1].json["usage"]


def test_greedy_chat_matches_the_generator(client, generator):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}
    result = post(client, CHAT, body)
    assert result.status_code == 200, result.text
    reply = result.json
    prompt_ids = generator.tokenizer.encode(generator.tokenizer.apply_chat_template(messages))
    expected = direct(generator, prompt_ids, max_tokens=5, temperature=0.0)
    assert set(reply) == {"id", "object", "created", "model", "choices", "usage"}
    assert reply["id"].startswith("chatcmpl-") and reply["object"] == "chat.completion"
    assert reply["model"] == MODEL and isinstance(reply["created"], int)
    assert reply["choices"] == [{"index": 0, "message": {"role": "assistant", "content": expected.text},
                                 "logprobs": None, "finish_reason": expected.finish_reason}]
    assert reply["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": expected.completion_tokens,
                              "total_tokens": len(prompt_ids) + expected.completion_tokens}
    # text parts say the same as a plain string
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    assert post(client, CHAT, {**body, "messages": parts}).json["choices"] == reply["choices"]


def test_chat_without_max_tokens_may_fill_the_context(client, generator):
    messages = [{"role": "user", "content": "Hello"}]
    prompt_ids = generator.tokenizer.encode(generator.tokenizer.apply_chat_template(messages))
    expected = direct(generator, prompt_ids, max_tokens=generator.context_length - len(prompt_ids),
                      temperature=0.0)
    reply = post(client, CHAT, {"model": MODEL, "messages": messages, "temperature": 0}).json
    assert reply["choices"][0]["message"]["content"] == expected.text
    assert reply["usage"]["completion_tokens"] == expected.completion_tokens


# --- service errors, limits and Falcon's own errors -----------------------------------------------------------

def test_not_ready_cluster_answers_503_with_counts(generator):
    readiness = Readiness(3, ("w1",), ("w2", "w3"))
    client = testing.TestClient(create_app(make_service(generator, readiness=lambda: readiness)))
    for path, body in ((COMPLETIONS, GOOD_COMPLETION), (CHAT, GOOD_CHAT)):
        result = post(client, path, body)
        error = assert_error_shape(result, 503, "cluster_not_ready", None, "cluster_not_ready")
        assert error["message"].startswith("Model is not ready. Required nodes: 3, connected ready nodes: 1")
        assert "w2" in error["message"]
        assert result.headers["retry-after"] == "1"
    # the model list needs no workers
    assert client.simulate_get("/v1/models").status_code == 200


def test_full_queue_answers_429(gated):
    service = make_service(gated, max_queue=1, max_batch=1)  # one generates, one may wait
    client = testing.TestClient(create_app(service))
    long = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = gated.tokenizer.encode("Hello")
    with service.open(ids, long) as running:  # its next step waits at the gate: it holds the batch's one place
        waiter = threading.Thread(target=service.complete, args=(ids, long))
        waiter.start()
        deadline = time.monotonic() + 30
        while service.queue_depth < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.01)
        result = post(client, COMPLETIONS, GOOD_COMPLETION)
        assert_error_shape(result, 429, "rate_limit_exceeded", None, "server_busy")
        assert result.headers["retry-after"] == "1"
        gated.pipeline.gate.set()
        running.drain()
    waiter.join(30)
    assert post(client, COMPLETIONS, GOOD_COMPLETION).status_code == 200  # there is room again


def completer(service: GenerationService, ids: list[int], params: SamplingParams, outcomes: list):
    """A thread's target: complete one request, adding its finish reason, or the QueueFull refusing it, to
    `outcomes`."""
    def complete() -> None:
        try:
            outcomes.append(service.complete(ids, params).finish_reason)
        except QueueFull as exc:
            outcomes.append(exc)
    return complete


def test_a_place_whose_client_has_gone_counts_as_free_for_the_queue(gated):
    """A generation whose client went away leaves the batch at the next step boundary, where the batch takes the
    request waiting first: a request arriving meanwhile is behind nobody, and is not refused as if the batch were
    full and max_queue more waited."""
    service = make_service(gated, max_queue=0, max_batch=1)  # no request may wait
    ids = gated.tokenizer.encode("Hello")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outcomes: list = []
    complete = completer(service, ids, params, outcomes)

    gone = service.open(ids, params)  # its next step waits at the gate, so the batch holds it past its close
    gone.close()  # its client went away: it leaves at the step's end
    assert service.running == 1
    arriving = threading.Thread(target=complete)
    arriving.start()
    deadline = time.monotonic() + 30
    while not service.queue_depth and not outcomes:
        assert time.monotonic() < deadline, "the request neither queued nor was refused"
        time.sleep(0.01)
    gated.pipeline.gate.set()
    arriving.join(30)
    assert outcomes == ["length"], outcomes


@pytest.mark.parametrize("max_batch, max_queue", [(1, 1), (1, 3), (2, 1), (3, 2)])
def test_max_queue_requests_wait_while_max_batch_generate(gated, max_batch, max_queue):
    """head.max_batch and head.max_queue as the topology file words them: max_batch generate, max_queue wait,
    one more is refused."""
    service = make_service(gated, max_queue=max_queue, max_batch=max_batch)
    gated.pipeline.hold_at = max_batch  # the batch fills (the running ones decode meanwhile), then holds
    ids = gated.tokenizer.encode("Hello")
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    outcomes: list = []
    complete = completer(service, ids, params, outcomes)

    with service.open(ids, params) as running:  # steps after the first wait at the gate
        others = [threading.Thread(target=complete) for _ in range(max_batch - 1 + max_queue)]
        for thread in others:
            thread.start()
        deadline = time.monotonic() + 30
        while (service.running, service.queue_depth) != (max_batch, max_queue) and not outcomes:
            assert time.monotonic() < deadline, "the requests never queued"
            time.sleep(0.01)
        assert not outcomes, outcomes  # every one is running or waiting, none refused
        with pytest.raises(QueueFull, match=f"{max_queue} requests are already waiting"):
            service.open(ids, params)
        gated.pipeline.gate.set()
        running.drain()
    for thread in others:
        thread.join(30)
    assert outcomes == ["length"] * (max_batch - 1 + max_queue)
    assert (service.running, service.queue_depth) == (0, 0)


def test_worker_failure_answers_502(generator):
    def failing() -> Readiness:
        raise StageFailed("w1", "CUDA out of memory")

    client = testing.TestClient(create_app(make_service(generator, readiness=failing)))
    error = assert_error_shape(post(client, COMPLETIONS, GOOD_COMPLETION), 502, "worker_error", None,
                               "worker_error")
    assert "w1" in error["message"] and "CUDA out of memory" in error["message"]


@pytest.mark.parametrize("exc, status, type_, code", [
    (ClusterNotReady(Readiness(2, (), ("a", "b"))), 503, "cluster_not_ready", "cluster_not_ready"),
    (QueueFull(4), 429, "rate_limit_exceeded", "server_busy"),
    (ShuttingDown(), 503, "service_unavailable", "shutting_down"),
    (HeadShuttingDown(), 503, "service_unavailable", "service_unavailable"),
    (WorkerLost("w2", "connection reset"), 503, "worker_lost", "worker_lost"),
    (StageFailed("w2", "bad shape"), 502, "worker_error", "worker_error"),
    (ServiceError("something new"), 503, "service_unavailable", "service_unavailable"),
    (RequestError("bad", param="x", code="invalid_value"), 400, "invalid_request_error", "invalid_value"),
    (falcon.HTTPInvalidHeader("not a number", "Content-Length"), 400, "invalid_request_error",
     "invalid_header_value"),
    (falcon.HTTPServiceUnavailable(), 503, "internal_error", "service_unavailable"),
    (KeyError("secret"), 500, "internal_error", "internal_error"),
])
def test_error_reply_maps_each_error_once(exc, status, type_, code):
    reply = error_reply(exc, "POST /v1/completions")
    assert (reply.status, reply.type, reply.code) == (status, type_, code)
    assert set(reply.body()["error"]) == {"message", "type", "param", "code"}


def test_unexpected_errors_answer_500_without_details_and_are_logged(generator, caplog):
    def broken() -> Readiness:
        raise RuntimeError("secret internal detail")

    client = testing.TestClient(create_app(make_service(generator, readiness=broken)))
    with caplog.at_level(logging.ERROR, logger="tc.head.api"):
        result = post(client, COMPLETIONS, GOOD_COMPLETION)
    error = assert_error_shape(result, 500, "internal_error", None, "internal_error")
    assert error["message"] == INTERNAL_ERROR_MESSAGE
    assert "secret" not in result.text
    logged = [r for r in caplog.records if r.exc_info]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])


def test_body_over_the_limit_answers_413(generator):
    limit = 1024
    client = testing.TestClient(create_app(make_service(generator), max_body_bytes=limit))
    big = json.dumps({**GOOD_COMPLETION, "prompt": "x" * 2000}).encode()
    error = assert_error_shape(post(client, COMPLETIONS, big), 413, "invalid_request_error", None,
                               "request_too_large")
    assert str(limit) in error["message"]
    compact = json.dumps({**GOOD_COMPLETION, "max_tokens": 1}).encode()
    at_limit = compact[:-1] + b" " * (limit - len(compact)) + b"}"
    assert len(at_limit) == limit
    assert post(client, COMPLETIONS, at_limit).status_code == 200
    assert post(client, COMPLETIONS, at_limit + b" ").status_code == 413
    assert DEFAULT_MAX_BODY_BYTES == 1 << 20


def test_unknown_route_and_wrong_method_answer_in_openai_shape(client):
    error = assert_error_shape(client.simulate_get("/v1/nothing"), 404, "invalid_request_error", None,
                               "unknown_url")
    assert "GET /v1/nothing" in error["message"]
    assert_error_shape(client.simulate_post("/"), 404, "invalid_request_error", None, "unknown_url")
    result = client.simulate_get(COMPLETIONS)
    error = assert_error_shape(result, 405, "invalid_request_error", None, "method_not_allowed")
    assert "POST" in result.headers["allow"] and "POST" in error["message"]
    assert_error_shape(client.simulate_delete("/v1/models"), 405, "invalid_request_error", None,
                       "method_not_allowed")


def test_each_request_logs_one_line(client, caplog):
    with caplog.at_level(logging.INFO, logger="tc.head.api"):
        post(client, COMPLETIONS, completion(max_tokens=2, temperature=0))
        client.simulate_get("/v1/nothing")
    lines = [r.getMessage() for r in caplog.records if r.name == "tc.head.api"]
    assert len(lines) == 2
    assert re.fullmatch(r"POST /v1/completions 200 id=cmpl-[0-9a-f]{32} prompt_tokens=5 completion_tokens=2 "
                        r"wait=\d+\.\d{3}s ttft=\d+\.\d{3}s tokens_per_s=\d+\.\d finish=length \d+\.\d{3}s", lines[0]), lines[0]
    assert re.fullmatch(r"GET /v1/nothing 404 \d+\.\d{3}s", lines[1]), lines[1]


def test_probes_log_at_debug_and_only_there(client, caplog):
    """A load balancer's health checks and Prometheus's scrapes, answered as they are (200, or 503 while the
    cluster is not ready), log at DEBUG: every few seconds at INFO they would bury the cluster's own lines."""
    with caplog.at_level(logging.DEBUG, logger="tc.head.api"):
        for path in ("/health", "/health/ready", "/metrics"):
            assert client.simulate_get(path).status_code == 200
        client.simulate_head("/health")
        client.simulate_get("/health/nothing")
    records = [r for r in caplog.records if r.name == "tc.head.api"]
    assert [(r.levelno, r.getMessage().split()[:3]) for r in records] == [
        (logging.DEBUG, ["GET", "/health", "200"]), (logging.DEBUG, ["GET", "/health/ready", "200"]),
        (logging.DEBUG, ["GET", "/metrics", "200"]), (logging.DEBUG, ["HEAD", "/health", "200"]),
        (logging.INFO, ["GET", "/health/nothing", "404"])]


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("GET", "/v1/models/other"), ("HEAD", "/v1/models"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
    ("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("GET", "/v1/responses"), ("GET", "/v1/cluster"),
    ("HEAD", "/v1/cluster"), ("GET", "/health"),
    ("HEAD", "/health"), ("GET", "/health/ready"), ("GET", "/health/"), ("GET", "/metrics"), ("GET", "/v1/nothing"),
])
def test_while_loading_each_route_answers_as_it_will_or_that_the_model_is_loading(generator, method, path):
    """The loading head's app has every route of the full one: a route answers what the full app will (the model's
    card, a 404 or 405), or a 503 that says the model is loading, never a 404 that it will not give later."""
    service = make_service(generator)
    loading = HeadLoading(service.model_id, service.context_length, lambda: Readiness(2, (), ("a", "b")))
    loading.begin("fetching_tensors", "fetching model.safetensors (1 of 1) from the Hub", unit="bytes")
    loading.advance(10, 20)
    waiting = testing.TestClient(create_loading_app(loading, Metrics())).simulate_request(method, path, json={})
    served = testing.TestClient(create_app(service)).simulate_request(method, path, json={})
    if waiting.status_code != 503:
        assert waiting.status_code == served.status_code
        assert path == "/metrics" or waiting.text == served.text  # the metrics: only the requests are there yet
    elif path.startswith("/health"):
        assert waiting.headers["Retry-After"] == "1" and served.status_code in (200, 503)
        if method != "HEAD":
            assert waiting.json["loading"] == {"step": "fetching_tensors", "message": "fetching model.safetensors "
                                               "(1 of 1) from the Hub",
                                               "progress": {"done": 10, "total": 20, "unit": "bytes"}}
    else:
        assert served.status_code not in (404, 405)
        if method != "HEAD":
            assert_error_shape(waiting, 503, "service_unavailable", code="model_loading")
        assert waiting.headers["Retry-After"] == "1"


def test_health_and_readiness(generator):
    service = make_service(generator, readiness=lambda: Readiness(2, ("a",), ("b",)))
    client = testing.TestClient(create_app(service))
    assert client.simulate_get("/health").json == {"status": "ok"}
    not_ready = client.simulate_get("/health/ready")
    assert not_ready.status_code == 503
    assert not_ready.json == {"ready": False, "required_nodes": 2, "ready_nodes": ["a"], "missing_nodes": ["b"]}
    ready = testing.TestClient(create_app(make_service(generator))).simulate_get("/health/ready")
    assert ready.status_code == 200 and ready.json["ready"] is True


# --- the fields beyond the first set -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> OurModel:
    return OurModel(tiny_model_dir)


def reference_logprobs(reference: OurModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of our single-process fp32 logits: row i is the distribution of the token after ids[:i+1]."""
    return torch.log_softmax(reference.full_logits(ids), dim=-1)


def test_completion_logprobs_match_the_single_process_model(client, generator, reference):
    prompt_ids = generator.tokenizer.encode("Say this is a test")
    reply = post(client, COMPLETIONS, completion(prompt=prompt_ids, max_tokens=8, temperature=0, ignore_eos=True,
                                                 logprobs=3)).json["choices"][0]
    expected = direct(generator, prompt_ids, max_tokens=8, temperature=0.0, ignore_eos=True)
    logprobs = reply["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(expected.token_ids) == 8
    table = reference_logprobs(reference, prompt_ids + list(expected.token_ids))
    for i, token in enumerate(expected.token_ids):
        row = table[len(prompt_ids) - 1 + i]
        assert logprobs["token_logprobs"][i] == pytest.approx(float(row[token]), abs=1e-4)
        top = logprobs["top_logprobs"][i]
        # the 3 most likely and the chosen token (greedy: the most likely), keyed by text: the tiny model's
        # padding ids all read "", so keys may collide and leave fewer entries
        assert 1 <= len(top) <= 3 and top[logprobs["tokens"][i]] == logprobs["token_logprobs"][i]
        best = torch.topk(row, 3).values.tolist()
        assert all(any(abs(v - b) < 1e-4 for b in best) for v in top.values())
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_chat_logprobs_match_the_single_process_model(client, generator, reference):
    messages = [{"role": "user", "content": "Hello"}]
    prompt_ids = generator.tokenizer.encode(generator.tokenizer.apply_chat_template(messages))
    reply = post(client, CHAT, {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0,
                                "ignore_eos": True, "logprobs": True, "top_logprobs": 2}).json["choices"][0]
    expected = direct(generator, prompt_ids, max_tokens=6, temperature=0.0, ignore_eos=True)
    content = reply["logprobs"]["content"]
    assert len(content) == len(expected.token_ids) == 6
    table = reference_logprobs(reference, prompt_ids + list(expected.token_ids))
    raw = b""
    specials = generator.tokenizer.tokenizer.get_added_tokens_decoder()
    for i, (entry, token) in enumerate(zip(content, expected.token_ids)):
        row = table[len(prompt_ids) - 1 + i]
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(torch.topk(row, 2).values.tolist(),
                                                                             abs=1e-4)
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]  # greedy: the chosen token is the most likely
        if token not in specials:  # the text leaves special tokens out; their entries still show them
            raw += bytes(entry["bytes"])
    # the bytes put back together are the text (the tiny tokenizer has one token per byte)
    assert raw.decode("utf-8", errors="replace").startswith(reply["message"]["content"])
    # logprobs without top_logprobs: the chosen tokens only
    plain = post(client, CHAT, {"model": MODEL, "messages": messages, "max_tokens": 2, "min_tokens": 2,
                                "temperature": 0, "logprobs": True}).json["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in plain] == [[], []]


def test_echo_returns_the_prompt_with_its_logprobs(client, generator, reference):
    prompt = "Say this"
    prompt_ids = generator.tokenizer.encode(prompt)
    reply = post(client, COMPLETIONS, completion(prompt=prompt, max_tokens=3, min_tokens=3, temperature=0,
                                                 echo=True, logprobs=1)).json
    expected = direct(generator, prompt_ids, max_tokens=3, min_tokens=3, temperature=0.0)
    choice = reply["choices"][0]
    assert choice["text"] == prompt + expected.text
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][:len(prompt_ids)] == list(range(len(prompt)))
    assert logprobs["text_offset"][len(prompt_ids)] == len(prompt)
    table = reference_logprobs(reference, prompt_ids + list(expected.token_ids))
    for i, token in enumerate(prompt_ids[1:] + list(expected.token_ids), start=1):
        assert logprobs["token_logprobs"][i] == pytest.approx(float(table[i - 1][token]), abs=1e-4)
    assert reply["usage"]["completion_tokens"] == 3
    # max_tokens 0 with echo: the prompt scored, nothing generated
    only = post(client, COMPLETIONS, completion(prompt=prompt, max_tokens=0, echo=True, logprobs=0)).json
    assert only["choices"][0]["text"] == prompt and only["usage"]["completion_tokens"] == 0
    assert only["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:len(prompt_ids)]


def test_a_prompt_scored_with_echo_may_fill_the_context(client, generator, reference):
    """max_tokens 0 with echo scores a prompt and generates nothing (how evaluation harnesses read a text's
    log-likelihood, a window of the whole context at a time), so a prompt of the whole context is served; one
    token more, or asking to generate after it, is refused."""
    context = generator.context_length
    prompt_ids = [(7 * i) % 200 + 5 for i in range(context)]
    reply = post(client, COMPLETIONS, completion(prompt=prompt_ids, max_tokens=0, echo=True, logprobs=0))
    assert reply.status_code == 200, reply.text
    logprobs = reply.json["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == context and reply.json["usage"]["completion_tokens"] == 0
    table = reference_logprobs(reference, prompt_ids)
    for i in (1, context // 2, context - 1):
        assert logprobs["token_logprobs"][i] == pytest.approx(float(table[i - 1][prompt_ids[i]]), abs=1e-4)
    over = assert_error_shape(post(client, COMPLETIONS, completion(prompt=prompt_ids + [5], max_tokens=0, echo=True)),
                              400, "invalid_request_error", "prompt", "context_length_exceeded")
    assert f"the prompt is {context + 1} tokens;" in over["message"]
    generating = assert_error_shape(post(client, COMPLETIONS, completion(prompt=prompt_ids, max_tokens=1)), 400,
                                    "invalid_request_error", "prompt", "context_length_exceeded")
    assert f"the prompt is {context} tokens, leaving no room to generate" in generating["message"]


def test_an_assistant_refusal_or_silence_carried_over_is_what_the_assistant_said(client):
    """A conversation carried over from a model that declined holds its words in `refusal`, with content null
    (OpenAI's replies do that): it is served, and read as the assistant's text, as if it were its content. One
    whose assistant said nothing (content null, maybe beside reasoning_content) is served as an empty turn."""
    def reply_to(assistant: dict) -> dict:
        body = chat(messages=[{"role": "user", "content": "Tell me a secret"}, assistant,
                              {"role": "user", "content": "Why not?"}], max_tokens=6, temperature=0)
        reply = post(client, CHAT, body)
        assert reply.status_code == 200, reply.text
        return reply.json
    words = "I can't help with that."
    declined = reply_to({"role": "assistant", "content": None, "refusal": words})
    said = reply_to({"role": "assistant", "content": words})
    assert declined["usage"]["prompt_tokens"] == said["usage"]["prompt_tokens"]
    assert declined["choices"][0]["message"]["content"] == said["choices"][0]["message"]["content"]
    silent = reply_to({"role": "assistant", "content": ""})
    assert silent["usage"]["prompt_tokens"] < said["usage"]["prompt_tokens"]
    # a reply with no text at all (a thinking model stopped before its answer: tc's own replies give content null
    # beside reasoning_content), sent back as the client got it, is an empty turn
    for unsaid in ({"role": "assistant", "content": None}, {"role": "assistant", "reasoning_content": "Hmm."},
                   {"role": "assistant", "content": None, "reasoning_content": "Hmm."}):
        reply = reply_to(unsaid)
        assert (reply["usage"], reply["choices"]) == (silent["usage"], silent["choices"])


def test_a_chat_over_the_context_is_refused_in_plain_words(client, generator):
    error = assert_error_shape(post(client, CHAT, chat_message(content="x " * generator.context_length)), 400,
                               "invalid_request_error", "messages", "context_length_exceeded")
    assert "but the messages are " in error["message"], error["message"]


def test_stop_as_a_string_or_a_list(client, generator):
    text = direct(generator, generator.tokenizer.encode("Hello"), max_tokens=12, temperature=0.0).text
    cut = next(i for i, ch in enumerate(text) if i > 0 and text.index(ch) == i)
    for stop in (text[cut], [text[cut]], ["never appears", text[cut:cut + 2]]):
        reply = post(client, COMPLETIONS, completion(prompt="Hello", max_tokens=12, temperature=0, stop=stop)).json
        assert reply["choices"][0]["text"] == text[:cut] and reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path, base", [(COMPLETIONS, completion(prompt="Hello")), (CHAT, GOOD_CHAT)])
def test_same_seed_same_text_other_seed_other_text(client, path, base):
    body = {**base, "max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "presence_penalty": 0.5,
            "frequency_penalty": 0.3, "repetition_penalty": 1.1}

    def text(seed: int) -> str:
        choice = post(client, path, {**body, "seed": seed}).json["choices"][0]
        return choice["text"] if path == COMPLETIONS else choice["message"]["content"]

    first = text(1234)
    assert text(1234) == first
    assert any(text(seed) != first for seed in (1, 2, 3))


def test_penalties_change_greedy_output(client, generator):
    prompt = "Hello"
    plain = post(client, COMPLETIONS, completion(prompt=prompt, max_tokens=30, temperature=0)).json
    tokens = direct(generator, generator.tokenizer.encode(prompt), max_tokens=30, temperature=0.0).token_ids
    assert len(set(tokens)) < len(tokens)  # the tiny model repeats itself, so a penalty has work to do
    for field, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 2.0)):
        penalised = post(client, COMPLETIONS, completion(prompt=prompt, max_tokens=30, temperature=0,
                                                         **{field: value})).json
        assert penalised["choices"][0]["text"] != plain["choices"][0]["text"], field
