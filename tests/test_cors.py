"""Browser clients (head.cors_origins): a page of another origin calling the API, as a browser does it, against a
live Waitress server: the preflight, whole and streamed replies, errors, origins left out, and the default of no
CORS headers at all."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from cluster import free_ports, write_topology
from model_helpers import OurModel, serve_app
from tc.generation import Generator
from tc.head.http_server import HttpServer
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tc.topology import load_topology

MODEL = "tiny"
PAGE = "http://localhost:5173"  # where a chat UI's dev server serves it
OTHER = "https://evil.example"
BODY_LIMIT = 64 * 1024
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
# what a browser sends before a POST of JSON with an API key: the OpenAI clients add their X-Stainless-* headers
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


@pytest.fixture(scope="module")
def generator(tiny_model_dir) -> Generator:
    model = OurModel(tiny_model_dir)
    return Generator(model.head, TextTokenizer.load(tiny_model_dir), model.pipeline(), torch.float32)


def serve(generator: Generator, cors_origins: tuple[str, ...], **service_args) -> HttpServer:
    return serve_app(generator, MODEL, BODY_LIMIT, cors_origins, **service_args)


@pytest.fixture(scope="module")
def listed(generator):
    """A server that lets pages of PAGE (and one more origin) call it."""
    running = serve(generator, (PAGE, "https://chat.example.com"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def expected_text(generator) -> str:
    prompt = generator.tokenizer.encode(COMPLETION["prompt"])
    return generator.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0)).text


def call(server: HttpServer, method: str, path: str, headers: dict[str, str],
         body: dict | bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection: status, headers (names lower case, repeated ones joined with ', '), body."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        connection.request(method, path, body=data, headers=headers)
        response = connection.getresponse()
        got: dict[str, str] = {}
        for name, value in response.getheaders():
            got[name.lower()] = f"{got[name.lower()]}, {value}" if name.lower() in got else value
        return response.status, got, response.read()
    finally:
        connection.close()


def words(header: str) -> set[str]:
    return {part.strip().lower() for part in header.split(",") if part.strip()}


def post_json(server: HttpServer, origin: str | None, body: dict | bytes,
              path: str = "/v1/completions") -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", "Authorization": "Bearer none"}
    if origin is not None:
        headers["Origin"] = origin
    return call(server, "POST", path, headers, body)


# --- a listed origin ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_preflight_of_a_listed_origin_is_allowed(listed, path):
    status, headers, body = call(listed, "OPTIONS", path, {"Origin": PAGE, **PREFLIGHT})
    assert 200 <= status < 300 and body == b"", (status, body)
    assert headers["access-control-allow-origin"] == PAGE
    assert "post" in words(headers["access-control-allow-methods"])
    assert {"authorization", "content-type", "x-stainless-os"} <= words(headers["access-control-allow-headers"])
    assert "origin" in words(headers["vary"])  # a cache must not give this answer to another origin's page
    assert "access-control-allow-credentials" not in headers  # the API reads no cookies


def test_a_reply_to_a_listed_origin_says_it_may_read_it(listed, expected_text):
    status, headers, body = post_json(listed, PAGE, COMPLETION)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == expected_text
    assert headers["access-control-allow-origin"] == PAGE
    assert "origin" in words(headers["vary"])
    assert "retry-after" in words(headers["access-control-expose-headers"])  # a page may then wait as told
    status, headers, _ = call(listed, "GET", "/v1/models", {"Origin": "https://chat.example.com"})
    assert status == 200 and headers["access-control-allow-origin"] == "https://chat.example.com"


def test_a_streamed_reply_to_a_listed_origin_says_it_too(listed, expected_text):
    status, headers, body = post_json(listed, PAGE, {**COMPLETION, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["access-control-allow-origin"] == PAGE
    events = [line[len("data: "):] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1]) == expected_text


@pytest.mark.parametrize(("method", "path", "body", "status", "code"), [
    ("POST", "/v1/completions", b"{not json", 400, "invalid_json"),
    ("POST", "/v1/completions", {**COMPLETION, "model": "another"}, 404, "model_not_found"),
    ("GET", "/v1/nowhere", None, 404, "unknown_url"),
    ("GET", "/v1/completions", None, 405, "method_not_allowed"),
    ("POST", "/v1/completions", {**COMPLETION, "prompt": "x" * BODY_LIMIT}, 413, "request_too_large"),
], ids=["bad json", "another model", "unknown route", "wrong method", "body over the limit"])
def test_errors_to_a_listed_origin_say_it_may_read_them(listed, method, path, body, status, code):
    """A page that may not read an error sees only a failed fetch, never why."""
    headers = {"Origin": PAGE, "Content-Type": "application/json"}
    got, headers, data = call(listed, method, path, headers, body)
    assert got == status and json.loads(data)["error"]["code"] == code, data
    assert headers["access-control-allow-origin"] == PAGE


def test_what_waitress_refuses_itself_says_it_too(listed):
    """A body far over the limit is refused by the HTTP server before the app sees it (docs/api.md)."""
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: {PAGE}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {10 * BODY_LIMIT}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", listed.port), timeout=30) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    assert status_line.split()[1] == "413" and json.loads(body)["error"]["code"] == "request_too_large"
    assert headers["access-control-allow-origin"] == PAGE
    assert "origin" in words(headers["vary"])


def test_the_503s_while_the_server_stops_say_it_too(gated):
    """Requests the server refuses while it stops (docs/api.md, shutting_down) never reach the app."""
    server = serve(gated, (PAGE,), max_batch=1)
    running = threading.Thread(target=post_json, args=(server, PAGE, {**COMPLETION, "ignore_eos": True}))
    running.start()
    stopper = threading.Thread(target=server.stop, args=(30,))
    try:
        wait_for(lambda: json.loads(call(server, "GET", "/v1/cluster", {})[2])["batch"]["in_use"] == 1,
                 "the generation to hold its place")
        stopper.start()  # it now waits for that generation to finish, and refuses what comes meanwhile
        replies: list = []
        wait_for(lambda: replies.append(call(server, "GET", "/health", {"Origin": PAGE})) or replies[-1][0] == 503,
                 "the server to refuse requests")
        status, headers, body = replies[-1]
        assert json.loads(body)["error"]["code"] == "shutting_down"
        assert headers["access-control-allow-origin"] == PAGE
        # the page may read when to come back, as from the app's own 503s, and no cache hands this to another origin
        assert headers["retry-after"] and "retry-after" in words(headers["access-control-expose-headers"])
        assert "origin" in words(headers["vary"])
    finally:
        gated.pipeline.gate.set()
        running.join(30)
        if stopper.ident is None:
            server.stop()
        stopper.join(30)


def wait_for(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- an origin not listed, and the default --------------------------------------------------------------------------

def test_a_page_of_an_origin_not_listed_is_not_allowed(listed, expected_text):
    status, headers, _ = call(listed, "OPTIONS", "/v1/chat/completions", {"Origin": OTHER, **PREFLIGHT})
    assert not any(name.startswith("access-control-") for name in headers), headers
    status, headers, body = post_json(listed, OTHER, COMPLETION)  # served, but the browser keeps it from the page
    assert status == 200 and json.loads(body)["choices"][0]["text"] == expected_text
    assert not any(name.startswith("access-control-") for name in headers), headers
    status, headers, _ = post_json(listed, OTHER, b"{not json")
    assert status == 400 and "access-control-allow-origin" not in headers


@pytest.fixture(scope="module")
def default(generator):
    running = serve(generator, ())
    yield running
    running.stop()


def test_by_default_no_reply_carries_cors_headers(default):
    """As before head.cors_origins: a browser keeps every other origin's page from reading the replies."""
    replies = [call(default, "OPTIONS", "/v1/chat/completions", {"Origin": PAGE, **PREFLIGHT}),
               post_json(default, PAGE, COMPLETION), post_json(default, PAGE, {**COMPLETION, "stream": True}),
               post_json(default, PAGE, b"{not json")]
    assert [status for status, _, _ in replies] == [200, 200, 200, 400]
    for _, headers, _ in replies:
        assert not any(name.startswith("access-control-") for name in headers), headers
        assert "origin" not in words(headers.get("vary", ""))


