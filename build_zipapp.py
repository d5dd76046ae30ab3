"""Build `tc.pyz`: one file holding the `tc` package and the pure-Python packages it imports.

    python build_zipapp.py [--out dist/tc.pyz] [--cache-dir build/zipapp-wheels]

The archive carries tc/ (minus bytecode caches) plus falcon, waitress, PyYAML (`yaml`), Jinja2, MarkupSafe
and prometheus_client, each pinned below to one release and one wheel by sha256. Native packages
(torch, safetensors, tokenizers, numpy, huggingface_hub) stay on each host; the archive's `__main__.py` runs
`tc/__main__.py`, which checks for them before importing anything else.

Only `.py` files go into the archive. falcon, PyYAML and MarkupSafe each ship optional C speedups with a
pure-Python fallback: a zip cannot load a shared library, and one archive must run on Linux and macOS under
Python 3.10-3.12, so the fallback is what runs. Wheels are fetched with pip once and cached under `build/`, so a
rebuild is quick and works offline; entries are sorted and carry a fixed timestamp, so the same inputs give the
same bytes.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "dist" / "tc.pyz"
DEFAULT_CACHE = ROOT / "build" / "zipapp-wheels"

SHEBANG = b"#!/usr/bin/env python3\n"
# the earliest time a zip entry can record; any fixed value makes the archive reproducible
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
COMPRESS_LEVEL = 9

# pip flags that select a py3-none-any wheel
PURE_WHEEL = ("--platform", "any", "--implementation", "py", "--abi", "none", "--python-version", "3.10")
# MarkupSafe and PyYAML publish no py3-none-any wheel. Their .py files are the same in every platform wheel of a
# release, so one fixed platform wheel is the source (whatever the building machine is) and only its .py is kept.
CPYTHON_WHEEL = ("--platform", "manylinux_2_17_x86_64", "--implementation", "cp", "--abi", "cp311",
                 "--python-version", "3.11")


@dataclass(frozen=True)
class Pin:
    """One bundled distribution: the exact wheel to take and which of its top-level names go in the archive."""

    name: str                       # distribution name, as pip spells it
    version: str
    wheel: str                      # the exact wheel file name pip must produce
    sha256: str
    packages: tuple[str, ...]       # top-level import packages copied into the archive
    skip: tuple[str, ...] = ()      # other top-level names in the wheel, left out on purpose
    pip_select: tuple[str, ...] = PURE_WHEEL


PINS: tuple[Pin, ...] = (
    Pin("falcon", "4.4.0", "falcon-4.4.0-py3-none-any.whl",
        "2109d8dbaf6297b51de2e059558bc092d9b8b040cab8f390d3b7bec88312e20c", ("falcon",)),
    Pin("waitress", "3.0.2", "waitress-3.0.2-py3-none-any.whl",
        "c56d67fd6e87c2ee598b76abdd4e96cfad1f24cacdea5078d382b1f9d7b5ed2e", ("waitress",)),
    # `_yaml` is a deprecated top-level alias of the C extension yaml._yaml, useless without it
    Pin("pyyaml", "6.0.3",
        "pyyaml-6.0.3-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
        "b8bb0864c5a28024fac8a632c443c87c5aa6f215c0b126c449ae1a150412f31d", ("yaml",), skip=("_yaml",),
        pip_select=CPYTHON_WHEEL),
    Pin("jinja2", "3.1.6", "jinja2-3.1.6-py3-none-any.whl",
        "85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67", ("jinja2",)),
    Pin("markupsafe", "3.0.3",
        "markupsafe-3.0.3-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
        "0bf2a864d67e76e5c9a34dc26ec616a66b9888e25e7b9460e1c76d3293bd9dbf", ("markupsafe",),
        pip_select=CPYTHON_WHEEL),
    # the head's /metrics; its twisted/aiohttp/django helpers are plain modules imported only on demand
    Pin("prometheus_client", "0.26.0", "prometheus_client-0.26.0-py3-none-any.whl",
        "fa93d06737aa02bacd05794768508bb97d2fbee28cb3bca04eaae92f0ca953d6", ("prometheus_client",)),
)

NATIVE_SUFFIXES = (".so", ".pyd", ".dylib")
BUILD_ENTRY = "tc/BUILD"  # the build's digest (tc.build()), made here for each archive
# files of a package that the pure-Python code never reads: native code, its sources, and typing stubs
DROPPED_SUFFIXES = NATIVE_SUFFIXES + (".pyx", ".pxd", ".c", ".h", ".pyi")
DROPPED_NAMES = ("py.typed",)
LICENSE_PREFIXES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS")

ARCHIVE_MAIN = '''\
"""tc.pyz entry point: runs tc/__main__.py, which checks the host's native packages before anything else."""
import runpy

