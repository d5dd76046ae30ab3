"""The addresses the head listens on: an IPv6 join port and API that a worker and a client reach, and a host name
that resolves to several addresses (localhost as ::1 and 127.0.0.1 on macOS and several Linux distributions).

Real head, worker process, sockets and HTTP; only the second test stands in for a resolver that gives two
addresses for a name (this machine's own resolves localhost to one), with the real addresses."""
from __future__ import annotations

import json
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from cluster import ROOT, Process, write_topology
from tc.head.http_server import start_http_server
from tc.head.main import start_head
from tc.topology import load_topology
from tiny_model import write_tiny_model


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_a_head_on_ipv6_addresses_takes_a_worker_and_serves(tmp_path):
    """head.listen and head.api on [::1]: the join port bound IPv4 whatever the host before (the topology took the
    address, and the head failed once it had loaded), and a worker joined over IPv6 serves a request over it."""
    model_dir = write_tiny_model(tmp_path / "tiny-qwen", seed=3)
    path = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}],
                          head={"api": "[::1]:8000", "listen": "[::1]:7001"})
    head = start_head(load_topology(path).with_ports(api_port=0, listen_port=0))
    worker = Process([sys.executable, "-m", "tc", "worker", "--join", f"[::1]:{head.listen_port}", "--node-id", "a",
                      "--device", "cpu", "--threads", "1"], tmp_path / "worker.log")
    try:
        assert head.registry.wait_ready(120), worker.output()
        assert head.http.url == f"http://[::1]:{head.http.port}"
        body = json.dumps({"model": "tiny-qwen", "prompt": "hello", "max_tokens": 3}).encode()
        request = urllib.request.Request(head.http.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200 and json.load(reply)["usage"]["completion_tokens"] == 3
    finally:
        worker.stop()
        head.stop()


def test_an_api_host_name_of_two_addresses_is_served_on_the_first(monkeypatch):
    """Waitress serves a name of several addresses on several sockets, an object without the port the head reads:
    the head died on its first line of serving. It binds the name's IPv4 address now, as a plain socket bound a
    name before (and as clients told to use 127.0.0.1 reach it), whatever order the resolver gives."""
    resolve = socket.getaddrinfo

    def two_addresses(host, *args, **kwargs):  # IPv6 first, as macOS and glibc may order localhost's
        if host != "both.test":
            return resolve(host, *args, **kwargs)
        return resolve("::1", *args, **kwargs) + resolve("127.0.0.1", *args, **kwargs)

    def app(environ, start_response):
        start_response("204 No Content", [])
        return [b""]

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    server = start_http_server(app, "both.test", 0, threads=1)
    try:
        assert server.url == f"http://both.test:{server.port}"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=10) as reply:
            assert reply.status == 204
    finally:
        server.stop()


# A head in a process of its own, whose limit on open files is lowered to under what it holds once it listens,
# and put back once it has said it cannot take a connection: no other test's threads share the limit.
FD_STARVED_HEAD = """
import logging, os, resource, sys, threading
from tc.head.main import start_head
from tc.topology import load_topology

said = threading.Event()

class Watch(logging.Handler):
    def emit(self, record):
        if "cannot take a worker's connection" in record.getMessage():
            said.set()

logging.basicConfig(level=logging.INFO)
logging.getLogger("tc.head.workers").addHandler(Watch())
head = start_head(load_topology(sys.argv[1]).with_ports(api_port=0, listen_port=0))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 3, hard))
print("LISTENING", head.listen_port, flush=True)
said.wait(120)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("READY" if head.registry.wait_ready(120) else "NOT READY", flush=True)
head.stop()
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts a process's open files in /proc")
def test_a_join_port_out_of_file_descriptors_says_so_and_takes_the_worker_once_it_has_one(tmp_path):
    """accept() failing for want of a file descriptor was retried without a word, while the worker waited in the
    backlog and was told it may have dialled the API's port: the head says what to raise now, and the worker gets
    in once there is room. A real head in a process of its own, its limit on open files under what it holds."""
    import subprocess

    model_dir = write_tiny_model(tmp_path / "tiny-qwen", seed=3)
    path = write_topology(tmp_path / "t.yaml", model_dir, [{"id": "a", "device": "cpu"}])
    head = subprocess.Popen([sys.executable, "-c", FD_STARVED_HEAD, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        line = head.stdout.readline()
        assert line.startswith("LISTENING"), line + head.stderr.read()
        worker = Process([sys.executable, "-m", "tc", "worker", "--join", f"127.0.0.1:{line.split()[1]}",
                          "--node-id", "a", "--device", "cpu", "--threads", "1"], tmp_path / "worker.log")
        out, err = head.communicate(timeout=300)
        assert out.strip() == "READY", err + worker.output()
        assert "cannot take a worker's connection on the join port" in err and "ulimit -n" in err
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()
        if worker is not None:
            worker.stop()
