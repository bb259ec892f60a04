"""One writer per job output: a lock file beside --output, held while the job reads and writes it.

Two jobs on one output (`--resume` twice at once) would both append every row. The first takes an
exclusive flock on `.<name>.lock` next to the output and writes its pid there; a second is refused in
one line naming that pid. The lock goes when the holder exits, however it exits (the kernel drops
flocks of a dead process), so a killed job never leaves the output locked.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from lmcli.errors import LmcliError

Job = TypeVar("Job", bound=Callable[..., Any])


def lock_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.lock")


@contextlib.contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold the lock of `output` for the block; LmcliError naming the holder's pid when another has it."""
    import fcntl

    path = lock_path(output)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LmcliError(f"cannot lock {output}: cannot create {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise LmcliError(f"{output} is being written by another lmcli job (pid {holder}); "
                             f"wait for it to finish, or stop it") from None
        # The holder before us may have removed the file after we opened it: lock the one on disk.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # the pid is for the message only (a full disk cannot hold it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still holding it: a waiter that opened it retries on the new file
        os.close(fd)


def holding_output_lock(job: Job) -> Job:
    """`job(input_path, output, ...)` run under the lock of `output` when that is a file's path."""

    @functools.wraps(job)
    def locked(input_path: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(output, (str, Path)) or (Path(output).exists() and not Path(output).is_file()):
            return job(input_path, output, *args, **kwargs)  # stdout, a pipe, a device, or a rank's own output
        with output_lock(Path(output)):
            return job(input_path, output, *args, **kwargs)

    return locked  # type: ignore[return-value]


def close_output(stream: IO[str], output: Path) -> None:
    """Close a job's output file; what could not be written then (a full disk) names the file."""
    try:
        stream.close()
    except OSError as e:
        raise LmcliError(f"cannot write {output}: {e.strerror or e}") from None
