"""tc.pyz: what goes in, that building is reproducible, and that it runs on a host with only the native packages."""
from __future__ import annotations

import glob
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pyz_env import clean_env, pyz_command, pyz_run_dir

ROOT = Path(__file__).resolve().parent.parent
BUNDLED_PACKAGES = ("falcon", "waitress", "yaml", "jinja2", "markupsafe", "prometheus_client")
NATIVE_SUFFIXES = (".so", ".pyd", ".dylib")
CHILD_TIMEOUT_S = 300  # `plan` imports torch, which takes a while on a busy machine


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_zipapp", ROOT / "build_zipapp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_zipapp"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bz = _load_builder()


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)


def _other_pythons() -> list[str]:
    """Interpreters for the other supported minor versions found on this machine (plain or under pyenv)."""
    found = []
    for minor in (10, 11, 12):
        if (3, minor) == sys.version_info[:2]:
            continue
        names = [shutil.which(f"python3.{minor}") or "",
                 *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/python3.{minor}")))]
        for name in names:
            if name and subprocess.run([name, "-S", "-c", f"import sys; assert sys.version_info[:2] == (3, {minor})"],
                                       capture_output=True).returncode == 0:
                found.append(name)
                break
    return found


@pytest.fixture(scope="module")
def pyz(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "tc.pyz"
    proc = subprocess.run([sys.executable, str(ROOT / "build_zipapp.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout and "KiB" in proc.stdout  # it says where it wrote and how big
    return out


# ---- what the archive holds -----------------------------------------------------------------------------------


def test_archive_holds_tc_and_the_pure_python_packages(pyz):
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    assert os.access(pyz, os.X_OK)
    with zipfile.ZipFile(pyz) as zf:
        assert zf.testzip() is None
        names = set(zf.namelist())
        entry_point = zf.read("__main__.py")
    for module in ("__main__.py", "tc/__init__.py", "tc/__main__.py", "tc/deps.py", "tc/cli.py", "tc/topology.py",
                   "tc/planner.py", "tc/head/main.py", "tc/worker/main.py", "tc/protocol/__init__.py",
                   "tc/model/config.py"):
        assert module in names
    for package in BUNDLED_PACKAGES:
        assert f"{package}/__init__.py" in names
    assert "markupsafe/_native.py" in names  # the pure-Python fallback
    assert "prometheus_client/exposition.py" in names  # what the head's /metrics renders with
    assert not [n for n in names if n.endswith(NATIVE_SUFFIXES)]
    assert not [n for n in names if "__pycache__" in n.split("/") or n.endswith((".pyc", ".pyo"))]
    assert not [n for n in names if n.split("/")[0] in ("_yaml", "torch", "numpy", "tokenizers")]
    # tc speaks CBOR through its own codec (tc/protocol/cbor.py); cbor2 is only the tests' reference
    assert not [n for n in names if n.split("/")[0].split("-")[0].lower() in ("cbor2", "_cbor2")]
    assert "tc/protocol/cbor.py" in names
    assert b"cbor2" not in entry_point
    # each bundled distribution carries its licence text along
    for pin in bz.PINS:
        assert any(n.startswith(f"{pin.name}-{pin.version}.dist-info/") and "LICEN" in n.upper() for n in names)


def test_build_is_reproducible_whatever_the_file_times(tmp_path):
    # a private copy of tc/, so that edits in the checkout cannot race the two builds
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tc", repo / "tc", ignore=shutil.ignore_patterns("__pycache__"))
    first = bz.build_zipapp(tmp_path / "a.pyz", repo_root=repo)
    for path in (repo / "tc").rglob("*"):
        os.utime(path, (1_234_567_890, 1_234_567_890))
    second = bz.build_zipapp(tmp_path / "b.pyz", repo_root=repo)
    assert first.sha256 == second.sha256
    assert (tmp_path / "a.pyz").read_bytes() == (tmp_path / "b.pyz").read_bytes()
    with zipfile.ZipFile(tmp_path / "a.pyz") as zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        assert names == sorted(names)
        assert {i.date_time for i in infos} == {bz.ZIP_EPOCH}
        tc_files = {n for n in names if n.startswith("tc/") and not n.endswith("/")}
        sources = {p.relative_to(repo).as_posix() for p in (repo / "tc").rglob("*") if p.is_file()}
        assert tc_files == sources | {bz.BUILD_ENTRY}  # and the build's digest of them
        assert zf.read("tc/deps.py") == (repo / "tc" / "deps.py").read_bytes()


def _wheel(files: dict[str, bytes]) -> zipfile.ZipFile:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return zipfile.ZipFile(io.BytesIO(buf.getvalue()))


FAKE_PIN = bz.Pin("fakepkg", "1.0", "fakepkg-1.0-py3-none-any.whl", "0" * 64, ("fakepkg",), skip=("_fakepkg",))
FAKE_BASE = {"fakepkg/__init__.py": b"x = 1\n", "fakepkg-1.0.dist-info/METADATA": b"Name: fakepkg\n",
             "fakepkg-1.0.dist-info/RECORD": b"", "fakepkg-1.0.dist-info/licenses/LICENSE": b"MIT\n"}


@pytest.mark.parametrize("extra, kept", [
    ({}, {"fakepkg/__init__.py", "fakepkg-1.0.dist-info/METADATA", "fakepkg-1.0.dist-info/licenses/LICENSE"}),
    ({"fakepkg/_speedups.cpython-311-x86_64-linux-gnu.so": b"\x7fELF", "fakepkg/_speedups.c": b"",
      "fakepkg/_speedups.pyi": b"", "fakepkg/py.typed": b"", "fakepkg/cy.pyx": b"",
      "_fakepkg/__init__.py": b"", "_fakepkg.cpython-311-x86_64-linux-gnu.so": b"\x7fELF"},
     {"fakepkg/__init__.py", "fakepkg-1.0.dist-info/METADATA", "fakepkg-1.0.dist-info/licenses/LICENSE"}),
    ({"fakepkg/sub/mod.py": b"", "fakepkg/_native.py": b""},
     {"fakepkg/__init__.py", "fakepkg/sub/mod.py", "fakepkg/_native.py", "fakepkg-1.0.dist-info/METADATA",
      "fakepkg-1.0.dist-info/licenses/LICENSE"}),
])
def test_wheel_entries_keep_only_python_and_licences(extra, kept):
    assert set(bz.wheel_entries(FAKE_PIN, _wheel({**FAKE_BASE, **extra}))) == kept


@pytest.mark.parametrize("extra, complaint", [
    ({"fakepkg/templates/page.html": b"<p>"}, "data file fakepkg/templates/page.html"),
    ({"otherpkg/__init__.py": b""}, "'otherpkg', which the pin neither bundles nor skips"),
])
def test_wheel_entries_refuse_what_they_do_not_know(extra, complaint):
    with pytest.raises(bz.BuildError, match=complaint):
        bz.wheel_entries(FAKE_PIN, _wheel({**FAKE_BASE, **extra}))


def test_wheel_without_pure_package_is_refused():
    files = {k: v for k, v in FAKE_BASE.items() if k != "fakepkg/__init__.py"}
    files["fakepkg/_speedups.cpython-311-x86_64-linux-gnu.so"] = b"\x7fELF"
    with pytest.raises(bz.BuildError, match="no pure-Python package fakepkg"):
        bz.wheel_entries(FAKE_PIN, _wheel(files))


def test_cached_wheel_is_used_without_pip(tmp_path):
    wheel = tmp_path / FAKE_PIN.wheel
    wheel.write_bytes(b"not really a wheel")
    pin = bz.Pin(FAKE_PIN.name, FAKE_PIN.version, FAKE_PIN.wheel, bz.sha256_of(wheel), FAKE_PIN.packages)
    assert bz.fetch_wheel(pin, tmp_path) == wheel  # a pip run for "fakepkg" would fail: it does not exist


# ---- running it on a host with only the native packages ---------------------------------------------------------

CHILD_CHECK = r"""
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
import falcon, falcon.testing, falcon.util, falcon.util.misc, falcon.util.uri
import jinja2, jinja2.sandbox, markupsafe, waitress, yaml, tc
import prometheus_client, prometheus_client.exposition

files = {m.__name__: m.__file__ for m in (falcon, jinja2, markupsafe, waitress, yaml, prometheus_client,
                                          prometheus_client.exposition, tc)}
speedups = {
    "yaml": yaml.__with_libyaml__,
    "markupsafe": markupsafe._escape_inner.__module__ != "markupsafe._native",
    "falcon": (falcon.util._CyBufferedReader, falcon.util.misc._cy_encode_items_to_latin1,
               falcon.util.uri._cy_uri) != (None, None, None),
}

class Resource:
    def on_get(self, req, resp):
        resp.media = {"ok": True}

app = falcon.App()
app.add_route("/r", Resource())
server = waitress.create_server(app, host="127.0.0.1", port=0)
server.close()
env = jinja2.sandbox.ImmutableSandboxedEnvironment(autoescape=True)
registry = prometheus_client.CollectorRegistry()
counter = prometheus_client.Counter("tc_check_requests", "requests seen by the check", ["code"], registry=registry)
counter.labels(code="200").inc(3)
exposition = prometheus_client.generate_latest(registry).decode()
works = {
    "yaml": yaml.safe_load("a: [1, 2]") == {"a": [1, 2]},
    "jinja2": env.from_string("{{ x }}!").render(x="<b>") == "&lt;b&gt;!",
    "falcon": falcon.testing.simulate_get(app, "/r").json == {"ok": True},
    "prometheus_client": 'tc_check_requests_total{code="200"} 3.0' in exposition.splitlines(),
    # not bundled and not installed in these environments: tc must get by without it
    "no cbor2": importlib.util.find_spec("cbor2") is None,
}
print(json.dumps({"files": files, "speedups": speedups, "works": works}))
"""

# the modules that speak the wire protocol and serve /metrics; they need the host's torch, so only the clean
# environment (native packages present) can import them
TC_CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import tc.protocol.framing, tc.head.api, tc.head.metrics
cbor2_loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("cbor2", "_cbor2"))
try:
    import cbor2
except ImportError:
    cbor2_missing = True
else:
    cbor2_missing = False
print(json.dumps({
    "files": {m.__name__: m.__file__ for m in (tc.protocol.framing, tc.head.api, tc.head.metrics,
                                               sys.modules["prometheus_client"], sys.modules["falcon"])},
    "cbor2_missing": cbor2_missing,
    "cbor2_loaded": cbor2_loaded,
}))
"""


def _check_imports_from_pyz(python: str, env: dict[str, str], pyz_copy: Path) -> None:
    proc = _run([python, "-S", "-s", "-c", CHILD_CHECK, str(pyz_copy)], env, pyz_copy.parent)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    for name, file in report["files"].items():
        assert file.startswith(str(pyz_copy) + os.sep), (name, file)
    assert report["speedups"] == {name: False for name in report["speedups"]}
    assert report["works"] == {name: True for name in report["works"]}


def test_bundled_packages_import_from_the_pyz_in_a_clean_env(pyz, tmp_path):
    argv, env = pyz_command(pyz, tmp_path)
    _check_imports_from_pyz(argv[0], env, Path(argv[-1]))


def test_protocol_and_api_import_from_the_pyz_without_cbor2(pyz, tmp_path):
    argv, env = pyz_command(pyz, tmp_path)
    pyz_copy = Path(argv[-1])
    proc = _run([argv[0], "-S", "-s", "-c", TC_CHECK, str(pyz_copy)], env, pyz_copy.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for name, file in report["files"].items():
        assert file.startswith(str(pyz_copy) + os.sep), (name, file)
    assert report["cbor2_missing"] is True
    assert report["cbor2_loaded"] == []


@pytest.mark.parametrize("python", _other_pythons() or [pytest.param("", marks=pytest.mark.skip(
    reason="no other Python 3.10-3.12 interpreter on this machine"))])
def test_bundled_packages_import_on_other_python_versions(pyz, tmp_path, python):
    # bare interpreter: -S and no PYTHONPATH leave only the standard library beside the archive
    copy = tmp_path / "run" / "tc.pyz"
    copy.parent.mkdir()
    shutil.copyfile(pyz, copy)
    env = clean_env([])
    del env["PYTHONPATH"]
    _check_imports_from_pyz(python, env, copy)
    # and the archive itself starts there, reaching the native-package check
    proc = _run([python, "-S", "-s", str(copy), "--help"], env, copy.parent)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1
    assert "torch" in proc.stderr and "pip install" in proc.stderr


def test_help_runs_from_pyz_in_a_clean_env(pyz, tmp_path):
    argv, env = pyz_command(pyz, tmp_path)
    proc = _run([*argv, "--help"], env, pyz_run_dir(argv))
    assert proc.returncode == 0, proc.stderr
    for command in ("head", "worker", "plan", "generate"):
        assert command in proc.stdout


def test_version_runs_from_pyz_in_a_clean_env(pyz, tmp_path):
    """The release a tc.pyz is, which the head and every worker must share (a mismatch is refused by name)."""
    from tc import __version__

    argv, env = pyz_command(pyz, tmp_path)
    proc = _run([*argv, "--version"], env, pyz_run_dir(argv))
    assert proc.returncode == 0, proc.stderr
    with zipfile.ZipFile(pyz) as archive:
        build = archive.read("tc/BUILD").decode().strip()
    assert proc.stdout == f"tc {__version__} (build {build})\n" and len(build) == 12


def test_the_build_is_a_digest_of_what_the_archive_holds(tmp_path):
    """Two builds of one release told apart (ops compare `--version` across machines, and the head warns of a
    worker of another build): the same sources give the same build, a changed source another."""
    sources = tmp_path / "repo"
    shutil.copytree(ROOT / "tc", sources / "tc", ignore=shutil.ignore_patterns("__pycache__"))
    first = bz.collect_entries(sources, bz.DEFAULT_CACHE)[bz.BUILD_ENTRY]
    assert bz.collect_entries(sources, bz.DEFAULT_CACHE)[bz.BUILD_ENTRY] == first
    (sources / "tc" / "topology.py").write_text((sources / "tc" / "topology.py").read_text() + "\n# changed\n")
    assert bz.collect_entries(sources, bz.DEFAULT_CACHE)[bz.BUILD_ENTRY] != first
    from tc import __version__, version_line
    assert version_line() == f"tc {__version__} (from source)"  # a checkout holds no BUILD


def test_plan_runs_from_pyz_in_a_clean_env(pyz, tmp_path, tiny_model_dir):
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        f"model: {tiny_model_dir}\nquant: fp16\ndtype: fp32\n"
        # plan binds nothing, so any ports do
        "head: {api: '127.0.0.1:18000', listen: '127.0.0.1:17001'}\n"
        "nodes:\n  - {id: a, device: cpu}\n  - {id: b, device: cpu}\n")
    argv, env = pyz_command(pyz, tmp_path)
    proc = _run([*argv, "plan", str(topology)], env, pyz_run_dir(argv))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 layers" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert {"a", "b"} <= {row[0] for row in rows if row}


def test_log_level_is_taken_after_the_command_too(pyz, tmp_path):
    """`tc plan --log-level error ...` as well as `tc --log-level error plan ...`: where an operator adds it to a
    command line already written, after the command, it was refused as an unknown argument."""
    topology = tmp_path / "topology.yaml"  # a repo id: resolving it logs at INFO, then fails offline at ERROR
    topology.write_text("model: example-org/not-cached\nquant: fp16\ndtype: fp32\n"
                        "head: {api: '127.0.0.1:18000', listen: '127.0.0.1:17001'}\nnodes:\n  - {id: a, device: cpu}\n")
    argv, env = pyz_command(pyz, tmp_path)
    env = {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    loud = _run([*argv, "plan", str(topology)], env, pyz_run_dir(argv))
    assert loud.returncode == 2 and " INFO " in loud.stderr and "cannot get config.json" in loud.stderr, loud.stderr
    for args in (["plan", "--log-level", "error"], ["--log-level", "error", "plan"],
                 ["--log-level", "debug", "plan", "--log-level", "error"]):
        quiet = _run([*argv, *args, str(topology)], env, pyz_run_dir(argv))
        assert quiet.returncode == 2 and "cannot get config.json" in quiet.stderr, (args, quiet.stderr)
        assert " INFO " not in quiet.stderr and " DEBUG " not in quiet.stderr, (args, quiet.stderr)


def _imported_modules(stderr: str) -> set[str]:
    """Module names from `-X importtime` lines: 'import time: self | cumulative |   name'."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")
            and not line.rstrip().endswith("imported package")}


@pytest.mark.parametrize("without, named", [
    (("tokenizers",), ("tokenizers",)),
    (("tokenizers", "torch"), ("torch", "tokenizers")),
])
def test_missing_native_package_is_one_line_and_exit_3(pyz, tmp_path, without, named):
    argv, env = pyz_command(pyz, tmp_path, without=without)
    proc = _run([argv[0], "-X", "importtime", *argv[1:], "plan", "topology.yaml"], env, pyz_run_dir(argv))
    assert proc.returncode == 3
    assert proc.stdout == ""
    message = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert len(message) == 1, message
    for name in named:
        assert name in message[0]
    assert f"pip install {' '.join(named)}" in message[0]
    # nothing but the standard library and tc's own check ran before the message
    imported = {name.split(".")[0] for name in _imported_modules(proc.stderr)}
    assert imported - set(sys.stdlib_module_names) == {"tc"}, imported - set(sys.stdlib_module_names)


def _older_python() -> str | None:
    """A Python older than 3.10 on this machine (plain or under pyenv), or None."""
    for minor in (9, 8):
        names = [shutil.which(f"python3.{minor}") or "",
                 *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/python3.{minor}")))]
        for name in names:
            if name and subprocess.run([name, "-S", "-c", f"import sys; assert sys.version_info[:2] == (3, {minor})"],
                                       capture_output=True).returncode == 0:
                return name
    return None


def test_a_python_older_than_3_10_is_named_before_the_packages(pyz, tmp_path):
    """On Python 3.9 tc.pyz said to pip install torch and the rest for that Python, which tc does not support: the
    interpreter is what to change, and it says so first."""
    python = _older_python()
    if python is None:
        pytest.skip("no Python older than 3.10 on this machine")
    proc = _run([python, "-S", "-s", str(pyz), "--help"], clean_env([]), tmp_path)
    assert proc.returncode == 3 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: tc needs Python 3.10 or newer") and "pip install" not in line, line


def test_version_shows_on_a_host_without_the_native_packages(pyz, tmp_path):
    """tc --version is how an operator tells which release a tc.pyz is, before installing anything for it: it
    answered with the missing packages' pip line instead."""
    from tc import __version__

    argv, env = pyz_command(pyz, tmp_path, without=("torch", "tokenizers"))
    proc = _run([*argv, "--version"], env, pyz_run_dir(argv))
    assert proc.returncode == 0 and proc.stdout.startswith(f"tc {__version__} (build "), proc.stderr


@pytest.mark.parametrize("package, installed, floor", [("torch", "2.3.1", "2.4"), ("huggingface_hub", "0.24.7", "0.25")])
def test_a_package_older_than_tc_runs_on_is_one_line_and_exit_3(pyz, tmp_path, package, installed, floor):
    """A host whose torch or huggingface_hub predates the oldest release tc runs on is told so, with the pip line,
    before anything imports it: an old torch failed somewhere inside the model code, an old huggingface_hub at the
    first download."""
    argv, env = pyz_command(pyz, tmp_path, without=(package,))
    site_dir = Path(env["PYTHONPATH"])
    (site_dir / package).mkdir()
    (site_dir / package / "__init__.py").write_text("raise ImportError('this release is too old to import')\n")
    dist_info = site_dir / f"{package}-{installed}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {installed}\n")
    proc = _run([*argv, "plan", "topology.yaml"], env, pyz_run_dir(argv))
    assert proc.returncode == 3 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [f"error: tc needs {package} {floor} or newer, and this Python has {package} "
                                        f"{installed}; upgrade with: python -m pip install '{package}>={floor}'"], \
        proc.stderr


def test_pyz_copied_alone_runs_a_head_and_a_worker(pyz, tmp_path):
    """The product as ops people use it: one tc.pyz in an empty directory, on a host without the pure packages."""
    from cluster import Cluster, write_topology
    from tiny_model import write_tiny_model

    from pyz_env import pyz_command, pyz_run_dir

    model = write_tiny_model(tmp_path / "tiny-qwen", seed=4)
    argv, env = pyz_command(pyz, tmp_path)
    topology = write_topology(pyz_run_dir(argv) / "topology.yaml", model, [{"id": "only", "device": "cpu"}])
    with Cluster(topology, pyz_run_dir(argv), tc=argv, env=env) as cluster:
        cluster.start_head()
        cluster.wait_api()
        cluster.start_worker(None)  # no --node-id: the head gives it the free entry
        cluster.wait_ready()
        status, body = cluster.post("/v1/chat/completions", {
            "model": "tiny-qwen", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
            "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
        assert "worker only joined" in cluster.head.output()


def test_native_kernels_build_from_the_source_inside_the_pyz(pyz, tmp_path):
    from tc.model import native

    if native.kernels() is None:
        pytest.skip("no native kernels on this machine")
    code = ("import sys; from tc.model import native; k = native.kernels(); "
            "print(native.__file__); print('built' if k is not None else 'none')")
    env = {**{k: v for k, v in os.environ.items() if k not in ("TC_NATIVE_KERNELS", "TC_CACHE_DIR")},
           "HOME": str(tmp_path), "PYTHONPATH": str(pyz)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, state = proc.stdout.split()
    assert where.startswith(str(pyz)) and state == "built"  # qdot.c read from the archive, compiled, loaded
    assert list((tmp_path / ".cache" / "truecluster" / "kernels").glob("native-*.so"))
