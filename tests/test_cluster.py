"""The cluster end to end on a tiny model: a real head and real worker processes over loopback TCP."""
from __future__ import annotations

import http.client
import json
import re
import socket
import sys
import time
from typing import Iterator

import pytest
import torch

from cluster import ROOT, WORKER_JOIN_S, Cluster, Process, join_loaded, worker_hello, write_topology
from hub_standin import HubStandIn
from model_helpers import OurModel
from tc.generation import Generator
from tc.model.tokenizer import TextTokenizer
from tc.planner import format_bytes
from tc.protocol.connection import Connection
from tc.protocol.messages import ERROR_NODE_TAKEN, PROTOCOL_VERSION, Error, Hello
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

NODES = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=5, shards=2)


def local_greedy(model_dir, prompt: str, max_tokens: int) -> str:
    model = OurModel(model_dir)
    tok = TextTokenizer.load(model_dir)
    gen = Generator(model.head, tok, model.pipeline(), torch.float32)
    return gen.generate(tok.encode(prompt), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                           ignore_eos=True)).text


def completion(cluster: Cluster, prompt: str = PROMPT, max_tokens: int = 12, **extra) -> tuple[int, dict]:
    """A greedy completion of exactly max_tokens tokens (a random model's EOS does not cut it short)."""
    return cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True, **extra})


def stream_events(response: http.client.HTTPResponse) -> Iterator[object]:
    """The data of each server-sent event as it arrives: parsed JSON, or the string "[DONE]"."""
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            yield data.decode() if data == b"[DONE]" else json.loads(data)




def raw_hello(cluster: Cluster, hello: Hello) -> object:
    """Join with a hand-made HELLO over a real socket; return the head's first reply."""
    sock = socket.create_connection(("127.0.0.1", cluster.listen_port), timeout=10)
    conn = Connection(sock)
    try:
        conn.send(hello)
        return conn.recv().message
    finally:
        conn.close()


def test_two_workers_match_the_single_process_model(tmp_path, model_dir):
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES)
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        # before any worker has loaded: 503 with the counts docs/api.md gives
        status, body = completion(cluster)
        assert status == 503
        assert body["error"]["type"] == "cluster_not_ready"
        assert "Required nodes: 2, connected ready nodes: 0" in body["error"]["message"]
        cluster.start_worker("a")
        cluster.start_worker("b")
        cluster.wait_ready()
        status, body = completion(cluster)
        assert status == 200, body
        assert body["choices"][0]["text"] == local_greedy(model_dir, PROMPT, 12)
        assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"
        head_log = cluster.head.output()
        assert "assigned layers 0-1" in head_log and "assigned layers 2-3" in head_log
        # each worker's weights as it reports them loaded, in the binary units of the plan's table (KiB here)
        _, view = cluster.get("/v1/cluster")
        for node in view["nodes"]:
            loaded = format_bytes(node["loaded_weight_bytes"])
            assert loaded.endswith(" KiB"), loaded
            assert f"worker {node['id']} ready: {loaded} of weights on cpu" in head_log, head_log
            assert f"ready: {loaded} of weights" in cluster.workers[node["id"]].output()
        assert re.search(r"head tensors loaded \([0-9.]+ KiB, torch.float32\)", head_log), head_log
        # head.listen is 127.0.0.1: the hint joins that address, from this machine only
        assert ("on this machine (head.listen is a loopback address: no other machine can join) run: python tc.pyz "
                f"worker --join 127.0.0.1:{cluster.listen_port} [--node-id ID]") in head_log, head_log


def test_the_join_hint_names_the_address_workers_reach():
    from tc.head.main import join_hint

    assert join_hint("0.0.0.0", 7001) == ("on each machine", "<this-host>:7001")
    assert join_hint("::", 7001) == ("on each machine", "<this-host>:7001")
    assert join_hint("192.168.1.50", 7001) == ("on each machine", "192.168.1.50:7001")
    assert join_hint("head.lan", 7001) == ("on each machine", "head.lan:7001")
    for loopback, address in (("127.0.0.1", "127.0.0.1:7001"), ("::1", "[::1]:7001"), ("localhost", "localhost:7001")):
        where, joined = join_hint(loopback, 7001)
        assert where.startswith("on this machine") and joined == address


