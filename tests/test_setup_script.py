"""scripts/setup.sh: what it asks pip for. The default must stay as it is (CI reaches PyPI only); the CPU
build of torch is an explicit choice, TORCH_INDEX_URL, used for torch alone.

pip itself is not run: the script is pointed (PYTHON=...) at an interpreter stand-in that records its arguments.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
QUIET = ["-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
# torch's install shows pip's progress: a first one downloads up to several GB, which quiet would show as a hang
LOUD = ["-m", "pip", "install", "--progress-bar", "on", "--disable-pip-version-check"]


def pip_calls(tmp_path: Path, **env: str) -> list[list[str]]:
    log = tmp_path / "calls.jsonl"
    recorder = tmp_path / "python"
    recorder.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    recorder.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "TORCH_INDEX_URL")}
    subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env={**clean, "PYTHON": str(recorder), **env},
                   check=True, timeout=60)
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_default_installs_torch_from_pips_own_index(tmp_path):
    assert pip_calls(tmp_path) == [[*LOUD, "torch==2.13.0"], [*QUIET, "-e", ".[test]"]]


def test_an_empty_index_url_is_the_default(tmp_path):
    assert pip_calls(tmp_path, TORCH_INDEX_URL="") == [[*LOUD, "torch==2.13.0"], [*QUIET, "-e", ".[test]"]]


def test_torch_index_url_picks_the_cpu_build_for_torch_alone(tmp_path):
    calls = pip_calls(tmp_path, TORCH_INDEX_URL=CPU_INDEX, TORCH_SPEC="torch==2.13.0")
    assert calls == [[*LOUD, "--index-url", CPU_INDEX, "torch==2.13.0"], [*QUIET, "-e", ".[test]"]]


def test_torch_spec_still_picks_the_version(tmp_path):
    calls = pip_calls(tmp_path, TORCH_SPEC="torch>=2.4,<2.15", TORCH_INDEX_URL=CPU_INDEX)
    assert calls[0] == [*LOUD, "--index-url", CPU_INDEX, "torch>=2.4,<2.15"]
