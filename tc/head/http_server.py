"""Serving the API: a Waitress server in a daemon thread, with a stop that answers every request it accepted.

Waitress runs its own event loop (wasyncore) in the thread calling `run()` and hands each request to one of
`threads` worker threads. Whatever touches the loop's sockets (accepting, closing) runs inside the loop itself,
through Waitress's trigger, so no other thread changes the loop's socket map while it polls.

Stopping, in order:
1. a gate in front of the app answers every request from then on with a 503 `shutting_down`, and one more
   request thread starts, so that requests queued behind long ones are answered at once;
2. the server keeps accepting while requests in flight finish, so a client arriving now learns why it is
   refused rather than finding the port closed;
3. then it takes what the kernel has already accepted (the listen backlog), closes the listening socket, and
   waits until those requests too have their 503;
4. last, it closes the connections left, all idle by then unless a request outlived the drain timeout (their
   number is logged).

The replies that never reach the app (the gate's 503s, Waitress's own refusals) carry the CORS headers the app's
would (`cors_headers`), so that a browser page shows the error rather than a blocked request.
"""
from __future__ import annotations

import json
import logging
import resource
import select
import socket
import threading
import time
from typing import Any, Callable, Iterable

from waitress import create_server, wasyncore
from waitress.channel import ClientDisconnected, HTTPChannel
from waitress.task import ErrorTask

from .addresses import bind_address
from .api import CORS_EXPOSED_HEADERS, DEFAULT_MAX_BODY_BYTES, allowed_origin, error_reply, server_error_reply
from .api_requests import BodyTooLarge
from .metrics import Metrics
from .service import ShuttingDown

log = logging.getLogger(__name__)
UNROUTED = "unrouted"  # tc_http_requests_total's route for a reply made before the app saw the request

DRAIN_TIMEOUT_S = 5.0
BACKLOG_DRAIN_S = 1.0  # after the listener closes: time for the requests of connections taken from its backlog
QUIET_S = 0.2  # a connection counts as idle once it has been quiet this long: a new one's request may be in transit
MAX_BACKLOG = 4096  # connections taken from the listen backlog when it closes (Linux caps the backlog at 4096)
IDLE_CONNECTIONS = 1000  # open connections allowed past one per request thread (connection_limit)
FD_HEADROOM = 256  # file descriptors kept for everything else the head opens
STALLED_CLIENT_S = 120.0  # a client that reads none of a reply's buffered output for this long is dropped
SHUTDOWN_REPLY = error_reply(ShuttingDown(), "")  # what the app answers a request it refuses while stopping


