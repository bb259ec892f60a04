"""Batch jobs under torchrun: data parallel (each rank a share of the rows, in its own part file) and
tensor parallel (every rank runs every row in step, rank 0 writes).

The process group and the tensor-parallel model are lmcli.distributed's, below loading; a rank's job
output is a jobs.JobOutput (a part file, or nowhere).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from lmcli.distributed import rank, world_size
from lmcli.errors import LmcliError, UsageError
from lmcli.jobs import runner as jobs
from lmcli.jobs.runner import FileOutput, JobOutput

# --- data parallel batch jobs ---------------------------------------------------------------------
#
# Every rank reads the whole input and takes every N-th row that is not done yet (row i of the
# remaining rows goes to rank i mod N), writing its results to its own part file (OUTPUT.partR) as
# each row finishes, exactly as a one-process job writes OUTPUT. When all ranks are done, rank 0
# appends the parts to OUTPUT in input order and removes them. A resumed job, with any number of
# ranks, first moves the finished rows of leftover part files into OUTPUT; then the rows still to
# do are shared out again. Rows carry their own seeds, so no result depends on the number of ranks.


def part_path(output_path: Path, part: int) -> Path:
    return output_path.with_name(f"{output_path.name}.part{part}")


def _parts(output_path: Path) -> list[Path]:
    pattern = re.compile(re.escape(output_path.name) + r"\.part\d+$")
    return sorted(p for p in output_path.parent.glob(output_path.name + ".part*") if pattern.fullmatch(p.name))


def _on_rank_0(action) -> Any:
    """Run `action` on rank 0 only; its result, or its LmcliError, reaches every rank."""
    outcome: list[Any] = [None]
    if rank() == 0:
        try:
            outcome[0] = ("ok", action())
        except LmcliError as error:
            outcome[0] = ("error", error)
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


def _append_lines(output_path: Path, lines: list[bytes]) -> None:
    try:
        with open(output_path, "ab") as out:
            out.write(b"".join(line + b"\n" for line in lines))
            out.flush()
            os.fsync(out.fileno())
    except OSError as e:
        raise LmcliError(f"cannot write {output_path}: {e.strerror or e}") from None


def _complete_lines(path: Path) -> list[bytes]:
    """The whole lines of a part file (a kill may have left half a line at the end)."""
    lines = path.read_bytes().split(b"\n")
    lines.pop()  # b"" after a final newline, else the partial line
    return [line for line in lines if line.strip()]


def _absorb_parts(output_path: Path, order: dict[str, int] | None = None) -> int:
    """Append the rows of the part files to `output_path` (in input order when `order` maps ids to
    input positions), then remove the parts. Returns the number of rows moved."""
    parts = _parts(output_path)
    lines = [line for part in parts for line in _complete_lines(part)]
    if order is not None:
        lines.sort(key=lambda line: order.get(jobs.id_key(json.loads(line).get("id")), len(order)))
    if lines or not output_path.exists():
        _append_lines(output_path, lines)
    for part in parts:
        part.unlink()
    return len(lines)


def adopt_parts(output_path: Path, resume: bool, overwrite: bool) -> None:
    """Part files an interrupted data-parallel job left beside OUTPUT: with --resume their rows join
    OUTPUT (whatever the number of ranks now, one included); with --overwrite they are removed."""
    leftovers = _parts(output_path)
    if not leftovers:
        return
    if overwrite:
        for part in leftovers:
            part.unlink()
    elif resume:
        if output_path.exists():
            jobs.read_finished(output_path)  # drops a torn last line before appending
        _absorb_parts(output_path)
    else:
        raise UsageError(f"{leftovers[0]} is part of an interrupted data-parallel job; use --resume to "
                         "finish it or --overwrite to replace it")


def _prepare_output(output_path: Path, resume: bool, overwrite: bool) -> None:
    """Rank 0, before any rank reads OUTPUT: the checks a one-process job makes, leftover parts
    adopted, and the file tidied (torn line and failed rows dropped) so the ranks can all read it."""
    if overwrite:
        output_path.unlink(missing_ok=True)
    elif output_path.exists() and not resume:
        raise UsageError(f"{output_path} already exists; use --resume to finish it or --overwrite to replace it")
    adopt_parts(output_path, resume, overwrite)
    if output_path.exists():
        jobs.read_finished(output_path)


class _RankPart(FileOutput):
    """A data-parallel rank's output: the rows OUTPUT holds are done; the rest are shared out by rank,
    and each rank appends its own to its part file (rank 0 alone shows a progress bar)."""

    def __init__(self, output_path: Path):
        super().__init__(output_path, resume=True, write_to=part_path(output_path, rank()))
        self.progress = rank() == 0

    def share(self, todo: list) -> list:
        return todo[rank()::world_size()]


class _InStep(JobOutput):
    """A tensor-parallel rank but 0: runs the rows rank 0 runs (those in `done` are done), writing to `stream`."""

    def __init__(self, stream: IO[str], done: Path | None):
        super().__init__(stream)
        self.path = done

    def finished(self) -> dict[str, dict]:
        return jobs.read_finished(self.path) if self.path is not None else {}


def run_tensor_parallel_job(input_path: Path, output_path: Path | None, settings, *, load, batch_size=None,
                            resume: bool = False, overwrite: bool = False, identity=None):
    """A batch job on a model split over the ranks: every rank runs every row in step, rank 0 writes."""
    if output_path is not None:
        _on_rank_0(lambda: _prepare_output(output_path, resume, overwrite))
    if rank() == 0:
        return jobs.run_job(input_path, output_path, settings, load=load, batch_size=batch_size, resume=resume,
                            overwrite=overwrite, identity=identity)
    # The other ranks skip the rows rank 0 skips, and write nowhere.
    done = output_path if resume and output_path is not None and output_path.exists() else None
    with open(os.devnull, "w") as nowhere:
        return jobs.run_job(input_path, _InStep(nowhere, done), settings, load=load, batch_size=batch_size)


def run_data_parallel_job(input_path: Path, output_path: Path | None, settings, *, load, batch_size=None,
                          resume: bool = False, overwrite: bool = False, identity=None):
    """A batch job shared by the ranks of the process group; returns the whole job's JobReport
    (on every rank)."""
    if output_path is None:
        raise UsageError("a data-parallel job (torchrun without --tp) needs --output FILE")

    _on_rank_0(lambda: _prepare_output(output_path, resume, overwrite))
    report = jobs.run_job(input_path, _RankPart(output_path), settings, load=load, batch_size=batch_size,
                          identity=identity)
    reports: list[Any] = [None] * world_size()
    dist.all_gather_object(reports, report)  # also waits for every rank to finish

    def merge() -> None:
        rows = jobs.read_rows(input_path, settings)
        _absorb_parts(output_path, {jobs.id_key(row.id): i for i, row in enumerate(rows)})

    _on_rank_0(merge)
    total = jobs.JobReport(rows=report.rows, skipped=report.skipped)
    for each in reports:
        total.written += each.written
        total.failed += each.failed
        total.tokens += each.tokens
        total.seconds = max(total.seconds, each.seconds)
    return total
