"""The head's API while the head loads its tensors: a real head process fetching its shard from a stand-in for the
Hub, which holds the shard half sent until the test lets it go, so the load lasts exactly as long as the test wants.
Meanwhile the port answers, /health and every route say the model is loading, and once it has loaded the same port
serves; a load that fails ends the head with its error and closes the port."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from cluster import Cluster, Process, write_topology
from hub_standin import HubStandIn, needs_hf_xet
from model_helpers import OurModel
from tc.generation import Generator
from tc.model.tokenizer import TextTokenizer
from tc.sampling import SamplingParams
from tiny_model import write_tiny_model

REPO = "acme/tiny-qwen"
SHARD = "model.safetensors"
PROMPT = "the quick brown fox"
WAIT_S = 120  # a deadline for what the test waits on, never a pause: on a busy machine a start takes seconds

Reply = tuple[int, dict[str, str], Any]


def hub_env(hub: HubStandIn) -> dict[str, str]:
    # a held download waits on the test, however slow the machine: no read timeout or stall rule may end it first
    return {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DOWNLOAD_TIMEOUT": str(WAIT_S * 3),
            "TC_DOWNLOAD_STALL_S": str(WAIT_S * 3)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=5)


def call(cluster: Cluster, method: str, path: str, body: dict | None = None) -> Reply:
    """One request: its status, headers and body (JSON, or the text of /metrics; None for HEAD)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(cluster.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    if method == "HEAD":
        return status, headers, None
    return status, headers, json.loads(raw) if headers.get("Content-Type", "").startswith("application/json") \
        else raw.decode()


def wait_for(event: threading.Event, head: Process, what: str) -> None:
    """Wait for `event`, giving up at once if the head exits (it would never come)."""
    deadline = time.monotonic() + WAIT_S
    while not event.wait(0.1):
        assert head.proc.poll() is None, f"the head exited before {what}:\n{head.output()}"
        assert time.monotonic() < deadline, f"no {what} in {WAIT_S}s:\n{head.output()}"


def poll(get: Callable[[], Reply], until: Callable[[Reply], bool], what: str) -> Reply:
    """Ask again until the reply shows `until` (a state of the head that the test has set in motion)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        reply = get()
        if until(reply):
            return reply
        assert time.monotonic() < deadline, f"{what} not seen in {WAIT_S}s; last reply {reply}"
        time.sleep(0.05)


def local_greedy(model_dir: Path, prompt: str, max_tokens: int) -> str:
    model = OurModel(model_dir)
    tok = TextTokenizer.load(model_dir)
    gen = Generator(model.head, tok, model.pipeline(), torch.float32)
    return gen.generate(tok.encode(prompt), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                           ignore_eos=True)).text


@contextlib.contextmanager
def head_mid_download(tmp_path: Path, model_dir: Path, xet: bool = False
                      ) -> Iterator[tuple[HubStandIn, Cluster, Process]]:
    """A head of a one-worker topology whose shard the Hub stand-in holds half sent (with `xet`, from a Xet-backed
    repo: half its xorb): (the stand-in, the cluster, the head's process), once the head is in the middle of that
    download."""
    with HubStandIn({REPO: model_dir}, hold={SHARD}, xet={SHARD} if xet else set()) as hub:
        topology = write_topology(tmp_path / "t.yaml", REPO, [{"id": "a", "device": "cpu"}],
                                  hf_cache_dir=str(tmp_path / "head-cache"))
        env = {**hub_env(hub), "HF_XET_CACHE": str(tmp_path / "xet")}
        with Cluster(topology, tmp_path, env=env) as cluster:
            head = cluster.start_head()
            wait_for(hub.holding, head, "the head's download of its shard")
            yield hub, cluster, head


def test_the_api_says_the_head_is_loading_until_it_serves(tmp_path: Path, model_dir: Path) -> None:
    size = (model_dir / SHARD).stat().st_size
    with head_mid_download(tmp_path, model_dir) as (hub, cluster, head):
        # a worker started now joins, and fetches its layers (held by the stand-in too) while the head fetches its own
        worker = cluster.start_worker("a", "--hf-cache-dir", str(tmp_path / "worker-cache"))

        # the bytes the stand-in has sent arrive at the head in their own time: their count is what it reports
        status, headers, body = poll(lambda: call(cluster, "GET", "/health"),
                                     lambda reply: (reply[2]["loading"]["progress"] or {}).get("done") == size // 2,
                                     "the download's progress")
        loading = {"step": "fetching_tensors", "message": f"fetching {SHARD} (1 of 1) from the Hub",
                   "progress": {"done": size // 2, "total": size, "unit": "bytes"}}
        assert (status, body) == (503, {"status": "loading", "loading": loading})
        assert headers["Retry-After"] == "1"
        assert call(cluster, "HEAD", "/health")[0] == 503
        assert call(cluster, "GET", "/health/ready")[::2] == (503, {
            "ready": False, "required_nodes": 1, "ready_nodes": [], "missing_nodes": ["a"], "loading": loading})

        refusals = [call(cluster, "POST", "/v1/completions", {"model": REPO, "prompt": PROMPT}),
                    call(cluster, "POST", "/v1/chat/completions",
                         {"model": REPO, "messages": [{"role": "user", "content": "hi"}]}),
                    call(cluster, "GET", "/v1/cluster")]
        for status, headers, body in refusals:
            assert status == 503 and headers["Retry-After"] == "1"
            assert body["error"]["type"] == "service_unavailable" and body["error"]["code"] == "model_loading"
            assert body["error"]["message"] == (f"The model is still loading at the head (fetching {SHARD} "
                                                "(1 of 1) from the Hub); try again shortly")
        # a method a route never takes is refused as it will be once the head serves
        assert call(cluster, "GET", "/v1/completions")[0] == 405
        status, _, models_while_loading = call(cluster, "GET", "/v1/models")
        assert status == 200 and [card["id"] for card in models_while_loading["data"]] == [REPO]
        status, _, metrics = call(cluster, "GET", "/metrics")
        assert status == 200
        counted = 'tc_http_requests_total{method="POST",route="/v1/completions",status="503"} 1.0'
        assert counted in metrics

        poll(lambda: (0, {}, worker.output()), lambda reply: "joined the head as a" in reply[2], "the worker's join")
        assert "not reachable" not in worker.output()  # the head listened for workers from the start

        hub.release.set()
        cluster.wait_api()
        assert call(cluster, "GET", "/health")[::2] == (200, {"status": "ok"})
        assert call(cluster, "GET", "/v1/models")[::2] == (200, models_while_loading)
        assert counted in call(cluster, "GET", "/metrics")[2]  # one registry, before and after
        cluster.wait_ready()
        status, _, body = call(cluster, "POST", "/v1/completions", {
            "model": REPO, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["text"] == local_greedy(model_dir, PROMPT, 6)


def test_a_worker_loads_its_layers_while_the_head_loads_its_own(tmp_path: Path, model_dir: Path) -> None:
    """The head takes workers from the start: a worker joins and loads its layers while the head still fetches
    its tokenizer (held half sent), and /health/ready says so, not ready; once the head has loaded, it serves at
    once and says the cluster is ready, once."""
    with HubStandIn({REPO: model_dir}, hold={"tokenizer.json"}) as hub:
        topology = write_topology(tmp_path / "t.yaml", REPO, [{"id": "a", "device": "cpu"}],
                                  hf_cache_dir=str(tmp_path / "head-cache"))
        with Cluster(topology, tmp_path, env=hub_env(hub)) as cluster:
            head = cluster.start_head()
            wait_for(hub.holding, head, "the head's download of its tokenizer")
            cluster.start_worker("a", "--hf-cache-dir", str(tmp_path / "worker-cache"))
            status, headers, body = poll(lambda: call(cluster, "GET", "/health/ready"),
                                         lambda reply: reply[2]["ready_nodes"] == ["a"], "the worker's load")
            assert status == 503 and headers["Retry-After"] == "1"
            assert body == {"ready": False, "required_nodes": 1, "ready_nodes": ["a"], "missing_nodes": [],
                            "loading": {"step": "fetching_tokenizer", "message": "fetching the tokenizer's files",
                                        "progress": None}}
            assert call(cluster, "GET", "/v1/cluster")[0] == 503
            assert "worker a ready" in head.output() and "cluster ready" not in head.output()

            hub.release.set()
            cluster.wait_ready()
            status, _, body = call(cluster, "POST", "/v1/completions", {
                "model": REPO, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert status == 200 and body["choices"][0]["text"] == local_greedy(model_dir, PROMPT, 6)
            assert head.output().count("cluster ready: all 1 workers loaded") == 1, head.output()


@needs_hf_xet
def test_a_head_loading_a_xet_backed_repo_says_how_far_its_download_has_come(tmp_path: Path,
                                                                              model_dir: Path) -> None:
    """hf_xet fetches a Xet-backed repo's shard with a client of its own, past the hook that counts a body's bytes:
    the head's API must still say how many have come, not 0 until the shard is whole."""
    size = (model_dir / SHARD).stat().st_size
    with head_mid_download(tmp_path, model_dir, xet=True) as (hub, cluster, head):
        sent = len(hub.xorb(SHARD)) // 2  # what the stand-in has sent of the xorb holding the shard
        status, _, body = poll(lambda: call(cluster, "GET", "/health"),
                               lambda reply: (reply[2]["loading"]["progress"] or {}).get("done") == sent,
                               "the Xet download's progress")
        assert status == 503 and body["loading"] == {
            "step": "fetching_tensors", "message": f"fetching {SHARD} (1 of 1) from the Hub",
            "progress": {"done": sent, "total": size, "unit": "bytes"}}
        assert hub.fetched_over_xet() == {SHARD} and SHARD not in hub.fetched_files()

        hub.release.set()
        cluster.wait_api()
        assert call(cluster, "GET", "/health")[::2] == (200, {"status": "ok"})


def test_a_load_that_fails_ends_the_head_and_closes_its_port(tmp_path: Path, model_dir: Path) -> None:
    with head_mid_download(tmp_path, model_dir) as (hub, cluster, head):
        assert call(cluster, "GET", "/health")[0] == 503
        # the link breaks off, and the Hub fails the download's resumption
        hub.refuse[SHARD] = (500, None)
        hub.cut = True
        hub.release.set()
        assert head.proc.wait(WAIT_S) == 2
        assert f"cannot get {SHARD} of {REPO}: the Hub failed (500)" in head.output()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", cluster.api_port), timeout=5).close()
