"""Lost workers, stopped workers, a head that comes back, resuming a request, spares, and SIGTERM.

Real head and worker processes on a tiny model over loopback. To be sure a worker goes away while a request is
in flight (a tiny model generates in well under a second), the tests first freeze the worker with SIGSTOP while
the request runs, then kill, continue or signal it.
"""
from __future__ import annotations

import re
import signal
import socket
import time
import urllib.request

import pytest
import torch

from cluster import WORKER_JOIN_S, Cluster, Process, Request, write_topology
from model_helpers import OurModel
from tc.generation import Generator
from tc.head.pipeline import grace_ended
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

PROMPT = "the quick brown fox"
LONG = 200  # tokens: long enough that a request is still running when a worker is frozen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=7, shards=2)


@pytest.fixture(scope="module")
def alone(model_dir):
    """The single-process model's completion of PROMPT, as a function of its sampling parameters."""
    model = OurModel(model_dir)
    tok = TextTokenizer.load(model_dir)
    gen = Generator(model.head, tok, model.pipeline(), torch.float32)
    return lambda params: gen.generate(tok.encode(PROMPT), params)


@pytest.fixture(scope="module")
def greedy(alone):
    """Greedy text of the single-process model, as a function of max_tokens."""
    cache: dict[int, str] = {}

    def run(max_tokens: int) -> str:
        if max_tokens not in cache:
            cache[max_tokens] = alone(SamplingParams(max_tokens, temperature=0, ignore_eos=True)).text
        return cache[max_tokens]

    return run


def long_request(cluster: Cluster, max_tokens: int = LONG, **fields) -> Request:
    """A greedy completion of exactly max_tokens tokens (`fields` added to its body), posted from a thread."""
    return Request(cluster, {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                             "ignore_eos": True, **fields})


def freeze_mid_request(cluster: Cluster, worker: Process, max_tokens: int = LONG, **fields) -> Request:
    """Start a request and SIGSTOP `worker` while it runs; the request is then held at that worker."""
    for delay in (0.15, 0.05, 0.0):
        request = long_request(cluster, max_tokens, **fields)
        time.sleep(delay)
        worker.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        if request.thread.is_alive():
            return request
        worker.proc.send_signal(signal.SIGCONT)  # it finished first: try again, sooner
        status, body = request.wait(1)
        assert status == 200, body
    # the worker is frozen before the request is sent: it still reaches that worker and waits there
    worker.proc.send_signal(signal.SIGSTOP)
    request = long_request(cluster, max_tokens, **fields)
    time.sleep(0.5)
    assert request.thread.is_alive()
    return request


def start(tmp_path, model_dir, nodes=("a", "b"), workers=("a", "b"), *extra: str, **head) -> Cluster:
    head = {"heartbeat_s": 0.5, "heartbeat_timeout_s": 3, **head}
    node_list = [{"id": n, "device": "cpu", **({"spare": True} if n.startswith("spare") else {})} for n in nodes]
    topo = write_topology(tmp_path / "t.yaml", model_dir, node_list, head=head)
    cluster = Cluster(topo, tmp_path)
    cluster.start_head()
    cluster.wait_api()
    for node in workers:
        cluster.start_worker(node, "--retry-max-s", "1", *extra)
    cluster.wait_ready()
    return cluster


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def assert_serves(cluster: Cluster, greedy, max_tokens: int = 12) -> None:
    status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": PROMPT,
                                                    "max_tokens": max_tokens, "temperature": 0,
                                                    "ignore_eos": True})
    assert status == 200, body
    assert body["choices"][0]["text"] == greedy(max_tokens)


