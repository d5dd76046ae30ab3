"""Where tc keeps its built kernels, measured speeds and probe lock (tc/cache_dir.py), in processes that have a
home and in processes that have none."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tc.cache_dir import cache_path
from tc.model import native

ROOT = Path(__file__).resolve().parent.parent

# A process without a home, as a container run under an arbitrary uid has it: HOME unset, and a uid that neither
# the password file (an empty one mounted over it) nor any other source knows. unshare -rm gives the mount; a user
# namespace nested in it gives the uid.
HOMELESS = ('mount --bind "$0" /etc/passwd && exec unshare --user --map-user=54321 --map-group=54321 '
            'env -u HOME "$@"')

# What such a process does: imports the head's and the worker's modules, then builds, locks and looks up as they do.
IN_NO_HOME = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from pathlib import Path
try:
    Path.home()
    print("home found")
except (RuntimeError, KeyError):
    pass
import tc.head.main, tc.worker.main
from tc.bench import default_bench_dir
from tc.model import native, probe
print("bench:", default_bench_dir())
print("built:", native._build({"one.c": b"int one(void) { return 1; }\\n"}, native._compiler()))
with probe.probe_lock() as held:
    print("lock:", held)
"""


def run_without_a_home(tmp_path: Path) -> subprocess.CompletedProcess:
    empty = tmp_path / "passwd"
    empty.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("TC_CACHE_DIR", "TC_NATIVE_KERNELS")}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", HOMELESS, str(empty), sys.executable, "-c", IN_NO_HOME],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "TMPDIR": str(tmp_path / "tmp")})
    if "home found" in done.stdout:
        pytest.skip("this machine finds a home for any uid")
    return done


def _can_take_the_home_away() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "unshare", "--user", "--map-user=54321", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_namespaces = pytest.mark.skipif(not _can_take_the_home_away(),
                                      reason="no nested user and mount namespaces here (unshare -rm, --map-user)")


def test_the_cache_is_tc_cache_dir_where_it_is_set_else_under_the_home(tmp_path):
    assert cache_path("kernels", environ={"TC_CACHE_DIR": str(tmp_path)}) == tmp_path / "kernels"
    assert cache_path("bench", environ={"TC_CACHE_DIR": ""}) == Path.home() / ".cache" / "truecluster" / "bench"


@needs_namespaces
def test_without_a_home_tc_imports_and_keeps_its_cache_in_a_private_temporary_directory(tmp_path):
    (tmp_path / "tmp").mkdir()
    done = run_without_a_home(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    own = tmp_path / "tmp" / "truecluster-54321"
    assert f"bench: {own / 'bench'}" in done.stdout and "lock: True" in done.stdout
    assert f"built: {own / 'kernels'}/native-" in done.stdout
    assert own.stat().st_mode & 0o777 == 0o700
    assert done.stdout.count("no home directory") == 1  # said once, not once a lookup


@needs_namespaces
def test_without_a_home_a_temporary_directory_open_to_others_is_not_taken_for_the_cache(tmp_path):
    (tmp_path / "tmp" / "truecluster-54321").mkdir(parents=True)
    (tmp_path / "tmp" / "truecluster-54321").chmod(0o777)  # anyone could plant a library there for us to load
    done = run_without_a_home(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bench: None" in done.stdout and "lock: False" in done.stdout
    assert f"built: {tmp_path / 'tmp'}/{native.PRIVATE_PREFIX}" in done.stdout  # for the process alone
    assert "no private temporary directory" in done.stdout
    assert not list((tmp_path / "tmp" / "truecluster-54321").iterdir())
