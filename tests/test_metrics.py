"""Seeing the cluster: /metrics (read back with prometheus_client's own parser), /v1/cluster, health, and the
same on a real head with a real worker process."""
from __future__ import annotations

import json
import socket
import time

import openai
import prometheus_client
import pytest
import torch
from falcon import testing
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, write_topology
from model_helpers import OurModel
from tc.generation import Generator
from tc.head.api import create_app
from tc.head.main import load_config_and_plan
from tc.head.metrics import Metrics
from tc.head.service import GenerationService, Readiness
from tc.head.workers import WorkerRegistry
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tc.topology import load_topology
from tiny_model import write_tiny_model

MODEL = "tiny"
READY = Readiness(2, ("a", "b"), ())

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by (sample name, its labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(client: testing.TestClient) -> Samples:
    result = client.simulate_get("/metrics")
    assert result.status_code == 200
    assert result.headers["content-type"].startswith("text/plain")
    return parse(result.text)


@pytest.fixture(scope="module")
def generator(tiny_model_dir) -> Generator:
    model = OurModel(tiny_model_dir)
    return Generator(model.head, TextTokenizer.load(tiny_model_dir), model.pipeline(), torch.float32)


def make_client(generator: Generator, readiness=lambda: READY, **kwargs) -> tuple[testing.TestClient,
                                                                                  GenerationService]:
    service = GenerationService(MODEL, generator.tokenizer, generator, readiness, **kwargs)
    return testing.TestClient(create_app(service)), service


def test_metrics_parse_and_counters_move(generator):
    client, _ = make_client(generator)
    before = scrape(client)
    assert value(before, "tc_prompt_tokens_total") == 0
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert client.simulate_post("/v1/completions", json=body).status_code == 200
    assert client.simulate_post("/v1/completions", json={**body, "stream": True}).status_code == 200
    assert client.simulate_post("/v1/completions", json={**body, "max_tokens": -1}).status_code == 400
    after = scrape(client)
    route = {"method": "POST", "route": "/v1/completions"}
    assert value(after, "tc_http_requests_total", **route, status="200") == 2
    assert value(after, "tc_http_requests_total", **route, status="400") == 1
    assert value(after, "tc_http_requests_total", method="GET", route="/metrics", status="200") == 1
    assert value(after, "tc_prompt_tokens_total") == 2 * len(generator.tokenizer.encode("Hello"))
    assert value(after, "tc_completion_tokens_total") == 8
    assert value(after, "tc_generations_total", outcome="length") == 2
    assert value(after, "tc_time_to_first_token_seconds_count") == 2
    assert value(after, "tc_time_to_first_token_seconds_sum") > 0
    assert value(after, "tc_decode_step_seconds_count") == 6  # 3 decodes after each prefill
    assert value(after, "tc_queue_wait_seconds_count") == 2
    assert value(after, "tc_queue_depth") == 0 and value(after, "tc_requests_running") == 0
    # no remote pipeline here: no hops were observed
    assert not [k for k in after if k[0].startswith(("tc_stage_compute", "tc_hop_network")) and after[k]]


def test_a_request_refused_with_a_429_is_not_a_failed_generation(gated):
    """Load shed at a full queue is counted as the HTTP status it is, not as generations that failed (dashboards
    alert on those)."""
    client, service = make_client(gated, max_queue=0, max_batch=1)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    with service.open(gated.tokenizer.encode("Hello"), SamplingParams(max_tokens=3, temperature=0)) as stream:
        assert client.simulate_post("/v1/completions", json=body).status_code == 429  # it holds the batch's place
        gated.pipeline.gate.set()
        stream.drain()
    samples = scrape(client)
    route = {"method": "POST", "route": "/v1/completions"}
    assert value(samples, "tc_http_requests_total", **route, status="429") == 1
    assert value(samples, "tc_generations_total", outcome="error") == 0
    assert value(samples, "tc_generations_total", outcome="length") == 1  # the one that ran


@pytest.mark.filterwarnings("ignore:Unknown REQUEST_METHOD")  # the test client's WSGI check says so too
def test_a_method_http_does_not_define_counts_as_other_not_as_a_series_of_its_own(generator):
    # any token is a method to the HTTP server: one series per name sent grew /metrics and the head without bound
    client, _ = make_client(generator)
    for method in ("FOO1", "FOO2", "X" * 40):
        assert client.simulate_request(method, "/health").status_code in (400, 405)
    samples = scrape(client)
    methods = {dict(labels)["method"] for name, labels in samples if name == "tc_http_requests_total"}
    assert methods == {"other"}  # the scrape counts once it is answered
    assert sum(v for (name, labels), v in samples.items()
               if name == "tc_http_requests_total" and dict(labels)["method"] == "other") == 3


def test_node_up_follows_readiness(generator):
    client, _ = make_client(generator, readiness=lambda: Readiness(3, ("a",), ("b", "c")))
    samples = scrape(client)
    assert value(samples, "tc_node_up", node="a") == 1
    assert value(samples, "tc_node_up", node="b") == 0 and ("tc_node_up", frozenset({("node", "c")})) in samples


def test_each_app_has_its_own_registry(generator):
    first, _ = make_client(generator)
    second, _ = make_client(generator)
    first.simulate_post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "ignore_eos": True})
    assert value(scrape(first), "tc_generations_total", outcome="length") == 1
    assert value(scrape(second), "tc_generations_total", outcome="length") == 0
    assert "tc_generations_total" not in prometheus_client.generate_latest().decode()  # the global one is untouched


