"""Start a real head and real worker processes on loopback, for end-to-end tests and benchmarks."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tc.protocol.connection import Connection
from tc.protocol.errors import ConnectionClosed
from tc.protocol.framing import Envelope
from tc.protocol.messages import (PROTOCOL_VERSION, Assignment, DeviceInfo, Hello, HelloAck, LoadComplete, Ping,
                                  Pong)

ROOT = Path(__file__).resolve().parent.parent

# A worker measures itself before its first join wherever this machine's figures are not in tc's cache yet (every
# dtype and mode: ~32 s on a 2-core VM, longer for two at once or on a slower CPU under load), whichever test starts
# it: what a test waits for a worker it started to join, or to be refused at its join, allows for that.
WORKER_JOIN_S = 300.0


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on loopback now (each socket stays bound until all are chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_topology(path: Path, model: str | Path, nodes: list[dict], **settings) -> Path:
    data = {"model": str(model), "quant": settings.pop("quant", "fp16"), "dtype": settings.pop("dtype", "fp32"),
            "head": {"api": "127.0.0.1:8000", "listen": "127.0.0.1:7001", **settings.pop("head", {})},
            "nodes": nodes, **settings}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def worker_hello(node_id: str | None = None, **changes) -> Hello:
    """The HELLO a CPU-only worker sends, for tests that join by hand; `changes` replaces any field."""
    fields = dict(protocol_version=PROTOCOL_VERSION, tc_version="0", node_id=node_id, hostname="test",
                  platform="linux", python_version="3", torch_version="2",
                  devices=(DeviceInfo("cpu", "cpu", "cpu", None, None),), selected_device="cpu",
                  compute_dtypes=("fp32",), max_memory_bytes=None)
    return Hello(**{**fields, **changes})


def join_loaded(port: int, hello: Hello) -> Connection:
    """Join the head listening at `port` by hand with `hello`, take the ASSIGNMENT and report its layers loaded at
    once: a worker whose inference the test scripts. Returns the connection, its reads without a timeout."""
    conn = Connection(socket.create_connection(("127.0.0.1", port), timeout=15))
    conn.send(hello)
    assert isinstance(conn.recv(timeout=15).message, HelloAck)
    env = conn.recv(timeout=15)
    assert isinstance(env.message, Assignment), env.message
    conn.settimeout(None)
    conn.send(LoadComplete(load_seconds=0.0, weight_bytes=1, device="cpu", compute_dtype="fp32"))
    return conn


class HandJoinedWorker:
    """A worker joined by hand (join_loaded) whose reader thread answers every PING at once, as a real worker's
    does, and hands every other frame to `received`; `closed` is set once the connection ends. A subclass sets
    what `received` uses before calling this __init__: frames may come as soon as it returns."""

    def __init__(self, port: int, hello: Hello):
        self.closed = threading.Event()
        self.conn = join_loaded(port, hello)
        threading.Thread(target=self._read, daemon=True).start()

    def received(self, env: Envelope) -> None:
        """A frame from the head other than PING, on the reader thread."""

    def ended(self) -> None:
        """The connection ended (the reader thread's last call)."""

    def _read(self) -> None:
        try:
            while True:
                env = self.conn.recv()
                if isinstance(env.message, Ping):
                    self.conn.send(Pong(nonce=env.message.nonce))
                else:
                    self.received(env)
        except (ConnectionClosed, OSError):
            self.closed.set()
            self.ended()


class Process:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, cwd: Path | None = None):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
                                     cwd=str(cwd or ROOT))

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Cluster:
    """A head and its workers as child processes. `tc` is the command prefix (python -m tc, or a tc.pyz)."""

    def __init__(self, topology: Path, workdir: Path, tc: list[str] | None = None, env: dict | None = None,
                 api_host: str = "127.0.0.1", join_host: str = "127.0.0.1", head_prefix: tuple[str, ...] = (),
                 api_key: str | None = None):
        self.topology, self.workdir, self.env = topology, workdir, env or {}
        # sent with every request of get and post, as an OpenAI client sends its api_key (head.api_keys)
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if tc is None:
            # `python -m tc` runs in workdir: put this checkout first on the path, so the processes run the code
            # under test rather than whatever `tc` the environment has installed
            path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
            self.env = {"PYTHONPATH": path, **self.env}
        self.tc = tc or [sys.executable, "-m", "tc"]
        # two ports at once, held together while chosen: one free port asked for twice can come back twice
        self.api_port, self.listen_port = free_ports(2)
        # where the test reaches the API, where workers reach the head, and a command prefix for the head
        # (e.g. ip netns exec NS) for tests that put processes in network namespaces
        self.api_host, self.join_host, self.head_prefix = api_host, join_host, list(head_prefix)
        self.head: Process | None = None
        self.workers: dict[str, Process] = {}

    @property
    def url(self) -> str:
        return f"http://{self.api_host}:{self.api_port}"

    def start_head(self) -> Process:
        self.head = Process([*self.head_prefix, *self.tc, "head", str(self.topology), "--api-port",
                             str(self.api_port), "--listen-port", str(self.listen_port)], self.workdir / "head.log",
                            self.env, cwd=self.workdir)
        return self.head

    def start_worker(self, node_id: str | None, *extra: str, name: str | None = None,
                     env: dict | None = None, prefix: tuple[str, ...] = (), join_host: str | None = None) -> Process:
        name = name or node_id or f"worker{len(self.workers)}"
        args = [*prefix, *self.tc, "worker", "--join", f"{join_host or self.join_host}:{self.listen_port}",
                "--device", "cpu", "--threads", "1", *extra]
        if node_id:
            args += ["--node-id", node_id]
        proc = Process(args, self.workdir / f"{name}.log", {**self.env, **(env or {})}, cwd=self.workdir)
        self.workers[name] = proc
        return proc

    def start_all(self, node_ids: list[str]) -> None:
        """Start the head, then one worker per node id, and wait until the cluster is ready."""
        self.start_head()
        self.wait_api()
        for node_id in node_ids:
            self.start_worker(node_id)
        self.wait_ready()

    def get(self, path: str, timeout: float = 5) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=self.auth),
                                        timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **self.auth})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def wait_api(self, timeout: float = 300) -> None:
        """Wait until the head has loaded its tensors and serves its API (/health 200; 503 while it loads).

        A head loading the demo model in bf16 times its products first (packed head, native prefetch): 12-24 s on
        a loaded 2-core VM, ~7 s more where it first builds the native kernels, more again on a slower CPU; a head
        that exits fails the wait at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.head is not None
            if self.head.proc.poll() is not None:
                raise AssertionError(f"head exited:\n{self.head.output()}")
            try:
                if self.get("/health", timeout=1)[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"head API not up in {timeout}s:\n{self.head.output()}")

    def wait_ready(self, timeout: float = WORKER_JOIN_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status, body = self.get("/health/ready", timeout=2)
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            for name, w in self.workers.items():
                if w.proc.poll() is not None and w.proc.returncode != 0:
                    raise AssertionError(f"worker {name} exited {w.proc.returncode}:\n{w.output()}")
            time.sleep(0.3)
        logs = "\n".join(f"--- {n}\n{w.output()[-3000:]}" for n, w in self.workers.items())
        raise AssertionError(f"cluster not ready in {timeout}s\n--- head\n{self.head.output()[-3000:]}\n{logs}")

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop()
        if self.head is not None:
            self.head.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_cluster(tmp_path: Path, model_dir: Path, **head) -> Cluster:
    """A head and two CPU workers, "a" and "b", serving `model_dir`, ready; heartbeats every 0.5 s and a worker lost
    after 3 s of silence, and the `head` settings given."""
    nodes = [{"id": "a", "device": "cpu"}, {"id": "b", "device": "cpu"}]
    topology = write_topology(tmp_path / "t.yaml", model_dir, nodes,
                              head={"heartbeat_s": 0.5, "heartbeat_timeout_s": 3, **head})
    cluster = Cluster(topology, tmp_path)
    cluster.start_head()
    cluster.wait_api()
    cluster.start_worker("a")
    cluster.start_worker("b")
    cluster.wait_ready()
    return cluster


class Request:
    """A POST /v1/completions sent from a thread; `.reply` and `.answered_at` once it returns."""

    def __init__(self, cluster: Cluster, body: dict, timeout: float = 300):
        self.reply: tuple[int, dict] | None = None
        self.answered_at = 0.0

        def post() -> None:
            self.reply = cluster.post("/v1/completions", body, timeout=timeout)
            self.answered_at = time.monotonic()

        self.thread = threading.Thread(target=post, daemon=True)
        self.thread.start()

    def wait(self, timeout: float) -> tuple[int, dict]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"no answer within {timeout}s: the request hangs"
        assert self.reply is not None
        return self.reply
