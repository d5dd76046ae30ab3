"""Real network faults: the head and two workers each in their own network namespace, joined by veth pairs.

    root ns --(A.0.1 / A.0.2)-- head ns --(A.1.1 / A.1.2)-- worker ns 1
                                        \\--(A.2.1 / A.2.2)-- worker ns 2

The test talks to the API over the root link; each worker reaches the head over its own link. Faults are
made with iproute2: `tc netem` adds latency (skipped where the kernel has no netem), and setting a link down
cuts a worker off mid-generation without closing any socket, which only heartbeats can notice.

Needs root and `ip netns` (.ci/run installs iproute2); skipped with the reason otherwise. The namespaces are
removed at the end, whatever happened.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from cluster import Cluster, write_topology
from model_helpers import OurModel
from tc.generation import Generator
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

PROMPT = "the quick brown fox"
IP = shutil.which("ip") or "/usr/sbin/ip"
# iproute2's tc, by full path: a `tc` found on PATH may be something else entirely
TC = next((p for p in ("/usr/sbin/tc", "/sbin/tc") if os.path.exists(p)), None)


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


def _netns_unavailable() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(IP):
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    probe = f"tcprobe{os.getpid()}"
    result = run(IP, "netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"`ip netns add` fails here: {result.stderr.strip()}"
    run(IP, "netns", "del", probe, check=False)
    return None


SKIP_REASON = _netns_unavailable()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


@dataclass
class Lab:
    tag: str
    net: str  # "10.N": the first two octets of every address here

    @property
    def head_ns(self) -> str:
        return f"tch{self.tag}"

    def worker_ns(self, i: int) -> str:
        return f"tcw{i}{self.tag}"

    def head_dev(self, i: int) -> str:
        """The head's end of the link to worker i (0: the link to the root namespace)."""
        return f"h{i}{self.tag}"

    def worker_dev(self, i: int) -> str:
        return f"w{i}{self.tag}"

    @property
    def api_host(self) -> str:
        return f"{self.net}.0.2"

    def head_addr(self, i: int) -> str:
        return f"{self.net}.{i}.1"

    def ns_exec(self, ns: str) -> tuple[str, ...]:
        return (IP, "netns", "exec", ns)

    def set_link(self, i: int, up: bool) -> None:
        """Cut (or restore) worker i's cable: both ends go down, no socket is told anything."""
        state = "up" if up else "down"
        run(*self.ns_exec(self.head_ns), IP, "link", "set", self.head_dev(i), state)
        run(*self.ns_exec(self.worker_ns(i)), IP, "link", "set", self.worker_dev(i), state)


def remove_stale_labs() -> None:
    """Remove the labs of runs that were killed before their teardown: each is tagged with its run's pid.

    A stale lab's root-side link keeps its addresses, and a new lab on the same ones would be unreachable."""
    names = run(IP, "netns", "list").stdout.split()
    links = re.findall(r"^\d+: (r0\d+)[@:]", run(IP, "-o", "link").stdout, re.MULTILINE)
    tags = {m.group(1) for n in names if (m := re.fullmatch(r"tc(?:h|w[12])(\d+)", n))}
    tags |= {link[2:] for link in links}
    for tag in tags:
        if tag != str(os.getpid()) and not os.path.exists(f"/proc/{tag}"):
            remove_lab(Lab(tag, ""))


def free_net() -> str:
    """The first 10.N network that no link of the root namespace is on."""
    used = run(IP, "-o", "-4", "addr").stdout
    for n in range(200, 250):
        if f" 10.{n}." not in used:
            return f"10.{n}"
    raise RuntimeError("no free 10.200-249 network for the lab")


def build_lab() -> Lab:
    remove_stale_labs()
    tag = str(os.getpid())
    lab = Lab(tag, free_net())
    namespaces = [lab.head_ns, lab.worker_ns(1), lab.worker_ns(2)]
    for ns in namespaces:
        run(IP, "netns", "add", ns)
        run(*lab.ns_exec(ns), IP, "link", "set", "lo", "up")
    # root <-> head
    root_dev = f"r0{tag}"
    run(IP, "link", "add", root_dev, "type", "veth", "peer", "name", lab.head_dev(0))
    run(IP, "link", "set", lab.head_dev(0), "netns", lab.head_ns)
    run(IP, "addr", "add", f"{lab.net}.0.1/24", "dev", root_dev)
    run(IP, "link", "set", root_dev, "up")
    run(*lab.ns_exec(lab.head_ns), IP, "addr", "add", f"{lab.net}.0.2/24", "dev", lab.head_dev(0))
    run(*lab.ns_exec(lab.head_ns), IP, "link", "set", lab.head_dev(0), "up")
    # head <-> worker i
    for i in (1, 2):
        run(IP, "link", "add", lab.head_dev(i), "type", "veth", "peer", "name", lab.worker_dev(i))
        run(IP, "link", "set", lab.head_dev(i), "netns", lab.head_ns)
        run(IP, "link", "set", lab.worker_dev(i), "netns", lab.worker_ns(i))
        run(*lab.ns_exec(lab.head_ns), IP, "addr", "add", f"{lab.net}.{i}.1/24", "dev", lab.head_dev(i))
        run(*lab.ns_exec(lab.head_ns), IP, "link", "set", lab.head_dev(i), "up")
        run(*lab.ns_exec(lab.worker_ns(i)), IP, "addr", "add", f"{lab.net}.{i}.2/24", "dev", lab.worker_dev(i))
        run(*lab.ns_exec(lab.worker_ns(i)), IP, "link", "set", lab.worker_dev(i), "up")
    return lab


