"""JSONL batch jobs that survive a kill: read the input, write each row as it finishes, resume.

Job semantics (this is what the README documents):

- Input: `.jsonl` (one object per line: `prompt`, optional `id` and the
  settings in `lmcli.settings.generation_settings.ROW_SETTINGS`) or plain
  text (one prompt per line, `\\n` for a newline, `\\\\` for a backslash). Blank
  lines are skipped; a row without `id` gets its line number (1-based). Ids are
  JSON values: `1` and `"1"` are different rows.
- A `.jsonl` file whose first row is an OpenAI batch request is read as such
  (jobs/openai_batch.py); its rows are keyed by `custom_id` and answered with
  OpenAI batch response rows.
- Precedence: command-line flag > row field > the model's own defaults >
  lmcli's defaults. A row's field that a flag overrides is still checked
  (a bad value is that row's error), then dropped silently (no per-row
  warning). Top-k/top-p are one unit: a flag that sets either keeps a row's
  pair out; otherwise a row that sets either replaces both. `--greedy` (or
  `--temperature 0`) makes every row greedy; without a temperature flag a
  row's `temperature: 0` makes that row greedy. `--stop` replaces a row's
  `stop`.
- Output order: **completion order**. Each row is written, tagged by its `id`,
  the moment it finishes, as one complete line that is flushed and fsync'd.
  (Input order would mean holding finished rows back until every earlier row
  is done, and a kill would lose them.) Sort by `id` afterwards if you need to.
- Rows run continuously (generation/continuous.py) on decoder-only models whose
  rows are batch-invariant: up to --batch-size in flight, a finished row's place
  refilled at once, rows of any settings side by side, a prompt prefix shared by
  rows computed once. Elsewhere (float weights, --fast-kernels, encoder-decoders,
  --tp) rows are grouped by the settings a batch must share (all decoding settings
  but the seed and max_new_tokens, and --ignore-eos), then sorted by
  max_new_tokens and prompt length so little padding is wasted. Seeds, stop strings and max_new_tokens
  stay per row.
- Speculation: a row's `prompt_lookup`, `draft_model`, `num_draft_tokens` choose over the flags'; such
  rows run apart and record their counts (lmcli.generation.speculative_setup.JobSpeculation).
- The input is read as it is consumed (job_input.JobRows), never held in memory.
- Every sampled row records the `seed` it used (drawn when none was given), so
  `lmcli generate --seed S ...` reproduces it alone.
- Every output row records the model it came from (name and content
  fingerprint) and the settings it was generated with.
- Resume: `--resume` keeps every successful row already in the output, checks
  that its `input_hash` (prompt + settings) still matches the input and that
  it came from the same model (else refuses, writing nothing), warns about
  rows whose id the input no longer has (kept), and runs the rest. A partial last line (hard kill mid-write) and rows that failed
  before are removed first (the file is rewritten atomically), so every id ends
  up in the output exactly once.
- A bad row (invalid JSON, no prompt, a bad setting, a prompt too long for the
  model) becomes an output row with an `error` field; the job goes on and exits
  non-zero at the end.

The output file and resume are here (reading an output line by line, jobs/output.py's); reading the
input is jobs/input.py's, generating the rows
generation/rows.py's, the settings settings/generation_settings.py's, the progress bar console.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lmcli.console import JobProgress
from lmcli.errors import LmcliError, UsageError
from lmcli.generation.rows import (
    PreparedRow,
    RowResult,
    generate_batch,
    plan_batches,
    prepare_row,
    require_chat_template,
    truncation_warning,
)
from lmcli.io.bounded import MAX_ROW_DEPTH, text_deeper_than
from lmcli.io.output_lock import close_output, holding_output_lock
from lmcli.jobs.input import JobRow, JobRows, id_key
from lmcli.jobs.input import read_rows as read_rows  # lmcli.jobs.distributed reads the input so
from lmcli.jobs.input import unescape_line as unescape_line  # part of the job format, documented here
from lmcli.jobs.output import kept_record, output_lines, rewrite_without
from lmcli.settings.generation_settings import GenerationSettings, RowError

# ----------------------------------------------------------------------------- output


class RowWriter:
    """Writes each output row as one complete line, flushed (and fsync'd for files) at once."""

    def __init__(self, stream: IO[str], durable: bool):
        self._stream = stream
        self._durable = durable
        self.rows = 0
        self.failed = 0

    def write(self, row: dict) -> None:
        try:
            self._stream.write(json.dumps(row, ensure_ascii=False) + "\n")
            self._stream.flush()
            if self._durable:
                os.fsync(self._stream.fileno())
        except OSError as e:
            if not self._durable:
                raise  # stdout: a closed pipe is handled (quietly) by the CLI
            raise LmcliError(f"cannot write {self._stream.name}: {e.strerror or e}") from None
        self.rows += 1
        self.failed += row.get("error") is not None


class JobOutput:
    """Where a job's rows go and which are there already. This one: a stream (stdout by default),
    nothing done before, no progress bar. FileOutput is --output FILE; lmcli.jobs.distributed's ranks
    bring their own (a part file each, or nowhere)."""

    path: Path | None = None  # the output file the user named: resume checks against it, messages name it
    progress = False  # whether a progress bar is worth showing (it is silent anyway off a terminal)

    def __init__(self, stream: IO[str] | None = None):
        self._stream = stream

    def finished(self) -> dict[str, dict]:
        """The rows done already, by id key (see id_key)."""
        return {}

    def share(self, todo: Any) -> Any:
        """Of the rows still to do (JobRows, which slice lazily), those this process runs."""
        return todo

    def open(self) -> RowWriter:
        import sys

        return RowWriter(self._stream or sys.stdout, durable=False)

    def close(self) -> None:
        pass


class FileOutput(JobOutput):
    """--output FILE: refused if it exists unless resumed (its finished rows kept) or overwritten."""

    progress = True

    def __init__(self, path: Path, resume: bool = False, overwrite: bool = False, write_to: Path | None = None):
        super().__init__()
        self.path, self.resume, self.overwrite = path, resume, overwrite
        self._write_to = write_to or path  # where rows are appended (a data-parallel rank: its part file)

    def finished(self) -> dict[str, dict]:
        assert self.path is not None
        if not self.path.exists():
            return {}
        if self.resume:
            return read_finished(self.path)
        if not self.overwrite:
            raise UsageError(f"{self.path} already exists; use --resume to finish it or --overwrite to replace it")
        return {}

    def open(self) -> RowWriter:
        try:
            self._stream = open(self._write_to, "a" if self.resume else "w", encoding="utf-8", newline="\n")  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise LmcliError(f"cannot write {self._write_to}: {e.strerror or e}") from None
        return RowWriter(self._stream, durable=True)

    def close(self) -> None:
        if self._stream is not None:
            close_output(self._stream, self._write_to)  # a full disk's error names the file


def output_row_key(row: dict) -> tuple[str, bool, dict]:
    """(id key, failed, lmcli's record: input_hash, model, ...) of a row in a job's output, either format."""
    if "custom_id" in row and "response" in row:  # an OpenAI batch response row
        record = row.get("lmcli")
        return id_key(row["custom_id"]), row.get("error") is not None, record if isinstance(record, dict) else {}
    return id_key(row["id"]), "error" in row, row


def read_finished(path: Path) -> dict[str, dict]:
    """Successful rows already in a job's output, by id; tidies the file for appending.

    What is kept of each is lmcli's record of how it was made (its id, input_hash and model, the model
    record shared by the rows that name the same one), not its text: resuming an output of a million
    rows holds their ids and hashes (about 400 bytes a row, measured), never the rows. The file is read as a
    stream. A partial last line (a hard kill mid-write) and rows that failed are removed, by copying
    the rest to a temporary file renamed over the output, so that a crash during the tidy-up loses
    nothing.
    """
    finished: dict[str, dict] = {}
    models: dict[str, Any] = {}  # one record per model named (rows of one job name the same)
    dropped: list[int] = []  # line numbers of the failed rows and of a partial last line
    for number, raw, complete in output_lines(path):
        if not complete:
            dropped.append(number)
            continue
        try:
            if text_deeper_than(raw.decode("utf-8", "replace"), MAX_ROW_DEPTH):  # lmcli writes none so deep
                raise ValueError("too deep for json.loads")
            row = json.loads(raw)
            key, failed, record = output_row_key(row)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise LmcliError(
                f"{path}, line {number}: not a row written by lmcli; fix or remove that line, then --resume"
            ) from None
        if failed:
            dropped.append(number)  # failed rows are retried
            continue
        if key in finished:
            raise LmcliError(f"{path}, line {number}: id {key} appears twice; remove one, then --resume")
        finished[key] = kept_record(row, record, models)
    if dropped:
        rewrite_without(path, set(dropped))
    return finished


# ----------------------------------------------------------------------------- jobs


@dataclass
class JobReport:
    rows: int = 0  # rows in the input
    skipped: int = 0  # already done (--resume)
    written: int = 0
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    orphans: list[str] = field(default_factory=list)  # ids in the output that the input no longer has
    continuous: Any = None  # generation.continuous.ContinuousStats when the rows ran continuously


@holding_output_lock  # one writer per --output: a second job is refused, naming the first one's pid
def run_job(
    input_path: Path,
    output: Path | JobOutput | None,
    settings: GenerationSettings,
    *,
    load: Callable[[], tuple[Any, Any]],
    batch_size: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    identity: Callable[[], dict] | None = None,
) -> JobReport:
    """Run a batch job; `load()` is only called when some row needs the model.

    `output`: a file (with `resume` / `overwrite`), None for stdout, or a JobOutput.
    `identity()` names the model about to be used ({"name", "fingerprint"}, without loading it): every
    row records it, and --resume refuses an output whose rows came from another model.
    """
    import sys

    from lmcli.jobs import openai_batch

    if not isinstance(output, JobOutput):
        output = JobOutput() if output is None else FileOutput(output, resume, overwrite)
    started = time.perf_counter()
    rows = JobRows(input_path, settings)  # read as consumed: the input is never held in memory
    report = JobReport(rows=len(rows))
    model_record = identity() if identity is not None else None

    finished = output.finished()
    if finished:
        report.orphans, report.skipped = _check_resumable(rows, finished, output.path, model_record)
    todo = output.share(rows.where(lambda row: id_key(row.id) not in finished) if finished else rows)
    by_key: dict[str, JobRow] = {}  # the rows being generated
    model_name = model_record["name"] if model_record is not None else "lmcli"

    def record(row_hash: str, settings_used: GenerationSettings | None, seed: int | None) -> dict:
        """lmcli's record of how a row was made: what --resume checks."""
        out: dict[str, Any] = {"input_hash": row_hash}
        if model_record is not None:
            out["model"] = model_record
        if settings_used is not None:
            out["settings"] = settings_record(settings_used)
            out["seed"] = seed
        return out

    def result_row(result: RowResult) -> dict:
        row = by_key.pop(id_key(result.row.id))
        made = record(result.row.input_hash, result.row.settings, result.row.seed)
        if row.url is not None:
            return openai_batch.response_row(str(row.id), row.url, result, model_name, made)
        out = result.to_json()
        row_hash = out.pop("input_hash")  # stays the last field
        if model_record is not None:
            out["model"] = model_record
        out["settings"] = settings_record(result.row.settings)
        out["input_hash"] = row_hash
        return out

    def write_error(row: JobRow, message: str) -> None:
        made = record(row.input_hash, None, None)
        if row.url is not None:
            writer.write(openai_batch.error_row(row.id if isinstance(row.id, str) else None, message, made))
            return
        out: dict[str, Any] = {"id": row.id}
        if isinstance(row.prompt, str):
            out["prompt"] = row.prompt
        out["error"] = message
        if model_record is not None:
            out["model"] = model_record
        out["input_hash"] = row.input_hash
        writer.write(out)

    writer = output.open()
    progress = JobProgress(0, enabled=False)
    loaded: list[tuple[Any, Any]] = []

    def prepared_rows() -> Iterator[PreparedRow]:
        """The rows to generate, tokenised as they are reached; the others become error rows on the way.
        The model is loaded at the first row that needs it."""
        nonlocal progress
        for row in todo:
            if row.error is not None or row.prompt is None or row.settings is None:
                write_error(row, row.error or "no prompt")
                progress.advance()
                continue
            if not loaded:
                loaded.append(load())
                # Started only now: the load shows its own spinner, and its time is no part of tokens/s.
                progress = JobProgress(len(todo) if output.progress else 0, writer.rows, enabled=output.progress)
            model, tokenizer = loaded[0]
            try:
                if row.settings.chat:
                    require_chat_template(tokenizer)
                prepared = prepare_row(tokenizer, row.id, row.prompt, row.settings, row.input_hash,
                                       context=model.config.max_position_embeddings)
                if row.settings.lora is not None:  # an adapter that is not loaded: this row's error
                    from lmcli.kernels import lora

                    lora.check_row(model, row.settings.lora)
            except RowError as e:
                write_error(row, f"line {row.line}: {e}")
                progress.advance()
                continue
            if prepared.dropped_tokens:
                warning = truncation_warning(prepared, model.config.max_position_embeddings)
                sys.stderr.write(f"row {json.dumps(row.id)}: {warning}\n")
            by_key[id_key(row.id)] = row
            yield prepared

    def done(result: RowResult) -> None:
        writer.write(result_row(result))
        report.tokens += len(result.tokens)
        progress.advance(len(result.tokens))

    def failed(row: PreparedRow, message: str) -> None:
        write_error(by_key.pop(id_key(row.id)), message)
        progress.advance()

    try:
        source = prepared_rows()
        first = next(source, None)
        if first is not None:
            model, tokenizer = loaded[0]
            report.continuous = _generate_rows(model, tokenizer, itertools.chain([first], source),
                                               batch_size or default_batch_size(model), done, failed)
    finally:
        progress.close()
        output.close()
    report.written = writer.rows
    report.failed = writer.failed
    report.seconds = time.perf_counter() - started
    return report


def default_batch_size(model) -> int:
    # A CPU is busy with a few rows already; a GPU needs many to be kept busy.
    return 32 if model.device.type == "cuda" else 8


def settings_record(settings: GenerationSettings) -> dict:
    """The settings a row was generated with, as its output row records them (seed apart)."""
    values = dataclasses.asdict(settings)
    values.pop("seed")
    values["stop"] = list(settings.stop)
    values["constraint"] = settings.constraint.describe() if settings.constraint is not None else None
    for name in ("prompt_lookup", "draft_model"):  # off: not recorded (rows read as before speculation)
        if not values[name]:
            del values[name]
    return {name: value for name, value in values.items() if value is not None}


def _check_resumable(rows: Iterable[JobRow], finished: dict[str, dict], output_path,
                     model_record) -> tuple[list[str], int]:
    """Refuse to finish an output made by another model or from other rows; return the orphans' ids
    and how many input rows are done already."""
    openai_input = any(row.url is not None for row in rows)
    openai_output = any("custom_id" in row for row in finished.values())
    if rows and openai_input != openai_output:
        kinds = ("OpenAI batch responses", "lmcli rows")
        raise LmcliError(f"{output_path} holds {kinds[not openai_output]} but the input has "
                         f"{'OpenAI batch requests' if openai_input else 'lmcli rows'}; use a new --output")
    if model_record is not None:
        recorded = [output_row_key(row)[2].get("model") for row in finished.values()]
        others = [m for m in recorded if isinstance(m, dict) and m.get("fingerprint") != model_record["fingerprint"]]
        if others:
            raise LmcliError(
                f"{output_path}: {len(others)} of its {len(finished)} finished rows came from another model "
                f"({others[0].get('name')}, {others[0].get('fingerprint')}) than the one given now "
                f"({model_record['name']}, {model_record['fingerprint']}); resume with that model, "
                "or use a new --output or --overwrite"
            )
    done_keys = set()  # of the finished rows, those the input still has
    for row in rows:
        done = finished.get(id_key(row.id))
        if done is not None and output_row_key(done)[2].get("input_hash") != row.input_hash:
            raise LmcliError(
                f"row {id_key(row.id)} (input line {row.line}) is not the row that produced it in {output_path}:"
                " its prompt or settings changed; use a new --output, or --overwrite"
            )
        if done is not None:
            done_keys.add(id_key(row.id))
    return [key for key in finished if key not in done_keys], len(done_keys)


def _generate_rows(model, tokenizer, rows: Iterable[PreparedRow], batch_size: int, done, failed) -> Any:
    """Every row: continuously (generation/continuous.py) where use_continuous says so, returning its
    stats, else in planned batches (None)."""
    from lmcli.generation.continuous import ContinuousRun, use_continuous
    from lmcli.generation.speculative_setup import JobSpeculation

    speculation = JobSpeculation(model, tokenizer)  # speculating rows run apart, as they are reached
    model = speculation.model  # the others run as without speculation (continuously where they can)
    rows = speculation.apart(rows, done, lambda row, e: failed(row, _one_line(e)),
                             (ValueError, RuntimeError, LmcliError), batch_size)
    if not use_continuous(model):
        for batch in plan_batches(list(rows), batch_size):
            _generate_isolating_failures(model, tokenizer, batch, done, failed)
        return None
    from lmcli.generation.prefix_cache import prefix_cache_for

    def beams_apart(rows: Iterable[PreparedRow]) -> Iterator[PreparedRow]:
        """Beam rows (num_beams > 1) run each by itself as they are reached; the others run continuously."""
        for row in rows:
            if row.settings.beams > 1:
                _generate_isolating_failures(model, tokenizer, [row], done, failed)
            else:
                yield row

    rows = beams_apart(rows)

    def isolate(stranded: list[PreparedRow]) -> None:
        for row in stranded:
            _generate_isolating_failures(model, tokenizer, [row], done, failed)

    run = ContinuousRun(model, tokenizer, batch_size, on_done=done, alone=lambda row: isolate([row]),
                        prefix_cache=prefix_cache_for(model))
    run.run(rows, isolate, errors=(ValueError, RuntimeError, LmcliError))
    run.stats.prefix_evicted = run.prefix_cache.stats.evicted if run.prefix_cache is not None else 0
    if run.prefix_cache is not None:
        from lmcli.console import prompt_cache_state

        run.stats.from_disk = run.prefix_cache.stats.from_disk
        run.stats.from_memory = run.prefix_cache.stats.from_memory
        run.stats.prompt_cache = prompt_cache_state(run.prefix_cache)
    return run.stats


def _generate_isolating_failures(model, tokenizer, batch, done, failed) -> None:
    """Run a batch; if it fails, run its unfinished rows one by one so only the bad row fails."""
    finished_ids: set[str] = set()

    def on_done(result: RowResult) -> None:
        finished_ids.add(id_key(result.row.id))
        done(result)

    try:
        generate_batch(model, tokenizer, batch, on_done=on_done)
        return
    except (ValueError, RuntimeError, LmcliError) as e:
        if len(batch) == 1:
            failed(batch[0], _one_line(e))
            return
    for row in batch:
        if id_key(row.id) not in finished_ids:
            _generate_isolating_failures(model, tokenizer, [row], done, failed)


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, LmcliError) else f"{type(error).__name__}: {text}"
