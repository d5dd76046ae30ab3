"""The worker process: join the head, load the assigned layers, serve them until told otherwise.

Before its first join the worker measures what a layer costs on its device (tc.bench: every weight mode and
native compute dtype, read back from the cache after the first time), and every HELLO carries the figures, for
a head that plans from them. `--bench` prints them alone; `--no-bench` joins without.

Two threads per connection: this one reads frames and answers PING at once (so a long prefill or a download
never looks like a dead worker), and a compute thread runs loading and inference in order. With direct hops
(peers.py) a listener takes hidden states from the stage before, its reader handing each RUN_BATCH to the same
compute thread, which passes its output to the next stage when the head's ROUTE says so.

Failing without hanging: every failure of the compute thread reaches the head. A load that fails, whatever the
exception, is a LOAD_FAILED with the reason (the worker stays joined, out of service, until it is restarted); an
inference command that fails is an INFERENCE_ERROR that fails that request only. Anything else the compute
thread raises (a reply it cannot send, a bug) would leave a worker that answers PINGs and computes nothing, so
it sends an ERROR compute_failed with the reason and ends the connection; the head drops the worker with that
reason and the worker rejoins with backoff.

Staying joined: when the connection ends, the head says it is shutting down, or the head has sent nothing (not
even a PING) for head_timeout_s, or for HEARTBEAT_MISSES of the head's ping intervals where those are longer (a
head that died without closing, or a cut link), the worker rejoins with
backoff; loaded layers are kept for the next assignment. A step the compute thread is running through its layers
then (a long prompt's) is given up at the next layer: it would answer no one, and the head waits for a lost
worker's return only its resume grace. A head that refuses the rejoin because a connected worker holds the entry
(code node_taken) most likely still holds this worker's own last connection, which it has not yet seen end: the
worker tries again (for up to STILL_HELD_MAX_S), where a worker that never joined takes that refusal as final. A
head that breaks the protocol (garbage, a command before any ASSIGNMENT, a message a worker never takes) gets an
ERROR and the connection is dropped, then rejoined.

Leaving: SIGTERM or SIGINT tells the head (an ERROR with code shutting_down, so its request in flight fails with
that reason), closes the connection and exits 0. From the signal on, the worker runs and passes on no step: a
frame already queued would otherwise carry the request on, even to its end, before the head reads the farewell.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

import torch

from .. import full_version
from ..bench import Measured, bench_table, default_bench_dir, measure_all
from ..model_source import ModelSource, ModelSourceError
from ..model.qwen2 import StepInterrupted, compute_dtype_name
from ..model.config import ModelConfig
from ..model.weights import layer_tensor_names
from ..planner import format_bytes
from ..protocol.auth import AuthError, answer_challenge, new_nonce, token_key
from ..protocol.connection import Connection, connect, is_loopback
from ..protocol.errors import ConnectionClosed, ProtocolError
from ..protocol.framing import DEFAULT_MAX_FRAME_BYTES
from ..protocol.messages import (ERROR_COMPUTE_FAILED, ERROR_NODE_TAKEN, ERROR_PROTOCOL, ERROR_SHUTTING_DOWN,
                                 PROTOCOL_VERSION, Assignment, ClearCache, DeviceInfo, Error, Hello, HelloAck,
                                 InferenceError, LoadComplete, HiddenState, LoadFailed, LoadProgress, Ping, Pong,
                                 Release, Route, RunBatch, SpeedFigure)
from ..topology import GIB, HEARTBEAT_MISSES, HEARTBEAT_RANGE_S, SIZE_RANGE_MB, HostPort
from .device import DeviceError, compute_dtypes, detect_devices, offered_devices, select_device, system_summary
from ..openmp import on_own_thread
from ..signals import on_signals
from ..trace import mark
from .peers import Forwarder, PeerListener, Routes
from .runtime import (LoadedStage, StageOutput, StageRuntime, apply_threads, load_assignment, torch_threads,
                      warn_past_the_cores)

log = logging.getLogger(__name__)

REFUSED_EXIT = 2
# How long a worker joined before takes "node taken" for its own last connection, which the head has not yet seen
# end: a head drops a connection whose PINGs go unanswered within its heartbeat timeout (15 s unless its topology
# says otherwise). Refused for longer, another worker holds the entry, and the refusal is final.
STILL_HELD_MAX_S = 300.0
HANDSHAKE_TIMEOUT_S = 30.0
# A head answers HELLO at once: silence past this is most likely --join naming an HTTP server (the head's API
# port), which never answers a frame. Said then, rather than after the whole handshake bound.
SILENCE_HINT_S = 5.0
DEFAULT_HEAD_TIMEOUT_S = 30.0  # several of the head's default 5 s heartbeats
TOKEN_ENV = "TC_JOIN_TOKEN"
TOKEN_FILE_ENV = "TC_JOIN_TOKEN_FILE"
HEAD_TIMEOUT_ENV = "TC_HEAD_TIMEOUT_S"
MAX_FRAME_ENV = "TC_MAX_FRAME_MB"
MIB = 1 << 20
DOWNLOAD_REPORT_S = 1.0  # how often a worker tells the head how its download goes


class Refused(Exception):
    """The head refused this worker, or could not prove itself; retrying would not help."""


class StillHeld(Exception):
    """The head holds this worker's entry for a connection this worker has left (after hearing nothing from the
    head for --head-timeout-s): the head drops it once it sees it end, and the worker rejoins then."""


HANDSHAKE_MAX_FRAME_BYTES = 1 << 20  # a head's HELLO_ACK or ERROR before it admits this worker: the head's own bound


class WorkerSetupError(ValueError):
    """A worker setting (token file, timeout, frame size) is unusable; the message says how to fix it."""


@dataclass(frozen=True)
class WorkerOptions:
    host: str
    port: int
    node_id: str | None
    device: str
    hf_cache_dir: str | None
    max_memory_bytes: int | None
    retry_max_s: float = 30.0
    join_token: str | None = field(default=None, repr=False)  # a secret: never in logs or reprs
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    threads: int | None = None  # --threads; when given, the topology entry's threads do not apply
    bench: bool = True  # measure this machine (or read the cached figures) and say so in HELLO
    bench_dir: Path | None = field(default_factory=default_bench_dir)  # where figures are kept; None: not kept
    peer_port: int | None = 0  # where the stage before passes hidden states straight here (0: any free port);
    # None: it passes them through the head
    peer_host: str | None = None  # the address the stage before reaches this worker at (None: the head's view)


def _assignment_key(a: Assignment) -> tuple:
    """What layers loaded for an earlier assignment must match to serve this one: the same settings, the same
    config.json, and for a local model directory the same files. A head restarted over a checkpoint rewritten in
    place (same path, new weights) would otherwise be served the old layers, and answer wrongly without a word.
    A Hub model is named by the commit the head resolved its revision to, so a branch that moved since the load
    is loaded anew. The context served is part of it: longrope's rotary tables are made for it."""
    return (a.model_id, a.revision, a.device, a.quant, a.group_size, a.compute_dtype, a.layer_start,
            a.layer_end_exclusive, a.model_source, json.dumps(a.config, sort_keys=True), a.context_length,
            _local_files(a.model_id) if a.model_source == "local" else ())


