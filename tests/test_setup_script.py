"""scripts/setup.sh: what it asks pip for. The default must stay as it is (CI reaches PyPI only); the CPU
build of torch is an explicit choice, TORCH_INDEX_URL, used for torch alone.

pip itself is not run: the script is pointed (PYTHON=...) at an interpreter stand-in that records its arguments.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
QUIET = ["-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
# torch's install shows pip's progress: a first one downloads up to several GB, which quiet would show as a hang
LOUD = ["-m", "pip", "install", "--progress-bar", "on", "--disable-pip-version-check"]


def run_setup(tmp_path: Path, managed: bool = False, pip_breaks: bool = False,
              **env: str) -> tuple[subprocess.CompletedProcess, list]:
    """setup.sh run with PYTHON a stand-in that records its pip installs, and answers the check for a Python the
    system manages as one would (`managed`) or as a virtual environment's does, and pip's configuration as one
    with break-system-packages = true would (`pip_breaks`)."""
    log = tmp_path / "calls.jsonl"
    recorder = tmp_path / "python"
    recorder.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"if sys.argv[1] == '-c':\n    sys.exit({int(managed)})\n"
                        f"if sys.argv[1:4] == ['-m', 'pip', 'config']:\n"
                        f"    print({'true' if pip_breaks else ''!r})\n    sys.exit(0 if {pip_breaks} else 1)\n"
                        f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    recorder.chmod(0o755)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("TORCH_SPEC", "TORCH_INDEX_URL", "PIP_BREAK_SYSTEM_PACKAGES")}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True,
                          env={**clean, "PYTHON": str(recorder), **env}, timeout=60)
    return done, [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def pip_calls(tmp_path: Path, **env: str) -> list[list[str]]:
    done, calls = run_setup(tmp_path, **env)
    assert done.returncode == 0, done.stderr
    return calls


def test_a_python_the_system_manages_is_told_to_make_a_virtual_environment_first(tmp_path):
    done, calls = run_setup(tmp_path, managed=True)
    assert done.returncode == 1 and calls == []
    assert "PEP 668" in done.stderr and "python3 -m venv .venv" in done.stderr
    done, calls = run_setup(tmp_path, managed=True, PIP_BREAK_SYSTEM_PACKAGES="1")  # pip's own ways past it
    assert done.returncode == 0 and calls[0][-1] == "torch==2.13.0"
    (tmp_path / "calls.jsonl").unlink()
    done, calls = run_setup(tmp_path, managed=True, pip_breaks=True)
    assert done.returncode == 0 and calls[0][-1] == "torch==2.13.0"


def test_a_python_that_is_not_there_is_named(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": str(tmp_path / "no-such-python")})
    assert done.returncode == 1 and f"no {tmp_path / 'no-such-python'} here" in done.stderr


def test_the_check_for_a_managed_python_passes_this_one():
    check = (ROOT / "scripts" / "setup.sh").read_text().split("! \"$PY\" -c '", 1)[1].split("'", 1)[0]
    managed = Path(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED").exists()
    in_venv = sys.prefix != sys.base_prefix
    assert subprocess.run([sys.executable, "-c", check]).returncode == int(managed and not in_venv)


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
