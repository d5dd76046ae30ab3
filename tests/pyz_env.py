"""Run tc.pyz the way a fresh host would: native packages installed, none of the pure-Python ones.

`pyz_command(pyz, tmp_dir)` copies the archive alone into a new directory and builds a site directory of
symlinks to this Python's installed packages, minus falcon, waitress, PyYAML, Jinja2, MarkupSafe and
prometheus_client, minus cbor2 (which tc does not need), and minus any native package named in `without`. The
child runs with `-S -s`, so no site-packages, .pth file or user site sneaks the host's copies back in: whatever it
imports of those packages must come from the archive.

    argv, env = pyz_command(pyz, tmp_path)
    subprocess.run([*argv, "plan", "topology.yaml"], env=env, cwd=pyz_run_dir(argv))
"""
from __future__ import annotations

import os
import re
import shutil
import site
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path

# top-level names in site-packages that belong to the bundled packages: import names, C speedup modules and
# dist-info directories (compared after lower-casing and cutting at the first '-' or '.'; the dist-info key of
# prometheus_client is its import name)
BUNDLED_NAMES = frozenset({"falcon", "waitress", "yaml", "_yaml", "pyyaml", "jinja2", "markupsafe",
                           "prometheus_client"})
# installed here (tests/test_protocol.py checks the wire codec against it) but neither bundled nor needed by tc;
# leaving it out of the clean site proves that tc runs without it
NOT_NEEDED = frozenset({"cbor2", "_cbor2"})


def host_site_dirs() -> list[Path]:
    """This Python's site-packages directories, in import order, without duplicates."""
    candidates = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs: list[Path] = []
    for candidate in candidates:
        path = Path(candidate)
        if path.is_dir() and path not in dirs:
            dirs.append(path)
    return dirs


def distribution_key(entry_name: str) -> str:
    """'PyYAML-6.0.3.dist-info' -> 'pyyaml', '_yaml.cpython-311-x86_64-linux-gnu.so' -> '_yaml'."""
    return re.split(r"[-.]", entry_name, maxsplit=1)[0].lower()


def clean_site_dir(dest_parent: Path, *, without: Iterable[str] = ()) -> Path:
    """Make a new directory of symlinks to the host's site-packages entries, minus the bundled packages,
    NOT_NEEDED and `without`.

    `without` takes import or distribution names (e.g. "tokenizers", "torch"), to act out a host that lacks them.
    """
    excluded = BUNDLED_NAMES | NOT_NEEDED | {name.lower() for name in without}
    site_dir = Path(tempfile.mkdtemp(dir=dest_parent, prefix="site-"))
    for source_dir in host_site_dirs():
        for entry in sorted(source_dir.iterdir()):
            target = site_dir / entry.name
            if distribution_key(entry.name) in excluded or entry.suffix == ".pth" or target.exists():
                continue
            target.symlink_to(entry, target_is_directory=entry.is_dir())
    return site_dir


def clean_env(pythonpath: Iterable[Path]) -> dict[str, str]:
    """This process's environment without any PYTHON* setting, plus PYTHONPATH set to `pythonpath`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return env


def pyz_command(pyz_path: Path, tmp_dir: Path, *, without: Iterable[str] = ()) -> tuple[list[str], dict[str, str]]:
    """Return (argv prefix, env) that run a copy of `pyz_path` in a clean environment under `tmp_dir`.

    The copy sits alone in a new directory (see `pyz_run_dir`), which is the working directory to use, so nothing
    beside it can be imported by accident. Append the tc command line to the argv prefix.
    """
    run_dir = Path(tempfile.mkdtemp(dir=tmp_dir, prefix="pyz-run-"))
    copy = run_dir / "tc.pyz"
    shutil.copyfile(pyz_path, copy)
    site_dir = clean_site_dir(Path(tmp_dir), without=without)
    return [sys.executable, "-S", "-s", str(copy)], clean_env([site_dir])


def pyz_run_dir(argv_prefix: list[str]) -> Path:
    """The empty directory holding the archive copy of a `pyz_command` argv prefix: the child's working directory."""
    return Path(argv_prefix[-1]).parent
