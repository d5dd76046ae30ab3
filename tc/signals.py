"""Signal handlers whose work runs on a thread of their own.

A Python signal handler runs on the main thread between two of its bytecodes, wherever that thread is: inside an
Event's wait while it holds the Event's lock, inside a log call while it writes the stream. A handler that sets
that Event deadlocks there (the lock is not reentrant), and one that logs may find the stream mid-write and raise
into the code it interrupted. So the handler installed here only puts the signal's number on a SimpleQueue,
whose put is reentrant (written in C for exactly this use), and a daemon thread takes it from there and calls the
real handler, which may take any lock.
"""
from __future__ import annotations

import logging
import queue
import signal
import threading
from typing import Callable, Iterable

log = logging.getLogger(__name__)


def on_signals(signals: Iterable[signal.Signals], handler: Callable[[signal.Signals], None]) -> None:
    """Call `handler` on a thread of its own for each of `signals` this process receives, replacing the handlers
    installed before. Only the main thread may install them, as with signal.signal."""
    received: queue.SimpleQueue[int] = queue.SimpleQueue()

    def relay() -> None:
        while True:
            sig = signal.Signals(received.get())
            try:
                handler(sig)
            except Exception:  # the next signal (an operator's second, to exit at once) must still be heard
                log.exception("handling %s failed", sig.name)

    for sig in signals:  # first: raises ValueError off the main thread, before a relay is started for nothing
        signal.signal(sig, lambda signum, _frame: received.put(signum))
    threading.Thread(target=relay, name="signals", daemon=True).start()
