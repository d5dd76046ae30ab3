"""The timing helpers every load-time probe is built on (tc/model/probe.py)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tc.model import probe
from tc.model.probe import probe_lock, race


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


@pytest.mark.parametrize("llc_mib, swept_mib", [(8, 16), (32, 64), (480, probe.SWEEP_MAX_BYTES >> 20)])
def test_a_cache_sweep_reads_twice_the_last_level_cache_and_no_more_than_its_cap(monkeypatch, llc_mib, swept_mib):
    # 480 MiB: what a VM's sysfs gave as its L3, the host's, where sweeps of twice it took half a bf16 load
    monkeypatch.setattr(probe, "cache_bytes", lambda level: {3: llc_mib << 20}[level])
    sweep = probe.cache_sweeper()
    buffer = sweep.__self__  # the tensor whose sum it is
    assert buffer.numel() * buffer.element_size() == swept_mib << 20
    assert sweep().item() == buffer.numel()  # it reads all of it


needs_flock = pytest.mark.skipif(probe.fcntl is None, reason="no flock on this platform: probes run unlocked")


def _in_another_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@needs_flock
def test_the_probe_lock_keeps_a_second_prober_waiting_and_lets_it_go_after(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(probe, "_waited_in_vain", False)
    path = tmp_path / "cache" / "probe.lock"  # its folder is made on first use

    def second(wait_s: float) -> tuple[bool, float]:
        started = time.monotonic()
        with probe_lock(path, wait_s=wait_s) as held:
            return held, time.monotonic() - started

    with probe_lock(path) as held:
        assert held
        with probe_lock(path) as nested:  # a probe inside a probe on this thread goes on at once
            assert nested
        held_by_second, waited = _in_another_thread(lambda: second(0.2))
        assert not held_by_second and waited >= 0.2  # another holder (flock is per open file): it waited, then ran
        assert "timing probes without it" in caplog.text
        held_by_second, waited = _in_another_thread(lambda: second(5.0))
        assert not held_by_second and waited < 2.5  # once a wait ran out, later probes only try
    assert _in_another_thread(lambda: second(0.2))[0]  # free again: had at once


@needs_flock
def test_a_race_waits_for_another_processes_probe(tmp_path, monkeypatch):
    path = tmp_path / "probe.lock"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from tc.model.probe import probe_lock
with probe_lock(__import__('pathlib').Path({str(path)!r})):
    print('held', flush=True)
    time.sleep(2.0)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(probe, "PROBE_LOCK", path)
        monkeypatch.setattr(probe, "_waited_in_vain", False)
        started = time.monotonic()
        race([lambda: None], 1, clock=time.perf_counter)
        assert time.monotonic() - started >= 1.0  # it ran once the other process let the lock go
    finally:
        holder.wait(timeout=10)
