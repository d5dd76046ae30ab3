"""A CPU quota on one process without cgroups: it runs `duty` of every period and is stopped for the rest."""
from __future__ import annotations

import os
import signal
import threading


class Throttle:
    """SIGCONT, wait duty x period, SIGSTOP, wait the rest; repeat until stopped (as the cpulimit tool does).

    The process then gets about `duty` of one core's time however many threads it runs, so it is slower by a
    real cause, one a benchmark inside it sees as well.
    """

    def __init__(self, pid: int, duty: float, period_s: float = 0.01):
        if not 0 < duty < 1:
            raise ValueError(f"duty must be between 0 and 1, got {duty}")
        self.pid, self.duty, self.period_s = pid, duty, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"throttle-{pid}", daemon=True)

    def __enter__(self) -> "Throttle":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Throttle":
        return self.__enter__()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._signal(signal.SIGCONT)  # never leave it stopped

    def _signal(self, sig: int) -> bool:
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _run(self) -> None:
        on, off = self.duty * self.period_s, (1 - self.duty) * self.period_s
        while not self._stop.is_set():
            if not self._signal(signal.SIGCONT) or self._stop.wait(on):
                return
            if not self._signal(signal.SIGSTOP) or self._stop.wait(off):
                return