def test_killed_worker_fails_the_request_within_a_second_then_rejoins(tmp_path, model_dir, greedy):
    with start(tmp_path, model_dir, resume=False) as cluster:
        b = cluster.workers["b"]
        request = freeze_mid_request(cluster, b)
        killed_at = time.monotonic()
        b.proc.kill()
        status, body = request.wait(10)
        assert request.answered_at - killed_at < 1.0, "the error took more than a second"
        assert status == 503, body
        assert body["error"]["type"] == "worker_lost" and body["error"]["code"] == "worker_lost"
        assert "worker b" in body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
        # the head stays up and says why it cannot serve
        assert cluster.get("/v1/models")[0] == 200
        assert cluster.get("/health")[0] == 200
        status, ready = cluster.get("/health/ready")
        assert status == 503 and ready["missing_nodes"] == ["b"]
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 4})
        assert status == 503 and body["error"]["type"] == "cluster_not_ready"
        # the same worker restarted joins, reloads its layers, and the cluster serves again: no head restart
        cluster.workers.pop("b").stop()
        cluster.start_worker("b", name="b-again")
        cluster.wait_ready()
        assert_serves(cluster, greedy)
        assert "assigned layers 2-3" in cluster.workers["b-again"].output()


def test_stopped_worker_is_dropped_by_heartbeat_and_rejoins_when_continued(tmp_path, model_dir, greedy):
    timeout_s = 2.0
    with start(tmp_path, model_dir, resume=False, heartbeat_timeout_s=timeout_s) as cluster:
        b = cluster.workers["b"]
        request = freeze_mid_request(cluster, b)
        stopped_at = time.monotonic() - 0.3
        status, body = request.wait(timeout_s + 5)
        # detected within the topology's bound (plus one check period of the watch thread and some slack)
        assert request.answered_at - stopped_at < timeout_s + 2.0
        assert status == 503 and body["error"]["type"] == "worker_lost", body
        assert "worker b" in body["error"]["message"] and "silent" in body["error"]["message"]
        assert cluster.get("/health/ready")[0] == 503
        b.proc.send_signal(signal.SIGCONT)  # it finds its connection closed and rejoins, its layers still loaded
        cluster.wait_ready()
        assert_serves(cluster, greedy)
        wait_for(lambda: "already loaded; reusing" in b.output(), 10, "the worker to reuse its layers")


def test_workers_rejoin_a_head_that_comes_back(tmp_path, model_dir, greedy):
    with start(tmp_path, model_dir) as cluster:
        assert_serves(cluster, greedy)
        cluster.head.proc.kill()
        cluster.head.proc.wait()
        cluster.head.log.close()
        cluster.start_head()  # same ports
        cluster.wait_api()
        cluster.wait_ready(120)
        assert_serves(cluster, greedy)
        for name in ("a", "b"):
            assert "already loaded; reusing" in cluster.workers[name].output()


def test_a_worker_without_a_node_id_rejoins_a_restarted_head_in_its_entry_and_keeps_its_layers(tmp_path, model_dir,
                                                                                               greedy):
    """Workers that join without --node-id (as topology.example.yaml suggests) come back to a restarted head in
    any order: the first back took the first free entry, another worker's, and loaded that one's layers again,
    where it now names the entry it held and gets it."""
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}],
                          head={"heartbeat_s": 0.5, "heartbeat_timeout_s": 3})
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        first = cluster.start_worker(None, "--retry-max-s", "1", name="first")
        wait_for(lambda: "joined the head as a" in first.output(), 60, "the first worker to take entry a")
        second = cluster.start_worker(None, "--retry-max-s", "1", name="second")
        cluster.wait_ready()
        assert "joined the head as b" in second.output()
        first.stop()
        cluster.head.proc.kill()
        cluster.head.proc.wait()
        cluster.head.log.close()
        cluster.start_head()  # same ports: the second worker rejoins it first, with entry a free
        wait_for(lambda: second.output().count("joined the head as") == 2, 60, "the second worker to rejoin")
        cluster.start_worker(None, "--retry-max-s", "1", name="first-again")
        cluster.wait_ready(120)
        assert second.output().split("joined the head as")[2].startswith(" b")
        assert "already loaded; reusing" in second.output()
        assert_serves(cluster, greedy)


