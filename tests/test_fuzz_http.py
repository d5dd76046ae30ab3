"""Hostile HTTP bodies: property-based tests that every one gets a 4xx OpenAI error (or a real answer), never a
5xx, and that the next valid request still works.

Most run against falcon.testing over a real GenerationService on a tiny model; a few go through a live
Waitress server on a real socket. The strategies reach for what broke before: nesting past Python's recursion
limit, lone surrogates (valid JSON escapes that are not text), sampling values so small they overflow, numbers
with thousands of digits; each of those also has a plain regression test at the end.
"""
from __future__ import annotations

import gzip
import http.client
import json
import re
import socket
from typing import Any

import pytest
import torch
from falcon import testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_helpers import OurModel
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.http_server import HttpServer, start_http_server
from tc.head.service import GenerationService, Readiness
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams

MODEL = "tiny"
BODY_LIMIT = 64 * 1024
VALID = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])

# --- the service ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def generator(tiny_model_dir) -> Generator:
    model = OurModel(tiny_model_dir)
    return Generator(model.head, TextTokenizer.load(tiny_model_dir), model.pipeline(), torch.float32)


def make_app(generator: Generator, max_queue: int = 16):
    service = GenerationService(MODEL, generator.tokenizer, generator, lambda: Readiness(1, ("w1",), ()),
                                max_queue=max_queue)
    return create_app(service, max_body_bytes=BODY_LIMIT)


@pytest.fixture(scope="module")
def client(generator) -> testing.TestClient:
    return testing.TestClient(make_app(generator))


@pytest.fixture(scope="module")
def expected_valid(generator) -> str:
    ids = generator.tokenizer.encode(VALID["prompt"])
    return generator.generate(ids, SamplingParams(max_tokens=4, temperature=0)).text


def assert_openai_error(status: int, headers: dict, body: bytes) -> dict:
    assert 400 <= status < 500, (status, body[:500])
    assert headers.get("content-type", "").startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def check(result: testing.Result) -> None:
    """A fuzzed request's reply: a 2xx answer or a 4xx OpenAI error; never a 5xx."""
    assert result.status_code < 500, (result.status_code, result.text[:500])
    if result.status_code >= 400:
        assert_openai_error(result.status_code, {k.lower(): v for k, v in result.headers.items()}, result.content)


def still_works(client: testing.TestClient, expected: str) -> None:
    result = client.simulate_post("/v1/completions", json=VALID)
    assert result.status_code == 200, result.text
    assert result.json["choices"][0]["text"] == expected


def post_raw(client: testing.TestClient, path: str, body: bytes) -> testing.Result:
    return client.simulate_post(path, body=body, headers={"Content-Type": "application/json"})


def post_json(client: testing.TestClient, path: str, body: Any) -> testing.Result:
    # json.dumps escapes every non-ASCII character, so even a lone surrogate travels as valid JSON text
    return post_raw(client, path, json.dumps(body).encode("ascii"))


# --- strategies -----------------------------------------------------------------------------------------------

huge_ints = st.one_of(st.integers(), st.integers(min_value=-(10**40), max_value=10**40),
                      st.sampled_from([-1, 0, 2**31, 2**63, -(2**63) - 1, 2**64, 10**300]))
