"""The worker process: join the head, load the assigned layers, serve them until told otherwise.

Two threads per connection: this one reads frames and answers PING at once (so a long prefill or a download
never looks like a dead worker), and a compute thread runs loading and inference in order.
"""
from __future__ import annotations

import argparse
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from .. import __version__
from ..model_source import ModelSource, ModelSourceError
from ..model.weights import layer_tensor_names
from ..protocol.connection import Connection, connect
from ..protocol.errors import ConnectionClosed, ProtocolError
from ..protocol.messages import (PROTOCOL_VERSION, Assignment, ClearCache, Error, Hello, HelloAck, LoadComplete,
                                 LoadFailed, LoadProgress, Ping, Pong, RunDecode, RunPrefill)
from .device import DeviceError, compute_dtypes, detect_devices, select_device, system_summary
from .runtime import LoadedStage, StageRuntime, load_assignment

log = logging.getLogger(__name__)

REFUSED_EXIT = 2


class Refused(Exception):
    """The head refused this worker; retrying would not help."""


@dataclass(frozen=True)
class WorkerOptions:
    host: str
    port: int
    node_id: str | None
    device: str
    hf_cache_dir: str | None
    max_memory_bytes: int | None
    retry_max_s: float = 30.0
    threads: int | None = None  # --threads; wins over the topology entry's threads


def _assignment_key(a: Assignment) -> tuple:
    return (a.model_id, a.revision, a.device, a.quant, a.group_size, a.compute_dtype, a.layer_start,
            a.layer_end_exclusive)