def test_hops_split_into_compute_and_network():
    metrics = Metrics()
    metrics.watch(lambda: 0, lambda: 0, lambda: Readiness(2, (), ("a", "b")), slots=lambda: 8,
                  tokens_per_s=lambda: 0.0)
    metrics.observe_step("decode", [("a", 0.010, 0.013), ("b", 0.020, 0.021), ("b", 0.005, 0.004)])
    samples = parse(metrics.render()[0].decode())
    assert value(samples, "tc_stage_compute_seconds_sum", node="a", phase="decode") == pytest.approx(0.010)
    assert value(samples, "tc_hop_network_seconds_sum", node="a", phase="decode") == pytest.approx(0.003)
    # a round trip measured under the reported compute (clocks differ) counts as no network time, not negative
    assert value(samples, "tc_hop_network_seconds_sum", node="b", phase="decode") == pytest.approx(0.001)
    assert value(samples, "tc_hop_network_seconds_count", node="b", phase="decode") == 2


def test_queue_depth_counts_waiting_generations(gated):
    client, service = make_client(gated)
    with service.open(gated.tokenizer.encode("Hello"), SamplingParams(max_tokens=3, temperature=0)) as stream:
        samples = scrape(client)  # while its next step waits at the gate
        assert value(samples, "tc_requests_running") == 1 and value(samples, "tc_queue_depth") == 0
        body = client.simulate_get("/v1/cluster").json
        assert body["queue"] == {"waiting": 0, "running": 1, "limit": 16}
        gated.pipeline.gate.set()
        stream.drain()
    assert value(scrape(client), "tc_requests_running") == 0


def test_cluster_route_without_workers_describes_the_process(generator):
    client, _ = make_client(generator, readiness=lambda: Readiness(1, (), ("w1",)))
    body = client.simulate_get("/v1/cluster").json
    assert body == {"object": "cluster", "model": MODEL, "ready": False, "required_nodes": 1, "ready_nodes": [],
                    "missing_nodes": ["w1"], "queue": {"waiting": 0, "running": 0, "limit": 16},
                    "batch": {"slots": 8, "in_use": 0, "kept": 0, "prefill_chunk": 256, "tokens_per_s": 0.0,
                              "sequences": []},
                    "plan": None, "nodes": []}


def test_cluster_route_shows_the_plan_and_each_node(tmp_path, generator, tiny_model_dir):
    topology = load_topology(write_topology(tmp_path / "t.yaml", tiny_model_dir,
                                            [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]))
    _, config, plan = load_config_and_plan(topology)
    registry = WorkerRegistry(topology, plan, config)  # not started: every node is waiting for its worker
    service = GenerationService(MODEL, generator.tokenizer, generator, registry.readiness)
    client = testing.TestClient(create_app(service, cluster=registry))
    body = client.simulate_get("/v1/cluster").json
    assert body["ready"] is False and body["missing_nodes"] == ["a", "b"]
    assert body["plan"]["num_layers"] == config.num_hidden_layers
    assert [s["layers"] for s in body["plan"]["stages"]] == [[0, 2], [2, 4]]
    assert [n["id"] for n in body["nodes"]] == ["a", "b"]
    assert {n["state"] for n in body["nodes"]} == {"waiting"}
    ready = client.simulate_get("/health/ready")
    assert ready.status_code == 503 and ready.json["missing_nodes"] == ["a", "b"]
    assert client.simulate_get("/health").json == {"status": "ok"}
    samples = scrape(client)
    assert value(samples, "tc_node_up", node="a") == 0 and value(samples, "tc_node_up", node="b") == 0


