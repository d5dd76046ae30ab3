"""head.plan_from: workers — a real head plans once from its workers' HELLO speeds, then never again."""
from __future__ import annotations

import queue
import re
import socket
import threading
import time
import urllib.request

import pytest

from cluster import WORKER_JOIN_S, Cluster, worker_hello, write_topology
from tc.protocol.connection import Connection
from tc.protocol.errors import ConnectionClosed
from tc.protocol.messages import Assignment, DeviceInfo, HelloAck, Ping, Pong, SpeedFigure
from tiny_model import write_tiny_model

NODES = [{"id": "slow", "device": "cpu"}, {"id": "fast", "device": "cpu"}]


def figure(decode_gbps: float) -> SpeedFigure:
    return SpeedFigure(device="cpu", dtype="fp32", quant="fp16", decode_bytes_per_s=decode_gbps * 1e9,
                       prefill_bytes_per_s=decode_gbps * 1e10, layer_overhead_s=0.0)


class HandWorker:
    """A joined connection that says HELLO with chosen speeds; its reader answers every PING at once (echoing the
    payload, as a real worker's reader does, so the head can probe the link) and keeps each ASSIGNMENT."""

    def __init__(self, cluster: Cluster, node_id: str, decode_gbps: float | None, **hello):
        """`decode_gbps` None: a worker that measured nothing; `hello`: other HELLO fields."""
        sock = socket.create_connection(("127.0.0.1", cluster.listen_port), timeout=10)
        self.conn = Connection(sock)
        self.conn.send(worker_hello(node_id, speeds=() if decode_gbps is None else (figure(decode_gbps),), **hello))
        assert isinstance(self.conn.recv().message, HelloAck)
        self.conn.settimeout(None)
        self.assignments: queue.Queue[Assignment] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                message = self.conn.recv().message
                if isinstance(message, Ping):
                    self.conn.send(Pong(nonce=message.nonce, payload=message.payload))
                elif isinstance(message, Assignment):
                    self.assignments.put(message)
        except (ConnectionClosed, OSError):
            pass

    def next_assignment(self, timeout: float) -> Assignment | None:
        """The ASSIGNMENT the head sends within `timeout`, or None if it sends none."""
        try:
            return self.assignments.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", num_hidden_layers=8)


def test_the_head_plans_once_every_node_has_joined_and_keeps_that_plan(tmp_path, model_dir):
    topology = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"plan_from": "workers", "heartbeat_s": 1,
                              "speed": {"decode_gbps": 10, "prefill_gbps": 100, "layer_ms": 0}})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        slow = HandWorker(cluster, "slow", decode_gbps=1)
        assert slow.next_assignment(1.5) is None  # no plan while "fast" has not joined
        status, view = cluster.get("/v1/cluster")
        assert status == 200 and view["plan"] is None
        assert {n["id"]: n["state"] for n in view["nodes"]} == {"slow": "planning", "fast": "waiting"}

        fast = HandWorker(cluster, "fast", decode_gbps=10)
        got = {"fast": fast.next_assignment(10), "slow": slow.next_assignment(10)}
        spans = {node: (a.layer_start, a.layer_end_exclusive) for node, a in got.items()}
        assert spans == {"slow": (0, 1), "fast": (1, 8)}  # the ten-times slower node holds one layer
        status, view = cluster.get("/v1/cluster")
        assert [s["layers"] for s in view["plan"]["stages"]] == [[0, 1], [1, 8]]
        assert all(s["predicted_decode_ms"] > 0 for s in view["plan"]["stages"])
        assert "plan from the workers' measurements" in cluster.head.output()

        # the slow worker leaves and comes back as a much faster machine: the plan is kept, not redone
        slow.close()
        deadline = time.monotonic() + 10
        while cluster.get("/v1/cluster")[1]["nodes"][0]["state"] != "waiting" and time.monotonic() < deadline:
            time.sleep(0.1)
        again = HandWorker(cluster, "slow", decode_gbps=100)
        assignment = again.next_assignment(10)
        assert assignment is not None and (assignment.layer_start, assignment.layer_end_exclusive) == (0, 1)
        again.close()
        fast.close()