numbers = st.one_of(huge_ints, st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([5e-324, 1e-300, 1e-40, -0.0, 1.7976931348623157e308]))
# text with the odd characters too: lone surrogates (JSON can escape them), NUL, controls, astral planes
texts = st.one_of(st.text(max_size=40), st.text(st.characters(codec=None, categories=None), max_size=10),
                  st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e", "\U0001f600" * 3, "<|im_start|>"]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
deep = st.integers(min_value=1, max_value=400).map(lambda n: json.loads("[" * n + "]" * n))
anything = st.one_of(json_values, deep)
small_tokens = st.integers(min_value=1, max_value=4)
token_lists = st.lists(st.one_of(st.integers(min_value=0, max_value=400), huge_ints), min_size=0, max_size=300)

SAMPLING = {
    "max_tokens": st.one_of(small_tokens, huge_ints, anything),
    "temperature": st.one_of(st.just(0), st.floats(min_value=0, max_value=2), numbers, anything),
    "top_p": st.one_of(st.floats(min_value=1e-6, max_value=1), numbers, anything),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), anything),
    "seed": st.one_of(huge_ints, anything),
    "n": st.one_of(st.just(1), huge_ints, anything),
    "stream": st.one_of(st.booleans(), anything),
    "user": st.one_of(st.text(max_size=10), anything),
    "frequency_penalty": st.one_of(st.just(0), numbers, anything),
    # token ids in and past the vocabulary, each written as digits (leading zeros too), with any number
    "logit_bias": st.one_of(st.just({}), anything, st.dictionaries(
        st.one_of(st.integers(min_value=0, max_value=400).map(str), st.from_regex(r"[0-9]{1,12}", fullmatch=True)),
        st.one_of(st.floats(min_value=-100, max_value=100), numbers), max_size=4)),
}
completion_bodies = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), anything),
     "prompt": st.one_of(st.text(max_size=200), token_lists, st.lists(token_lists, max_size=2),
                         st.lists(st.text(max_size=20), max_size=3), anything)},
    optional={**SAMPLING, "echo": anything, "suffix": anything, "best_of": anything},
)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), anything),
     "content": st.one_of(st.text(max_size=60), st.lists(st.fixed_dictionaries(
         {"type": st.one_of(st.just("text"), anything), "text": st.one_of(st.text(max_size=20), anything)}),
         max_size=3), anything)},
    optional={"name": anything, "tool_call_id": anything, "tool_calls": anything, "extra": anything}), max_size=4)
chat_bodies = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), anything), "messages": st.one_of(messages, anything)},
    optional={**SAMPLING, "max_completion_tokens": st.one_of(small_tokens, huge_ints, anything),
              "tools": anything, "tool_choice": anything, "parallel_tool_calls": anything,
              "response_format": anything},
)


def with_extra_keys(bodies):
    return st.tuples(bodies, st.dictionaries(st.text(max_size=12), anything, max_size=2)).map(
        lambda pair: {**pair[1], **pair[0]})


def bounded(body: dict) -> dict:
    """Keep a valid request short: the point is the parsing, not generating 250 tokens (a huge max_tokens is
    tried once, in test_huge_max_tokens_is_capped_by_the_context)."""
    capped = {name: 8 for name in ("max_tokens", "max_completion_tokens")
              if type(body.get(name)) is int and body[name] > 8}
    return {**body, **capped}


# --- properties ------------------------------------------------------------------------------------------------

@FUZZ
@given(body=with_extra_keys(completion_bodies))
def test_completion_bodies_never_5xx(client, expected_valid, body):
    check(post_json(client, "/v1/completions", bounded(body)))


@FUZZ
@given(body=with_extra_keys(chat_bodies))
def test_chat_bodies_never_5xx(client, body):
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body = {**body, "max_tokens": 3}  # chat's default is "until the context is full": slow, not more telling
    check(post_json(client, "/v1/chat/completions", bounded(body)))


