"""API keys (head.api_keys) against a live Waitress server: what a client without one, with a wrong one, or with one
in the wrong form gets; what stays open; the OpenAI clients; browsers; and the keys kept out of logs and replies.
The topology's checks of the keys are in test_topology.py; the demo cluster behind a key in test_demo_openai.py."""
from __future__ import annotations

import http.client
import json
import logging
from pathlib import Path

import openai
import pytest
import torch

from cluster import free_ports, write_topology
from model_helpers import OurModel, serve_app
from tc.generation import Generator
from tc.head.api import create_loading_app
from tc.head.http_server import HttpServer, start_http_server
from tc.head.loading import HeadLoading
from tc.head.metrics import Metrics
from tc.head.service import Readiness
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tc.topology import load_topology

MODEL = "tiny"
KEY, OTHER_KEY = "sk-first-key-0123456789abcdef", "sk-second-key-fedcba9876543210"
BODY_LIMIT = 64 * 1024
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
PAGE = "http://localhost:5173"


@pytest.fixture(scope="module")
def generator(tiny_model_dir) -> Generator:
    model = OurModel(tiny_model_dir)
    return Generator(model.head, TextTokenizer.load(tiny_model_dir), model.pipeline(), torch.float32)


@pytest.fixture(scope="module")
def server(generator):
    """A server with two keys, whose pages of PAGE may call it from a browser."""
    running = serve_app(generator, MODEL, BODY_LIMIT, (PAGE,), (KEY, OTHER_KEY))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def expected_text(generator) -> str:
    prompt = generator.tokenizer.encode(COMPLETION["prompt"])
    return generator.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0)).text


def call(server: HttpServer, method: str, path: str, headers: dict[str, str] | None = None,
         body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection: status, headers (names lower case), body."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body).encode(),
                           headers=headers or {})
        response = connection.getresponse()
        return response.status, {name.lower(): value for name, value in response.getheaders()}, response.read()
    finally:
        connection.close()


def refused(reply: tuple[int, dict[str, str], bytes]) -> str:
    """The message of a 401 of OpenAI's shape, after checking that shape."""
    status, headers, body = reply
    assert status == 401, (status, body)
    assert headers["www-authenticate"] == "Bearer"
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key", error
    return error["message"]


def test_either_key_is_answered_and_the_answer_is_the_models(server, expected_text):
    for key in (KEY, OTHER_KEY):
        status, _, body = call(server, "POST", "/v1/completions", {"Authorization": f"Bearer {key}"}, COMPLETION)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == expected_text, body
    # the scheme's name is not case-sensitive (RFC 9110), and spaces around the key are not part of it
    status, _, body = call(server, "POST", "/v1/completions", {"Authorization": f"bearer  {KEY} "}, COMPLETION)
    assert status == 200, body


@pytest.mark.parametrize("authorization, says", [
    (None, "You didn't provide an API key"),
    ("", "You didn't provide an API key"),
    ("Bearer", "You didn't provide an API key"),
    (f"Bearer {KEY}x", "Incorrect API key provided"),
    (f"Bearer {KEY[:-1]}", "Incorrect API key provided"),
    (f"Bearer {KEY},{OTHER_KEY}", "Incorrect API key provided"),
    (f"{KEY}", "must use Bearer auth"),  # the key without its scheme
    ("Basic dXNlcjpwYXNz", "must use Bearer auth"),
    ("Bearer sk-caf\u00e9-0123456789abcdef", "Incorrect API key provided"),  # not ASCII: no key is
], ids=["none", "empty", "bearer alone", "longer", "shorter", "two keys", "no scheme", "basic", "latin-1"])
def test_a_request_without_one_of_the_keys_gets_a_401_that_says_what_to_send(server, authorization, says):
    headers = {} if authorization is None else {"Authorization": authorization}
    if authorization and not authorization.isascii():
        headers = {"Authorization": authorization.encode("latin-1")}  # as a client sends a latin-1 header
    message = refused(call(server, "POST", "/v1/completions", headers, COMPLETION))
    assert says in message, message
    assert "Incorrect" in says or "Authorization: Bearer YOUR_KEY" in message, message
    assert KEY not in message and OTHER_KEY not in message and "dXNlcjpwYXNz" not in message