def test_workers_without_speeds_get_the_byte_split(tmp_path, model_dir):
    topology = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"plan_from": "workers",
                              "speed": {"decode_gbps": 10, "prefill_gbps": 100, "layer_ms": 0}})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        workers = [HandWorker(cluster, node_id, decode_gbps=None) for node_id in ("slow", "fast")]
        spans = []
        for worker in workers:
            message = worker.next_assignment(10)
            assert message is not None
            spans.append((message.layer_start, message.layer_end_exclusive))
            worker.close()
        assert spans == [(0, 4), (4, 8)]


def test_plan_says_the_head_will_plan_from_the_workers(tmp_path, model_dir, capsys):
    """`tc plan` on a topology whose head plans from the workers says that the split it shows is not final."""
    from tc.cli import main

    for plan_from, said in (("workers", True), ("topology", False)):
        topology = write_topology(tmp_path / f"{plan_from}.yaml", model_dir, NODES, head={"plan_from": plan_from})
        assert main(["plan", str(topology)]) == 0
        out = capsys.readouterr().out
        assert ("the head makes its plan once all 2 workers have joined" in out) == said, out


def test_workers_offering_less_memory_get_a_smaller_batch_not_a_refusal(tmp_path, model_dir):
    """head.max_batch left out means as many as the nodes fit: workers whose memory holds 6 full-context caches
    beside their layers are planned with a batch of 6, which the API serves, rather than refused for the 8 a
    plan from the topology alone (no memory known) allowed."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"plan_from": "workers",
                              "speed": {"decode_gbps": 10, "prefill_gbps": 100, "layer_ms": 0}})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        # 4 layers of the tiny model: 338 KiB of weights; a full-context cache 256 KiB a sequence
        workers = [HandWorker(cluster, node["id"], None, max_memory_bytes=2_000_000) for node in NODES]
        assignments = [worker.next_assignment(10) for worker in workers]
        assert all(a is not None for a in assignments), cluster.head.output()
        assert [a.max_sequences for a in assignments] == [6, 6]
        status, view = cluster.get("/v1/cluster")
        assert view["plan"]["max_batch"] == 6 and view["batch"]["slots"] == 6
        with urllib.request.urlopen(cluster.url + "/metrics", timeout=5) as reply:
            assert "tc_batch_slots 6.0" in reply.read().decode()
        assert "batch: up to 6 sequences at once" in cluster.head.output()
        for worker in workers:
            worker.close()


def test_a_worker_gets_no_more_layers_than_its_device_has_free(tmp_path, model_dir):
    """A worker that names no --max-memory-gb offers what its device reports free: the plan gives it no more layers
    than that holds (the byte split's 4 would have run its load out of memory), and one whose memory holds no layer
    gets no plan, with the figure and where it came from in the head's log."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"plan_from": "workers",
                              "speed": {"decode_gbps": 10, "prefill_gbps": 100, "layer_ms": 0}})

    def free(nbytes: int) -> dict:
        return {"devices": (DeviceInfo("cpu", "cpu", "cpu", 8 * 2**30, nbytes),)}

    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        # 4 layers of the tiny model take 338 KiB: 200,000 bytes hold 2 of them
        workers = [HandWorker(cluster, "slow", None, **free(200_000)), HandWorker(cluster, "fast", None)]
        assignments = [w.next_assignment(10) for w in workers]
        spans = [(a.layer_start, a.layer_end_exclusive) for a in assignments]
        assert spans == [(0, 2), (2, 8)], cluster.head.output()
        # the device's figure places the weights; the batch stays the topology's (caches fill only as far as
        # sequences go), where a --max-memory-gb sizes it too (the test below)
        assert [a.max_sequences for a in assignments] == [8, 8]
        for worker in workers:
            worker.close()
    (tmp_path / "again").mkdir()
    with Cluster(topology, tmp_path / "again") as cluster:
        cluster.start_head()
        cluster.wait_api()
        workers = [HandWorker(cluster, "slow", None, **free(50_000)), HandWorker(cluster, "fast", None)]
        assert workers[0].next_assignment(3) is None
        output = cluster.head.output()
        assert re.search(r"cannot plan from the joined workers: node slow: layers 0-[0-9] need .* of weights but its "
                         r"worker offers 48.8 KiB \(what cpu on test reports free\)", output), output
        for worker in workers:
            worker.close()


