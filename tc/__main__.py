import os
import sys

if sys.version_info < (3, 10):  # first: installing the packages for this interpreter would not help
    print(f"error: tc needs Python 3.10 or newer (3.10-3.12 are the releases it is tested on); this is Python "
          f"{sys.version.split()[0]}: run tc.pyz with another python", file=sys.stderr)
    sys.exit(3)

from tc import version_line
from tc.deps import missing_message, missing_native_packages, outdated_message


def _asks_version(argv: list[str]) -> bool:
    """Whether `argv` asks for tc --version, which needs none of the native packages."""
    for arg in argv:
        if arg == "--version":
            return True
        if not arg.startswith("-"):  # the command: what follows is its own
            return False
    return False


if _asks_version(sys.argv[1:]):  # the release of a tc.pyz shows on a host that has yet to get its packages
    print(version_line())
    sys.exit(0)

from tc.openmp import settle_openmp

settle_openmp(os.environ)  # before torch loads libgomp, which reads it once (tc/openmp.py)

missing = missing_native_packages()
problem = missing_message(missing) if missing else outdated_message()
if problem:
    print(f"error: {problem}", file=sys.stderr)
    sys.exit(3)

from tc.cli import exit_process, main  # noqa: E402  (only after the dependency check)

exit_process(main())