def _local_files(model_dir: str) -> tuple:
    """The name, size and modification time of each file of a local model directory (its top level, where
    config.json and the shards are); nothing when it cannot be read (the load then says why)."""
    try:
        with os.scandir(model_dir) as entries:
            return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file()))
    except OSError:
        return ()


def read_token_file(path: Path) -> str:
    """The join token in a file (surrounding whitespace dropped). Raises WorkerSetupError."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkerSetupError(f"cannot read the join token file {path}: {exc}") from exc
    if not token:
        raise WorkerSetupError(f"the join token file {path} is empty; put the head's head.join_token in it")
    return token


def join_token_from(token_file: Path | None, environ: Mapping[str, str]) -> str | None:
    """The token from --join-token-file, else TC_JOIN_TOKEN_FILE, else TC_JOIN_TOKEN; None when none is given.

    Never from a plain command-line value: process lists show command lines to every user of the machine.
    """
    if token_file is not None:
        return read_token_file(token_file)
    if environ.get(TOKEN_FILE_ENV):
        return read_token_file(Path(environ[TOKEN_FILE_ENV]))
    raw = environ.get(TOKEN_ENV, "")
    if raw and not raw.strip():  # set to blanks: a token meant and lost (the head would refuse the worker for none)
        raise WorkerSetupError(f"{TOKEN_ENV} holds only whitespace; set it to the head's head.join_token, or unset "
                               "it for a head without one")
    return raw.strip() or None


def _in_range(value: object, what: str, low: float, high: float) -> float:
    """`value` (a flag's, or an environment variable's text) as a number in [low, high], the flag's own range: one
    past it (a frame limit of bytes, a timeout past what a socket takes) failed the worker later with a traceback."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = float("nan")
    if not low <= number <= high:
        raise WorkerSetupError(f"{what} must be a number from {low:g} to {high:g}, got {value!r}")
    return number


