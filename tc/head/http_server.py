"""Serving the API: a Waitress server in a daemon thread, with a clean stop.

Waitress runs its own event loop (wasyncore) in the thread calling `run()` and hands each request to one of
`threads` worker threads. Stopping closes the loop's sockets from inside the loop itself (through Waitress's
trigger), so no other thread touches the loop's socket map while it polls.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from waitress import create_server, wasyncore

from .api import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 5.0


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


class HttpServer:
    """A running Waitress server; `stop()` shuts it down."""

    def __init__(self, server: Any, socket_map: dict, thread: threading.Thread, host: str):
        self._server, self._map, self._thread = server, socket_map, thread
        self.host = host
        self.port = int(server.effective_port)  # Waitress reports it as getnameinfo text
        self._stop_lock = threading.Lock()
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    def stop(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Stop accepting, let requests in flight finish (up to `timeout_s`), close every connection."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        # worker threads leave after their current request; queued requests are cancelled
        self._server.task_dispatcher.shutdown(cancel_pending=True, timeout=timeout_s)
        if self._thread.is_alive():
            # the thunk runs on the loop's thread; an empty map ends the loop
            self._server.trigger.pull_trigger(lambda: wasyncore.close_all(self._map))
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the HTTP server thread did not stop within %.1fs", timeout_s)
        else:
            log.info("HTTP API on %s stopped", self.url)

    def __enter__(self) -> "HttpServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_http_server(app: Callable, host: str, port: int, threads: int = 8, *,
                      max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> HttpServer:
    """Serve the WSGI `app` on host:port (port 0: any free port, see `.port`) from a daemon thread.

    Pass the `max_body_bytes` given to `create_app`. Raises OSError when the address cannot be bound.
    """
    socket_map: dict = {}
    server = create_server(app, map=socket_map, host=host, port=port, threads=threads,
                           max_request_body_size=waitress_body_limit(max_body_bytes), ident="tc")
    thread = threading.Thread(target=server.run, name=f"http-{server.effective_port}", daemon=True)
    thread.start()
    running = HttpServer(server, socket_map, thread, host)
    log.info("HTTP API listening on %s (%d threads)", running.url, threads)
    return running