def test_workers_reload_a_checkpoint_rewritten_while_the_head_was_down(tmp_path):
    """A worker keeps its layers across a head's restart only when the checkpoint is the one it loaded: here the
    model directory is written afresh (other weights, same path) while the head is down, and the restarted head's
    cluster answers as the new model does, where the workers had served their old layers without a word."""
    model_dir = write_tiny_model(tmp_path / "model" / "tiny-qwen", seed=7, shards=2)

    def greedy_text() -> str:
        model = OurModel(model_dir)
        tok = TextTokenizer.load(model_dir)
        gen = Generator(model.head, tok, model.pipeline(), torch.float32)
        return gen.generate(tok.encode(PROMPT), SamplingParams(12, temperature=0, ignore_eos=True)).text

    with start(tmp_path, model_dir) as cluster:
        old = greedy_text()
        assert_serves(cluster, lambda _: old)
        cluster.head.proc.kill()
        cluster.head.proc.wait()
        cluster.head.log.close()
        write_tiny_model(model_dir, seed=8, shards=2)
        new = greedy_text()
        assert new != old
        cluster.start_head()  # same ports
        cluster.wait_api()
        cluster.wait_ready(120)
        assert_serves(cluster, lambda _: new)
        for name in ("a", "b"):
            assert "already loaded; reusing" not in cluster.workers[name].output()
            assert cluster.workers[name].output().count("assigned layers") == 2


def test_request_resumes_on_the_restarted_worker_with_the_same_text(tmp_path, model_dir, greedy):
    with start(tmp_path, model_dir, resume=True, resume_grace_s=120) as cluster:
        b = cluster.workers.pop("b")
        request = freeze_mid_request(cluster, b)
        b.proc.kill()
        b.stop()
        time.sleep(0.5)
        assert request.thread.is_alive(), "the request should wait for the entry to be filled"
        assert cluster.get("/health/ready")[0] == 503
        cluster.start_worker("b", name="b-again")
        status, body = request.wait(180)
        assert status == 200, body
        assert body["choices"][0]["text"] == greedy(LONG)
        assert "resumed on a refilled pipeline" in cluster.head.output()


def test_a_resumed_request_keeps_its_logit_bias(tmp_path, model_dir, alone):
    """The request bans the token greedy text uses most; after the resume it still never makes it, and its text is
    the biased text of the single-process model."""
    plain = alone(SamplingParams(LONG, temperature=0, ignore_eos=True)).token_ids
    banned = max(set(plain), key=plain.count)
    biased = alone(SamplingParams(LONG, temperature=0, ignore_eos=True, logit_bias=((banned, -100.0),)))
    assert banned not in biased.token_ids and biased.token_ids != plain
    with start(tmp_path, model_dir, resume=True, resume_grace_s=120) as cluster:
        b = cluster.workers.pop("b")
        request = freeze_mid_request(cluster, b, logit_bias={str(banned): -100})
        b.proc.kill()
        b.stop()
        cluster.start_worker("b", name="b-again")
        status, body = request.wait(180)
        assert status == 200, body
        assert body["choices"][0]["text"] == biased.text
        assert "resumed on a refilled pipeline" in cluster.head.output()