def test_a_prompt_past_a_workers_frame_limit_is_read_over_several_steps(tmp_path, model_dir):
    """A worker that takes small frames (--max-frame-mb) gets a long prompt in parts, each within its limit, and
    the text is the single-process model's; one whose limit cannot carry a single step is refused at its join,
    naming the flag. Before, the prompt's one frame made the worker drop the head and rejoin, again and again,
    until the request failed as worker_lost."""
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES)
    prompt = "the quick brown fox " * 10  # 200 positions (a byte each): past what 0.02 MiB frames carry
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        for cap_mb, refusal in (("0.001", "too small for this worker's own HELLO"),
                                ("0.002", "start it with --max-frame-mb 1 or more")):
            cluster.start_worker("a", "--max-frame-mb", cap_mb, name="tiny-frames")
            tiny = cluster.workers.pop("tiny-frames")
            assert tiny.proc.wait(WORKER_JOIN_S) == 2, tiny.output()  # refused: it would fail every request
            assert refusal in tiny.output() and "Traceback" not in tiny.output()
        cluster.start_worker("a", "--max-frame-mb", "0.02")
        cluster.start_worker("b")
        cluster.wait_ready()
        status, body = completion(cluster, prompt, 6)
        assert status == 200, body
        assert body["choices"][0]["text"] == local_greedy(model_dir, prompt, 6)
        assert body["usage"]["prompt_tokens"] > 150
        assert "broke the protocol" not in cluster.workers["a"].output()


def test_a_step_fits_the_frames_of_a_stage_that_computes_wider_than_the_head(tmp_path, model_dir):
    """A node computing in fp32 under a bf16 topology passes on 4 bytes a value where the head sends 2: a step's
    positions are bounded for the widest form, so a long prompt's parts fit the next worker's small frames. Before,
    they were bounded for the head's 2 bytes; the first stage's fp32 output of a part was twice what the next
    worker takes, which dropped the head at every attempt until the request failed as worker_lost."""
    nodes = [{"id": "a", "device": "cpu", "dtype": "fp32"}, {"id": "b", "device": "cpu"}]
    topo = write_topology(tmp_path / "t.yaml", model_dir, nodes, dtype="bf16", head={"resume": False})
    prompt = "the quick brown fox " * 10
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")
        cluster.start_worker("b", "--max-frame-mb", "0.02")
        cluster.wait_ready()
        status, body = completion(cluster, prompt, 4)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > 150 and body["usage"]["completion_tokens"] == 4
        assert "broke the protocol" not in cluster.workers["b"].output()


def test_refused_workers_leave_the_head_serving(tmp_path, model_dir):
    nodes = [{"id": "a", "device": "cpu"}, {"id": "gpu", "device": "cuda:0"}]
    topo = write_topology(tmp_path / "t.yaml", model_dir, nodes, head={"heartbeat_s": 1})
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        unknown = cluster.start_worker("nobody", name="unknown")
        assert unknown.proc.wait(WORKER_JOIN_S) == 2
        assert "unknown node id 'nobody'" in unknown.output()
        no_gpu = cluster.start_worker("gpu", name="no-gpu")
        assert no_gpu.proc.wait(WORKER_JOIN_S) == 2
        assert "needs device cuda:0" in no_gpu.output()
        reply = raw_hello(cluster, worker_hello("a", protocol_version=PROTOCOL_VERSION + 1))
        assert isinstance(reply, Error) and "protocol" in reply.message
        cluster.start_worker("a")
        deadline = time.monotonic() + WORKER_JOIN_S
        while "worker a joined" not in cluster.head.output():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        taken = cluster.start_worker("a", name="second-a")
        assert taken.proc.wait(WORKER_JOIN_S) == 2
        assert "already taken" in taken.output()
        reply = raw_hello(cluster, worker_hello("a"))  # a code a worker that was joined can act on (it retries)
        assert isinstance(reply, Error) and reply.code == ERROR_NODE_TAKEN and "already taken" in reply.message
        assert cluster.get("/health")[0] == 200
        status, body = cluster.get("/health/ready")
        assert status == 503 and body["missing_nodes"] == ["gpu"]


