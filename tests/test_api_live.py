"""The API served by Waitress on a real socket, spoken to by the official `openai` client and raw HTTP."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families
import pytest
import torch
from tokenizers import Tokenizer, processors

from model_helpers import OurModel
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.http_server import HttpServer, start_http_server, waitress_body_limit
from tc.head.service import GenerationService, Readiness
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tiny_model import sentencepiece_tokenizer, write_tiny_model

MODEL = "tiny"
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def generator(tiny_model_dir) -> Generator:
    model = OurModel(tiny_model_dir)
    return Generator(model.head, TextTokenizer.load(tiny_model_dir), model.pipeline(), torch.float32)


def serve(generator: Generator) -> HttpServer:
    service = GenerationService(MODEL, generator.tokenizer, generator, readiness=lambda: Readiness(1, ("w1",), ()))
    return start_http_server(create_app(service, max_body_bytes=BODY_LIMIT), "127.0.0.1", 0, threads=4,
                             max_body_bytes=BODY_LIMIT, metrics=service.metrics)


@pytest.fixture(scope="module")
def server(generator):
    running = serve(generator)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def raw_post(server: HttpServer, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_server_reports_the_port_it_got(server):
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "truecluster"
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_through_the_openai_client(client, generator):
    reply = client.completions.create(model=MODEL, prompt="Say this is a test", max_tokens=5, temperature=0)
    expected = generator.generate(generator.tokenizer.encode("Say this is a test"),
                                  SamplingParams(max_tokens=5, temperature=0.0))
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == expected.completion_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_through_the_openai_client(client, generator):
    messages = [{"role": "user", "content": "Hello"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, seed=3)
    prompt_ids = generator.tokenizer.encode(generator.tokenizer.apply_chat_template(messages))
    expected = generator.generate(prompt_ids, SamplingParams(max_tokens=5, temperature=0.0))
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(prompt_ids)


def test_sampling_fields_through_the_openai_client(client):
    def ask(seed: int):
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0.8, seed=seed,
                                         presence_penalty=0.3, frequency_penalty=0.2, stop=["\n\n", "zz"],
                                         logprobs=2, extra_body={"top_k": 20, "min_p": 0.05,
                                                                 "repetition_penalty": 1.1})

    first = ask(42)
    assert ask(42).choices[0].text == first.choices[0].text
    logprobs = first.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == first.usage.completion_tokens
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=1)
    assert reply.usage.completion_tokens == len(reply.choices[0].logprobs.content) <= 3


def test_the_openai_clients_storage_routing_and_prediction_parameters_leave_the_reply_as_it_is(client):
    def reply(**fields) -> str:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_completion_tokens=6, temperature=0, **fields).choices[0].message

    # extra_body: the client's own names for them came in releases after the oldest one the tests allow
    assert reply(service_tier="auto", extra_body={
        "store": False, "metadata": {"run": "nightly"}, "modalities": ["text"],
        "prediction": {"type": "content", "content": "Hello there"}, "prompt_cache_key": "conversation-1",
        "safety_identifier": "user-7f3a"}) == reply()
    with pytest.raises(openai.BadRequestError, match="unsupported field 'store'"):
        reply(extra_body={"store": True})  # a completion kept for later: not here


def test_min_p_1_through_the_openai_client_samples_the_greedy_text(client):
    def text(temperature: float, seed: int, **extra) -> str:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_completion_tokens=8, temperature=temperature, seed=seed,
                                              extra_body={"ignore_eos": True, **extra}).choices[0].message.content

    greedy = text(0, 0)
    assert all(text(1.5, seed, min_p=1) == greedy for seed in (1, 2))


def test_a_repetition_penalty_near_zero_repeats_the_prompt_as_a_small_one_does(client):
    """A repetition_penalty near 0 (the API takes any number over 0) divided the seen tokens' logits past the
    largest float: inf, then NaN in the sampler, which drew tokens the model had nothing to do with. Such a penalty
    asks what a small one asks: the seen token the model likes best, whatever the temperature."""
    def text(penalty: float, temperature: float) -> str:
        return client.completions.create(model=MODEL, prompt="Hello Hello Hello", max_tokens=6, seed=1,
                                         temperature=temperature, extra_body={"repetition_penalty": penalty,
                                                                              "ignore_eos": True}).choices[0].text

    expected = text(1e-10, 0)  # small, and still far from overflowing the tiny model's logits
    for penalty in (1e-40, 1e-46):
        assert text(penalty, 0) == expected
        assert text(penalty, 0.7) == expected


def test_seeds_that_share_their_low_32_bits_give_their_own_text(client):
    """`seed` is a signed 64-bit integer, but the sampler's generator kept only its low 32 bits: 5 and 5 + 2**32, or
    -1 and 2**32 - 1, gave the same text. Each gives its own now, and each again when asked again."""
    def text(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=2, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    for low, high in [(5, 5 + 2**32), (-1, 2**32 - 1)]:
        assert text(high) != text(low)
        assert text(high) == text(high)


def test_a_logit_bias_of_minus_100_bans_the_token_greedy_would_pick(client, generator):
    prompt_ids = generator.tokenizer.encode("Say this is a test")
    plain = generator.generate(prompt_ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    banned = plain.token_ids[0]
    expected = generator.generate(prompt_ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                             logit_bias=((banned, -100.0),)))
    assert banned not in expected.token_ids and expected.text != plain.text
    ask = dict(model=MODEL, prompt="Say this is a test", max_tokens=12, temperature=0, logit_bias={str(banned): -100},
               extra_body={"ignore_eos": True})
    assert client.completions.create(**ask).choices[0].text == expected.text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**ask, stream=True))
    assert streamed == expected.text
    # each of n sampled choices (seed + i) carries the bias, as the choice alone would
    sampled = client.completions.create(**{**ask, "temperature": 1.5, "seed": 9, "n": 2})
    for choice in sampled.choices:
        alone = generator.generate(prompt_ids, SamplingParams(max_tokens=12, temperature=1.5, seed=9 + choice.index,
                                                              ignore_eos=True, logit_bias=((banned, -100.0),)))
        assert choice.text == alone.text and banned not in alone.token_ids


def test_a_logit_bias_of_100_forces_a_token_whose_logprob_is_reported_before_the_bias(client, generator):
    """Chat, sampled: +100 on "z" makes every token "z", whole or streamed. Its log-probability is the model's own,
    read before the bias (as vLLM reports it): well below the ~0 that the biased distribution would give."""
    (z,) = generator.tokenizer.encode("z")
    messages = [{"role": "user", "content": "Hello"}]
    ask = dict(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=5, logit_bias={str(z): 100},
               logprobs=True, top_logprobs=1)
    prompt_ids = generator.tokenizer.encode(generator.tokenizer.apply_chat_template(messages))
    expected = generator.generate(prompt_ids, SamplingParams(max_tokens=6, temperature=1.0, seed=5, logprobs=1,
                                                             logit_bias=((z, 100.0),)))
    assert expected.token_ids == (z,) * 6 and expected.tokens[0].logprob.logprob < -0.01
    reply = client.chat.completions.create(**ask)
    assert reply.choices[0].message.content == "z" * 6
    assert [entry.logprob for entry in reply.choices[0].logprobs.content] == \
        pytest.approx([t.logprob.logprob for t in expected.tokens])
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **ask, stream=True) if chunk.choices)
    assert streamed == "z" * 6


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"50": 101})
    assert info.value.body["param"] == "logit_bias" and info.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"typical_p": 0.9})
    assert info.value.body["param"] == "typical_p" and info.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_p": 1.5})
    assert info.value.body["param"] == "min_p" and info.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs" and info.value.code == "invalid_value"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert info.value.code == "model_not_found"


def test_invalid_json_gets_the_openai_error_shape(server):
    status, headers, body = raw_post(server, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


def post_as(server: HttpServer, body: bytes, content_type: str | None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", body=body,
                           headers={"Content-Type": content_type} if content_type is not None else {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "application/x-www-form-urlencoded", "text/plain;charset=UTF-8", None])
def test_a_json_body_is_read_whatever_its_content_type(server, content_type):
    """`curl -d` sends a form's Content-Type, fetch() with a string body text/plain, and a bare HTTP client none:
    the body is JSON all the same, and is read so (as llama.cpp's server reads it)."""
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}).encode()
    status, reply = post_as(server, body, content_type)
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("content_type, body", [
    ("application/x-www-form-urlencoded", b"model=tiny&prompt=Hello"),
    ("multipart/form-data; boundary=XyZ",
     b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny\r\n--XyZ--\r\n'),
    ("text/plain", b"Hello"),
])
def test_a_body_that_is_no_json_and_not_sent_as_json_is_told_to_send_json(server, content_type, body):
    """A form, or text, got "the request body is not valid JSON: Expecting value: line 1 column 1 (char 0)",
    which does not say that the server reads JSON only, nor how to send it."""
    status, reply = post_as(server, body, content_type)
    error = reply["error"]
    assert status == 415 and error["code"] == "unsupported_media_type"
    assert repr(content_type) in error["message"] and "Content-Type: application/json" in error["message"]
    # sent as JSON, the same body is JSON that is broken: the parser's own words say where
    status, reply = post_as(server, body, "application/json")
    assert status == 400 and reply["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("path", ["/health", "/health/ready", "/v1/models", f"/v1/models/{MODEL}", "/v1/cluster",
                                  "/metrics"])