def test_a_resume_replays_in_steps_that_fit_the_workers_frames(tmp_path, model_dir):
    """Workers that take small frames (--max-frame-mb): the replay of a sequence's history after a worker is lost
    goes in steps each within their limit, where it went as one frame (the whole history of every sequence in
    flight) that the new worker refused, failing the request."""
    import http.client
    import json

    prompt = "a long prompt of more positions than one step of small frames carries " * 2  # 144 positions
    max_tokens = 100  # long enough that b is lost mid-generation: 144 + 100 positions fit the context of 256
    model = OurModel(model_dir)
    tok = TextTokenizer.load(model_dir)
    expected = Generator(model.head, tok, model.pipeline(), torch.float32).generate(
        tok.encode(prompt), SamplingParams(max_tokens, temperature=0, ignore_eos=True)).text
    with start(tmp_path, model_dir, ("a", "b"), ("a", "b"), "--max-frame-mb", "0.02", resume=True,
               resume_grace_s=120) as cluster:
        connection = http.client.HTTPConnection("127.0.0.1", cluster.api_port, timeout=180)
        connection.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny-qwen", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        b, texts = cluster.workers.pop("b"), []
        for line in response:
            if line.startswith(b"data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                if len(texts) == 3:  # the prompt read (past what one step carries) and tokens chosen: lose b
                    b.proc.kill()
                    b.stop()
                    cluster.start_worker("b", "--max-frame-mb", "0.02", name="b-again")
            elif line.startswith(b"data: [DONE]"):
                break
        connection.close()
        assert "".join(texts) == expected
        assert "resumed on a refilled pipeline" in cluster.head.output()
        assert "broke the protocol" not in cluster.workers["b-again"].output()


def test_spare_takes_over_a_lost_node_and_the_request_resumes(tmp_path, model_dir, greedy):
    with start(tmp_path, model_dir, ("a", "b", "spare1"), ("a", "b", "spare1"), resume_grace_s=120) as cluster:
        wait_for(lambda: "spare spare1 joined" in cluster.head.output(), 30, "the spare to stand by")
        rows = {row["id"]: row for row in cluster.get("/v1/cluster")[1]["nodes"]}
        assert rows["spare1"]["state"] == "standby" and rows["b"]["served_by"] == "b"
        b = cluster.workers["b"]
        request = freeze_mid_request(cluster, b)
        b.proc.kill()
        status, body = request.wait(180)
        assert status == 200, body
        assert body["choices"][0]["text"] == greedy(LONG)
        head_log = cluster.head.output()
        assert "spare spare1 takes over node b (layers 2-3)" in head_log
        assert "resumed on a refilled pipeline" in head_log
        assert cluster.get("/health/ready")[0] == 200
        rows = {row["id"]: row for row in cluster.get("/v1/cluster")[1]["nodes"]}
        assert "spare1" not in rows and rows["b"]["served_by"] == "spare1" and rows["b"]["state"] == "ready"
        assert_serves(cluster, greedy)
        # the lost worker, back, is told its node is covered instead of taking it away mid-service
        cluster.workers.pop("b").stop()
        back = cluster.start_worker("b", name="b-again")
        assert back.proc.wait(WORKER_JOIN_S) == 2
        assert "served by the spare spare1" in back.output()


def test_resume_gives_up_after_the_grace_period(tmp_path, model_dir):
    with start(tmp_path, model_dir, resume=True, resume_grace_s=2) as cluster:
        b = cluster.workers["b"]
        request = freeze_mid_request(cluster, b)
        killed_at = time.monotonic()
        b.proc.kill()
        status, body = request.wait(20)
        assert 1.5 < request.answered_at - killed_at < 6
        assert status == 503 and body["error"]["type"] == "worker_lost", body
        assert "worker b" in body["error"]["message"] and "grace period" in body["error"]["message"]
        assert "no worker filled its place" in body["error"]["message"]
        assert "(head.resume_grace_s: give it more than a worker's start-up and load time)" in body["error"]["message"]


def test_a_resume_that_gives_up_says_what_each_missing_node_was_doing():
    """The error named the lost node alone and said no worker came, with the advice to give more grace, whatever
    held the pipeline back: another node gone meanwhile, or a worker that came but could not load its layers
    (where more grace cannot help)."""
    grace = " at the end of the 5s resume grace period"
    more_time = " (head.resume_grace_s: give it more than a worker's start-up and load time)"
    assert grace_ended("killed", "b", [("c", "waiting", "lost: connection closed")], 5) == (
        "killed; no worker filled node c's place" + grace + more_time)
    assert grace_ended("killed", "b", [("b", "failed", "load failed: no such directory /m")], 5) == (
        "killed; a worker took its place but could not load its layers (no such directory /m)" + grace
        + ": fix that and restart the worker")
    assert grace_ended("killed", "b", [("b", "failed", "load failed: x"), ("c", "failed", "load failed: y")], 5) == (
        "killed; a worker took its place but could not load its layers (x); a worker took node c's place but could "
        "not load its layers (y)" + grace + ": fix that and restart those workers")
    assert grace_ended("killed", "b", [("a", "loading", ""), ("b", "waiting", "")], 5) == (
        "killed; no worker filled its place; a worker took node a's place but was still loading its layers" + grace
        + more_time)


def test_sigterm_to_the_head_ends_requests_in_flight_with_a_clear_error_and_tells_the_workers(tmp_path, model_dir):
    with start(tmp_path, model_dir) as cluster:
        b = cluster.workers["b"]
        request = freeze_mid_request(cluster, b)
        cluster.head.proc.send_signal(signal.SIGTERM)
        status, body = request.wait(15)
        assert status == 503, body
        assert "shutting down" in body["error"]["message"]
        assert cluster.head.proc.wait(20) == 0
        b.proc.send_signal(signal.SIGCONT)
        assert "head stopped" in cluster.head.output()
        # the listen socket is closed: nothing accepts workers any more
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", cluster.listen_port), timeout=2).close()
        # the running worker was told why (the frozen one may find the connection gone before it reads the word)
        told = "the head says: the head is shutting down; rejoin when it is back; rejoining"
        wait_for(lambda: told in cluster.workers["a"].output(), 15, "worker a to be told")
        # the workers stay up, trying to rejoin with backoff
        for name in ("a", "b"):
            worker = cluster.workers[name]
            wait_for(lambda: "not reachable" in worker.output(), 15, f"worker {name} to try rejoining")
            assert worker.proc.poll() is None


def test_a_head_stopped_for_longer_than_the_heartbeat_limit_keeps_its_workers(tmp_path, model_dir, greedy):
    with start(tmp_path, model_dir) as cluster:  # heartbeat_timeout_s 3
        head = cluster.head
        head.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(6)  # the pause under test: twice the heartbeat limit, the workers answering PINGs unread
        finally:
            head.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: cluster.get("/health")[0] == 200, 15, "the head to answer again")
        time.sleep(4)  # past the heartbeat limit again, counted from the head's wake: it reads the PONGs meanwhile
        said = head.output()
        assert "silent for" not in said and "the head did not run for" in said, said
        assert "joined" not in said.split("the head did not run for")[1]  # no worker had to rejoin
        assert cluster.get("/health/ready")[0] == 200
        assert_serves(cluster, greedy)