def test_lost_worker_fails_the_request_then_rejoins(tmp_path, model_dir):
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"heartbeat_s": 1})
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")
        b = cluster.start_worker("b")
        cluster.wait_ready()
        # A stream of as many tokens as the context allows: worker b is killed once the first tokens have
        # arrived, so the kill always lands mid-generation (the model cannot end it early: ignore_eos).
        http_conn = http.client.HTTPConnection("127.0.0.1", cluster.api_port, timeout=60)
        http_conn.request("POST", "/v1/completions", json.dumps({
            "model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}), {"Content-Type": "application/json"})
        response = http_conn.getresponse()
        assert response.status == 200
        events = stream_events(response)
        first = next(events)
        assert first["choices"][0]["finish_reason"] is None
        b.proc.kill()
        started = time.monotonic()
        rest = list(events)  # the head ends the stream (resume grace, then the loss), or the test times out
        assert time.monotonic() - started < 30, "the request hung after its worker died"
        http_conn.close()
        assert "[DONE]" not in rest and "error" in rest[-1], rest[-3:]
        assert rest[-1]["error"]["type"] in ("worker_lost", "cluster_not_ready"), rest[-1]
        assert len(rest) < 240, "the generation finished although its worker was killed"
        assert cluster.get("/v1/models")[0] == 200
        assert cluster.get("/health/ready")[0] == 503
        cluster.workers.pop("b").stop()
        cluster.start_worker("b", name="b-again")
        cluster.wait_ready()
        status, body = completion(cluster)
        assert status == 200 and body["choices"][0]["text"] == local_greedy(model_dir, PROMPT, 12)


def test_worker_downloads_from_a_hub_and_serves(tmp_path, model_dir):
    with HubStandIn({"acme/tiny-qwen": model_dir}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
        topo = write_topology(tmp_path / "t.yaml", "acme/tiny-qwen", NODES,
                              hf_cache_dir=str(tmp_path / "head-cache"))
        with Cluster(topo, tmp_path, env=env) as cluster:
            cluster.start_head()
            cluster.wait_api()
            for node in ("a", "b"):
                cluster.start_worker(node, "--hf-cache-dir", str(tmp_path / f"cache-{node}"))
            cluster.wait_ready()
            status, body = cluster.post("/v1/completions", {"model": "acme/tiny-qwen", "prompt": PROMPT,
                                                            "max_tokens": 6, "temperature": 0})
            assert status == 200 and body["choices"][0]["text"] == local_greedy(model_dir, PROMPT, 6)
        # worker a holds layers 0-1, which live in the first shard only
        snapshot = next((tmp_path / "cache-a").glob("models--acme--tiny-qwen/snapshots/*"))
        assert sorted(p.name for p in snapshot.iterdir()) == [
            "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]
        assert "fetching model-00001-of-00002.safetensors" in cluster.workers["a"].output()


def test_workers_fetch_the_commit_the_head_resolved_though_the_branch_moved(tmp_path, model_dir):
    """An upload moves the branch after the head has read config.json and its own tensors: the workers fetch
    their layers from the head's commit, not the newer upload's shards under the head's config."""
    newer = write_tiny_model(tmp_path / "newer", seed=6, shards=2)
    old, new = "a" * 40, "b" * 40
    with HubStandIn({"acme/tiny-qwen": model_dir}, snapshots={old: model_dir, new: newer},
                    branches={"main": old}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
        topo = write_topology(tmp_path / "t.yaml", "acme/tiny-qwen", NODES,
                              hf_cache_dir=str(tmp_path / "head-cache"))
        with Cluster(topo, tmp_path, env=env) as cluster:
            cluster.start_head()
            cluster.wait_api()  # the head serves once it has fetched all it needs
            hub.branches["main"] = new
            for node in ("a", "b"):
                cluster.start_worker(node, "--hf-cache-dir", str(tmp_path / f"cache-{node}"))
            cluster.wait_ready()
            status, body = cluster.post("/v1/completions", {"model": "acme/tiny-qwen", "prompt": PROMPT,
                                                            "max_tokens": 6, "temperature": 0})
            assert status == 200 and body["choices"][0]["text"] == local_greedy(model_dir, PROMPT, 6)
    for node in ("a", "b"):
        snapshots = tmp_path / f"cache-{node}" / "models--acme--tiny-qwen" / "snapshots"
        assert [p.name for p in snapshots.iterdir()] == [old]
    assert not [path for method, path in hub.requests if f"/resolve/{new}/" in path]


def test_openai_client_against_the_cluster(tmp_path, model_dir):
    openai = pytest.importorskip("openai")
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES)
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")
        cluster.start_worker("b")
        cluster.wait_ready()
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none")
        assert [m.id for m in client.models.list()] == ["tiny-qwen"]
        text = client.completions.create(model="tiny-qwen", prompt=PROMPT, max_tokens=5, temperature=0)
        assert text.choices[0].text == local_greedy(model_dir, PROMPT, 5)
        chat = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1


def test_a_refusal_quotes_a_workers_strings_cut_short(tmp_path, model_dir):
    """A worker's node id or version may be anything up to a frame's size; the refusal (a log line, and the
    worker's error) quotes the first 80 characters and says how long it was, where a 100 KB id gave a 100 KB line."""
    from tc.head.admission import Refusal, choose_entry
    from tc.model.config import ModelConfig
    from tc.topology import load_topology

    topology = load_topology(write_topology(tmp_path / "t.yaml", model_dir, NODES))
    config = ModelConfig.from_file(model_dir / "config.json")
    for hello in (worker_hello("x" * 100_000), worker_hello(protocol_version=0, tc_version="v" * 100_000)):
        with pytest.raises(Refusal) as info:
            choose_entry(hello, topology, None, set(), config, 8)
        assert len(str(info.value)) < 400 and "(100000 characters)" in str(info.value)


def test_a_worker_of_another_build_serves_and_the_head_says_so(tmp_path, model_dir):
    """Two builds of one release speak the same protocol, so a worker of another tc.pyz joins; the head says which
    builds they are, as an operator who copied an old tc.pyz to one machine needs to hear."""
    from tc import full_version

    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    with Cluster(write_topology(tmp_path / "t.yaml", model_dir, nodes), tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("a")  # this checkout, as the head
        conn = join_loaded(cluster.listen_port, worker_hello("b", tc_version="0.1.0+0123456789ab"))
        try:
            cluster.wait_ready()
        finally:
            conn.close()
        log = cluster.head.output()
    assert re.search(r"b from 127\.0\.0\.1:\d+: this worker runs tc '0\.1\.0\+0123456789ab' and the head tc "
                     + re.escape(full_version()) + ": they speak the same protocol", log), log
    assert log.count("they speak the same protocol") == 1  # not of worker a, the same build as the head


def test_a_worker_without_a_node_id_that_only_a_held_entry_fits_is_told_it_is_taken(tmp_path, model_dir):
    """A worker without --node-id rejoining while the head still holds its last connection found no free entry
    that fits (the free one another machine's device) and was refused for good; it now hears that the entry it
    would fit is taken (node_taken), which a worker joined before waits out (tests/test_hangs.py)."""
    from tc.head.admission import NodeTaken, choose_entry
    from tc.model.config import ModelConfig
    from tc.topology import load_topology

    nodes = [{"id": "a", "device": "cpu"}, {"id": "gpu", "device": "cuda:0"}]
    topology = load_topology(write_topology(tmp_path / "t.yaml", model_dir, nodes))
    config = ModelConfig.from_file(model_dir / "config.json")
    assert choose_entry(worker_hello(), topology, None, set(), config, 8).id == "a"
    with pytest.raises(NodeTaken) as info:
        choose_entry(worker_hello(), topology, None, {"a"}, config, 8)
    assert "needs device cuda:0" in str(info.value) and "it would fit a, held by a connected worker" in str(info.value)


def test_a_worker_without_a_node_id_gets_the_entry_it_held_again_where_it_is_free(tmp_path, model_dir):
    """Workers without --node-id that rejoin at once (a head restarted) came back in any order and took the first
    free entries, swapping them, so that each loaded another stage's layers; each now names the entry it held, and
    gets it where it is free and fits, else the first free one as before."""
    from tc.head.admission import NodeTaken, choose_entry
    from tc.model.config import ModelConfig
    from tc.topology import load_topology

    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}, {"id": "gpu", "device": "cuda:0"},
             {"id": "spare", "device": "cpu", "spare": True}]
    topology = load_topology(write_topology(tmp_path / "t.yaml", model_dir, nodes))
    config = ModelConfig.from_file(model_dir / "config.json")

    def entry(held: str | None, taken: set[str]) -> str:
        return choose_entry(worker_hello(held_node_id=held), topology, None, taken, config, 8).id

    assert entry("b", set()) == "b" and entry(None, set()) == "a"
    assert entry("b", {"b"}) == "a"  # held by another: the first free one
    assert entry("gpu", set()) == entry("gone-from-the-topology", set()) == "a"  # one it cannot serve, or none
    assert entry("spare", set()) == "a"  # a spare's entry waits until the pipeline's are filled, as ever
    assert choose_entry(worker_hello("a", held_node_id="b"), topology, None, set(), config, 8).id == "a"
    # held by a worker of the same host: most likely its own last connection, dead where the head has not seen it
    # end (a link that blipped); it waits that out rather than take another's entry
    with pytest.raises(NodeTaken, match="entry b, which this worker held, is held by a connection from 'test'"):
        choose_entry(worker_hello(held_node_id="b"), topology, None, {"b"}, config, 8, {"b": "test"})
    assert choose_entry(worker_hello(held_node_id="b"), topology, None, {"b"}, config, 8, {"b": "other"}).id == "a"


def test_a_rejoining_worker_whose_entry_its_own_last_connection_holds_is_told_to_wait(tmp_path, model_dir):
    """Through the real head: a worker without --node-id whose last connection the head still holds (its link
    blipped) hears node_taken, which it waits out, where it took the first free entry, another worker's; a worker
    of another host that held the entry takes a free one."""
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES)
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        first = Connection(socket.create_connection(("127.0.0.1", cluster.listen_port), timeout=10))
        try:
            first.send(worker_hello(hostname="box-1"))
            assert first.recv().message.node_id == "a"
            reply = raw_hello(cluster, worker_hello(hostname="box-1", held_node_id="a"))
            assert isinstance(reply, Error) and reply.code == ERROR_NODE_TAKEN, reply
            assert "entry a, which this worker held" in reply.message
            reply = raw_hello(cluster, worker_hello(hostname="box-2", held_node_id="a"))
            assert reply.node_id == "b", reply
        finally:
            first.close()


def test_a_worker_refused_for_its_device_s_free_memory_is_not_told_to_offer_more(tmp_path, model_dir):
    """A worker without --max-memory-gb offers what its device reports free: a refusal advised --max-memory-gb,
    which past that figure only runs the load out of memory; it says what the device has free. A device that
    reports no free memory (MPS: its total), or an offer the worker made, keeps the advice."""
    from tc.head.admission import stage_fit_problem
    from tc.model.config import ModelConfig
    from tc.planner import Stage
    from tc.protocol.messages import DeviceInfo
    from tc.topology import load_topology

    entry = load_topology(write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}])).node("a")
    config = ModelConfig.from_file(model_dir / "config.json")
    stage = Stage("a", "cpu", "fp32", 0, 2, 1 << 20, None)

    def problem(free: int | None, offered: int | None = None, total: int = 1 << 30) -> str | None:
        device = DeviceInfo("cpu", "cpu", "x86_64", total, free)
        return stage_fit_problem(entry, worker_hello(devices=(device,), max_memory_bytes=offered), stage, config, 1)

    assert "but cpu on test has 512.0 KiB free; free memory there (what else runs on it holds the rest), or pin " \
           "fewer layers on a" in problem(1 << 19)
    assert "--max-memory-gb" not in problem(1 << 19)
    assert "this worker offers 512.0 KiB; give it more memory (--max-memory-gb" in problem(1 << 30, 1 << 19)
    assert "this worker offers 512.0 KiB; give it more memory (--max-memory-gb" in problem(None, total=1 << 19)
    assert problem(1 << 30) is None