def test_every_get_route_answers_head(server, path):
    """HTTP requires HEAD wherever GET is served, and uptime monitors check with it: it got a 405, so such a
    monitor took the API for down. The answer is GET's status and headers, without a body, and the connection
    stays usable (no stray body bytes ahead of the next reply)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request("HEAD", path)
        head = connection.getresponse()
        assert head.status == 200 and head.read() == b""
        connection.request("GET", path)
        get = connection.getresponse()
        body = get.read()
        assert get.status == 200 and body
        assert head.getheader("Content-Type") == get.getheader("Content-Type")
        if path != "/metrics" and path != "/v1/cluster":  # those two change between the requests
            assert int(head.getheader("Content-Length")) == len(body)
    finally:
        connection.close()


def test_body_limits(server):
    # just over the app's limit: the app's 413, in the OpenAI shape
    status, _, body = raw_post(server, "/v1/completions", b" " * (BODY_LIMIT + 1))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # over Waitress's own cap: refused before the app runs, by Waitress, in the same shape and words
    status, headers, body = raw_post(server, "/v1/completions", b" " * waitress_body_limit(BODY_LIMIT))
    assert status == 413 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert f"at most {BODY_LIMIT} bytes" in json.loads(body)["error"]["message"]
    # both counted: the app's under its route, Waitress's (which no route saw) under "unrouted"
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
        exposition = reply.read().decode()
    assert 'tc_http_requests_total{method="POST",route="/v1/completions",status="413"}' in exposition
    assert 'tc_http_requests_total{method="POST",route="unrouted",status="413"} 1.0' in exposition


def test_concurrent_requests_are_all_served(server, client):
    results: list[str] = []
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
            results.append(reply.choices[0].text)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert len(results) == 3 and len(set(results)) == 1


def test_idle_connections_past_a_hundred_leave_the_api_answering(generator):
    """Clients' pools keep idle keep-alive connections open for minutes; Waitress's default stopped accepting at
    100 open connections, so /health and every new client met silence, not even a 429."""
    running = serve(generator)
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", running.port), timeout=10))
        connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 200, response.read()
        connection.close()
    finally:
        for sock in idle:
            sock.close()
        running.stop()


def test_the_connection_limit_stays_under_the_files_this_process_may_open():
    import resource

    from tc.head.http_server import FD_HEADROOM, IDLE_CONNECTIONS, connection_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        limit = connection_limit(8)
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # raised where the hard limit allows; else kept under the soft one, never under the request threads
        if now >= 8 + IDLE_CONNECTIONS + FD_HEADROOM:
            assert limit == 8 + IDLE_CONNECTIONS
        else:
            assert limit == max(now - FD_HEADROOM, 8)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_whole_reply_whose_client_left_gives_its_place_back(long_generator):
    """A client that closes its connection while its (not streamed) reply is generated: the generation ends
    within a step, counted abandoned and logged with status 499, where it used to run to max_tokens, holding a
    place in the batch that others waited for."""
    generator = long_generator
    service = GenerationService(MODEL, generator.tokenizer, generator, readiness=lambda: Readiness(1, ("w1",), ()),
                                max_batch=1)
    running_server = start_http_server(create_app(service), "127.0.0.1", 0, threads=4)
    try:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 8000, "temperature": 0,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", running_server.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        def running() -> int:
            with urllib.request.urlopen(running_server.url + "/v1/cluster", timeout=10) as reply:
                return json.load(reply)["queue"]["running"]

        deadline = time.monotonic() + 30
        while running() == 0:  # under way
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock.close()
        while running():
            assert time.monotonic() < deadline, "the generation ran on after its client left"
            time.sleep(0.01)
        status, _, reply = raw_post(running_server, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode())
        assert status == 200, reply  # the place is free again
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(service.metrics.render()[0].decode()) for s in f.samples}
        assert samples[("tc_generations_total", (("outcome", "abandoned"),))] == 1
        assert samples[("tc_completion_tokens_total", ())] < 8000
        assert samples[("tc_http_requests_total", (("method", "POST"), ("route", "/v1/completions"),
                                                   ("status", "499")))] == 1
    finally:
        running_server.stop()


@pytest.fixture(scope="module")
def long_generator(tmp_path_factory) -> Generator:
    """A tiny model with room for thousands of tokens: a generation that runs for seconds."""
    model_dir = write_tiny_model(tmp_path_factory.mktemp("long") / "long", seed=3, max_position_embeddings=8192)
    model = OurModel(model_dir)
    return Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_client_left_while_queued_frees_its_place(long_generator, stream):
    """A client that gives up while its request waits for a place (a timeout under load, and the SDK retries):
    the request leaves the queue within a moment, counted abandoned, where it stayed to be read and answered for
    nobody, and held a place in the queue that others were refused for."""
    generator = long_generator
    service = GenerationService(MODEL, generator.tokenizer, generator, readiness=lambda: Readiness(1, ("w1",), ()),
                                max_batch=1, max_queue=4)
    running_server = start_http_server(create_app(service), "127.0.0.1", 0, threads=4)

    def queue() -> dict:
        with urllib.request.urlopen(running_server.url + "/v1/cluster", timeout=10) as reply:
            return json.load(reply)["queue"]

    try:
        with service.open(generator.tokenizer.encode("Hello"), SamplingParams(max_tokens=8000, temperature=0,
                                                                              ignore_eos=True)):
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream}).encode()
            sock = socket.create_connection(("127.0.0.1", running_server.port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 30
            while queue()["waiting"] != 1:  # it waits behind the held generation
                assert time.monotonic() < deadline
                time.sleep(0.01)
            sock.close()
            while queue()["waiting"]:
                assert time.monotonic() < deadline, "the request stayed queued after its client left"
                time.sleep(0.01)
            assert queue()["running"] == 1  # the held one runs on
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(service.metrics.render()[0].decode()) for s in f.samples}
        assert samples[("tc_generations_total", (("outcome", "abandoned"),))] == 2  # it, and the one held here
        assert ("tc_generations_total", (("outcome", "error"),)) not in samples
    finally:
        running_server.stop()


def serve_sentencepiece(tmp_path, tokenizer: Tokenizer, chat_template: str) -> HttpServer:
    """The tiny model with a SentencePiece `tokenizer` (tiny_model.sentencepiece_tokenizer's vocabulary), served."""
    model_dir = write_tiny_model(tmp_path / "sp", seed=0)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                                 "chat_template": chat_template}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    model = OurModel(model_dir)
    return serve(Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32))