def test_the_live_gauges_answer_while_the_head_loads(tmp_path, tiny_model_dir, monkeypatch):
    """/metrics answers while the head loads its tensors (minutes for a large model), and showed no tc_node_up
    then: an alert on a node down could not fire. A real head, held in its load (at its tokenizer) by the test."""
    import threading
    import urllib.request

    from cluster import free_port
    from tc.head import main as head_main

    port = free_port()
    topology = load_topology(write_topology(tmp_path / "t.yaml", tiny_model_dir, [
        {"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}])).with_ports(api_port=port, listen_port=0)
    reached, release = threading.Event(), threading.Event()
    load = TextTokenizer.load

    def held(*args, **kwargs):
        reached.set()
        release.wait(60)
        return load(*args, **kwargs)

    monkeypatch.setattr(head_main.TextTokenizer, "load", held)
    heads: list = []
    starting = threading.Thread(target=lambda: heads.append(head_main.start_head(topology)), daemon=True)
    starting.start()
    try:
        assert reached.wait(60), "the head did not reach its tokenizer"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            samples = parse(reply.read().decode())
        for node in ("a", "b"):
            assert ("tc_node_up", frozenset({("node", node)})) in samples and \
                value(samples, "tc_node_up", node=node) == 0
        assert ("tc_batch_slots", frozenset()) in samples and value(samples, "tc_batch_slots") == 8
        assert ("tc_queue_depth", frozenset()) in samples
    finally:
        release.set()
        starting.join(60)
        for head in heads:
            head.stop()
    assert heads, "the head did not start"


# --- a real head and worker ------------------------------------------------------------------------------------

def local_greedy(model_dir, prompt: str, max_tokens: int) -> str:
    model = OurModel(model_dir)
    tokenizer = TextTokenizer.load(model_dir)
    generator = Generator(model.head, tokenizer, model.pipeline(), torch.float32)
    return generator.generate(tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                       ignore_eos=True)).text


def get_text(cluster: Cluster, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(cluster.url + path, timeout=10) as reply:
        return reply.read().decode()


@pytest.mark.slow
def test_a_real_cluster_streams_and_reports_its_stages(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny-qwen", seed=5)
    # one token a step (no drafts), so that each generation's decode steps are its tokens but the first
    topology = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}],
                              head={"draft_tokens": 0})
    expected = local_greedy(model_dir, "the quick brown fox", 12)
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")
        cluster.wait_ready()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=120)
        # a client that walks away mid-stream leaves nothing behind: the next request starts with a prefill
        body = json.dumps({"model": "tiny-qwen", "prompt": "Hello", "max_tokens": 200, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", cluster.api_port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data: ") < 3:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        sock.close()
        chunks = list(client.completions.create(model="tiny-qwen", prompt="the quick brown fox", max_tokens=12,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == expected
        whole = client.completions.create(model="tiny-qwen", prompt="the quick brown fox", max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == expected

        status, view = cluster.get("/v1/cluster")
        assert status == 200 and view["ready"] is True and view["plan"]["stages"][0]["layers"] == [0, 4]
        (node,) = view["nodes"]
        assert node["id"] == "a" and node["state"] == "ready" and node["device"] == "cpu"
        assert node["layers"] == [0, 4] and node["seconds_since_heard"] < 30 and node["loaded_weight_bytes"] > 0
        deadline = time.monotonic() + 30
        while True:  # the abandoned stream is counted when Waitress notices the client has gone
            samples = parse(get_text(cluster, "/metrics"))
            if value(samples, "tc_generations_total", outcome="abandoned") == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert value(samples, "tc_generations_total", outcome="abandoned") == 1
        assert value(samples, "tc_generations_total", outcome="length") == 2
        assert value(samples, "tc_node_up", node="a") == 1
        assert value(samples, "tc_stage_compute_seconds_count", node="a", phase="prefill") == 3
        # 11 decodes for each whole generation, and at least the 2 the abandoned one had sent
        assert value(samples, "tc_stage_compute_seconds_count", node="a", phase="decode") >= 24
        assert value(samples, "tc_hop_network_seconds_count", node="a", phase="decode") == \
            value(samples, "tc_stage_compute_seconds_count", node="a", phase="decode")
        assert value(samples, "tc_hop_network_seconds_sum", node="a", phase="decode") > 0
        head_log = cluster.head.output()
        assert " finish=abandoned " in head_log and head_log.count("POST /v1/completions 200 id=cmpl-") == 3