def test_real_workers_plan_from_their_measurements_and_the_cluster_view_compares(tmp_path, model_dir):
    """Real worker processes measure themselves, the head plans from that, and after a request /v1/cluster shows
    each node's predicted decode time beside the measured one, and the link's ping beside the hop it measured."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"plan_from": "workers",
                              "heartbeat_s": 0.5, "speed": {"decode_gbps": 10, "prefill_gbps": 100, "layer_ms": 0}})
    bench_dir = tmp_path / "bench"  # shared: the second worker reads what the first measured
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        for node in NODES:
            cluster.start_worker(node["id"], "--bench-dir", str(bench_dir))
        cluster.wait_ready(timeout=300)
        status, body = cluster.post("/v1/completions", {"model": model_dir.name, "prompt": "hello",
                                                        "max_tokens": 6, "temperature": 0})
        assert status == 200, body
        time.sleep(1.5)  # a few heartbeats: the pings' round trips
        _, view = cluster.get("/v1/cluster")
    for node in view["nodes"]:
        assert node["predicted_decode_ms"] > 0 and node["measured_decode_ms"] > 0, node
        assert node["predicted_hop_ms"] > 0 and node["measured_hop_ms"] > 0, node
    assert sum(s["layers"][1] - s["layers"][0] for s in view["plan"]["stages"]) == 8
    output = cluster.head.output()
    assert "predicted: decode" in output
    # each link was probed before the plan, so its hops are in the prediction. Its bandwidth is measured unless
    # the large echoes were no slower than the small ones (a loopback link can outrun the timing on a busy machine)
    for node in NODES:
        assert re.search(rf"link to worker {node['id']}: round trip [0-9.]+ ms, ([0-9.]+ GB/s|bandwidth not "
                         "measured)", output), output
        assert output.index(f"link to worker {node['id']}") < output.index("plan from the workers' measurements")
    assert "not measured (counted as free" not in output  # what the plan's table says of a link it counts as free


def test_a_spare_takes_the_lost_nodes_planned_layers(tmp_path, model_dir):
    """A spare that stood by since before the plan existed takes over exactly the layers planned for a lost node."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, [*NODES, {"id": "sp", "device": "cpu", "spare": True}],
                              head={"plan_from": "workers", "heartbeat_s": 1,
                                    "speed": {"decode_gbps": 10, "prefill_gbps": 100, "layer_ms": 0}})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        spare = HandWorker(cluster, "sp", decode_gbps=50)  # stands by; its speed plays no part in the plan
        slow = HandWorker(cluster, "slow", decode_gbps=1)
        fast = HandWorker(cluster, "fast", decode_gbps=10)
        assert fast.next_assignment(10) is not None
        planned = slow.next_assignment(10)
        assert planned is not None and (planned.layer_start, planned.layer_end_exclusive) == (0, 1)
        assert spare.next_assignment(1) is None  # nothing lost yet
        slow.close()
        taken = spare.next_assignment(10)
        assert taken is not None and (taken.layer_start, taken.layer_end_exclusive) == (0, 1)
        spare.close()
        fast.close()


LAYER_BYTES = 86528  # one of the tiny model's layers in fp16
LAYER_CACHE = 2 * 2 * 16 * 256 * 4  # a sequence's KV cache on a layer: K and V x 2 KV heads x 16 x 256 positions x fp32
STAGE_NEED = 4 * LAYER_BYTES + 8 * 4 * LAYER_CACHE  # a 4-layer node holding the default batch of 8 at full context


def serving_slow_and_fast(cluster: Cluster) -> tuple[HandWorker, HandWorker, Assignment]:
    """The head started, and hand-driven workers for NODES' two entries given their layers: (slow, fast, slow's
    ASSIGNMENT)."""
    cluster.start_head()
    cluster.wait_api()
    slow = HandWorker(cluster, "slow", None)
    fast = HandWorker(cluster, "fast", None)
    planned = slow.next_assignment(10)
    assert planned is not None and fast.next_assignment(10) is not None
    return slow, fast, planned