def test_logprob_tokens_of_a_sentencepiece_vocabulary_are_their_own_text_and_bytes(tmp_path):
    """Llama 2's, Mistral's and Gemma's vocabularies spell a space "▁" and a byte that is no whole character as a
    token "<0xE6>": those were shown as the text "<0xE6>" (bytes b"<0xE6>"), and "▁the" as "the"."""
    running = serve_sentencepiece(tmp_path, sentencepiece_tokenizer(), "{{ messages[0].content }}")
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model=MODEL, prompt="the café\n日", max_tokens=1, echo=True, logprobs=1,
                                          temperature=0)
        assert reply.choices[0].logprobs.tokens[:6] == [" the", " café", "\n", "bytes:\\xe6", "bytes:\\x97",
                                                        "bytes:\\xa5"]
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the café"}],
                                              max_tokens=4, logprobs=True, top_logprobs=20, temperature=0)
        shown = [alt for entry in chat.choices[0].logprobs.content for alt in [entry, *entry.top_logprobs]]
        for alt in shown:  # a piece of text is its UTF-8; a byte of a character is that byte
            raw = bytes(alt.bytes)
            assert alt.token == (f"bytes:\\x{raw[0]:02x}" if raw[:1] >= b"\x80" else raw.decode()), alt
        assert any(alt.token.startswith("bytes:") for alt in shown)  # the random model's likeliest include bytes
    finally:
        running.stop()


