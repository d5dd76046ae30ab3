"""OpenMP's idle spin is set before torch loads, and an operator's own setting wins."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tc.openmp import SPIN_COUNT, settle_openmp

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
