"""Untrusted peers: the join token's challenge-response, both ways, with real processes and hand-made peers;
configurable size limits; and no code execution on any network path."""
from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from cluster import ROOT, WORKER_JOIN_S, Cluster, worker_hello, write_topology
from tc.protocol.auth import (CHALLENGE_BYTES, NONCE_BYTES, AuthError, answer_challenge, check_answer, head_proof,
                              make_challenge, new_nonce, token_key, worker_proof)
from tc.protocol.connection import Connection
from tc.protocol.messages import Error, HelloAck
from tc.cli import build_parser
from tc.worker.main import (TOKEN_ENV, TOKEN_FILE_ENV, WorkerSetupError, join_token_from,
                            worker_options)
from tiny_model import write_tiny_model

TOKEN = "correct horse battery staple 42"
KEY = token_key(TOKEN)
NODES = [{"id": "a", "device": "cpu"}]


# --- the exchange, as pure functions -------------------------------------------------------------------------------

def test_round_trip_proves_both_sides():
    worker_nonce = new_nonce()
    head_nonce, challenge = make_challenge(KEY, worker_nonce)
    assert len(challenge) == CHALLENGE_BYTES and challenge[:NONCE_BYTES] == head_nonce
    answer = answer_challenge(KEY, worker_nonce, challenge)
    check_answer(KEY, head_nonce, worker_nonce, answer)  # no exception: accepted


def test_a_worker_with_another_token_is_refused():
    worker_nonce = new_nonce()
    head_nonce, challenge = make_challenge(KEY, worker_nonce)
    with pytest.raises(AuthError, match="head could not prove"):  # it cannot even check the head's proof
        answer_challenge(token_key("another token, long enough"), worker_nonce, challenge)
    forged = worker_proof(token_key("another token, long enough"), head_nonce, worker_nonce)
    with pytest.raises(AuthError, match="token proof is wrong"):
        check_answer(KEY, head_nonce, worker_nonce, forged)


def test_a_fake_head_cannot_pass_and_proofs_do_not_reflect():
    worker_nonce, head_nonce = new_nonce(), new_nonce()
    with pytest.raises(AuthError, match="head could not prove"):
        answer_challenge(KEY, worker_nonce, head_nonce + bytes(32))
    # a worker's proof, sent back as a head's proof (or the other way round), never checks out
    reflected = worker_proof(KEY, worker_nonce, head_nonce)
    with pytest.raises(AuthError):
        answer_challenge(KEY, worker_nonce, head_nonce + reflected)
    assert head_proof(KEY, worker_nonce, head_nonce) != worker_proof(KEY, head_nonce, worker_nonce)
    with pytest.raises(AuthError, match="did not ask"):
        answer_challenge(KEY, worker_nonce, None)
    with pytest.raises(AuthError, match="bytes, not"):
        answer_challenge(KEY, worker_nonce, b"short")


def test_a_replayed_answer_fails_against_a_fresh_challenge():
    worker_nonce = new_nonce()
    first_nonce, first = make_challenge(KEY, worker_nonce)
    recorded = answer_challenge(KEY, worker_nonce, first)
    second_nonce, _ = make_challenge(KEY, worker_nonce)  # the head's nonce is new on every connection
    with pytest.raises(AuthError):
        check_answer(KEY, second_nonce, worker_nonce, recorded)
    with pytest.raises(AuthError):
        check_answer(KEY, first_nonce, worker_nonce, None)


def test_tokens_must_be_text_without_surrounding_space():
    with pytest.raises(ValueError):
        token_key(" padded ")
    with pytest.raises(ValueError):
        token_key("")


# --- where the worker gets its token --------------------------------------------------------------------------

def worker_args(**extra) -> argparse.Namespace:
    """`worker --join 127.0.0.1:7001 --device cpu` as the command line parses it, with `extra` set after."""
    args = build_parser().parse_args(["worker", "--join", "127.0.0.1:7001", "--device", "cpu"])
    for name, value in extra.items():
        assert hasattr(args, name), name
        setattr(args, name, value)
    return args