def remove_lab(lab: Lab) -> None:
    for ns in (lab.head_ns, lab.worker_ns(1), lab.worker_ns(2)):
        run(IP, "netns", "del", ns, check=False)  # takes the veth ends inside it along
    run(IP, "link", "del", f"r0{lab.tag}", check=False)


@pytest.fixture(scope="module")
def lab():
    built = None
    try:
        built = build_lab()
        yield built
    finally:
        if built is not None:
            remove_lab(built)
        else:  # a half-built lab: remove whatever exists
            remove_lab(Lab(str(os.getpid()), ""))


@pytest.fixture(autouse=True)
def links_restored(lab):
    yield
    for i in (1, 2):
        lab.set_link(i, True)
        if TC is not None:
            for ns, dev in ((lab.head_ns, lab.head_dev(i)), (lab.worker_ns(i), lab.worker_dev(i))):
                run(*lab.ns_exec(ns), TC, "qdisc", "del", "dev", dev, "root", check=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=9)


@pytest.fixture(scope="module")
def greedy(model_dir):
    model = OurModel(model_dir)
    tok = TextTokenizer.load(model_dir)
    gen = Generator(model.head, tok, model.pipeline(), torch.float32)
    return lambda n: gen.generate(tok.encode(PROMPT), SamplingParams(n, temperature=0, ignore_eos=True)).text


def start(lab: Lab, tmp_path, model_dir, **head) -> Cluster:
    settings = {"api": "0.0.0.0:8000", "listen": "0.0.0.0:7001", "heartbeat_s": 0.5, "heartbeat_timeout_s": 2,
                **head}
    topo = write_topology(tmp_path / "t.yaml", model_dir,
                          [{"id": "w1", "device": "cpu"}, {"id": "w2", "device": "cpu"}], head=settings)
    cluster = Cluster(topo, tmp_path, api_host=lab.api_host, head_prefix=lab.ns_exec(lab.head_ns))
    cluster.start_head()
    cluster.wait_api()
    for i in (1, 2):
        cluster.start_worker(f"w{i}", "--retry-max-s", "1", prefix=lab.ns_exec(lab.worker_ns(i)),
                             join_host=lab.head_addr(i), env={"TC_HEAD_TIMEOUT_S": "4"})
    cluster.wait_ready()
    return cluster


def completion(cluster: Cluster, max_tokens: int, timeout: float = 120) -> tuple[int, dict]:
    """Greedy, exactly max_tokens long: the tests below time and interrupt generations of a known length."""
    return cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True}, timeout=timeout)


def netem(lab: Lab, i: int, spec: list[str]) -> None:
    for ns, dev in ((lab.head_ns, lab.head_dev(i)), (lab.worker_ns(i), lab.worker_dev(i))):
        result = run(*lab.ns_exec(ns), TC, "qdisc", "replace", "dev", dev, "root", "netem", *spec, check=False)
        if result.returncode != 0:
            pytest.skip(f"tc netem is not available here ({result.stderr.strip()}); this kernel lacks sch_netem")


def in_thread(fn) -> dict:
    result: dict = {}

    def go() -> None:
        result["reply"] = fn()
        result["at"] = time.monotonic()

    result["thread"] = threading.Thread(target=go, daemon=True)
    result["thread"].start()
    return result


def hold_mid_request(cluster: Cluster, worker: str, max_tokens: int = 240) -> dict:
    """Start a request and freeze `worker` (SIGSTOP) while it runs, so the request is held at it for sure."""
    proc = cluster.workers[worker].proc
    for delay in (0.1, 0.03, 0.0):
        result = in_thread(lambda: completion(cluster, max_tokens))
        time.sleep(delay)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        if result["thread"].is_alive():
            return result
        proc.send_signal(signal.SIGCONT)  # it finished first: again, sooner
    proc.send_signal(signal.SIGSTOP)
    result = in_thread(lambda: completion(cluster, max_tokens))
    time.sleep(0.5)
    assert result["thread"].is_alive()
    return result


def test_generation_over_namespaces_matches(lab, tmp_path, model_dir, greedy):
    with start(lab, tmp_path, model_dir) as cluster:
        status, body = completion(cluster, 16)
        assert status == 200 and body["choices"][0]["text"] == greedy(16)
        assert f"from {lab.net}.1.2" in cluster.head.output() and f"from {lab.net}.2.2" in cluster.head.output()