def test_a_text_prompt_starts_with_the_bos_token_its_tokenizer_adds(tmp_path):
    """Llama's, Gemma's and Mistral's tokenizers start every text with their BOS token (their post-processor adds
    it, as transformers' tokenizer(text) and vLLM's completions do): a /v1/completions prompt went without it, which
    such a model reads as text unlike any it was trained on. Token ids are taken as given, and a chat prompt,
    whose template writes the BOS itself, gets no second one."""
    tokenizer = sentencepiece_tokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    running = serve_sentencepiece(tmp_path, tokenizer, "{{ bos_token }}{{ messages[0].content }}")
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model=MODEL, prompt="the café", max_tokens=1, echo=True, logprobs=0,
                                          temperature=0)
        assert reply.choices[0].logprobs.tokens[:3] == ["<s>", " the", " café"]
        assert reply.usage.prompt_tokens == 3
        the_cafe = tokenizer.encode("the café", add_special_tokens=False).ids
        assert client.completions.create(model=MODEL, prompt=the_cafe, max_tokens=1).usage.prompt_tokens == 2
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the café"}],
                                              max_tokens=1)
        assert chat.usage.prompt_tokens == 3
        # a prompt that starts with the BOS itself (a client that renders the chat template) gets no second one
        reply = client.completions.create(model=MODEL, prompt="<s>the café", max_tokens=1, echo=True, logprobs=0,
                                          temperature=0)
        assert reply.choices[0].logprobs.tokens[:3] == ["<s>", " the", " café"] and reply.usage.prompt_tokens == 3
        twice = client.completions.create(model=MODEL, prompt="<s><s>the café", max_tokens=1)
        assert twice.usage.prompt_tokens == 4  # two the text holds itself: only the post-processor's goes
    finally:
        running.stop()