def test_a_spare_takes_no_node_whose_layers_exceed_its_max_memory_gb(tmp_path, model_dir):
    """A spare's max_memory_gb bounds what it may take over, as a node's bounds its own layers: a spare capped
    under a lost node's weights stands by, and one without a cap takes the node."""
    stage_bytes = 4 * LAYER_BYTES  # 4 of the tiny model's 8 layers
    small = stage_bytes / 2 / 2**30
    topology = write_topology(tmp_path / "t.yaml", model_dir, [
        *NODES, {"id": "small", "device": "cpu", "spare": True, "max_memory_gb": small},
        {"id": "big", "device": "cpu", "spare": True}], head={"heartbeat_s": 1})
    with Cluster(topology, tmp_path) as cluster:
        slow, fast, planned = serving_slow_and_fast(cluster)
        spare = HandWorker(cluster, "small", None)  # the machine itself offers all it has
        slow.close()
        assert spare.next_assignment(3) is None, "a spare took layers over its max_memory_gb"
        output = cluster.head.output()
        assert "spare small cannot take node slow" in output and "small's max_memory_gb is" in output, output
        big = HandWorker(cluster, "big", None)
        taken = big.next_assignment(10)
        assert taken is not None and (taken.layer_start, taken.layer_end_exclusive) == \
            (planned.layer_start, planned.layer_end_exclusive)
        assert "[--node-id ID]  (ids: slow, fast; spares: small, big)" in cluster.head.output()
        for worker in (spare, big, fast):
            worker.close()


@pytest.mark.parametrize("bounded_by", ["what it offers", "its max_memory_gb"])
def test_a_spare_that_holds_a_lost_nodes_weights_but_not_its_kv_cache_stands_by(tmp_path, model_dir, bounded_by):
    """Where topology.yaml asks for a batch (head.max_batch), a spare takes over a lost node only with room for
    what the plan counts there: its layers' weights and the KV caches of the whole batch. One with room for the
    weights and half the caches stands by, its reason logged with the numbers, whether its room is what its
    machine offers or its max_memory_gb; one with room for both takes the node."""
    lean_bytes = 4 * LAYER_BYTES + 4 * 4 * LAYER_CACHE  # the weights and 4 of the 8 caches: 1.3 MiB
    lean = {"id": "lean", "device": "cpu", "spare": True}
    if bounded_by == "its max_memory_gb":
        lean["max_memory_gb"] = lean_bytes / 2**30
    ample = {"id": "ample", "device": "cpu", "spare": True}
    topology = write_topology(tmp_path / "t.yaml", model_dir, [*NODES, lean, ample],
                              head={"heartbeat_s": 1, "max_batch": 8})
    with Cluster(topology, tmp_path) as cluster:
        slow, fast, planned = serving_slow_and_fast(cluster)
        assert (planned.layer_start, planned.layer_end_exclusive) == (0, 4)
        spare = HandWorker(cluster, "lean", None,
                           max_memory_bytes=lean_bytes if bounded_by == "what it offers" else None)
        slow.close()
        assert spare.next_assignment(3) is None, "a spare took a node whose KV cache it has no room for"
        output = cluster.head.output()
        assert ("spare lean cannot take node slow: entry slow (layers 0-3) needs 2.3 MiB: 338.0 KiB of weights + "
                "2.0 MiB of KV cache for 8 sequence(s) of 256.0 KiB each at full context on cpu, but "
                ) in output, output
        assert ("this worker offers 1.3 MiB" if bounded_by == "what it offers" else
                "lean's max_memory_gb is 0.0012989 (1.3 MiB) in topology.yaml") in output, output
        assert "set head.max_batch under 8, or pin fewer layers on slow" in output
        assert "or declare a spare with more memory" in output
        enough = HandWorker(cluster, "ample", None, max_memory_bytes=STAGE_NEED)  # exactly what the node needs
        taken = enough.next_assignment(10)
        assert taken is not None and (taken.layer_start, taken.layer_end_exclusive) == (0, 4)
        assert taken.max_sequences == 8
        for worker in (spare, enough, fast):
            worker.close()