def worker_options(args: argparse.Namespace, environ: Mapping[str, str]) -> WorkerOptions:
    """Options from the command line, falling back to the environment (TC_*) for the token, timeout and frame cap.

    --max-memory-gb counts GiB (2**30 bytes), the unit of the topology's max_memory_gb, so one figure means the
    same memory in either place. Raises WorkerSetupError.
    """
    max_memory = int(round(args.max_memory_gb * GIB)) if args.max_memory_gb else None
    host, port = args.join
    head_timeout = args.head_timeout_s or environ.get(HEAD_TIMEOUT_ENV) or DEFAULT_HEAD_TIMEOUT_S
    max_frame_mb = args.max_frame_mb or environ.get(MAX_FRAME_ENV)
    return WorkerOptions(
        host=host, port=port, node_id=args.node_id, device=args.device,
        hf_cache_dir=str(args.hf_cache_dir) if args.hf_cache_dir else None, max_memory_bytes=max_memory,
        retry_max_s=args.retry_max_s, join_token=join_token_from(args.join_token_file, environ),
        head_timeout_s=_in_range(head_timeout, "the head timeout (--head-timeout-s / TC_HEAD_TIMEOUT_S)",
                                 *HEARTBEAT_RANGE_S),
        max_frame_bytes=(DEFAULT_MAX_FRAME_BYTES if not max_frame_mb else
                         int(_in_range(max_frame_mb, "the frame limit (--max-frame-mb / TC_MAX_FRAME_MB)",
                                       *SIZE_RANGE_MB) * MIB)),
        threads=args.threads or None,
        bench=not args.no_bench,
        bench_dir=args.bench_dir or default_bench_dir(environ),
        peer_port=None if args.no_direct_hops else _port(args.peer_port),
        peer_host=args.peer_host or None,
    )


def _port(value: int) -> int:
    if not 0 <= value <= 65535:
        raise WorkerSetupError(f"--peer-port must be a port number 0-65535 (0: any free port), got {value}")
    return value