def _url_host(host: str) -> str:
    """A host a client can connect to: wildcard addresses become loopback, IPv6 goes in brackets."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def waitress_body_limit(max_body_bytes: int) -> int:
    """Waitress's own cap on request bodies, from the app's.

    Waitress answers an oversized body itself, in plain text, before the app sees it. Its cap therefore sits
    above the app's, so a body just over the limit gets the app's 413 in the OpenAI error shape, while a body
    far over it is still refused without being buffered. (Waitress refuses at `>=` its cap.)
    """
    return 2 * max_body_bytes + 1


def app_body_limit(waitress_limit: int) -> int:
    """The app's cap on request bodies, from Waitress's (the inverse of waitress_body_limit)."""
    return (waitress_limit - 1) // 2


def cors_headers(cors_origins: tuple[str, ...], origin: str | None) -> list[tuple[str, str]]:
    """What a reply the app does not write says to a page of `origin` (its Origin header, if any): what api.Cors
    has the app's replies say, so that a page may also read the Retry-After of the 503 while the server stops, and
    a cache never gives a reply naming one origin to another."""
    headers = [("Vary", "Origin")] if cors_origins and cors_origins != ("*",) else []
    allowed = allowed_origin(cors_origins, origin)
    if allowed is not None:
        headers += [("Access-Control-Allow-Origin", allowed),
                    ("Access-Control-Expose-Headers", ", ".join(CORS_EXPOSED_HEADERS))]
    return headers


class ShutdownGate:
    """WSGI middleware: passes requests to `app` (which HttpServer.serve may replace) until `close()`, then answers
    each with SHUTDOWN_REPLY."""

    def __init__(self, app: Callable, cors_origins: tuple[str, ...] = (), metrics: Metrics | None = None):
        self.app = app
        self.cors_origins = cors_origins
        self.metrics = metrics
        self.closed = threading.Event()
        self._count_lock = threading.Lock()
        self.refused = 0  # requests answered with the 503, for the log

    def close(self) -> None:
        self.closed.set()

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if not self.closed.is_set():
            return self.app(environ, start_response)
        with self._count_lock:
            self.refused += 1
        if self.metrics is not None:  # no route was looked up: the app never saw it
            self.metrics.observe_request(environ.get("REQUEST_METHOD", ""), UNROUTED, 503)
        body = json.dumps(SHUTDOWN_REPLY.body()).encode()
        start_response("503 Service Unavailable", [("Content-Type", "application/json"),
                                                   ("Content-Length", str(len(body))), *SHUTDOWN_REPLY.headers,
                                                   *cors_headers(self.cors_origins, environ.get("HTTP_ORIGIN"))])
        return [body]


class OpenAIErrorTask(ErrorTask):
    """Waitress's own refusals (a body over its cap, headers too large, broken chunked framing, a duplicate
    Content-Length, a transfer coding it does not read) in the OpenAI error shape the app answers everything
    else in; Waitress writes them as plain text, which clients cannot read as an error object."""

    def execute(self) -> None:
        error = self.request.error
        if error.code == 413:  # the app's refusal too, only found sooner: the same words, the app's limit
            reply = error_reply(BodyTooLarge(None, app_body_limit(self.channel.adj.max_request_body_size)), "")
        else:
            reply = server_error_reply(error.code, error.reason, str(error.body).strip())
        body = json.dumps(reply.body()).encode()
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        # the headers as far as Waitress read them (none, when it refused them): names upper case, '_' for '-'
        self.response_headers += cors_headers(self.channel.server.cors_origins, self.request.headers.get("ORIGIN"))
        self.set_close_on_finish()  # as Waitress does: the request's framing can no longer be trusted
        self.content_length = len(body)
        self.write(body)
        metrics = self.channel.server.metrics
        if metrics is not None:
            metrics.observe_request(self.request.command or "", UNROUTED, error.code)


class OpenAIErrorChannel(HTTPChannel):
    error_task_class = OpenAIErrorTask

    def _flush_outbufs_below_high_watermark(self) -> None:
        """Waitress's wait, on a request's thread, for the client to read a reply's output down below
        outbuf_high_watermark (16 MB), given up once the client has read nothing for STALLED_CLIENT_S.

        Waitress waits with no timeout: a client that stays connected and reads nothing (a long stream with
        logprobs writes 16 MB) held the thread for good, and enough of them every thread, /health's too. Given up,
        the connection is shut (the server's loop then closes it and drops its buffers) and the write raises
        ClientDisconnected, which ends the reply as a client that left ends it."""
        if self.total_outbufs_len <= self.adj.outbuf_high_watermark:
            return
        with self.outbuf_lock:
            _, failed = self._flush_exception(self._flush_some, do_close=False)
            if failed:  # as Waitress: the server's loop closes the connection and wakes this thread
                self.server.pull_trigger()
                self.outbuf_lock.wait()
                return
            unread, deadline = self.total_outbufs_len, time.monotonic() + STALLED_CLIENT_S
            while self.connected and self.total_outbufs_len > self.adj.outbuf_high_watermark:
                if self.total_outbufs_len < unread:  # it read some: it is slow, not stalled
                    unread, deadline = self.total_outbufs_len, time.monotonic() + STALLED_CLIENT_S
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("%s read none of its reply for %gs: dropped", self.addr, STALLED_CLIENT_S)
                    try:
                        self.socket.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    self.server.pull_trigger()
                    raise ClientDisconnected(f"the client read nothing for {STALLED_CLIENT_S:g}s")
                self.server.pull_trigger()
                self.outbuf_lock.wait(left)


class HttpServer:
    """A running Waitress server; `stop()` shuts it down."""

    def __init__(self, server: Any, socket_map: dict, thread: threading.Thread, host: str, gate: ShutdownGate):
        self._server, self._map, self._thread, self._gate = server, socket_map, thread, gate
        self.host = host
        self.port = int(server.effective_port)  # Waitress reports it as getnameinfo text
        self._stop_lock = threading.Lock()
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    def serve(self, app: Callable) -> None:
        """Hand each request from now on to the WSGI `app` (the head's full API once its model has loaded, in place
        of the one that said it was loading); a request already handed to the one before ends there."""
        self._gate.app = app

    def stop(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Answer every request accepted (in flight: up to `timeout_s` to finish; the rest: a 503), then close.

        The steps are in the module's docstring. Idempotent.
        """
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        dispatcher = self._server.task_dispatcher
        self._gate.close()
        dispatcher.set_thread_count(self._server.adj.threads + 1)
        deadline = time.monotonic() + timeout_s
        self._wait_answered(deadline)
        self._in_loop(self._stop_accepting, timeout_s)
        self._wait_answered(max(deadline, time.monotonic() + BACKLOG_DRAIN_S))
        unanswered = self._busy_channels()
        if unanswered:
            log.warning("%d HTTP connection(s) still busy after the %.1fs drain: closing them unanswered",
                        unanswered, timeout_s)
        dispatcher.shutdown(cancel_pending=True, timeout=1.0)
        # an empty map ends the loop
        self._in_loop(lambda: wasyncore.close_all(self._map), timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the HTTP server thread did not stop within %.1fs", timeout_s)
        else:
            log.info("HTTP API on %s stopped (%d request(s) answered with a 503 while stopping)", self.url,
                     self._gate.refused)

    def _in_loop(self, thunk: Callable[[], None], timeout_s: float) -> None:
        """Run `thunk` on the server loop's thread and wait for it (up to `timeout_s`)."""
        if not self._thread.is_alive():
            return
        done = threading.Event()

        def run() -> None:
            try:
                thunk()
            finally:
                done.set()

        self._server.trigger.pull_trigger(run)
        if not done.wait(timeout_s):
            log.warning("the HTTP server loop did not run its stop step within %.1fs", timeout_s)

    def _stop_accepting(self) -> None:
        """On the loop's thread: take every connection the kernel has accepted, then close the listening socket.

        Closing a listening socket resets the connections still in its backlog, whose clients may already have
        sent a request; taking them first leaves only the instant between the last accept and the close.
        """
        server = self._server
        poller = select.poll()
        poller.register(server.socket, select.POLLIN)
        for _ in range(MAX_BACKLOG):
            if not poller.poll(0):
                break
            server.handle_accept()
        server.accepting = False
        # the listening socket only: Waitress's own close() would also close the trigger, still needed
        wasyncore.dispatcher.close(server)

    def _busy_channels(self) -> int:
        """Connections with a request unanswered: queued, running, partly received, or its reply not yet sent.

        A connection that has been quiet for less than QUIET_S counts too: a new one's request may be in transit.
        """
        now = time.time()
        return sum(1 for channel in list(self._server.active_channels.values())
                   if channel.requests or channel.request is not None or channel.total_outbufs_len
                   or now - channel.last_activity < QUIET_S)

    def _wait_answered(self, deadline: float) -> None:
        while self._busy_channels() and time.monotonic() < deadline:
            time.sleep(0.02)

    def __enter__(self) -> "HttpServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def connection_limit(threads: int) -> int:
    """Connections Waitress keeps open before it stops accepting: IDLE_CONNECTIONS past one per request thread.

    Waitress's own default, 100, counts idle keep-alive connections too (a client's pool keeps its connections
    open for two minutes), and past it nobody is accepted, /health included: no 429, only silence. Past the
    request threads, the bounded queue is what refuses, so the limit only has to hold the idle ones. Each
    connection is a file descriptor: the soft limit on them is raised as far as the hard one allows, and the
    connection limit kept under it (with FD_HEADROOM for the model's files, the workers' links and the logs)."""
    want = threads + IDLE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want + FD_HEADROOM:
        raised = want + FD_HEADROOM if hard == resource.RLIM_INFINITY else min(hard, want + FD_HEADROOM)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (OSError, ValueError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want + FD_HEADROOM:
        log.warning("this process may open %d files, so the API keeps at most %d connections open (%d wanted); "
                    "raise the limit (ulimit -n) for more", soft, max(soft - FD_HEADROOM, threads), want)
        return max(soft - FD_HEADROOM, threads)
    return want


def start_http_server(app: Callable, host: str, port: int, threads: int = 8, *,
                      max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, cors_origins: tuple[str, ...] = (),
                      metrics: Metrics | None = None) -> HttpServer:
    """Serve the WSGI `app` on host:port (port 0: any free port, see `.port`) from a daemon thread.

    Pass the `max_body_bytes`, `cors_origins` and `metrics` given to `create_app`: the replies made before the app
    sees a request (Waitress's refusals, the 503 of a server shutting down) count there under route UNROUTED.
    Raises OSError when the address cannot be bound, ValueError for a host that does not resolve.
    """
    socket_map: dict = {}
    gate = ShutdownGate(app, cors_origins, metrics)
    _, address = bind_address(host, port)  # ValueError, as Waitress raises for a host it cannot resolve
    server = create_server(gate, map=socket_map, host=address, port=port, threads=threads,
                           max_request_body_size=waitress_body_limit(max_body_bytes), ident="tc",
                           connection_limit=connection_limit(threads), asyncore_use_poll=True,
                           # reads on while a request runs, so that a client that closed its connection is seen
                           # (waitress.client_disconnected); one that only half-closes is taken as gone too
                           channel_request_lookahead=1)
    server.channel_class = OpenAIErrorChannel  # before the loop runs: every connection is one of these
    server.cors_origins = cors_origins  # for OpenAIErrorTask, which Waitress makes with only its channel
    server.metrics = metrics
    thread = threading.Thread(target=server.run, name=f"http-{server.effective_port}", daemon=True)
    thread.start()
    running = HttpServer(server, socket_map, thread, host, gate)
    log.info("HTTP API listening on %s (%d threads)", running.url, threads)
    return running
