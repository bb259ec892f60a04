"""`python -m lmcli.native`: build lmcli's C++ kernels now (what `make install` runs), saying what it does."""

from __future__ import annotations

import sys

from lmcli import native


def main() -> int:
    b = native.current()
    if native.os.environ.get(native.ENV, "") == "0":
        print(f"native kernels: off ({native.ENV}=0)")
        return 0
    if b.path.exists():
        print(f"native kernels: {b.path} (already built)")
    else:
        print(f"native kernels: building {b.path}")
        try:
            native.build(b, verbose=True)
        except (RuntimeError, OSError) as exc:
            native._record_failure(b.failed, str(exc))
            print(f"native kernels: not built ({exc}); lmcli will use torch's kernels")
            return 0  # never fails an install: torch's kernels remain
    print(f"native kernels: {native.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