class Worker:
    def __init__(self, options: WorkerOptions):
        self.options = options
        # the second look asks the chosen GPU alone for its free memory (see device.cuda_devices)
        self.device = select_device(options.device, detect_devices())
        self.devices = offered_devices(options.device, self.device, detect_devices(selected=self.device))
        self.stop = threading.Event()
        self.loaded: tuple[tuple, LoadedStage] | None = None  # kept across rejoins: same assignment, no reload
        self._key = token_key(options.join_token) if options.join_token else None
        self._conn: Connection | None = None
        self._node_id: str | None = None
        self._head_answered = False  # whether this connection's other end has answered as a tc head does
        self._compute_failure: str | None = None  # why this connection's compute thread ended it, if it did
        self._held_since: float | None = None  # when the head first said this worker's entry was taken (StillHeld)
        self.speeds: tuple[SpeedFigure, ...] = ()  # what measure_speeds found; HELLO carries it
        self._peers: PeerListener | None = None  # this connection's listener for the stage before, if any

    def measure_speeds(self, fresh: bool = False) -> tuple[Measured, ...]:
        """Measure (or read back) this machine's speed on its device for HELLO; up to a minute the first time."""
        name = next(d.name for d in self.devices if d.id == self.device)
        figures = measure_all(self.device, name, compute_dtypes(self.device), self.options.bench_dir, fresh)
        self.speeds = tuple(SpeedFigure(device=f.device, dtype=f.dtype, quant=f.quant,
                                        decode_bytes_per_s=f.speed.decode_bytes_per_s,
                                        prefill_bytes_per_s=f.speed.prefill_bytes_per_s,
                                        layer_overhead_s=f.speed.layer_overhead_s) for f in figures)
        return figures

    def hello(self, auth: bytes | None = None) -> Hello:
        summary = system_summary()
        return Hello(protocol_version=PROTOCOL_VERSION, tc_version=full_version(), node_id=self.options.node_id,
                     hostname=summary["hostname"], platform=summary["platform"],
                     python_version=summary["python_version"], torch_version=summary["torch_version"],
                     devices=tuple(self.devices), selected_device=self.device,
                     compute_dtypes=compute_dtypes(self.device), max_memory_bytes=self.options.max_memory_bytes,
                     auth=auth, speeds=self.speeds, max_frame_bytes=self.options.max_frame_bytes,
                     peer_port=self._peers.port if self._peers else None,
                     peer_host=self.options.peer_host if self._peers else None,
                     held_node_id=self._node_id if self.options.node_id is None else None)

    def run(self) -> int:
        """Join, serve, and rejoin with backoff when the head goes away. Returns the exit status."""
        delay = 1.0
        while not self.stop.is_set():
            address = HostPort(self.options.host, self.options.port)
            try:
                # a head's replies before it admits this worker are a few hundred bytes: what announces more is
                # no tc head, and is given no buffer of up to --max-frame-mb (raised once admitted, in handshake)
                conn = connect(self.options.host, self.options.port, timeout=10.0,
                               max_frame_bytes=min(self.options.max_frame_bytes, HANDSHAKE_MAX_FRAME_BYTES))
            except OSError as exc:
                log.warning("head at %s not reachable (%s); retrying in %.3gs", address, exc, delay)
                self.stop.wait(delay)
                delay = min(delay * 2, self.options.retry_max_s)
                continue
            # a head's first frame is a small HELLO_ACK: a header announcing more is a server of another kind
            # speaking first (sshd's banner, say), not a limit to raise; _expect_ack gives the advice for later
            conn.frame_limit_advice = "a head's first reply is a few bytes: what answered is not a tc head"
            self._conn, self._head_answered = conn, False
            if self.stop.is_set():  # the signal came during connect(): its farewell had no connection to close
                self._conn = None
                conn.close()
                break
            try:
                served = self.session(conn)
            except Refused as exc:
                log.error("the head refused this worker: %s", exc)
                return REFUSED_EXIT
            except WorkerSetupError as exc:
                log.error("%s", exc)
                return REFUSED_EXIT
            except StillHeld as exc:
                now = time.monotonic()
                self._held_since = self._held_since or now
                if now - self._held_since > STILL_HELD_MAX_S:
                    log.error("the head refused this worker: %s (for %.0f s now: another worker holds the entry, "
                              "not this one's last connection)", exc, now - self._held_since)
                    return REFUSED_EXIT
                log.warning("the head has not yet seen this worker's last connection end (it says: %s); retrying "
                            "in %.3gs", exc, delay)
                served = False
            except (ConnectionClosed, OSError, ProtocolError) as exc:
                if self.stop.is_set():
                    break
                if not self._head_answered:  # nothing at that address has answered as a tc head
                    log.warning("no tc head answered at %s (%s): check that --join names the head's head.listen "
                                "address, not its API port; retrying in %.3gs", address, exc, delay)
                else:
                    log.warning("lost the head at %s (%s); rejoining", address, exc)
                served = False
            finally:
                self._conn = None
                conn.close()
            if served:
                delay = 1.0
            if not self.stop.is_set():
                self.stop.wait(delay)
                delay = min(delay * 2, self.options.retry_max_s)
        log.info("worker stopped")
        return 0

    def shutdown(self, why: str) -> None:
        """Leave for good: tell the head why, close the connection; run() then returns 0. Any thread may call it (a
        signal's, tc.signals)."""
        self.stop.set()
        conn, node = self._conn, self._node_id or self.options.node_id or "(unassigned)"

        def farewell() -> None:  # a thread of its own: the send may wait behind a large frame going out
            if conn is not None:
                try:
                    conn.send(Error(code=ERROR_SHUTTING_DOWN, message=f"worker {node} is shutting down ({why})"))
                except (OSError, ValueError):
                    pass
                conn.close()

        log.info("shutting down (%s)", why)
        threading.Thread(target=farewell, name="farewell", daemon=True).start()

    def _expect_ack(self, conn: Connection) -> HelloAck:
        if self._head_answered:
            env = conn.recv()
        else:
            try:
                env = conn.recv(timeout=SILENCE_HINT_S)
            except TimeoutError:
                log.warning("nothing has answered at %s for %.0f s, where a tc head answers at once: if that is an "
                            "HTTP server (the head's API port), --join must name the head's head.listen address "
                            "instead (port 7001 unless its topology says otherwise); still waiting", conn.peer,
                            SILENCE_HINT_S)
                env = conn.recv(timeout=HANDSHAKE_TIMEOUT_S - SILENCE_HINT_S)
        self._head_answered = True
        conn.frame_limit_advice = ("that is this worker's --max-frame-mb (TC_MAX_FRAME_MB): start it with one as "
                                   "large as the head's head.max_frame_mb")
        if isinstance(env.message, Error) and env.message.code == ERROR_SHUTTING_DOWN:
            raise ConnectionClosed(env.message.message)  # not a refusal: rejoin once the head is back
        if isinstance(env.message, Error) and env.message.code == ERROR_NODE_TAKEN and self._node_id is not None:
            # joined before, this process holds no other connection: what holds the entry is its last one
            raise StillHeld(env.message.message)
        if isinstance(env.message, Error):
            raise Refused(env.message.message)
        if not isinstance(env.message, HelloAck):
            raise ProtocolError(f"expected HELLO_ACK, got {env.message.TYPE}")
        return env.message

    def handshake(self, conn: Connection) -> HelloAck:
        """HELLO, and the join-token exchange when this worker has a token. Returns the head's last HELLO_ACK (the
        node id given, how often it pings)."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        nonce = new_nonce() if self._key is not None else None
        hello = self.hello(auth=nonce)
        try:
            conn.send(hello)
        except ValueError as exc:  # its own frame limit: no head could ever hear it
            raise WorkerSetupError(f"--max-frame-mb is too small for this worker's own HELLO ({exc})") from exc
        ack = self._expect_ack(conn)
        if self._key is not None:
            assert nonce is not None
            try:
                proof = answer_challenge(self._key, nonce, ack.challenge)
            except AuthError as exc:
                raise Refused(str(exc)) from exc
            conn.send(self.hello(auth=proof))
            ack = self._expect_ack(conn)
        if ack.challenge is not None:
            raise Refused("the head asks for a join token and this worker has none: give it the head's "
                          f"head.join_token with --join-token-file PATH or {TOKEN_ENV}")
        conn.max_frame_bytes = self.options.max_frame_bytes  # admitted: its steps may take as much as it allows
        return ack

    def session(self, conn: Connection) -> bool:
        """One connection's life. Returns True if the head accepted us and we served (so a rejoin starts fresh),
        False when our compute failed (so rejoining backs off)."""
        # Jobs for the compute thread, in order: (envelope, whether it came from the stage before, not the head).
        # SimpleQueue's put and get are C, where Queue's run a Condition's Python: every decode step passes here,
        # and handing one over took 47-72 us against 106-128 with the caches cold from a stage's weights.
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        routes = Routes()
        self._peers = self._listen_for_peers(conn, routes, jobs)
        try:
            return self._serve(conn, jobs, routes)
        finally:
            if self._peers is not None:
                self._peers.close()
                self._peers = None

    def silence_limit_s(self, heartbeat_s: float | None) -> float:
        """How long the head may say nothing before this worker counts it gone: --head-timeout-s, or several of
        the head's ping intervals where its topology's heartbeat_s is long (a minute, say); with the worker's
        bound alone, every idle worker would drop and rejoin between two pings."""
        if heartbeat_s is None or HEARTBEAT_MISSES * heartbeat_s <= self.options.head_timeout_s:
            return self.options.head_timeout_s
        limit = HEARTBEAT_MISSES * heartbeat_s
        log.info("the head pings every %gs: this worker counts it gone after %gs of silence, not its "
                 "--head-timeout-s of %gs", heartbeat_s, limit, self.options.head_timeout_s)
        return limit

    def _listen_for_peers(self, conn: Connection, routes: Routes, jobs: queue.SimpleQueue) -> PeerListener | None:
        """The listener for the stage before this one, on the address this worker reaches the head from (peers.py);
        None when direct hops are off here or the port cannot be had (the head then relays this stage's input).
        A worker that reaches the head over loopback runs on the head's machine, where a stage on another machine
        reaches it at the head's address (the head routes it there): it listens on every interface, unless
        --peer-host says where the others reach it."""
        host = conn.local_host
        if self.options.peer_port is None or host is None:
            return None
        if is_loopback(host) and self.options.peer_host is None:  # IPv4 and IPv6 both, where the system can
            host = "::" if ":" in host or socket.has_dualstack_ipv6() else "0.0.0.0"
        try:
            return PeerListener(host, self.options.peer_port, routes, lambda env: jobs.put((env, True)),
                                self.options.max_frame_bytes, self._key)
        except OSError as exc:
            log.warning("cannot listen for the stage before this one on %s port %d (%s); it passes hidden states "
                        "through the head instead", host, self.options.peer_port, exc)
            return None

    def _serve(self, conn: Connection, jobs: queue.SimpleQueue, routes: Routes) -> bool:
        ack = self.handshake(conn)
        node_id = ack.node_id
        self._node_id, self._held_since = node_id, None
        self._compute_failure = None
        # Every read (and write) is bounded: the head pings every heartbeat, so a long silence means it is gone.
        silence_limit_s = self.silence_limit_s(ack.heartbeat_s)
        conn.settimeout(silence_limit_s)
        log.info("joined the head as %s (device %s%s)", node_id, self.device,
                 f"; the stage before may pass hidden states to {self._peers.address}" if self._peers else "")
        # set when this session ends: a step the compute thread is running through its layers (a long prompt's)
        # is given up at the next layer, so that the worker rejoins within the head's resume grace rather than
        # once a step whose output no one will read has finished
        ending = threading.Event()
        computer = threading.Thread(target=self.compute_loop, args=(conn, jobs, routes, ending), name="compute",
                                    daemon=True)
        try:
            computer.start()
        except RuntimeError as exc:
            # a thread or memory limit, maybe for a moment: the head hears this worker is out of service, and it
            # rejoins with backoff, where raised the error would end the process
            self._fail_session(conn, f"no thread to compute on ({exc})", None)
            return False
        assigned = False
        try:
            while True:
                try:
                    env = conn.recv()
                    mark("received")
                except TimeoutError:
                    log.warning("heard nothing from the head for %.0fs; rejoining", silence_limit_s)
                    return True
                msg = env.message
                if isinstance(msg, Ping):
                    conn.send(Pong(nonce=msg.nonce, payload=msg.payload))
                elif isinstance(msg, Assignment):
                    assigned = True
                    jobs.put((env, False))
                elif isinstance(msg, (RunBatch, Route)) and not assigned:
                    raise ProtocolError(f"{msg.TYPE} before any ASSIGNMENT")
                elif isinstance(msg, Route):
                    routes.set(msg)  # here, not in order with the jobs: a peer's handshake may wait for it
                    if msg.inbound_key is not None and self._peers is not None:
                        self._peers.start()
                elif isinstance(msg, (RunBatch, Release, ClearCache)):
                    jobs.put((env, False))
                elif isinstance(msg, Error) and msg.code == ERROR_SHUTTING_DOWN:
                    log.warning("the head says: %s; rejoining", msg.message)
                    return True
                elif isinstance(msg, Error):
                    log.error("the head reports: %s (%s)", msg.message, msg.code)
                else:
                    raise ProtocolError(f"a worker does not accept {msg.TYPE} once joined")
        except ProtocolError as exc:
            log.error("the head broke the protocol (%s); dropping the connection", exc)
            try:
                conn.send(Error(code=ERROR_PROTOCOL, message=str(exc)))
            except (OSError, ValueError):
                pass
            raise
        except ConnectionClosed as exc:
            if self._compute_failure is not None:
                log.warning("left the head after a compute failure (%s); rejoining", self._compute_failure)
                return False
            if not self.stop.is_set():  # the head closed it, or a send to it broke or timed out (the exception says)
                log.warning("lost the head (%s); rejoining", exc)
            return True
        finally:
            ending.set()
            conn.close()
            jobs.put(None)
            computer.join(timeout=1 if self.stop.is_set() else 60)

    def compute_loop(self, conn: Connection, jobs: queue.SimpleQueue, routes: Routes | None = None,
                     ending: threading.Event | None = None) -> None:
        """Load and infer, in order, until the session ends (`ending`, where given, is set then: a step running
        through its layers is given up at the next one, as it is once the worker is leaving). Never dies silently
        (see the module's docstring)."""
        runtime: StageRuntime | None = None
        forwarder = Forwarder(self.options.max_frame_bytes, self._key)
        doing = "waiting for work"
        interrupted = None if ending is None else lambda: ending.is_set() or self.stop.is_set()
        try:
            while True:
                job = jobs.get()
                mark("computing")
                if job is None:
                    return
                env, from_peer = job
                msg = env.message
                doing = msg.TYPE
                if isinstance(msg, Assignment):
                    if self.loaded is None or self.loaded[0] != _assignment_key(msg):
                        runtime = None  # with release_stage: the old layers are gone before the new ones load
                        self.release_stage()
                    runtime = self.load(conn, msg, interrupted)
                elif isinstance(msg, ClearCache):
                    if runtime is not None:
                        runtime.clear()
                elif isinstance(msg, Release):
                    if runtime is not None:
                        runtime.release(msg.sequences)
                elif runtime is None:
                    conn.send(Error(code="not_loaded", message=f"{msg.TYPE} before an ASSIGNMENT was loaded"),
                              env.request_id, env.seq)
                else:
                    self._run_batch(conn, runtime, env, from_peer, routes.current if routes else None, forwarder)
        except (ConnectionClosed, OSError):
            return  # the reader sees it too and ends the session
        except StepInterrupted as exc:  # the session ended, or the worker is leaving: no reply, not even an error
            log.info("%s given up: %s (%s)", doing, exc,
                     "the worker is leaving" if self.stop.is_set() else "the connection to the head has ended")
            return
        except Exception as exc:  # a worker that pings but cannot compute must not stay joined
            self._fail_session(conn, f"the compute thread failed on {doing}: {type(exc).__name__}: {exc}", exc)
        finally:
            forwarder.close()

    def _run_batch(self, conn: Connection, runtime: StageRuntime, env, from_peer: bool, route: Route | None,
                   forwarder: Forwarder) -> None:
        """Run one RUN_BATCH and send its output on: to the next stage when its route says so and that works
        (with this stage's compute time added to those it carries), else to the head (with those times)."""
        msg: RunBatch = env.message
        on_route = route is not None and msg.route == route.route
        if from_peer and not on_route:
            # passed on under a route the head has since replaced: the head gave up that step and replays what it
            # needs, so running it now would only put stale positions in the caches
            log.info("dropped a batch passed on under route %d (the route is now %s)", msg.route,
                     route.route if route else "unset")
            return
        runtime.release(msg.released)
        output = None if self.stop.is_set() else self.infer(runtime, msg)
        if self.stop.is_set():
            # leaving (shutdown): the head is to hear the farewell, so its request fails as the operator's signal
            # says, not a step that a frame already queued here could still add to it
            log.info("%s of request %s not run or not passed on: the worker is leaving", msg.TYPE, env.request_id)
            return
        if isinstance(output, InferenceError):
            reply = output
        else:
            if on_route and route.next_host is not None and forwarder.send(
                    route, msg.passed_on(output.hidden_state, output.compute_seconds), env.request_id, env.seq):
                mark("passed")
                return  # the head hears from the last stage, or from one that could not pass it on
            reply = HiddenState(hidden_state=output.hidden_state, compute_seconds=output.compute_seconds,
                                upstream_seconds=msg.upstream_seconds)
        conn.send(reply, env.request_id, env.seq)
        mark("answered")

    def _fail_session(self, conn: Connection, reason: str, exc: BaseException | None) -> None:
        """Tell the head this worker is out of service and why, then end the connection (the reader rejoins).
        `exc`: the exception to log with its traceback, if any."""
        log.error("%s; leaving the head to rejoin", reason, exc_info=exc)
        self._compute_failure = reason
        node = self._node_id or self.options.node_id or "(unassigned)"
        try:
            conn.send(Error(code=ERROR_COMPUTE_FAILED, message=f"worker {node} is out of service ({reason}); it "
                                                               "rejoins"))
        except (OSError, ValueError):
            pass  # the connection is gone already; closing it below tells the head all it can learn
        conn.close()

    @staticmethod
    def _fetching(conn: Connection) -> Callable[[str, int, int], Callable[[int, int | None], None]]:
        """model_source.FetchProgress telling the head how a download of this worker's shards goes (LOAD_PROGRESS
        "download of FILE (i of n)", in bytes: the head shows it for the node), at most every DOWNLOAD_REPORT_S,
        and at once when the size changes or the file is whole. Once a report finds the head gone, none is sent
        again; the report raises ConnectionClosed where the download runs on the calling thread (an HTTP download,
        which ends there), and stays quiet on another (hf_xet's, which finishes the file)."""
        caller, gone = threading.current_thread(), [False]

        def file(name: str, number: int, files: int) -> Callable[[int, int | None], None]:
            stage, reported = f"download of {name} ({number} of {files})", [float("-inf"), None]

            def fetched(done: int, size: int | None) -> None:
                if not gone[0]:
                    now = time.monotonic()
                    if now - reported[0] < DOWNLOAD_REPORT_S and done != size and size == reported[1]:
                        return
                    reported[:] = [now, size]
                    try:
                        conn.send(LoadProgress(stage=stage, done=done, total=size or 0))
                        return
                    except ConnectionClosed:
                        gone[0] = True
                if threading.current_thread() is caller:
                    raise ConnectionClosed("the head went away during the download")
            return fetched
        return file

    @staticmethod
    def infer(runtime: StageRuntime, msg: RunBatch) -> StageOutput | InferenceError:
        """Run one batch; any failure (out of memory, a bad shape the checks missed, a bug) fails that batch's
        requests only: the caches, the one state a failed step can spoil, are dropped, and the weights are
        untouched."""
        try:
            return runtime.run(msg)
        except StepInterrupted:
            raise  # the session is ending: nothing is sent for the step (compute_loop), its caches go with it
        except Exception as exc:
            log.exception("%s failed", msg.TYPE)
            runtime.clear()
            return InferenceError(message=f"{msg.TYPE} failed: {type(exc).__name__}: {exc}")

    def release_stage(self) -> None:
        """Drop the loaded layers (the caller drops its runtime, which holds them and the cache) and give their
        memory back, so a new assignment never has to fit beside the old one: on a GPU that fits one stage, a
        reassignment would otherwise fail for want of memory the old stage still holds."""
        if self.loaded is None:
            return
        device = self.loaded[1].device
        self.loaded = None
        gc.collect()  # module hooks can hold a stage in a reference cycle; free it now, not at some later collection
        kind = torch.device(device).type
        if kind == "cuda":
            torch.cuda.empty_cache()  # the caching allocator would keep the freed blocks from other processes
        elif kind == "mps":
            torch.mps.empty_cache()  # as CUDA's: the freed blocks stay cached, and the next stage may not fit

    def load(self, conn: Connection, assignment: Assignment,
             interrupted: Callable[[], bool] | None = None) -> StageRuntime | None:
        """Load the assigned layers (or keep those loaded for the same assignment) and report it; the runtime that
        serves them, its steps given up where `interrupted` says so (StageRuntime), or None where loading failed."""
        key = _assignment_key(assignment)
        start, end = assignment.layer_start, assignment.layer_end_exclusive
        apply_threads(assignment.threads, self.options.threads)
        if self.loaded is not None and self.loaded[0] == key:
            log.info("layers %d-%d already loaded; reusing them", start, end - 1)
            loaded = replace(self.loaded[1], load_seconds=0.0)  # nothing was loaded for this assignment
        else:
            self.loaded = None
            log.info("assigned layers %d-%d of %s (%s, compute %s) on %s", start, end - 1, assignment.model_id,
                     assignment.quant, assignment.compute_dtype, assignment.device)
            try:
                source = ModelSource(assignment.model_id, is_local=assignment.model_source == "local",
                                     revision=assignment.revision, cache_dir=self.options.hf_cache_dir)
                model_dir = source.fetch_tensors(
                    layer_tensor_names(ModelConfig.from_dict(assignment.config), start, end), self._fetching(conn))

                def progress(done: int, total: int) -> None:
                    log.info("loaded layer %d/%d", done, total)
                    conn.send(LoadProgress(stage="layers", done=done, total=total))

                loaded = load_assignment(assignment, model_dir, assignment.device, progress)
            except ConnectionClosed:
                raise  # a progress report found the head gone: no one to tell
            except Exception as exc:  # whatever it is, the head must hear it, or the node shows loading for ever
                if isinstance(exc, ModelSourceError) and isinstance(exc.__cause__, ConnectionClosed):
                    raise exc.__cause__ from None  # a download's report found the head gone: not the Hub's failure
                # Our own errors (a missing file, a bad header, a download that failed) say what to do; anything
                # else is a surprise, which gets its type in the reason and its traceback in the log.
                expected = isinstance(exc, (ModelSourceError, OSError, ValueError))
                reason = str(exc) if expected else f"{type(exc).__name__}: {exc}"
                log.error("could not load layers %d-%d: %s; this worker stays joined and out of service: restart it "
                          "once that is fixed", start, end - 1, reason, exc_info=None if expected else exc)
                conn.send(LoadFailed(reason=reason))
                return None
            self.loaded = (key, loaded)
        log.info("layers %d-%d ready: %s of weights, %s, loaded in %.1fs", start, end - 1,
                 format_bytes(loaded.weight_bytes), loaded.dtype, loaded.load_seconds)
        # the dtype it computes in after any fallback (fp16 asked of a CPU computes in fp32), not the one asked for
        conn.send(LoadComplete(load_seconds=loaded.load_seconds, weight_bytes=loaded.weight_bytes,
                               device=loaded.device, compute_dtype=compute_dtype_name(loaded.dtype)))
        return StageRuntime(loaded, max_sequences=assignment.max_sequences, interrupted=interrupted)


def run_bench(args: argparse.Namespace) -> int:
    """`worker --bench`: measure this machine afresh (keeping the figures for the next start), print them, exit."""
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = select_device(args.device, detect_devices())
    except DeviceError as exc:
        log.error("%s", exc)
        return REFUSED_EXIT
    name = next(d.name for d in detect_devices(selected=device) if d.id == device)
    bench_dir = None if args.no_bench else (args.bench_dir or default_bench_dir())
    figures = measure_all(device, name, compute_dtypes(device), bench_dir, fresh=True)
    print(bench_table(figures, torch.get_num_threads()))
    return 0


def warn_past_the_memory(offered: int | None, device: str, devices: list[DeviceInfo]) -> bool:
    """Warn where --max-memory-gb offers more than `device` has (of `devices`, as detected): the head admits the
    worker by the figure offered (and with head.plan_from: workers gives it layers by it), so layers past the real
    memory run out of it while loading. True if it warned."""
    total = next((d.total_memory for d in devices if d.id == device), None)
    if offered is None or total is None or offered <= total:
        return False
    log.warning("--max-memory-gb offers %.1f GiB, and %s has %.1f GiB: the head admits this worker by the figure "
                "offered (and plans by it under head.plan_from: workers), so layers past the real memory run out of "
                "it while loading; give %.1f or less", offered / GIB, device, total / GIB,
                math.floor(total / GIB * 10) / 10)
    return True


def run_worker(args: argparse.Namespace) -> int:
    if args.bench:
        return run_bench(args)
    if args.join is None:
        log.error("worker needs --join HOST:PORT (the head's listen address), or --bench to measure this machine")
        return REFUSED_EXIT
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        options = worker_options(args, os.environ)
        worker = Worker(options)
    except (DeviceError, WorkerSetupError, ValueError) as exc:
        log.error("%s", exc)
        return REFUSED_EXIT
    if args.threads:
        warn_past_the_cores(args.threads, "--threads")  # before the speed probe, which runs on them
    warn_past_the_memory(options.max_memory_bytes, worker.device, worker.devices)
    if options.bench:
        try:
            on_own_thread(worker.measure_speeds, "speed-probe")  # no OpenMP pool left beside the compute thread's
        except (RuntimeError, ValueError) as exc:  # a device that cannot run the probe can still serve layers
            log.warning("could not measure this machine's speed (%s: %s); joining without it, so the head plans "
                        "this node by bytes or by the topology's nodes[].speed", type(exc).__name__, exc)
    on_signals((signal.SIGTERM, signal.SIGINT), lambda sig: worker.shutdown(f"{sig.name} received"))
    log.info("worker %s: device %s, %s, joining %s:%d%s", options.node_id or "(any entry)",
             worker.device, torch_threads(torch.get_num_threads()), options.host, options.port,
             " with a join token" if options.join_token else "")
    return worker.run()