def test_token_from_a_file_the_environment_or_nowhere(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert join_token_from(path, {}) == TOKEN
    assert join_token_from(None, {TOKEN_FILE_ENV: str(path)}) == TOKEN
    assert join_token_from(None, {TOKEN_ENV: TOKEN}) == TOKEN
    assert join_token_from(None, {}) is None
    assert join_token_from(None, {TOKEN_ENV: ""}) is None  # set empty: as if unset, as shells take it
    with pytest.raises(WorkerSetupError, match=f"{TOKEN_ENV} holds only whitespace; set it to the head's "
                                               "head.join_token, or unset it"):
        join_token_from(None, {TOKEN_ENV: " \t"})
    assert worker_options(worker_args(join_token_file=path), {}).join_token == TOKEN
    assert TOKEN not in repr(worker_options(worker_args(join_token_file=path), {}))
    with pytest.raises(WorkerSetupError, match="cannot read"):
        join_token_from(tmp_path / "missing", {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(WorkerSetupError, match="empty"):
        join_token_from(tmp_path / "empty", {})


def test_worker_flags_parse():
    args = build_parser().parse_args(["worker", "--join", "h:7001", "--join-token-file", "/tmp/t",
                                      "--head-timeout-s", "4", "--max-frame-mb", "8"])
    assert args.join_token_file == Path("/tmp/t") and args.head_timeout_s == 4 and args.max_frame_mb == 8
    options = worker_options(worker_args(head_timeout_s=4.0, max_frame_mb=8.0, join_token_file=None), {})
    assert options.head_timeout_s == 4.0 and options.max_frame_bytes == 8 << 20
    with pytest.raises(WorkerSetupError, match="head timeout"):
        worker_options(worker_args(), {"TC_HEAD_TIMEOUT_S": "-1"})
    # the flags' own ranges, which the environment's values were not held to: a timeout past what a socket takes
    # and a frame limit that rounds to no bytes failed the worker with a traceback once it had joined
    with pytest.raises(WorkerSetupError, match=r"the head timeout .* must be a number from 0.05 to 3600, got '1e10'"):
        worker_options(worker_args(), {"TC_HEAD_TIMEOUT_S": "1e10"})
    with pytest.raises(WorkerSetupError, match=r"the frame limit .* must be a number from 0.000976562 to 65536"):
        worker_options(worker_args(), {"TC_MAX_FRAME_MB": "1e-9"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--join", "h:7001", "--head-timeout-s", "1e10"])


def test_peer_flags_parse():
    """Where the worker before passes hidden states: any free port by default, a fixed one, or none."""
    assert (worker_options(worker_args(), {}).peer_port, worker_options(worker_args(), {}).peer_host) == (0, None)
    args = build_parser().parse_args(["worker", "--join", "h:7001", "--peer-port", "7002", "--peer-host", "10.0.0.9"])
    options = worker_options(args, {})
    assert (options.peer_port, options.peer_host) == (7002, "10.0.0.9")
    assert worker_options(worker_args(no_direct_hops=True), {}).peer_port is None
    with pytest.raises(WorkerSetupError, match="--peer-port must be a port number"):
        worker_options(worker_args(peer_port=70000), {})


# --- real processes -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen", seed=2)




@pytest.fixture(scope="module")
def guarded(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("guarded")
    topo = write_topology(tmp / "t.yaml", model_dir, NODES, head={"join_token": TOKEN})
    with Cluster(topo, tmp) as cluster:
        cluster.start_head()
        cluster.wait_api()
        yield cluster


def test_the_head_s_join_line_asks_for_the_token(guarded):
    """The head's log says what to run on each worker; copied as it stood, that line was refused for want of the
    token."""
    assert (f"worker --join 127.0.0.1:{guarded.listen_port} --join-token-file TOKEN_FILE [--node-id ID]"
            in guarded.head.output())
    assert "TOKEN_FILE: a file holding head.join_token" in guarded.head.output()
    assert TOKEN not in guarded.head.output()


def test_worker_without_the_token_is_refused(guarded):
    worker = guarded.start_worker("a", name="no-token")
    assert worker.proc.wait(WORKER_JOIN_S) == 2
    guarded.workers.pop("no-token").stop()
    assert "needs a join token" in worker.output()


def test_worker_with_a_wrong_token_is_refused(guarded):
    worker = guarded.start_worker("a", name="wrong-token", env={TOKEN_ENV: "this is not the token at all"})
    assert worker.proc.wait(WORKER_JOIN_S) == 2
    guarded.workers.pop("wrong-token").stop()
    # the worker notices first, and says the likely cause before the rarer one
    assert "could not prove it knows this worker's join token: most likely the two tokens differ" in worker.output()
    # and it leaves without a word, so the head's log says what a worker leaving at that point most likely means
    deadline = time.monotonic() + 60  # the head reads the close at once; a loaded machine may be slow to log it
    while "most likely differs from this head's head.join_token" not in guarded.head.output():
        assert time.monotonic() < deadline, guarded.head.output()[-2000:]
        time.sleep(0.1)


def test_stranger_replaying_an_old_answer_is_refused(guarded):
    conn = Connection(socket.create_connection(("127.0.0.1", guarded.listen_port), timeout=10))
    with conn:
        nonce = new_nonce()
        conn.send(worker_hello("a", auth=nonce))
        ack = conn.recv(timeout=10).message
        assert isinstance(ack, HelloAck) and ack.node_id == "" and len(ack.challenge) == CHALLENGE_BYTES
        stale = worker_proof(KEY, new_nonce(), nonce)  # right token, but for another connection's challenge
        conn.send(worker_hello("a", auth=stale))
        reply = conn.recv(timeout=10).message
        assert isinstance(reply, Error) and "token proof is wrong" in reply.message
    log = guarded.head.output()
    assert "token proof is wrong" in log


def test_hello_without_a_nonce_learns_nothing_about_the_topology(guarded):
    conn = Connection(socket.create_connection(("127.0.0.1", guarded.listen_port), timeout=10))
    with conn:
        conn.send(worker_hello("nobody"))
        reply = conn.recv(timeout=10).message
        assert isinstance(reply, Error) and "needs a join token" in reply.message
        assert "nobody" not in reply.message and "topology.yaml lists" not in reply.message


def test_worker_with_the_token_joins_and_serves(guarded, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    guarded.start_worker("a", name="good", env={TOKEN_FILE_ENV: str(token_file)})
    guarded.wait_ready()
    status, body = guarded.post("/v1/completions", {"model": "tiny-qwen", "prompt": "hi", "max_tokens": 3})
    assert status == 200, body
    for text in (guarded.head.output(), guarded.workers["good"].output()):
        assert TOKEN not in text


def test_worker_with_a_token_refuses_a_head_without_one(tmp_path, model_dir):
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES)
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        worker = cluster.start_worker("a", env={TOKEN_ENV: TOKEN})
        assert worker.proc.wait(WORKER_JOIN_S) == 2
        assert "did not ask for the join token" in worker.output()


def test_the_token_never_crosses_the_wire(tmp_path, model_dir):
    """A listener records everything a worker with a token sends to a head that cannot prove itself."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    received = bytearray()

    def fake_head() -> None:
        sock, _ = listener.accept()
        conn = Connection(sock)
        with conn:
            env = conn.recv(timeout=60)
            received.extend(repr(env).encode())
            received.extend(env.message.auth or b"")
            conn.send(HelloAck(node_id="", challenge=new_nonce() + bytes(32)))
            try:
                while True:
                    env = conn.recv(timeout=30)
                    received.extend(repr(env).encode())
            except (OSError, ConnectionError):
                pass

    thread = threading.Thread(target=fake_head, daemon=True)
    thread.start()
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES)
    cluster = Cluster(topo, tmp_path)
    cluster.listen_port = listener.getsockname()[1]
    try:
        worker = cluster.start_worker("a", env={TOKEN_ENV: TOKEN})
        assert worker.proc.wait(WORKER_JOIN_S) == 2  # it will not serve a head that cannot prove it knows the token
        assert "could not prove" in worker.output()
        thread.join(30)
        assert len(received) > 0
        assert TOKEN.encode() not in received and KEY not in received
    finally:
        cluster.stop()
        listener.close()


def test_body_limit_comes_from_the_topology(tmp_path, model_dir):
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES, head={"max_body_mb": 0.01})
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        status, body = cluster.post("/v1/completions", {"model": "tiny-qwen", "prompt": "x" * 20_000})
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert "10485 bytes" in body["error"]["message"]


def test_without_a_body_limit_the_head_takes_a_prompt_that_fills_its_context(tmp_path):
    """The body limit was 1 MiB whatever the model: a prompt that fills a long context, as token ids (5 bytes each
    here) or as escaped text, is more than that, and got a 413 before its tokens were counted. Unset, the limit
    follows the context; a body past it is told the limit and the setting that raises it."""
    from tc.head.api import body_limit

    context = 262_144
    model_dir = write_tiny_model(tmp_path / "long-context", seed=2, max_position_embeddings=context)
    topo = write_topology(tmp_path / "t.yaml", model_dir, NODES)
    prompt = [255] * (context - 16)
    assert len(json.dumps(prompt)) > 1 << 20
    with Cluster(topo, tmp_path) as cluster:
        cluster.start_head()
        cluster.wait_api()
        # read, counted and found to fit: only the missing worker stands in its way
        status, body = cluster.post("/v1/completions", {"model": "long-context", "prompt": prompt, "max_tokens": 1})
        assert status == 503 and body["error"]["code"] == "cluster_not_ready", body
        status, body = cluster.post("/v1/completions", {"model": "long-context", "prompt": "x" * body_limit(context)})
        assert status == 413 and body["error"]["code"] == "request_too_large"
        message = body["error"]["message"]
        assert f"at most {body_limit(context)} bytes" in message and "head.max_body_mb" in message


# --- nothing on a network path executes code ---------------------------------------------------------------------

UNSAFE = [
    (r"\bimport pickle\b|\bpickle\.", "pickle"),
    (r"\bmarshal\.loads|\bshelve\b|\bdill\b", "other code-carrying serialisers"),
    (r"torch\.load\((?![^)]*weights_only\s*=\s*True)", "torch.load without weights_only=True"),
    (r"trust_remote_code\s*=\s*True", "trust_remote_code"),
    (r"(?<![\w.])eval\(|(?<![\w.])exec\(", "eval/exec"),
    (r"yaml\.load\((?![^)]*Loader=_UniqueKeyLoader)|yaml\.unsafe_load|yaml\.Loader\b", "unsafe YAML loading"),
    (r"jinja2\.Environment\(|from jinja2 import Environment", "an unsandboxed Jinja environment"),
]


@pytest.mark.parametrize("pattern,what", UNSAFE, ids=[w for _, w in UNSAFE])
def test_no_code_execution_paths_in_the_package(pattern, what):
    hits = []
    for path in sorted((ROOT / "tc").rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(pattern, line) and not line.lstrip().startswith("#"):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, f"{what}:\n" + "\n".join(hits)
