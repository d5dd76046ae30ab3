"""The timing helpers every load-time probe is built on (tc/model/probe.py)."""
from __future__ import annotations

import time

from tc.model.probe import race


def test_race_counts_this_threads_work_by_default_and_wall_time_when_asked():
    # a sleep costs the thread no CPU time but costs the wall clock all of it: the two clocks must tell them apart
    calls = []

    def nap() -> None:
        calls.append(1)
        time.sleep(0.02)

    cpu, = race([nap], 2)
    wall, = race([nap], 2, clock=time.perf_counter)
    assert cpu < 0.01 <= 0.02 <= wall
    assert len(calls) == 2 * (1 + 2)  # one untimed call, then each turn


def test_race_runs_before_each_timed_call_untimed():
    order = []

    def sweep() -> None:  # slow, and outside the timing
        order.append("sweep")
        time.sleep(0.02)

    best = race([lambda: order.append("a"), lambda: order.append("b")], 2, before=sweep, clock=time.perf_counter)
    assert order == ["a", "b", "sweep", "a", "sweep", "b", "sweep", "a", "sweep", "b"]
    assert len(best) == 2 and all(0 <= t < 0.01 for t in best)