def test_a_text_that_starts_with_two_special_tokens_of_its_own_keeps_both():
    """Only a BOS the post-processor added goes where the text starts with its own: a tokenizer that adds none
    (Qwen's) keeps a prompt's two leading special tokens as written."""
    adds_none = TextTokenizer(sentencepiece_tokenizer(), frozenset({2}), None, {})
    assert adds_none.encode_prompt("<s><s>the") == adds_none.encode("<s><s>the") == [1, 1, 269]


def test_a_completion_that_starts_with_a_word_keeps_its_space(tmp_path):
    """A SentencePiece decoder (Llama 2's, Mistral's) drops the space a text starts with, and the completion's
    text was decoded as a text of its own: "the café" went on "teY" where the model wrote " teY" (the prompt
    and its completion read "the caféteY"). Its text is now what transformers' decoding of prompt and completion
    together adds to the prompt's, streamed or not."""
    running = serve_sentencepiece(tmp_path, sentencepiece_tokenizer(), "{{ messages[0].content }}")
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        # the seeded draw that makes the random model start with a word ("▁t")
        ask = dict(model=MODEL, prompt="the café", max_tokens=3, temperature=2, seed=386, logprobs=0,
                   extra_body={"ignore_eos": True})
        reply = client.completions.create(**ask).choices[0]
        assert reply.logprobs.tokens[0] == " t"
        assert reply.text == "".join(reply.logprobs.tokens) == " teY"
        assert "".join(chunk.choices[0].text for chunk in client.completions.create(**ask, stream=True)) == " teY"
    finally:
        running.stop()