def test_idle_workers_stay_joined_to_a_head_that_pings_less_often_than_their_head_timeout(tmp_path, model_dir, greedy):
    """A topology's heartbeat_s may be longer than a worker's --head-timeout-s (a minute against 30 s): the head
    says how often it pings as the worker joins, and the worker counts several intervals, so an idle worker stays
    joined. It dropped the head after its own bound and rejoined, over and over, and requests met a cluster whose
    workers came and went."""
    with start(tmp_path, model_dir, ("a",), ("a",), "--head-timeout-s", "0.3", heartbeat_s=1.0,
               heartbeat_timeout_s=5) as cluster:
        time.sleep(4)  # idle: pings a second apart, more than ten of the worker's own bounds
        said = cluster.workers["a"].output()
        assert "heard nothing from the head" not in said, said
        assert "counts it gone after 3s of silence, not its --head-timeout-s of 0.3s" in said
        assert cluster.head.output().count("joined") == 1, cluster.head.output()
        assert_serves(cluster, greedy)


def test_sigterm_to_a_worker_fails_its_request_and_it_exits_cleanly(tmp_path, model_dir, greedy):
    with start(tmp_path, model_dir, resume=False) as cluster:
        b = cluster.workers["b"]
        request = freeze_mid_request(cluster, b)
        b.proc.send_signal(signal.SIGTERM)
        b.proc.send_signal(signal.SIGCONT)
        status, body = request.wait(15)
        assert status == 503 and body["error"]["type"] == "worker_lost", body
        assert "worker b is shutting down (SIGTERM received)" in body["error"]["message"]
        assert b.proc.wait(20) == 0
        assert cluster.get("/health/ready")[0] == 503
        cluster.start_worker("b", name="b-again")
        cluster.wait_ready()
        assert_serves(cluster, greedy)