def test_a_worker_started_with_a_device_fills_only_an_entry_of_that_device(tmp_path, model_dir):
    """--device names the device a worker serves: on a machine of two GPUs, one started with --device cuda:1 took
    the topology's first free entry its machine could serve (the CPU's, or cuda:0's) and loaded there. It offers
    the head that device alone; --device auto offers every one."""
    from tc.head.admission import Refusal, choose_entry
    from tc.model.config import ModelConfig
    from tc.protocol.messages import DeviceInfo
    from tc.topology import load_topology
    from tc.worker.device import offered_devices

    machine = [DeviceInfo("cuda:0", "cuda", "GPU", 2**34, None), DeviceInfo("cuda:1", "cuda", "GPU", 2**34, 2**33),
               DeviceInfo("cpu", "cpu", "x86_64", 2**35, 2**34)]
    nodes = [{"id": "cpu-box", "device": "cpu"}, {"id": "gpu0", "device": "cuda:0"}, {"id": "gpu1", "device": "cuda:1"}]
    topology = load_topology(write_topology(tmp_path / "t.yaml", model_dir, nodes))
    config = ModelConfig.from_file(model_dir / "config.json")

    def entry(requested: str, selected: str, taken: set[str]) -> str:
        hello = worker_hello(devices=tuple(offered_devices(requested, selected, machine)), selected_device=selected)
        return choose_entry(hello, topology, None, taken, config, 8).id

    assert entry("cuda:1", "cuda:1", set()) == entry("cuda:1", "cuda:1", {"cpu-box", "gpu0"}) == "gpu1"
    assert entry("cpu", "cpu", set()) == "cpu-box"
    assert entry("auto", "cuda:0", set()) == "cpu-box" and entry("auto", "cuda:0", {"cpu-box"}) == "gpu0"
    named = worker_hello("cpu-box", devices=tuple(offered_devices("cuda:1", "cuda:1", machine)),
                         selected_device="cuda:1")
    with pytest.raises(Refusal, match="entry cpu-box needs device cpu, and this worker offers only cuda:1 "
                                      r"\(what its --device names, or all this machine has\)"):
        choose_entry(named, topology, None, set(), config, 8)