def test_a_worker_with_room_for_its_weights_but_not_its_kv_cache_is_refused_at_join(tmp_path, model_dir):
    """A planned node's worker that offers memory for its layers' weights but not for the KV caches of the batch
    the plan promised is refused at its join with the numbers and what to change, where it was admitted to run
    out of memory once the batch filled; one offering both joins."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"heartbeat_s": 1, "max_batch": 8})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        short = cluster.start_worker("slow", "--max-memory-gb", str(1 / 1024), name="short")  # 1 MiB
        assert short.proc.wait(WORKER_JOIN_S) == 2, short.output()
        said = " ".join(short.output().split())
        assert ("entry slow (layers 0-3) needs 2.3 MiB: 338.0 KiB of weights + 2.0 MiB of KV cache for 8 "
                "sequence(s) of 256.0 KiB each at full context on cpu, but this worker offers 1.0 MiB; "
                "give it more memory (--max-memory-gb, in GiB), set head.max_batch under 8, or pin fewer layers on "
                "slow in topology.yaml") in said, said
        assert "spare" not in said
        assert STAGE_NEED <= 4 << 20
        cluster.start_worker("slow", "--max-memory-gb", str(4 / 1024))  # 4 MiB
        deadline = time.monotonic() + WORKER_JOIN_S
        while "worker slow joined" not in cluster.head.output():
            assert time.monotonic() < deadline, cluster.head.output()
            time.sleep(0.2)


def test_where_the_batch_is_left_to_the_head_a_worker_short_of_its_caches_joins_with_a_warning(tmp_path, model_dir):
    """With head.max_batch left out, a worker (or a spare taking over) needs room for its weights and one
    full-context KV cache, the floor the plan itself keeps: caches fill only as far as sequences go, and a
    long-context model's batch seldom meets the worst case. One short of the batch joins, and the head's log says
    how many sequences it holds and what setting rules the rest out; one short of a single cache is refused."""
    topology = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"heartbeat_s": 1})
    with Cluster(topology, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        short = cluster.start_worker("slow", "--max-memory-gb", str((4 * LAYER_BYTES + 2 * 4 * LAYER_CACHE) / 2**30))
        deadline = time.monotonic() + WORKER_JOIN_S
        while "worker slow joined" not in cluster.head.output():
            assert time.monotonic() < deadline, cluster.head.output()
            time.sleep(0.2)
        said = " ".join(cluster.head.output().split())
        assert ("slow holds layers 0-3 with room for the KV caches of 2 of the batch's 8 sequences at "
                "full context (256.0 KiB each, beside 338.0 KiB of weights, in 850.0 KiB); it serves") in said, said
        assert "set head.max_batch to 2 in topology.yaml to rule that out" in said
        assert short.proc.poll() is None
        tiny = cluster.start_worker("fast", "--max-memory-gb", str(4 * LAYER_BYTES / 2**30), name="tiny")
        assert tiny.proc.wait(WORKER_JOIN_S) == 2, tiny.output()
        assert "KV cache for 1 sequence(s)" in " ".join(tiny.output().split()), tiny.output()


def test_plan_says_which_nodes_each_spare_can_stand_in_for(tmp_path, model_dir, capsys):
    """`tc plan` names, for each spare, the nodes whose layers and KV caches for the batch fit its max_memory_gb,
    as a takeover counts them, so a spare too small for any node is found before a node is lost, not when one is:
    one with room for slow's weights but not their caches can take over no node."""
    from tc.cli import main

    slow_need = 2 * LAYER_BYTES + 8 * 2 * LAYER_CACHE  # layers 0-1 and the default batch's 8 caches
    topology = write_topology(tmp_path / "t.yaml", model_dir, [
        {"id": "slow", "device": "cpu", "layers": "0-1"}, {"id": "fast", "device": "cpu"},
        {"id": "tiny", "device": "cpu", "spare": True, "max_memory_gb": 3 * LAYER_BYTES / 2**30},
        {"id": "mid", "device": "cpu", "spare": True, "max_memory_gb": slow_need / 2**30},
        {"id": "any", "device": "cpu", "spare": True}], head={"max_batch": 8})
    assert main(["plan", str(topology)]) == 0
    out = capsys.readouterr().out
    assert ("spare tiny: can take over no node: every node's layers, with the KV caches of 8 sequence(s) at full "
            "context, need more than its max_memory_gb") in out, out
    assert ("spare mid: stands by for slow only; the layers of fast, with the KV caches of 8 sequence(s) at full "
            "context, need more than its max_memory_gb") in out, out
    assert "spare any: stands by for any node" in out, out
    # the batch left to the head: a takeover needs room for one sequence's caches (admission.sequences_to_hold)
    text = topology.read_text()
    assert "max_batch: 8" in text
    topology.write_text(text.replace("max_batch: 8", "max_batch: null"))
    assert main(["plan", str(topology)]) == 0
    out = capsys.readouterr().out
    assert ("spare tiny: can take over no node: every node's layers, with the KV caches of 1 sequence(s) at full "
            "context, need more than its max_memory_gb") in out, out
    assert "spare mid: stands by for any node" in out, out