runpy.run_module("tc", run_name="__main__", alter_sys=True)
'''


class BuildError(Exception):
    """The archive cannot be built as pinned; the message says what to do."""


@dataclass(frozen=True)
class BuildResult:
    path: Path
    size: int
    sha256: str
    entries: int


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(pin: Pin, cache_dir: Path) -> Path:
    """Return the pinned wheel from the cache, downloading it with pip first if it is not there.

    Raises BuildError when pip cannot fetch it or the file differs from the pinned hash.
    """
    cached = cache_dir / pin.wheel
    if cached.is_file():
        if sha256_of(cached) == pin.sha256:
            return cached
        cached.unlink()  # a truncated or foreign file: fetch it again
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{pin.name}=={pin.version} --hash=sha256:{pin.sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", *pin.pip_select, "--require-hashes", "-r", str(requirements),
               "--dest", str(Path(tmp) / "wheels")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        downloaded = Path(tmp) / "wheels" / pin.wheel
        if proc.returncode != 0 or not downloaded.is_file():
            raise BuildError(
                f"could not download {pin.wheel} with pip (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}\n"
                f"connect to PyPI once, or put that file into {cache_dir} by hand")
        if sha256_of(downloaded) != pin.sha256:
            raise BuildError(f"{pin.wheel} from pip does not match the pinned sha256 {pin.sha256}; "
                             "check the package index, or update the pin in build_zipapp.py deliberately")
        os.replace(downloaded, cached)  # only complete, verified wheels ever appear in the cache
    return cached


def _is_license(name: str) -> bool:
    return name.upper().startswith(LICENSE_PREFIXES)


def wheel_entries(pin: Pin, wheel: zipfile.ZipFile) -> dict[str, bytes]:
    """The archive entries taken from one wheel: the .py files of its packages, its METADATA and licenses.

    Raises BuildError for a top-level name or a data file this build does not know how to treat, so that a new
    pin is looked at rather than silently bundled without a file it needs.
    """
    dist_info = f"{pin.name}-{pin.version}.dist-info"
    entries: dict[str, bytes] = {}
    for info in wheel.infolist():
        if info.is_dir():
            continue
        path = PurePosixPath(info.filename)
        top = path.parts[0]
        if top.lower() == dist_info.lower():
            if path.name == "METADATA" or _is_license(path.name) or "licenses" in path.parts[1:-1]:
                entries[info.filename] = wheel.read(info)
            continue
        # a top-level file is a module: 'name.py' or 'name.cpython-311-x86_64-linux-gnu.so'
        module = top if len(path.parts) > 1 else top.split(".", 1)[0]
        if module in pin.skip:
            continue
        if module not in pin.packages:
            raise BuildError(f"{pin.wheel} holds {module!r}, which the pin neither bundles nor skips; "
                             "add it to the pin's packages or skip in build_zipapp.py")
        if path.suffix == ".py":
            entries[info.filename] = wheel.read(info)
        elif path.suffix not in DROPPED_SUFFIXES and path.name not in DROPPED_NAMES:
            raise BuildError(f"{pin.wheel} holds the data file {info.filename}; decide whether the bundled code "
                             "reads it and teach build_zipapp.py to keep or drop it")
    missing = [p for p in pin.packages if f"{p}/__init__.py" not in entries]
    if missing:
        raise BuildError(f"{pin.wheel} has no pure-Python package {', '.join(missing)}; pick another wheel")
    return entries


def source_entries(repo_root: Path) -> dict[str, bytes]:
    """Every file under tc/ except bytecode caches and hidden files, keyed by its path in the archive."""
    package = repo_root / "tc"
    if not (package / "__main__.py").is_file():
        raise BuildError(f"{package} is not the tc package (no __main__.py); run build_zipapp.py from a checkout")
    entries: dict[str, bytes] = {}
    for path in package.rglob("*"):
        rel = path.relative_to(repo_root)
        if (path.is_dir() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo")
                or any(part.startswith(".") for part in rel.parts) or rel.as_posix() == BUILD_ENTRY):
            continue
        if path.suffix in NATIVE_SUFFIXES:
            raise BuildError(f"{rel} is a native library; tc itself must stay pure Python to run from the zip")
        entries[rel.as_posix()] = path.read_bytes()
    return entries


def collect_entries(repo_root: Path, cache_dir: Path) -> dict[str, bytes]:
    """All files of the archive, keyed by archive path. Raises BuildError on a clash or a failed fetch."""
    entries = {"__main__.py": ARCHIVE_MAIN.encode()}
    sources = [("tc/", source_entries(repo_root))]
    for pin in PINS:
        with zipfile.ZipFile(fetch_wheel(pin, cache_dir)) as wheel:
            sources.append((pin.wheel, wheel_entries(pin, wheel)))
    for origin, files in sources:
        clash = sorted(entries.keys() & files.keys())
        if clash:
            raise BuildError(f"{origin} would overwrite {', '.join(clash[:5])} in the archive")
        entries.update(files)
    # which build this is (tc --version, and each worker's HELLO): a digest of every file it holds
    digest = hashlib.sha256()
    for name in sorted(entries):
        digest.update(name.encode() + b"\0" + hashlib.sha256(entries[name]).digest())
    entries[BUILD_ENTRY] = digest.hexdigest()[:12].encode() + b"\n"
    return entries


def _zip_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH)
    info.create_system = 3  # Unix, whatever machine builds it, so the mode bits below mean the same everywhere
    if name.endswith("/"):
        info.external_attr = (0o40755 << 16) | 0x10  # directory, MS-DOS directory flag
    else:
        info.external_attr = 0o100644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
    return info


def archive_bytes_to(fileobj: BinaryIO, entries: dict[str, bytes]) -> None:
    """Write the shebang and a reproducible zip of `entries` to a binary file object."""
    # zipimport finds a namespace package only by its directory entry, so every directory gets one
    dirs = {"/".join(name.split("/")[:i]) + "/" for name in entries for i in range(1, name.count("/") + 1)}
    fileobj.write(SHEBANG)
    with zipfile.ZipFile(fileobj, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=COMPRESS_LEVEL) as zf:
        for name in sorted(dirs | entries.keys()):
            info = _zip_info(name)
            zf.writestr(info, b"" if name in dirs else entries[name])


def build_zipapp(out: Path = DEFAULT_OUT, *, repo_root: Path = ROOT, cache_dir: Path = DEFAULT_CACHE) -> BuildResult:
    """Build the archive at `out` (replacing it atomically) and describe it. Raises BuildError."""
    entries = collect_entries(repo_root, cache_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            archive_bytes_to(f, entries)
        tmp.chmod(0o755)  # runnable as ./tc.pyz through the shebang
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return BuildResult(path=out, size=out.stat().st_size, sha256=sha256_of(out), entries=len(entries))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build tc.pyz: tc plus its pure-Python dependencies in one file.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"archive to write (default {DEFAULT_OUT})")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help=f"where downloaded wheels are kept (default {DEFAULT_CACHE})")
    args = parser.parse_args(argv)
    try:
        result = build_zipapp(args.out, cache_dir=args.cache_dir)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    bundled = ", ".join(f"{pin.name} {pin.version}" for pin in PINS)
    print(f"wrote {result.path} ({result.size / 1024:.0f} KiB, {result.entries} files, sha256 {result.sha256})")
    print(f"bundled: {bundled}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
