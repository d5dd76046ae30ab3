"""Where tc keeps what it makes once per machine and finds again at the next start: the native kernels it built
(tc/model/native.py, `kernels/`), the speeds it measured (tc/bench.py, `bench/`) and the lock its timing probes
share (tc/model/probe.py, `probe.lock`). scripts/make_demo_model.py keeps the demo models in the same place.

That place is $TC_CACHE_DIR where it is set, else ~/.cache/truecluster. It is looked up when something is cached,
not when tc is imported.

A process may have no home at all: HOME unset and its user missing from the password database, as in a container
run under an arbitrary uid (Path.home() raises there). Its cache is then a directory of its user's own under the
system's temporary one, `truecluster-UID`, which the processes of that user share as they would a home's, said once
in a warning. Where that directory is not its user's alone (made by another, or open to others, where a library
put there would be loaded), there is no cache: None, and each caller does without (kernels built for the process,
speeds measured at every start, probes unlocked).
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

ENV = "TC_CACHE_DIR"
_told_homeless = False  # the warning for a process without a home, given once


def cache_path(*parts: str, environ: Mapping[str, str] = os.environ) -> Path | None:
    """The cache's root joined with `parts` (`cache_path("kernels")`), as `environ` places it; None where a process
    without a home has no private place for one (see above)."""
    env = environ.get(ENV)
    try:
        root = Path(env).expanduser() if env else Path.home() / ".cache" / "truecluster"
    except (RuntimeError, KeyError):  # no home to expand (KeyError: Python 3.10's pathlib)
        root = _homeless_root(env)
    return None if root is None else root.joinpath(*parts)


def _homeless_root(env: str | None) -> Path | None:
    global _told_homeless
    getuid = getattr(os, "getuid", None)  # POSIX: another platform's home does not hang on the password database
    root = None
    if getuid is not None:
        try:
            root = Path(tempfile.gettempdir()) / f"truecluster-{getuid()}"  # gettempdir: OSError where none is usable
            root.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(root)  # not followed: a link planted by another user is not ours
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != getuid() or st.st_mode & 0o077:
                root = None
        except OSError:
            root = None
    if not _told_homeless:
        _told_homeless = True
        why = f"{ENV}={env!r} names the home" if env else "HOME is unset and this user has no password entry"
        if root is None:
            log.warning("no home directory (%s) and no private temporary directory for tc's cache: native kernels "
                        "are built and speeds measured at every start; set %s to a directory to keep them", why, ENV)
        else:
            log.warning("no home directory (%s): tc's cache is %s; set %s to keep it elsewhere", why, root, ENV)
    return root