@FUZZ
@given(body=anything)
def test_any_json_value_as_the_body(client, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check(post_json(client, path, body))


@FUZZ
@given(raw=st.one_of(st.binary(max_size=300),
                     st.binary(max_size=60).map(lambda b: b'{"model": "tiny", "prompt": "' + b + b'"}'),
                     st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
                     st.integers(min_value=1, max_value=3000).map(
                         lambda n: b'{"model": "tiny", "prompt": ' + b"[" * n + b"]" * n + b"}"),
                     st.sampled_from([b"", b" ", b"null", b"NaN", b'{"prompt": NaN}', b"\xef\xbb\xbf{}",
                                      b'{"model": "tiny", "prompt": "a", "max_tokens": 1e999}',
                                      b'{"model": "tiny", "prompt": "a", "max_tokens": 4, "max_tokens": -1}',
                                      b'{"model": "tiny", "prompt": "\xff\xfe"}', b"\x00" * 50,
                                      b'{"model": "tiny", "prompt": [1, 2, ' + b"9" * 5000 + b"]}"])))
def test_raw_bytes_never_5xx(client, raw):
    check(post_raw(client, "/v1/completions", raw))
    check(post_raw(client, "/v1/chat/completions", raw))


def test_nesting_up_to_400_levels_is_a_400(client, expected_valid):
    for depth in (50, 200, 400):
        body = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        result = post_raw(client, "/v1/completions", body)
        check(result)
        assert result.status_code == 400
    still_works(client, expected_valid)


def test_bodies_over_the_limit_get_a_413(client, expected_valid):
    prompt = "x" * (BODY_LIMIT + 10)
    result = client.simulate_post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    check(result)
    assert result.status_code == 413 and result.json["error"]["code"] == "request_too_large"
    still_works(client, expected_valid)


@pytest.mark.parametrize("tokens", [256, 300, 4000])
def test_prompts_over_the_context_get_a_400(client, expected_valid, tokens):
    result = client.simulate_post("/v1/completions", json={"model": MODEL, "prompt": [1] * tokens})
    check(result)
    assert result.status_code == 400 and result.json["error"]["code"] == "context_length_exceeded"
    long_text = {"model": MODEL, "messages": [{"role": "user", "content": "word " * tokens}]}
    result = client.simulate_post("/v1/chat/completions", json=long_text)
    check(result)
    assert result.status_code in (400, 413)
    still_works(client, expected_valid)


def test_after_the_fuzzing_a_valid_request_gives_the_same_text(client, expected_valid):
    still_works(client, expected_valid)


# --- a live Waitress server -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(generator):
    service = GenerationService(MODEL, generator.tokenizer, generator, lambda: Readiness(1, ("w1",), ()))
    running = start_http_server(create_app(service, max_body_bytes=BODY_LIMIT), "127.0.0.1", 0, threads=4,
                                max_body_bytes=BODY_LIMIT)
    yield running
    running.stop()


def live_post(server: HttpServer, body: bytes, path: str = "/v1/completions",
              headers: dict | None = None) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def live_raw(server: HttpServer, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(data)  # and no half-close: the server takes a client that half-closes as gone (docs/api.md)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=with_extra_keys(completion_bodies))
def test_live_server_fuzz(server, body):
    status, headers, data = live_post(server, json.dumps(bounded(body)).encode())
    assert status < 500, (status, data[:300])
    if status >= 400:
        assert_openai_error(status, headers, data)


def test_live_server_hostile_bodies(server, expected_valid):
    for body in (b"\xff\xfe\xfd", b"{" * 300, b'{"model": "tiny", "prompt": "a", "max_tokens": -5}',
                 b'{"model": "tiny", "prompt": "' + b"\xc3" * 100 + b'"}', b"[]" * 1000):
        assert_openai_error(*live_post(server, body))
    # just over the app's limit: the app's own 413 in the OpenAI shape
    status, headers, data = live_post(server, b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}')
    assert status == 413 and json.loads(data)["error"]["code"] == "request_too_large"
    # far over it: refused before it is read, whoever answers
    status, _, _ = live_post(server, b"x" * (3 * BODY_LIMIT))
    assert status == 413
    # a broken Content-Length and a garbage request line never reach the app: Waitress refuses them with a 400
    # (see test_what_waitress_refuses_itself_is_an_openai_error), and keeps serving
    for request in (b"POST /v1/completions HTTP/1.1\r\nContent-Length: nope\r\n\r\n", b"\x00\x01\x02 garbage\r\n\r\n"):
        assert re.match(rb"HTTP/1\.[01] 400 ", live_raw(server, request))
    status, _, data = live_post(server, json.dumps(VALID).encode())
    assert status == 200 and json.loads(data)["choices"][0]["text"] == expected_valid


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, identity"])
def test_a_compressed_body_gets_a_415_that_says_so(server, expected_valid, encoding):
    """A body in a content coding was read as it stands: gzip got a 400 saying the body is not UTF-8, and a plain
    body declared compressed was served as if the header were not there."""
    plain = json.dumps(VALID).encode()
    for body in (gzip.compress(plain), plain):
        status, headers, data = live_post(server, body, headers={"Content-Encoding": encoding})
        error = assert_openai_error(status, headers, data)
        assert status == 415 and error["code"] == "unsupported_content_encoding", data
        assert encoding in error["message"] and headers["accept-encoding"] == "identity"
    status, _, data = live_post(server, plain, headers={"Content-Encoding": "identity"})
    assert status == 200 and json.loads(data)["choices"][0]["text"] == expected_valid


def test_a_body_that_starts_with_a_byte_order_mark_is_read(server, expected_valid):
    """Editors and PowerShell on Windows write a UTF-8 byte order mark before the JSON; RFC 8259 lets a parser
    ignore it, and it got a 400 'not valid JSON'. A mark anywhere else is still no JSON."""
    plain = json.dumps(VALID).encode()
    status, _, data = live_post(server, b"\xef\xbb\xbf" + plain)
    assert status == 200 and json.loads(data)["choices"][0]["text"] == expected_valid, data
    status, headers, data = live_post(server, b" \xef\xbb\xbf" + plain)
    assert status == 400 and assert_openai_error(status, headers, data)["code"] == "invalid_json"


def raw_reply(data: bytes) -> tuple[int, dict, bytes]:
    """The status, headers (lower-case names) and body of a raw HTTP reply."""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(("request_bytes", "status", "code"), [
    (POST_HEAD + b"Content-Length: nope\r\n\r\n", 400, "bad_request"),
    (POST_HEAD + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400, "bad_request"),
    (POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400, "bad_request"),
    (b"\x00\x01\x02 garbage\r\n\r\n", 400, "bad_request"),
    (POST_HEAD + b"Content-Length: %d\r\n\r\n" % (10 * BODY_LIMIT), 413, "request_too_large"),
    (POST_HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501, "not_implemented"),
], ids=["content-length", "two content-lengths", "chunk size", "request line", "body", "coding"])
def test_what_waitress_refuses_itself_is_an_openai_error(server, expected_valid, request_bytes, status, code):
    """Requests the HTTP server refuses before the app sees them were answered in Waitress's plain text, which
    no OpenAI client reads as an error object; they get the same shape as every other error.

    Headers over Waitress's cap (431) take the same path, but are left out here: the server closes with the rest
    of them unread, and the reset that sends may discard its reply before the client reads it."""
    got, headers, body = raw_reply(live_raw(server, request_bytes))
    assert got == status, body
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert error["type"] == "invalid_request_error" and error["message"]
    status, _, data = live_post(server, json.dumps(VALID).encode())
    assert status == 200 and json.loads(data)["choices"][0]["text"] == expected_valid


# --- regressions: inputs that once got a 500 --------------------------------------------------------------------

def test_nesting_past_the_recursion_limit_is_a_4xx(client, expected_valid):
    body = b'{"model": "tiny", "prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    check(post_raw(client, "/v1/completions", body))
    still_works(client, expected_valid)


@pytest.mark.parametrize("body", [b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}',
                                  b'{"model": "\\ud800", "prompt": "a"}',
                                  b'{"model": "tiny", "prompt": "a", "\\udfff": 1}',
                                  b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}'],
                         ids=["prompt", "model", "field name", "message"])
def test_lone_surrogates_are_a_4xx(client, expected_valid, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check(post_raw(client, path, body))
    still_works(client, expected_valid)


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"temperature": 5e-324},
                                    {"temperature": 1, "top_p": 1e-300}, {"temperature": 2, "top_p": 5e-324}])
def test_vanishing_sampling_values_are_answered(client, fields):
    check(client.simulate_post("/v1/completions", json={**VALID, **fields}))


def test_huge_max_tokens_is_capped_by_the_context(client):
    result = client.simulate_post("/v1/completions", json={**VALID, "max_tokens": 10**30})
    assert result.status_code == 200, result.text
    assert result.json["usage"]["prompt_tokens"] + result.json["usage"]["completion_tokens"] <= 256


def test_a_call_in_the_history_whose_arguments_nest_past_what_json_reads_is_served(client, expected_valid):
    """An earlier call's arguments are JSON text, read into an object for the template; text nested deeper than
    json reads (within the body limit, as a string the body parser never recurses into) was a RecursionError, a
    500. Like any arguments that are not JSON, it goes to the template as the text it is."""
    call = {"id": "abc123def", "type": "function", "function": {"name": "f", "arguments": "[" * 20_000 + "]" * 20_000}}
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "abc123def", "content": "r"}]}
    result = post_json(client, "/v1/chat/completions", body)
    assert result.status_code == 200, result.text
    still_works(client, expected_valid)