class Worker:
    def __init__(self, options: WorkerOptions):
        self.options = options
        self.devices = detect_devices()
        self.device = select_device(options.device, self.devices)
        self.stop = threading.Event()
        self.loaded: tuple[tuple, LoadedStage] | None = None  # kept across rejoins: same assignment, no reload

    def hello(self) -> Hello:
        summary = system_summary()
        return Hello(protocol_version=PROTOCOL_VERSION, tc_version=__version__, node_id=self.options.node_id,
                     hostname=summary["hostname"], platform=summary["platform"],
                     python_version=summary["python_version"], torch_version=summary["torch_version"],
                     devices=tuple(self.devices), selected_device=self.device,
                     compute_dtypes=compute_dtypes(self.device), max_memory_bytes=self.options.max_memory_bytes)

    def run(self) -> int:
        """Join, serve, and rejoin with backoff when the head goes away. Returns the exit status."""
        delay = 1.0
        while not self.stop.is_set():
            address = f"{self.options.host}:{self.options.port}"
            try:
                conn = connect(self.options.host, self.options.port, timeout=10.0)
            except OSError as exc:
                log.warning("head at %s not reachable (%s); retrying in %.0fs", address, exc, delay)
                self.stop.wait(delay)
                delay = min(delay * 2, self.options.retry_max_s)
                continue
            try:
                served = self.session(conn)
            except Refused as exc:
                log.error("the head refused this worker: %s", exc)
                return REFUSED_EXIT
            except (ConnectionClosed, OSError, ProtocolError) as exc:
                log.warning("lost the head at %s (%s); rejoining", address, exc)
                served = False
            finally:
                conn.close()
            if served:
                delay = 1.0
            if not self.stop.is_set():
                self.stop.wait(delay)
                delay = min(delay * 2, self.options.retry_max_s)
        return 0

    def session(self, conn: Connection) -> bool:
        """One connection's life. Returns True if the head accepted us (so a rejoin starts fresh)."""
        conn.send(self.hello())
        env = conn.recv()
        if isinstance(env.message, Error):
            raise Refused(env.message.message)
        if not isinstance(env.message, HelloAck):
            raise ProtocolError(f"expected HELLO_ACK, got {env.message.TYPE}")
        conn.settimeout(None)
        node_id = env.message.node_id
        log.info("joined the head as %s (device %s)", node_id, self.device)
        jobs: queue.Queue = queue.Queue()
        computer = threading.Thread(target=self.compute_loop, args=(conn, jobs), name="compute", daemon=True)
        computer.start()
        try:
            while True:
                env = conn.recv()
                msg = env.message
                if isinstance(msg, Ping):
                    conn.send(Pong(nonce=msg.nonce))
                elif isinstance(msg, (Assignment, RunPrefill, RunDecode, ClearCache)):
                    jobs.put(env)
                elif isinstance(msg, Error):
                    log.error("the head reports: %s (%s)", msg.message, msg.code)
                else:
                    conn.send(Error(code="protocol_error", message=f"a worker does not accept {msg.TYPE}"))
                    raise ProtocolError(f"unexpected {msg.TYPE} from the head")
        except ConnectionClosed:
            log.warning("the head closed the connection; rejoining")
            return True
        finally:
            jobs.put(None)
            computer.join(timeout=60)

    def compute_loop(self, conn: Connection, jobs: queue.Queue) -> None:
        runtime: StageRuntime | None = None
        while True:
            env = jobs.get()
            if env is None:
                return
            msg = env.message
            try:
                if isinstance(msg, Assignment):
                    runtime = self.load(conn, msg)
                elif isinstance(msg, ClearCache):
                    if runtime is not None:
                        runtime.clear()
                elif runtime is None:
                    conn.send(Error(code="not_loaded", message=f"{msg.TYPE} before an ASSIGNMENT was loaded"),
                              env.request_id, env.seq)
                elif isinstance(msg, RunPrefill):
                    conn.send(runtime.prefill(msg), env.request_id, env.seq)
                else:
                    conn.send(runtime.decode(msg), env.request_id, env.seq)
            except (ConnectionClosed, OSError):
                return  # the reader sees it too and ends the session

    def load(self, conn: Connection, assignment: Assignment) -> StageRuntime | None:
        if self.options.threads is None and assignment.threads is not None:
            torch.set_num_threads(assignment.threads)
            log.info("using %d torch threads, as topology.yaml sets for this entry", assignment.threads)
        key = _assignment_key(assignment)
        start, end = assignment.layer_start, assignment.layer_end_exclusive
        if self.loaded is not None and self.loaded[0] == key:
            log.info("layers %d-%d already loaded; reusing them", start, end - 1)
            loaded = self.loaded[1]
        else:
            self.loaded = None
            log.info("assigned layers %d-%d of %s (%s, compute %s) on %s", start, end - 1, assignment.model_id,
                     assignment.quant, assignment.compute_dtype, assignment.device)
            try:
                source = ModelSource(assignment.model_id, is_local=assignment.model_source == "local",
                                     revision=assignment.revision, cache_dir=self.options.hf_cache_dir)
                model_dir = source.fetch_tensors(layer_tensor_names(start, end))

                def progress(done: int, total: int) -> None:
                    log.info("loaded layer %d/%d", done, total)
                    conn.send(LoadProgress(stage="layers", done=done, total=total))

                loaded = load_assignment(assignment, model_dir, assignment.device, progress)
            except (ModelSourceError, ValueError, OSError, RuntimeError) as exc:
                log.error("could not load layers %d-%d: %s", start, end - 1, exc)
                conn.send(LoadFailed(reason=str(exc)))
                return None
            self.loaded = (key, loaded)
        log.info("layers %d-%d ready: %.0f MB of weights, %s, loaded in %.1fs", start, end - 1,
                 loaded.weight_bytes / 1e6, loaded.dtype, loaded.load_seconds)
        conn.send(LoadComplete(load_seconds=loaded.load_seconds, weight_bytes=loaded.weight_bytes,
                               device=loaded.device, compute_dtype=assignment.compute_dtype))
        return StageRuntime(loaded)


def run_worker(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    max_memory = int(args.max_memory_gb * 1e9) if args.max_memory_gb else None
    host, port = args.join
    options = WorkerOptions(host=host, port=port, node_id=args.node_id, device=args.device,
                            hf_cache_dir=str(args.hf_cache_dir) if args.hf_cache_dir else None,
                            max_memory_bytes=max_memory, retry_max_s=args.retry_max_s, threads=args.threads)
    try:
        worker = Worker(options)
    except DeviceError as exc:
        log.error("%s", exc)
        return REFUSED_EXIT
    log.info("worker %s: device %s, %d torch threads, joining %s:%d", options.node_id or "(any entry)",
             worker.device, torch.get_num_threads(), host, port)
    try:
        return worker.run()
    except KeyboardInterrupt:
        return 0

