"""A TCP proxy that delays every byte by a fixed time each way: a slow link in user space.

Where the kernel has no netem, this stands in for `tc qdisc ... netem delay`: bytes keep their order and
arrive `delay_s` after they were read, as over a long link (bandwidth is not limited).
"""
from __future__ import annotations

import heapq
import socket
import threading
import time


class LatencyProxy:
    def __init__(self, target: tuple[str, int], delay_s: float):
        self.target, self.delay_s = target, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Read from src, and write each chunk to dst once it has aged delay_s (a second thread writes)."""
        queue: list[tuple[float, int, bytes]] = []
        ready = threading.Condition()
        order = 0

        def writer() -> None:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, _, data = queue[0]
                    wait = due - time.monotonic()
                    if wait > 0:
                        ready.wait(wait)
                        continue
                    heapq.heappop(queue)
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:  # the other side has gone already: nothing left to tell it
                        pass
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=writer, daemon=True).start()
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            with ready:
                order += 1
                heapq.heappush(queue, (time.monotonic() + self.delay_s, order, data))
                ready.notify()
            if not data:
                return

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