def test_any_origin(generator):
    server = serve(generator, ("*",))
    try:
        status, headers, _ = call(server, "OPTIONS", "/v1/chat/completions", {"Origin": OTHER, **PREFLIGHT})
        assert 200 <= status < 300 and headers["access-control-allow-origin"] == "*"
        assert {"authorization", "content-type"} <= words(headers["access-control-allow-headers"])
        for body in (COMPLETION, {**COMPLETION, "stream": True}, b"{not json"):
            status, headers, _ = post_json(server, OTHER, body)
            assert headers["access-control-allow-origin"] == "*", status
            assert "origin" not in words(headers.get("vary", ""))  # the same answer for every page
    finally:
        server.stop()


# --- through the topology file ---------------------------------------------------------------------------------------

def test_the_head_serves_the_origins_its_topology_lists(tmp_path: Path, tiny_model_dir):
    """head.cors_origins reaches the head's server: its API answers a page's preflight, and its 503 while no worker
    has joined is readable by the page."""
    from tc.head.main import start_head

    api, listen = free_ports(2)
    path = write_topology(tmp_path / "t.yaml", tiny_model_dir, [{"id": "w", "device": "cpu"}],
                          head={"api": f"127.0.0.1:{api}", "listen": f"127.0.0.1:{listen}", "cors_origins": [PAGE]})
    head = start_head(load_topology(path))
    try:
        status, headers, _ = call(head.http, "OPTIONS", "/v1/chat/completions", {"Origin": PAGE, **PREFLIGHT})
        assert 200 <= status < 300 and headers["access-control-allow-origin"] == PAGE
        status, headers, body = post_json(head.http, PAGE, {**COMPLETION, "model": Path(tiny_model_dir).name})
        assert status == 503 and json.loads(body)["error"]["code"] == "cluster_not_ready"
        assert headers["access-control-allow-origin"] == PAGE
        assert "retry-after" in headers
    finally:
        head.stop()
