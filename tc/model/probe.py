"""Timing probes that choose between equivalent kernels at load time, steady on a machine other processes share.

The helpers exist for one reason: a timing on a loaded machine measures the load. `one_thread` runs the
candidates on the calling thread alone (with several threads, one preempted thread stalls a whole product for a
scheduler tick), and `race` then reads that thread's CPU time, which leaves out the time it waited for a core,
and lets the candidates take turns so that what the other processes do hits them alike. A race also takes the
machine's probe lock (`probe_lock`), so that the processes of a cluster loading at once on one machine (the head
and local workers) time their candidates one after another rather than against each other's: no clock is proof
against that, since a product on every thread that waits for a preempted one burns CPU time spinning at its
barrier, which a product on fewer threads does not.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..cache_dir import cache_path

try:
    import fcntl
except ImportError:  # Windows: no flock; probes there run unlocked
    fcntl = None

log = logging.getLogger(__name__)

# One file for every tc process of a user on this machine (None: `probe.lock` in tc's cache, tc/cache_dir.py); a
# probe that cannot have it within the wait runs anyway.
PROBE_LOCK: Path | None = None
PROBE_LOCK_WAIT_S = 30.0


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside, put back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_holding = threading.local()  # depth: how many probe_lock blocks this thread is inside while it holds the lock
_waited_in_vain = False  # a wait ran out once: later probes only try, so a stopped holder costs one wait, not one each


@contextlib.contextmanager
def probe_lock(path: Path | None = None, wait_s: float = PROBE_LOCK_WAIT_S) -> Iterator[bool]:
    """Hold the machine's probe lock inside (an flock on `path`, PROBE_LOCK's by default), so that no other tc
    process on the machine times its probes meanwhile; yields whether it is held. A thread that holds it already (a
    probe inside a probe) just goes on. Where the file cannot be had (no fcntl, a read-only home, no cache) or another
    process keeps it past `wait_s` (a process stopped mid-probe: after that, this process's probes only try it), the
    probe runs without it."""
    global _waited_in_vain
    if getattr(_holding, "depth", 0):
        _holding.depth += 1
        try:
            yield True
        finally:
            _holding.depth -= 1
        return
    path = path or PROBE_LOCK or cache_path("probe.lock")
    handle = None
    if fcntl is not None and path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a")
        except OSError:
            pass  # no lock file: the probe runs unlocked
    try:
        held = False
        if handle is not None:
            deadline = time.monotonic() + (0.0 if _waited_in_vain else wait_s)
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        if not _waited_in_vain:
                            log.warning("another process has held %s for over %.0f s; timing probes without it",
                                        path, wait_s)
                        _waited_in_vain = True
                        break
                    time.sleep(0.005)
                except OSError:
                    break  # a file system without locks
        _holding.depth = 1 if held else 0
        yield held
    finally:
        _holding.depth = 0
        if handle is not None:
            handle.close()  # closing releases the lock


def race(fns: list[Callable[[], object]], runs: int, before: Callable[[], object] | None = None,
         clock: Callable[[], float] = time.thread_time) -> list[float]:
    """The least thread CPU time (s) one call of each of `fns` took over `runs` turns, after one untimed call each;
    with `before`, that is called (untimed) before each timed call (a `cache_sweeper`, say).

    Only meaningful for CPU work inside `one_thread`: work done on other threads or devices is not counted. Another
    `clock` times work on every thread: time.process_time, the CPU time of all the process's threads (a thread
    waiting for a core adds nothing), or time.perf_counter, wall time. Holds the machine's probe lock throughout.
    """
    with probe_lock():
        for fn in fns:
            fn()
        best = [float("inf")] * len(fns)
        for _ in range(runs):
            for i, fn in enumerate(fns):
                if before is not None:
                    before()
                started = clock()
                fn()
                best[i] = min(best[i], clock() - started)
    return best


CACHE_FALLBACK = {1: 32 << 10, 3: 32 << 20}  # where the system does not say: common x86-64 sizes (L1 data, L3)


@functools.lru_cache(maxsize=None)
def cache_bytes(level: int) -> int:
    """The size of the data (or unified) cache of `level` that cpu0 has, as Linux's sysfs gives it; a common
    x86-64 size (CACHE_FALLBACK) where it does not say."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            found, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if found == str(level) and kind in ("Data", "Unified") and size[:-1].isdigit() and size[-1] in "KM":
            return int(size[:-1]) << (10 if size[-1] == "K" else 20)
    return CACHE_FALLBACK[level]


# The most a cache sweep reads. Twice the last-level cache empties it, but a VM's sysfs may give its host's whole
# L3 (480 MiB on a 2-core Sapphire Rapids-class VM), a share of which the guest's two cores see: sweeps of twice
# that, ~60 ms each, were 4.7 s of a 9.4 s bf16 load of the demo model in one process, and a process of a cluster
# pays them at every start. Capped here the load took 5.0 s, and every product, screen and kernel probe chose as
# before (after a 960 MiB sweep the one-row products timed 10-30% slower, in the same order).
SWEEP_MAX_BYTES = 256 << 20


def cache_sweeper() -> Callable[[], object]:
    """A function that reads a buffer twice the size of the last-level cache (SWEEP_MAX_BYTES at most), as a decode
    step's weights sweep it between the small operators around them: a probe that runs each candidate after it
    (race's `before`) times it as a step would find it (an operator of a few microseconds in a hot loop took several
    times that after such a sweep). The buffer lives as long as the function: make one for a probe and let it go
    after."""
    buffer = torch.ones(min(2 * cache_bytes(3), SWEEP_MAX_BYTES) // 4)  # float32
    return buffer.sum
