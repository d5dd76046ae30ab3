"""A tc process ends with its own status even while daemon threads are inside torch (tc/cli.py exit_process)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A daemon thread that spends nearly all its time in a torch operator with the GIL released, as a worker's compute
# thread does mid-step when SIGTERM ends the process. Python's own finalization kills such a thread so that the
# C++ runtime aborts the process (SIGABRT) on most runs.
BUSY_THREAD_THEN_EXIT = textwrap.dedent("""
    import logging, sys, threading, time
    import torch
    from tc.cli import exit_process
    logging.basicConfig(level="INFO", format="%(message)s")
    a = torch.randn(256, 256)
    def busy():
        while True:
            torch.mm(a, a)
    threading.Thread(target=busy, daemon=True).start()
    time.sleep(0.2)
    logging.getLogger("tc").info("logged last")
    print("printed last", end="")
    exit_process(3)
""")


def test_a_process_with_a_thread_inside_torch_exits_with_its_status_and_its_output_written():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    for _ in range(3):  # the abort it prevents strikes on most runs, not all
        done = subprocess.run([sys.executable, "-c", BUSY_THREAD_THEN_EXIT], capture_output=True, text=True,
                              env=env, timeout=60)
        assert done.returncode == 3, done.stderr
        assert done.stdout == "printed last"  # buffered (stdout is a pipe), so only the flush writes it
        assert "logged last" in done.stderr


def test_a_signal_while_a_worker_starts_ends_it_at_once_without_a_traceback(tmp_path):
    """SIGINT or SIGTERM during a start (here the first speed probe, seconds long; a download or a load on a large
    model) leaves with status 0 and one line, where Python's default handlers printed a traceback or aborted."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    for sig in (signal.SIGINT, signal.SIGTERM):
        bench_dir = tmp_path / sig.name  # no figures kept: the worker measures before it joins
        worker = subprocess.Popen([sys.executable, "-m", "tc", "worker", "--join", "127.0.0.1:9", "--device", "cpu",
                                   "--bench-dir", str(bench_dir)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=env)
        first = worker.stdout.readline()  # its first log line: the probe is under way
        assert worker.poll() is None, first + worker.communicate()[0]  # still measuring
        started = time.monotonic()
        worker.send_signal(sig)
        output = first + worker.communicate(timeout=60)[0]
        assert worker.returncode == 0, output
        assert time.monotonic() - started < 10, output
        assert f"{sig.name} received while starting: exiting" in output and "Traceback" not in output, output
        assert "joining 127.0.0.1:9" not in output  # it left; it did not go on to join


# A signal that lands while the main thread holds the lock its handler needs: in an Event's wait, between taking
# the Event's lock and sleeping, as a head's or a worker's main thread waits most of its life. A handler that set
# the Event itself deadlocked there; tc.signals runs it on a thread of its own.
SIGNAL_WHILE_THE_LOCK_IS_HELD = textwrap.dedent("""
    import os, signal, threading
    from tc.signals import on_signals
    done = threading.Event()
    on_signals([signal.SIGTERM], lambda sig: done.set())
    with done._cond:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):  # bytecodes: the Python handler runs among them
            pass
    print("handled" if done.wait(10) else "lost", end="")
""")


# A handler that raises (no thread to be had for a farewell, say) leaves the next signal heard: the relay thread
# ended with it, and the operator's second signal, to exit at once, went unanswered.
A_HANDLER_THAT_RAISES_ONCE = textwrap.dedent("""
    import os, signal, threading, time
    from tc.signals import on_signals
    calls, done = [], threading.Event()
    def handler(sig):
        calls.append(sig)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        done.set()
    on_signals([signal.SIGTERM], handler)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGTERM)
    print("handled" if done.wait(10) else "lost", end="")
""")


def test_a_signal_handler_that_raises_leaves_the_next_signal_heard():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", A_HANDLER_THAT_RAISES_ONCE], capture_output=True, text=True,
                          env=env, timeout=60)
    assert (done.returncode, done.stdout) == (0, "handled"), done.stderr
    assert "handling SIGTERM failed" in done.stderr and "can't start new thread" in done.stderr


def test_a_signal_handler_that_takes_a_lock_the_main_thread_holds_does_not_deadlock():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_THE_LOCK_IS_HELD], capture_output=True, text=True,
                          env=env, timeout=60)
    assert (done.returncode, done.stdout) == (0, "handled"), done.stderr
