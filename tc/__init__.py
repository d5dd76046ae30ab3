"""TrueCluster: one LLM across the machines you already own."""
from __future__ import annotations  # imported before the check for Python 3.10 (tc/cli.py) says what is wrong

import pkgutil

__version__ = "0.1.0"


def build() -> str | None:
    """Which build a tc.pyz is: a digest of everything in it, written into the archive by build_zipapp.py as
    tc/BUILD; None run from a checkout. Two builds of one release can differ, and only this tells them apart."""
    try:
        data = pkgutil.get_data(__name__, "BUILD")
    except OSError:
        return None
    text = (data or b"").decode("ascii", "replace").strip()
    return text or None


def full_version() -> str:
    """The release and the build, as a worker names itself to the head: "0.1.0+<build>", or "0.1.0" from source."""
    made = build()
    return __version__ if made is None else f"{__version__}+{made}"


def version_line() -> str:
    """What tc --version prints."""
    made = build()
    return f"tc {__version__} ({'build ' + made if made else 'from source'})"
