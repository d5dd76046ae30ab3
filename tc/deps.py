"""Check the native packages tc needs before anything imports them.

tc.pyz bundles its pure-Python dependencies but not the native ones, which must match each host's platform
(and, for torch, its accelerator). A missing one gets one line naming it and the pip command that fixes it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re

OLDEST_TORCH = (2, 4)  # the oldest torch release tc runs on (README)

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


def old_torch_message() -> str | None:
    """What to do when the installed torch is older than OLDEST_TORCH, read from its metadata without importing it;
    None when it is recent enough, or when its version cannot be read (it then gets its chance)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= OLDEST_TORCH:
        return None
    oldest = ".".join(map(str, OLDEST_TORCH))
    return (f"tc needs torch {oldest} or newer, and this Python has torch {version}; upgrade with: "
            f"python -m pip install 'torch>={oldest}'")
