import os
import sys

from tc.deps import missing_message, missing_native_packages
from tc.openmp import settle_openmp

settle_openmp(os.environ)  # before torch loads libgomp, which reads it once (tc/openmp.py)

missing = missing_native_packages()
if missing:
    print(f"error: {missing_message(missing)}", file=sys.stderr)
    sys.exit(3)

from tc.cli import exit_process, main  # noqa: E402  (only after the dependency check)

exit_process(main())
