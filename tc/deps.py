"""Check the native packages tc needs before anything imports them.

tc.pyz bundles its pure-Python dependencies but not the native ones, which must match each host's platform
(and, for torch, its accelerator). A missing one gets one line naming it and the pip command that fixes it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re

# import name -> the oldest release tc runs on (README, pyproject.toml): an older one fails later, far from the cause
OLDEST_RELEASES = {
    "torch": (2, 4),
    "huggingface_hub": (0, 25),  # errors.EntryNotFoundError, which model_source catches, came in 0.25
}

# import name -> pip requirement (torch pinned loosely: any 2.4+ build for the host's accelerator works)
NATIVE_PACKAGES = {
    "torch": "torch",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "numpy": "numpy",
    "huggingface_hub": "huggingface_hub",
}


def missing_native_packages() -> list[str]:
    return [name for name in NATIVE_PACKAGES if importlib.util.find_spec(name) is None]


def missing_message(missing: list[str]) -> str:
    reqs = " ".join(NATIVE_PACKAGES[m] for m in missing)
    return (f"tc needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed for this "
            f"Python; install with: python -m pip install {reqs}")


def outdated_message() -> str | None:
    """What to do when an installed package is older than tc runs on (OLDEST_RELEASES), read from its metadata
    without importing it; None when all are recent enough. A version that cannot be read gets its chance."""
    for name, oldest in OLDEST_RELEASES.items():
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found = re.match(r"(\d+)\.(\d+)", version)
        if found is None or (int(found[1]), int(found[2])) >= oldest:
            continue
        floor = ".".join(map(str, oldest))
        return (f"tc needs {name} {floor} or newer, and this Python has {name} {version}; upgrade with: "
                f"python -m pip install '{NATIVE_PACKAGES[name]}>={floor}'")
    return None