def test_a_scored_text_that_the_model_would_end_keeps_its_last_token(tmp_path):
    """lm-evaluation-harness scores a text with echo, max_tokens 1 and logprobs, and drops the last entry as the
    generated token. Where the model chose to end there (EOS), the completion had no entry of its own, so the
    harness dropped the text's last token and scored the rest, silently. The EOS token now has the last entry, in
    the whole reply and the streamed one alike, and stays out of the text and the usage."""
    model_dir = write_tiny_model(tmp_path / "m", seed=0)
    model = OurModel(model_dir)
    tokenizer = TextTokenizer.load(model_dir)
    prompt = tokenizer.encode("Say this is a test")
    # the model's own greedy choice after the prompt, made its end-of-sequence token: it ends the text there
    (ending,) = Generator(model.head, tokenizer, model.pipeline(), torch.float32).generate(
        prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)).token_ids
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ending}))
    running = serve(Generator(model.head, TextTokenizer.load(model_dir), model.pipeline(), torch.float32))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        ask = dict(model=MODEL, prompt=[prompt], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
        reply = client.completions.create(**ask)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 0
        assert choice.text == tokenizer.decode(prompt)
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(prompt) + 1
        echoed = client.completions.create(**{**ask, "max_tokens": 0}).choices[0].logprobs
        assert logprobs.tokens[:-1] == echoed.tokens
        assert logprobs.token_logprobs[1:-1] == pytest.approx(echoed.token_logprobs[1:], abs=1e-5)
        # the entry is the greedy choice's: the likeliest token there, at the end of the text
        assert logprobs.token_logprobs[-1] == max(logprobs.top_logprobs[-1].values())
        assert logprobs.top_logprobs[-1][logprobs.tokens[-1]] == logprobs.token_logprobs[-1]
        assert logprobs.text_offset[-1] == len(choice.text)
        chunks = [chunk.choices[0] for chunk in client.completions.create(**ask, stream=True) if chunk.choices]
        streamed = {key: [value for chunk in chunks if chunk.logprobs for value in getattr(chunk.logprobs, key)]
                    for key in ("tokens", "token_logprobs", "text_offset")}
        assert streamed["tokens"] == logprobs.tokens and streamed["text_offset"] == logprobs.text_offset
        assert streamed["token_logprobs"][-1] == pytest.approx(logprobs.token_logprobs[-1], abs=1e-5)
        assert "".join(chunk.text for chunk in chunks) == choice.text
    finally:
        running.stop()


def whole_and_streamed(client: openai.OpenAI, **ask) -> list[tuple[str, int]]:
    """A chat request's reply content and prompt_tokens, asked whole and then streamed (its chunks joined)."""
    reply = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    return [(reply.choices[0].message.content, reply.usage.prompt_tokens), (streamed, chunks[-1].usage.prompt_tokens)]


def test_a_continued_final_message_goes_on_where_its_text_ends(client, generator):
    """continue_final_message (vLLM's): the reply continues an answer begun for the model (a prefill) rather
    than a new turn after it; whole and streamed, with or without add_generation_prompt false beside it."""
    messages = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon a"}]
    tokenizer = generator.tokenizer
    # the prompt that opens the assistant's turn, then its text so far: where a ChatML turn's text starts
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages[:1]) + messages[1]["content"])
    expected = generator.generate(prompt_ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                             continues_prompt=True)).text
    for fields in ({"continue_final_message": True, "add_generation_prompt": False},
                   {"continue_final_message": True}):
        ask = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                   extra_body={**fields, "ignore_eos": True})
        assert whole_and_streamed(client, **ask) == [(expected, len(prompt_ids))] * 2
    # without it, the assistant's message is closed and a new turn opened after it
    closed = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens == \
        len(closed) > len(prompt_ids)
    # add_generation_prompt false alone: the messages as they are, no turn opened
    unopened = tokenizer.encode(tokenizer.apply_chat_template(messages[:1]).removesuffix("<|im_start|>assistant\n"))
    reply = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1,
                                           extra_body={"add_generation_prompt": False})
    assert reply.usage.prompt_tokens == len(unopened)


