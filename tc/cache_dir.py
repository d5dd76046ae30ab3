"""Where tc keeps what it makes once per machine and finds again at the next start: the native kernels it built
(tc/model/native.py, `kernels/`), the speeds it measured (tc/bench.py, `bench/`) and the lock its timing probes
share (tc/model/probe.py, `probe.lock`). scripts/make_demo_model.py keeps the demo models in the same place.

That place is $TC_CACHE_DIR where it is set, else ~/.cache/truecluster. It is looked up when something is cached,
not when tc is imported.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

ENV = "TC_CACHE_DIR"


def cache_path(*parts: str, environ: Mapping[str, str] = os.environ) -> Path:
    """The cache's root joined with `parts` (`cache_path("kernels")`), as `environ` places it."""
    env = environ.get(ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "truecluster"
    return root.joinpath(*parts)
