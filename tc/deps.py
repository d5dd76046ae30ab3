"""Check the native packages tc needs before anything imports them.

tc.pyz bundles its pure-Python dependencies but not the native ones, which must match each host's platform
(and, for torch, its accelerator). A missing one gets one line naming it and the pip command that fixes it.
"""
from __future__ import annotations

import importlib.util

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
