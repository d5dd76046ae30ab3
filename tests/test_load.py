"""Load on a real cluster: 32 concurrent clients, a bounded queue, and SIGTERM in the middle of it.

Every request must get an answer: its completion, or a 429 when the queue (head.max_queue) is full, or during
shutdown a 503. None may be lost or left hanging, and the head's memory must not grow with the number of requests
served.
"""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections import Counter

import psutil
import pytest
import torch

from cluster import Cluster, write_topology
from model_helpers import OurModel
from tc.generation import Generator
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

CLIENTS = 32
PER_CLIENT = 4
MAX_QUEUE = 4
MAX_BATCH = 2
PROMPTS = ["the quick brown fox", "hello there", "once upon a time", "a b c d"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=11)


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[str, str]:
    model = OurModel(model_dir)
    tok = TextTokenizer.load(model_dir)
    gen = Generator(model.head, tok, model.pipeline(), torch.float32)
    return {p: gen.generate(tok.encode(p), SamplingParams(MAX_TOKENS, temperature=0)).text for p in PROMPTS}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("load")
    topo = write_topology(tmp / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}],
                          head={"max_queue": MAX_QUEUE, "max_batch": MAX_BATCH, "heartbeat_s": 1})
    with Cluster(topo, tmp) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")
        cluster.start_worker("b")
        cluster.wait_ready()
        yield cluster


def one_request(port: int, prompt: str, timeout: float = 120) -> tuple:
    """(status, body, Retry-After) of one completion; ("refused", text, None) when nothing accepted the connection
    (no server: the request was never sent); ("error", text, None) when a request was sent and no HTTP answer came.
    """
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        try:
            connection.connect()
        except ConnectionRefusedError as exc:
            return "refused", f"{type(exc).__name__}: {exc}", None
        body = json.dumps({"model": "tiny-qwen", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True})
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read()), response.getheader("Retry-After")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return "error", f"{type(exc).__name__}: {exc}", None
    finally:
        connection.close()


def storm(port: int, clients: int = CLIENTS, per_client: int = PER_CLIENT, timeout: float = 120,
          during=None) -> list[tuple]:
    """Each client sends `per_client` requests back to back; returns every outcome (one per request sent)."""
    outcomes: list[tuple] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        start.wait()
        for i in range(per_client):
            prompt = PROMPTS[(index + i) % len(PROMPTS)]
            outcome = one_request(port, prompt, timeout)
            with lock:
                outcomes.append((prompt, *outcome))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    if during is not None:
        during()
    deadline = time.monotonic() + timeout + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hanging = sum(t.is_alive() for t in threads)
    assert hanging == 0, f"{hanging} clients still waiting: requests left hanging"
    return outcomes


def head_rss(cluster: Cluster) -> int:
    return psutil.Process(cluster.head.proc.pid).memory_info().rss


def test_every_request_gets_its_completion_or_a_429(cluster, expected):
    outcomes = storm(cluster.api_port)
    assert len(outcomes) == CLIENTS * PER_CLIENT  # nothing lost
    counts = Counter(o[1] for o in outcomes)
    assert set(counts) <= {200, 429}, [o for o in outcomes if o[1] not in (200, 429)][:5]
    assert counts[200] >= 1
    for prompt, status, body, retry_after in outcomes:
        if status == 200:
            assert body["choices"][0]["text"] == expected[prompt]
        else:
            assert body["error"]["type"] == "rate_limit_exceeded" and body["error"]["code"] == "server_busy"
            assert retry_after == "1"
    print(f"\n{CLIENTS} clients x {PER_CLIENT}: {counts[200]} completions, {counts[429]} refused with 429")


def test_memory_stays_bounded_over_rounds_of_load(cluster):
    storm(cluster.api_port, per_client=2)  # warm up: caches, thread stacks, allocator pools
    before = head_rss(cluster)
    for _ in range(3):
        storm(cluster.api_port, per_client=2)
    grown = head_rss(cluster) - before
    assert grown < 40 * 2**20, f"the head grew by {grown / 2**20:.1f} MiB over 3 rounds of {CLIENTS * 2} requests"
    assert cluster.get("/health/ready")[0] == 200


def test_the_queue_bound_holds(cluster):
    """With the batch held up in a step, max_batch requests hold its places (one running, the others admitted at
    the next step boundary), max_queue more wait, and the rest are refused at once."""
    worker = cluster.workers["b"]
    worker.proc.send_signal(signal.SIGSTOP)  # the request in flight waits at b (well within the heartbeat limit)
    try:
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(one_request(cluster.api_port, PROMPTS[0])))
                   for _ in range(MAX_QUEUE + MAX_BATCH + 6)]
        for t in threads:
            t.start()
            time.sleep(0.02)
        time.sleep(0.5)
        refused = len([r for r in results if r[0] == 429])
        assert refused == len(threads) - MAX_QUEUE - MAX_BATCH, results
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert sum(r[0] == 200 for r in results) == len(threads) - refused


def choices_request(port: int, n: int, timeout: float = 120) -> tuple:
    """(status, body) of one completion of `n` choices."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = json.dumps({"model": "tiny-qwen", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True, "n": n})
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_the_queue_bound_counts_requests_whatever_their_n(cluster):
    """max_queue requests may wait, each of several choices: the 429 comes to the one that finds max_queue
    requests waiting, not to one that finds their choices adding up to max_queue."""
    worker = cluster.workers["b"]
    worker.proc.send_signal(signal.SIGSTOP)  # the batch's first step waits at b: nothing leaves the queue
    try:
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(choices_request(cluster.api_port, MAX_BATCH)))
                   for _ in range(1 + MAX_QUEUE + 1)]  # one fills the batch, MAX_QUEUE wait, one is refused
        for t in threads:
            t.start()
            time.sleep(0.05)
        time.sleep(0.5)
        assert [r[0] for r in results] == [429], results
        assert results[0][1]["error"]["code"] == "server_busy"
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert sorted(r[0] for r in results) == [200] * (1 + MAX_QUEUE) + [429], results
    for status, body in results:
        if status == 200:
            assert len(body["choices"]) == MAX_BATCH


def test_sigterm_under_load_answers_or_refuses_everyone_and_exits(cluster):
    def terminate() -> None:
        time.sleep(0.5)
        cluster.head.proc.send_signal(signal.SIGTERM)

    outcomes = storm(cluster.api_port, per_client=6, timeout=30, during=terminate)
    assert cluster.head.proc.wait(30) == 0
    counts = Counter(o[1] for o in outcomes)
    # every request the head accepted got an HTTP answer; once it has stopped, connections are refused
    errors = [o[2] for o in outcomes if o[1] == "error"]
    assert not errors, errors[:5]
    assert set(counts) <= {200, 429, 503, "refused"}, counts
    for _, status, body, _ in outcomes:
        if status == 503:
            assert body["error"]["type"] in ("cluster_not_ready", "service_unavailable", "worker_lost"), body
    print(f"\nSIGTERM under load: {dict(counts)}")