def test_worker_without_a_head_keeps_retrying_and_stops_on_sigterm(tmp_path, model_dir):
    topo = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}])
    with Cluster(topo, tmp_path) as cluster:
        worker = cluster.start_worker("a", "--retry-max-s", "1")
        wait_for(lambda: worker.output().count("not reachable") >= 2, WORKER_JOIN_S, "two join attempts")
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(20) == 0


def test_head_and_worker_survive_a_burst_of_failures(tmp_path, model_dir, greedy):
    """Kill, stop and restart workers back to back; the head answers every request and ends up serving."""
    with start(tmp_path, model_dir, resume=False) as cluster:
        for round_ in range(2):
            victim = cluster.workers.pop("b" if round_ % 2 == 0 else "a")
            request = freeze_mid_request(cluster, victim, max_tokens=60)
            victim.proc.kill()
            status, body = request.wait(10)
            assert status == 503 and body["error"]["type"] in ("worker_lost", "cluster_not_ready"), body
            victim.stop()
            node = "b" if round_ % 2 == 0 else "a"
            cluster.start_worker(node, "--retry-max-s", "1", name=node)
            cluster.wait_ready()
        assert_serves(cluster, greedy)


def test_requests_the_head_refuses_while_it_stops_hear_it_is_shutting_down(tmp_path, model_dir):
    """While the head tells its workers goodbye (up to a second when one is frozen), a request arriving, and one
    still waiting for a place, learn that the head is shutting down, as those the HTTP server refuses do: not
    that workers are missing, which would send an operator looking for them."""
    with start(tmp_path, model_dir, max_batch=1) as cluster:
        b = cluster.workers["b"]
        running = freeze_mid_request(cluster, b)
        queued = long_request(cluster)
        time.sleep(0.3)
        cluster.head.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the head waits for the frozen worker to read its goodbye: the API still answers
        arriving = long_request(cluster)
        status, body = running.wait(15)
        assert status == 503 and body["error"]["code"] == "service_unavailable", body
        for request in (queued, arriving):
            status, body = request.wait(15)
            assert status == 503 and body["error"]["code"] == "shutting_down", body
            assert "shutting down" in body["error"]["message"]
        assert cluster.head.proc.wait(20) == 0
        b.proc.send_signal(signal.SIGCONT)
        assert "Model is not ready" not in cluster.head.output()


def generations_counted(cluster: Cluster) -> dict[str, float]:
    """tc_generations_total by outcome, from GET /metrics."""
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^tc_generations_total\{outcome="(\w+)"\} (\S+)$',
                                                                  text, re.MULTILINE)}


def test_every_choice_of_a_request_a_lost_worker_ended_counts_as_an_error(tmp_path, model_dir):
    """The choices of a request (its n) fail together when a worker is lost; the metrics and the log say each
    failed, not that its client went away."""
    with start(tmp_path, model_dir, resume=False) as cluster:
        b = cluster.workers["b"]
        request = freeze_mid_request(cluster, b, n=2)
        b.proc.kill()
        status, body = request.wait(10)
        assert status == 503 and body["error"]["code"] == "worker_lost", body
        wait_for(lambda: " finish=" in cluster.head.output(), 10, "the request's log line")
        assert generations_counted(cluster) == {"error": 2.0}
        assert " finish=error " in cluster.head.output()
