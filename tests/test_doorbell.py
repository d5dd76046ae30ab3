"""The doorbell the head's step thread waits on for any worker's answer (tc/head/workers.py)."""
from __future__ import annotations

import threading
import time

from tc.head.workers import Doorbell


def test_a_wait_ends_when_the_bell_rings_and_not_before():
    bell = Doorbell()
    rung_at: list[float] = []

    def ring_later() -> None:
        time.sleep(0.2)
        rung_at.append(time.monotonic())
        bell.ring()

    threading.Thread(target=ring_later, daemon=True).start()
    bell.wait(10.0)
    woke_at = time.monotonic()
    assert rung_at and woke_at >= rung_at[0]
    assert woke_at - rung_at[0] < 5.0


def test_a_wait_without_a_ring_lasts_its_timeout():
    bell = Doorbell()
    started = time.monotonic()
    bell.wait(0.2)
    assert time.monotonic() - started >= 0.19
    bell.wait(-1.0)  # a deadline already passed: no wait, no error


def test_rings_nobody_heard_leave_one_pending_not_many():
    """An answer that arrives before its step waits is not missed (the ring waits for the next wait), and many
    such rings wake one wait, not every wait after."""
    bell = Doorbell()
    for _ in range(5):
        bell.ring()
    started = time.monotonic()
    bell.wait(10.0)  # the pending ring: at once
    assert time.monotonic() - started < 5.0
    started = time.monotonic()
    bell.wait(0.2)  # no ring left
    assert time.monotonic() - started >= 0.19
