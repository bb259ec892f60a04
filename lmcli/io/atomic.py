"""Writing a directory all at once: into a temporary directory beside the target, renamed at the end.

A writer killed midway (SIGKILL, power loss) leaves no half-written target, only a hidden
`.NAME.partial-PID-*` directory beside it, which the next run for the same target removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lmcli.errors import LmcliError, UsageError


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove_stale_partials(target: Path) -> None:
    """Temporary directories of earlier runs for `target` whose process is gone."""
    prefix = f".{target.name}.partial-"
    for entry in target.parent.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _default_directory_mode() -> int:
    """The permissions `mkdir` would give a new directory under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success it becomes `target`, on any failure it is removed.

    `target` must not exist, or be an empty directory (which it then replaces).
    """
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{target}: exists and is not an empty directory; choose a new output directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(target)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    except OSError as exc:
        raise LmcliError(f"{target}: cannot create the output directory ({exc.strerror or exc})") from None
    try:
        yield work
        work.chmod(_default_directory_mode())  # mkdtemp makes it private (0700); the result should not be
        os.replace(work, target)  # atomic on one filesystem; replaces an empty directory
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
