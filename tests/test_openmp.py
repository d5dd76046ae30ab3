"""OpenMP's idle spin is set before torch loads, and an operator's own setting wins."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tc.openmp import SPIN_COUNT, on_own_thread, settle_openmp

ROOT = Path(__file__).resolve().parent.parent


def test_tc_sets_a_short_spin_unless_the_operator_chose():
    environ: dict[str, str] = {}
    settle_openmp(environ)
    assert environ == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    for own in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        environ = dict(own)
        settle_openmp(environ)
        assert environ == own


@pytest.mark.parametrize("own, seen", [({}, str(SPIN_COUNT)), ({"GOMP_SPINCOUNT": "42"}, "42")])
def test_the_setting_is_in_the_environment_when_torch_is_first_imported(own, seen):
    """libgomp reads its environment once, as torch loads it: `python -m tc` must settle it before that."""
    probe = textwrap.dedent("""
        import builtins, os, runpy, sys
        real_import = builtins.__import__
        def watch(name, *args, **kwargs):
            if name.split(".")[0] == "torch" and "torch" not in sys.modules:
                print("at torch import:", os.environ.get("GOMP_SPINCOUNT"), flush=True)
            return real_import(name, *args, **kwargs)
        builtins.__import__ = watch
        sys.argv = ["tc", "plan", "--help"]
        try:
            runpy.run_module("tc", run_name="__main__", alter_sys=True)
        except SystemExit:
            pass
        import torch  # where tc's command did not load it already, as `tc head` and `tc worker` do
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(own, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"at torch import: {seen}\n" in done.stdout, done.stdout


def test_work_on_its_own_thread_returns_or_raises_as_if_called_here():
    assert on_own_thread(lambda: 42, "answer") == 42

    def fail() -> None:
        raise ValueError("no such layer")

    with pytest.raises(ValueError, match="no such layer"):
        on_own_thread(fail, "failing")


def test_the_openmp_threads_a_one_off_job_started_end_with_it():
    """What on_own_thread is for: the pool of threads a parallel region starts lives as long as the thread that
    ran it, so one-off work done this way leaves no pool behind for the compute thread to share the cores with."""
    import torch

    def os_threads() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    if not Path("/proc/self/task").is_dir() or torch.get_num_threads() < 2:
        pytest.skip("needs /proc and at least 2 torch threads")
    before = os_threads()
    seen = on_own_thread(lambda: (torch.ones(8_000_000).mul_(1.5).sum(), os_threads())[1], "one-off")
    assert len(seen - before) >= 2  # the job's own thread, and the pool its parallel region started
    deadline = time.monotonic() + 5
    while os_threads() & (seen - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os_threads() & (seen - before), "threads the job started outlived it"
