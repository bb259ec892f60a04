"""Writing a file or a directory all at once: into a temporary beside the target, renamed at the end.

The one home of write-a-temporary-then-rename. A writer killed midway (SIGKILL, power loss) leaves
no half-written target, only a hidden `.NAME.partial-PID-*` beside it, which the next run for the
same target removes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
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


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_stale_partials(target: Path) -> None:
    """Temporaries of earlier runs for `target` whose process is gone."""
    prefix = f".{target.name}.partial-"
    for entry in target.parent.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _remove(entry)


@contextlib.contextmanager
def atomic_file(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `target` to write a file at; when the block ends it is renamed
    over `target` (atomic on one filesystem), and if the block fails it is removed.

    The caller makes the parent directory and turns OSError into its own one-line error."""
    target = Path(target)
    _remove_stale_partials(target)
    temporary = target.with_name(f".{target.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield temporary
        os.replace(temporary, target)
    finally:
        _remove(temporary)


def write_atomically(target: str | Path, data: str | bytes, durable: bool = False) -> None:
    """Replace `target`'s contents with `data` all at once; `durable`: on disk (fsync'd) before the rename."""
    with atomic_file(target) as temporary, open(temporary, "wb") as file:
        file.write(data.encode("utf-8") if isinstance(data, str) else data)
        if durable:
            file.flush()
            os.fsync(file.fileno())


def make_staging_directory(target: Path) -> Path:
    """A hidden temporary directory beside `target` (its parent made if missing), to fill and then hand
    to `replace_directory`; those that processes now gone left for the same target are removed first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))


def replace_directory(staging: Path, target: Path) -> None:
    """Rename the finished directory `staging` to `target`, moving aside whatever is there (stale or damaged).

    Readers of the old one keep their open files; a process racing us just leaves its own, equally good, copy.
    """
    for _ in range(3):
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=".stale-", dir=target.parent))
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.rename(target, trash / "entry")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(staging, target)
            return
        except OSError:  # someone else renamed theirs in between: look again
            continue
    raise OSError(f"could not place {target}")


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
        work = make_staging_directory(target)
    except OSError as exc:
        raise LmcliError(f"{target}: cannot create the output directory ({exc.strerror or exc})") from None
    try:
        yield work
        work.chmod(_default_directory_mode())  # mkdtemp makes it private (0700); the result should not be
        os.replace(work, target)  # atomic on one filesystem; replaces an empty directory
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
