"""Timing probes that choose between equivalent kernels at load time, steady on a machine other processes share.

Both helpers exist for one reason: a wall-clock timing on a loaded machine measures the load. `one_thread` runs
the candidates on the calling thread alone (with several threads, one preempted thread stalls a whole product
for a scheduler tick), and `race` then reads that thread's CPU time, which leaves out the time it waited for a
core, and lets the candidates take turns so that what the other processes do hits them alike.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside, put back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def race(fns: list[Callable[[], object]], runs: int) -> list[float]:
    """The least thread CPU time (s) one call of each of `fns` took over `runs` turns, after one untimed call each.

    Only meaningful for CPU work inside `one_thread`: work done on other threads or devices is not counted.
    """
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(runs):
        for i, fn in enumerate(fns):
            started = time.thread_time()
            fn()
            best[i] = min(best[i], time.thread_time() - started)
    return best