def test_every_v1_route_wants_a_key_and_the_health_and_metrics_routes_do_not(server):
    for method, path in [("GET", "/v1/models"), ("HEAD", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
                         ("GET", "/v1/cluster"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models/"),
                         ("PUT", "/v1/completions")]:
        status, headers, _ = call(server, method, path)
        assert status == 401 and headers["www-authenticate"] == "Bearer", (method, path, status)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(server, "GET", "/v1/models", auth)[0] == 200
    assert call(server, "PUT", "/v1/completions", auth)[0] == 405  # the key first, then the method
    for path in ("/health", "/health/ready", "/metrics"):
        assert call(server, "GET", path)[0] == 200, path
    for path in ("/v1/no-such-route", "/no-such-route"):  # no route: nothing to protect, the 404 that lists them
        assert call(server, "GET", path)[0] == 404, path


def test_the_openai_clients_with_the_key_and_without(server, expected_text):
    base_url = f"http://127.0.0.1:{server.port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)
    assert client.completions.create(**COMPLETION).choices[0].text == expected_text
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, stream=True)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] in ("length", "stop")
    stranger = openai.OpenAI(base_url=base_url, api_key="sk-someone-elses-key-0000", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as error:
        stranger.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         stream=True)
    assert error.value.status_code == 401 and error.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def test_a_browser_page_gets_its_preflight_without_a_key_and_can_read_the_401(server):
    """A preflight never carries credentials, so it is answered as without keys; the POST it announces is checked,
    and its 401 carries the CORS headers, so the page can show why."""
    status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions", {
        "Origin": PAGE, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert 200 <= status < 300 and headers["access-control-allow-origin"] == PAGE
    assert "authorization" in headers["access-control-allow-headers"].lower()
    reply = call(server, "POST", "/v1/chat/completions", {"Origin": PAGE, "Content-Type": "application/json"},
                 {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    refused(reply)
    assert reply[1]["access-control-allow-origin"] == PAGE
    assert "www-authenticate" in reply[1]["access-control-expose-headers"].lower()


def test_refused_requests_are_logged_and_counted_without_the_keys(server, caplog):
    caplog.set_level(logging.DEBUG)
    refused(call(server, "POST", "/v1/completions", {"Authorization": f"Bearer {KEY}-not"}, COMPLETION))
    refused(call(server, "POST", "/v1/completions", {"Authorization": KEY}, COMPLETION))
    assert "POST /v1/completions 401" in caplog.text
    assert KEY not in caplog.text
    _, _, metrics = call(server, "GET", "/metrics")
    assert 'tc_http_requests_total{method="POST",route="/v1/completions",status="401"}' in metrics.decode()


def test_the_app_of_a_loading_head_asks_for_a_key_too():
    """While the head loads its model it serves create_loading_app: /v1/models answers then, with a key only."""
    loading = HeadLoading(MODEL, 4096, lambda: Readiness(1, (), ("w1",)))
    running = start_http_server(create_loading_app(loading, Metrics(), api_keys=(KEY,)), "127.0.0.1", 0, threads=2)
    try:
        refused(call(running, "GET", "/v1/models"))
        refused(call(running, "POST", "/v1/completions", {"Authorization": "Bearer sk-wrong-0123456789abc"},
                     COMPLETION))
        status, _, body = call(running, "GET", "/v1/models", {"Authorization": f"Bearer {KEY}"})
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
        status, _, body = call(running, "POST", "/v1/completions", {"Authorization": f"Bearer {KEY}"}, COMPLETION)
        assert status == 503 and json.loads(body)["error"]["code"] == "model_loading", body
        assert call(running, "GET", "/health")[0] == 503  # open, and saying it loads
    finally:
        running.stop()


def test_a_path_with_leading_slashes_wants_a_key_under_any_wsgi_server():
    """Falcon's router reads "//v1/models" as "/v1/models"; the key check read it as no /v1 route, so under a WSGI
    server that passes the path as sent (Waitress folds the slashes itself) it answered without a key."""
    from falcon import testing

    loading = HeadLoading(MODEL, 4096, lambda: Readiness(1, (), ("w1",)))
    client = testing.TestClient(create_loading_app(loading, Metrics(), api_keys=(KEY,)))
    for path in ("/v1/models", "//v1/models", "///v1/models"):
        assert client.simulate_get(path).status_code == 401, path
    assert client.simulate_get("//v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_head_asks_for_a_key_once_it_serves(tmp_path: Path, tiny_model_dir, caplog):
    """head.api_keys reaches the head's server; its start says so in the log, and the topology's repr never shows
    the keys."""
    from tc.head.main import start_head

    caplog.set_level(logging.INFO)
    api, listen = free_ports(2)
    path = write_topology(tmp_path / "t.yaml", tiny_model_dir, [{"id": "w", "device": "cpu"}],
                          head={"api": f"127.0.0.1:{api}", "listen": f"127.0.0.1:{listen}", "api_keys": [KEY]})
    topology = load_topology(path)
    assert KEY not in repr(topology)
    head = start_head(topology)
    try:
        completion = {**COMPLETION, "model": Path(tiny_model_dir).name}
        refused(call(head.http, "POST", "/v1/completions", {}, completion))
        status, _, body = call(head.http, "POST", "/v1/completions", {"Authorization": f"Bearer {KEY}"}, completion)
        assert status == 503 and json.loads(body)["error"]["code"] == "cluster_not_ready", body  # no worker yet
        assert call(head.http, "GET", "/health")[0] == 200
    finally:
        head.stop()
    assert "its /v1 routes want one of 1 API key (head.api_keys)" in caplog.text
    assert KEY not in caplog.text