def test_a_join_address_that_is_no_head_says_so(tmp_path):
    """--join at an HTTP server (the head's API port, say) is not a head that was lost: the worker says nothing
    there answered as a tc head and which address --join should name."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    worker = Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{server.server_address[1]}",
                      "--no-bench", "--retry-max-s", "1"], tmp_path / "worker.log", cwd=ROOT)
    try:
        deadline = time.monotonic() + WORKER_JOIN_S  # a start under load, and the handshake's own bound
        while "no tc head answered" not in worker.output():
            assert time.monotonic() < deadline and worker.proc.poll() is None, worker.output()
            time.sleep(0.2)
        assert f"no tc head answered at 127.0.0.1:{server.server_address[1]}" in worker.output()
        assert "head.listen" in worker.output() and "lost the head" not in worker.output()
    finally:
        worker.stop()
        server.shutdown()


def test_a_join_address_that_never_answers_gets_the_hint_long_before_the_handshake_bound(tmp_path):
    """--join at the head's API port: waitress, which serves it, waits for the end of an HTTP request and never
    answers a frame, so the worker said nothing for the handshake's whole bound (30 s). It now says within a few
    seconds what --join should name, and goes on waiting in case a slow head answers after all."""
    import threading

    from waitress.server import create_server

    from tc.worker.main import HANDSHAKE_TIMEOUT_S, SILENCE_HINT_S

    server = create_server(lambda environ, start_response: [], host="127.0.0.1", port=0)
    threading.Thread(target=server.run, daemon=True).start()
    port = server.effective_port
    worker = Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{port}", "--no-bench"],
                     tmp_path / "worker.log", cwd=ROOT)
    try:
        deadline = time.monotonic() + WORKER_JOIN_S
        while "still waiting" not in worker.output():
            assert time.monotonic() < deadline and worker.proc.poll() is None, worker.output()
            time.sleep(0.2)
        output = worker.output()
        assert f"nothing has answered at 127.0.0.1:{port} for {SILENCE_HINT_S:.0f} s" in output
        assert "head.listen" in output
        assert SILENCE_HINT_S < HANDSHAKE_TIMEOUT_S and "no tc head answered" not in output  # the hint came first
    finally:
        worker.stop()
        server.close()


def test_a_join_address_where_another_server_speaks_first_is_no_head_and_no_frame_limit(tmp_path):
    """A server that speaks first (sshd's banner on port 22, written for 7001) reads as a frame header announcing
    a body of exabytes: the worker said to raise its --max-frame-mb to the head's head.max_frame_mb, a limit no
    setting could meet; what answered is simply not a tc head."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def banner() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            with sock:
                sock.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=banner, daemon=True).start()
    port = listener.getsockname()[1]
    worker = Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{port}", "--no-bench",
                      "--retry-max-s", "1"], tmp_path / "worker.log", cwd=ROOT)
    try:
        deadline = time.monotonic() + WORKER_JOIN_S  # a start under load, and the handshake's own bound
        while "no tc head answered" not in worker.output():
            assert time.monotonic() < deadline and worker.proc.poll() is None, worker.output()
            time.sleep(0.2)
        assert "what answered is not a tc head" in worker.output() and "head.listen" in worker.output()
        assert "--max-frame-mb" not in worker.output()
    finally:
        worker.stop()
        listener.close()


def test_a_join_address_that_announces_a_large_frame_first_is_no_head_at_once(tmp_path):
    """A server whose first 8 bytes read as a body of 100 MB (under the 256 MiB --max-frame-mb) had the worker
    take a buffer that size and wait out its 30 s handshake for the body; a head's first reply is a few hundred
    bytes, so such a header says at once that no tc head answered."""
    import socket
    import struct
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def announce() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            sock.sendall(struct.pack(">Q", 100_000_000))  # and nothing more: the connection stays open
            held.append(sock)

    threading.Thread(target=announce, daemon=True).start()
    port = listener.getsockname()[1]
    worker = Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{port}", "--no-bench",
                      "--retry-max-s", "1"], tmp_path / "worker.log", cwd=ROOT)
    try:
        deadline = time.monotonic() + WORKER_JOIN_S
        while "what answered is not a tc head" not in worker.output():
            assert time.monotonic() < deadline and worker.proc.poll() is None, worker.output()
            time.sleep(0.2)
        assert "--max-frame-mb" not in worker.output()
    finally:
        worker.stop()
        listener.close()
        for sock in held:
            sock.close()