def test_a_stage_passes_straight_to_a_worker_joined_over_loopback_on_the_head_machine(lab, tmp_path, model_dir,
                                                                                       greedy):
    """The head machine's own worker joins with --join 127.0.0.1:7001, the natural choice there; the stage before
    it runs on another machine. Its peer port was bound to loopback and the head routed the stage before to
    127.0.0.1, that machine's own: it could never pass hidden states on, and warned and retried for good. The head
    routes it to the head's address on its link now, where the worker listens."""
    nodes = [{"id": "w1", "device": "cpu"}, {"id": "w2", "device": "cpu"}]
    topo = write_topology(tmp_path / "t.yaml", model_dir, nodes, head={"api": "0.0.0.0:8000", "listen": "0.0.0.0:7001"})
    with Cluster(topo, tmp_path, api_host=lab.api_host, head_prefix=lab.ns_exec(lab.head_ns)) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker("w1", prefix=lab.ns_exec(lab.worker_ns(1)), join_host=lab.head_addr(1))
        cluster.start_worker("w2", prefix=lab.ns_exec(lab.head_ns), join_host="127.0.0.1")
        cluster.wait_ready()
        status, body = completion(cluster, 16)
        assert status == 200 and body["choices"][0]["text"] == greedy(16)
        nodes = {node["id"]: node["passes_to"] for node in cluster.get("/v1/cluster")[1]["nodes"]}
        assert nodes == {"w1": "w2", "w2": "head"}, (nodes, cluster.workers["w1"].output())
        assert "cannot pass hidden states" not in cluster.workers["w1"].output()
        assert "route 1: head -> w1 -> w2 -> head" in cluster.head.output()


@pytest.mark.skipif(TC is None, reason="iproute2's tc is not installed")
def test_latency_changes_timing_not_text(lab, tmp_path, model_dir, greedy):
    with start(lab, tmp_path, model_dir) as cluster:
        netem(lab, 1, ["delay", "20ms"])
        netem(lab, 2, ["delay", "20ms", "5ms"])
        started = time.monotonic()
        status, body = completion(cluster, 12)
        took = time.monotonic() - started
        assert status == 200 and body["choices"][0]["text"] == greedy(12)
        # 12 steps (prefill + 11 decodes), each crossing two links twice, 20 ms each way
        assert took > 12 * 2 * 2 * 0.015


def test_cut_link_fails_the_request_and_the_worker_returns_when_restored(lab, tmp_path, model_dir, greedy):
    with start(lab, tmp_path, model_dir, resume=False) as cluster:
        result = hold_mid_request(cluster, "w2")
        lab.set_link(2, False)  # cut while the request waits on w2; then w2 runs on, but cannot be heard
        cut_at = time.monotonic()
        cluster.workers["w2"].proc.send_signal(signal.SIGCONT)
        result["thread"].join(15)
        assert not result["thread"].is_alive(), "the request hangs on a cut link"
        status, body = result["reply"]
        assert status == 503 and body["error"]["type"] == "worker_lost" and "worker w2" in body["error"]["message"]
        assert result["at"] - cut_at < 2 + 2.0  # heartbeat_timeout_s plus a watch period and slack
        assert cluster.get("/health/ready")[0] == 503
        lab.set_link(2, True)
        cluster.wait_ready(60)  # the worker notices the silence, rejoins, and keeps its layers
        status, body = completion(cluster, 16)
        assert status == 200 and body["choices"][0]["text"] == greedy(16)
        assert "rejoining" in cluster.workers["w2"].output()


def test_cut_and_restored_link_resumes_the_request(lab, tmp_path, model_dir, greedy):
    with start(lab, tmp_path, model_dir, resume=True, resume_grace_s=60) as cluster:
        result = hold_mid_request(cluster, "w1")
        lab.set_link(1, False)
        cluster.workers["w1"].proc.send_signal(signal.SIGCONT)
        # the head counts w1 lost once it has been silent for heartbeat_timeout_s (2 s; a watch period later at
        # most, ~2.1 s here); the request then waits for w1's entry to be filled
        deadline = time.monotonic() + 30
        while "worker w1 lost" not in cluster.head.output():
            assert time.monotonic() < deadline, cluster.head.output()
            time.sleep(0.1)
        assert result["thread"].is_alive()
        lab.set_link(1, True)
        result["thread"].join(90)
        assert not result["thread"].is_alive()
        status, body = result["reply"]
        assert status == 200, body
        assert body["choices"][0]["text"] == greedy(240)
        assert "resumed on a refilled pipeline" in cluster.head.output()


def test_killed_worker_in_its_namespace_fails_fast(lab, tmp_path, model_dir):
    with start(lab, tmp_path, model_dir, resume=False) as cluster:
        result = hold_mid_request(cluster, "w1")
        cluster.workers["w1"].proc.kill()
        killed_at = time.monotonic()
        result["thread"].join(10)
        status, body = result["reply"]
        assert status == 503 and "worker w1" in body["error"]["message"]
        assert result["at"] - killed_at < 1.0