def test_chat_template_kwargs_reach_qwen3_s_template(tmp_path):
    """Qwen3's clients send chat_template_kwargs {"enable_thinking": false}: its template then opens the turn with
    its thinking done (an empty <think> block), and the reply is the model's after that prompt."""
    model_dir = write_tiny_model(tmp_path / "qwen3", seed=0)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    model, tokenizer = OurModel(model_dir), TextTokenizer.load(model_dir)
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32)
    messages = [{"role": "user", "content": "Hi"}]
    thinking = tokenizer.apply_chat_template(messages)
    prompt_ids = tokenizer.encode(thinking + "<think>\n\n</think>\n\n")
    expected = generator.generate(prompt_ids, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)).text
    running = serve(generator)
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        ask = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
        assert whole_and_streamed(client, **ask) == [(expected, len(prompt_ids))] * 2
        default = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        assert default.usage.prompt_tokens == len(tokenizer.encode(thinking))
    finally:
        running.stop()


def test_a_continued_message_s_next_word_keeps_its_space(tmp_path):
    """A SentencePiece decoder drops the space a text starts with: right for a reply of its own, which starts at
    its first word, but a continued message goes on from its last word, so the next one keeps its space (as the
    message and the reply decoded together read)."""
    tokenizer = sentencepiece_tokenizer()
    running = serve_sentencepiece(tmp_path, tokenizer, "{{ messages[-1].content }}")
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        the = tokenizer.token_to_id("▁the")
        ask = dict(model=MODEL, max_tokens=3, temperature=0, logit_bias={str(the): 100})  # "▁the" every time
        prompt = tokenizer.encode("the café", add_special_tokens=False).ids
        decoded = tokenizer.decode(prompt + [the] * 3)
        continued = decoded[len(tokenizer.decode(prompt)):]
        assert continued.startswith(" ")
        messages = [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "the café"}]
        assert whole_and_streamed(client, messages=messages, extra_body={"continue_final_message": True},
                                  **ask) == [(continued, len(prompt))] * 2
        own = client.chat.completions.create(messages=messages[1:], **ask).choices[0].message.content
        assert own == tokenizer.decode([the] * 3) == continued[1:]
    finally:
        running.stop()


def test_stop_closes_the_port(generator):
    running = serve(generator)
    status, _, _ = raw_post(running, "/v1/completions", b"{}")
    assert status == 400
    running.stop()
    running.stop()  # a second stop does nothing
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", running.port), timeout=2).close()
