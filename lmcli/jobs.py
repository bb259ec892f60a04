"""Generation for one prompt or many: settings, batching, and JSONL jobs that survive a kill.

A single `lmcli generate PROMPT` is a job of one row, so both paths share
`generate_batch`, and a row gives the same result alone or in a batch.

Job semantics (this is what the README documents):

- Input: `.jsonl` (one object per line: `prompt`, optional `id` and the
  settings in `lmcli.settings.ROW_SETTINGS`) or plain
  text (one prompt per line, `\\n` for a newline, `\\\\` for a backslash). Blank
  lines are skipped; a row without `id` gets its line number (1-based).
- Row fields override the command-line flags (and the model's own defaults)
  for that row. A row that sets `top_k` or `top_p` replaces both;
  `temperature: 0` makes the row greedy.
- Output order: **completion order**. Each row is written, tagged by its `id`,
  the moment it finishes, as one complete line that is flushed and fsync'd.
  (Input order would mean holding finished rows back until every earlier row
  is done, and a kill would lose them.) Sort by `id` afterwards if you need to.
- Rows are grouped by the settings a batch must share (all decoding settings
  but the seed and max_new_tokens, and --ignore-eos), then sorted by max_new_tokens and prompt
  length so little padding is wasted. Seeds, stop strings and max_new_tokens
  stay per row.
- Every sampled row records the `seed` it used (drawn when none was given), so
  `lmcli generate --seed S ...` reproduces it alone.
- Resume: `--resume` keeps every successful row already in the output, checks
  that its `input_hash` (prompt + settings) still matches the input, and runs
  the rest. A partial last line (hard kill mid-write) and rows that failed
  before are removed first (the file is rewritten atomically), so every id ends
  up in the output exactly once.
- A bad row (invalid JSON, no prompt, a bad setting, a prompt too long for the
  model) becomes an output row with an `error` field; the job goes on and exits
  non-zero at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lmcli.errors import LmcliError, TokenizerError, UsageError
from lmcli.settings import ROW_SETTINGS, GenerationSettings, RowError, input_hash

ROW_FIELDS = ("prompt", "id", *ROW_SETTINGS)


# ----------------------------------------------------------------------------- input


@dataclass
class JobRow:
    """One input row: either a prompt with its settings, or an error to report."""

    line: int
    id: int | str
    input_hash: str
    prompt: str | None = None
    settings: GenerationSettings | None = None
    error: str | None = None


def read_rows(path: Path, settings: GenerationSettings) -> list[JobRow]:
    """Read a job's input: JSONL when the name ends in .jsonl, else one prompt per line."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise LmcliError(f"cannot read input {path}: {e.strerror or e}") from None
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as some editors write
    parse = _parse_jsonl_line if str(path).endswith(".jsonl") else _parse_text_line
    rows = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError:
            rows.append(_bad_row(number, number, "not valid UTF-8", repr(raw), settings))
            continue
        rows.append(parse(number, text, settings))
    _refuse_duplicate_ids(rows)
    return rows


def _parse_text_line(number: int, text: str, settings: GenerationSettings) -> JobRow:
    prompt = unescape_line(text)
    return JobRow(number, number, input_hash(prompt, settings), prompt=prompt, settings=settings)


def unescape_line(text: str) -> str:
    """Plain-text input writes a newline inside a prompt as \\n and a backslash as \\\\."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "n\\":
            out.append("\n" if text[i + 1] == "n" else "\\")
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _parse_jsonl_line(number: int, text: str, settings: GenerationSettings) -> JobRow:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return _bad_row(number, number, f"not valid JSON ({e.msg} at column {e.colno})", text, settings)
    if not isinstance(obj, dict):
        return _bad_row(number, number, "a row must be a JSON object", text, settings)
    row_id = obj.get("id", number)
    if isinstance(row_id, bool) or not isinstance(row_id, (int, str)):
        return _bad_row(number, number, '"id" must be a string or an integer', text, settings)
    try:
        unknown = sorted(set(obj) - set(ROW_FIELDS))
        if unknown:
            raise RowError(f'unknown field "{unknown[0]}" (a row may have: {", ".join(ROW_FIELDS)})')
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise RowError('"prompt" is missing' if prompt is None else '"prompt" must be a string')
        row_settings = settings.for_row(obj)
    except RowError as e:
        return _bad_row(number, row_id, str(e), text, settings, prompt=obj.get("prompt"))
    return JobRow(number, row_id, input_hash(prompt, row_settings), prompt=prompt, settings=row_settings)


def _bad_row(number, row_id, message, text, settings, prompt=None) -> JobRow:
    prompt = prompt if isinstance(prompt, str) else None
    return JobRow(number, row_id, input_hash(text, settings), prompt=prompt, error=f"line {number}: {message}")


def _id_key(row_id: Any) -> str:
    # 7 and "7" are different ids; JSON text tells them apart.
    return json.dumps(row_id)


def _refuse_duplicate_ids(rows: list[JobRow]) -> None:
    seen: dict[str, int] = {}
    for row in rows:
        key = _id_key(row.id)
        if key in seen:
            raise UsageError(
                f"input lines {seen[key]} and {row.line} have the same id {key}; ids must be unique"
                " (a row without an id takes its line number)"
            )
        seen[key] = row.line


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
        self.failed += "error" in row


def read_finished(path: Path) -> dict[str, dict]:
    """Successful rows already in a job's output, by id; tidies the file for appending.

    A partial last line (a hard kill mid-write) and rows that failed are
    removed, by writing the rest to a temporary file and renaming it over the
    output, so that a crash during the tidy-up loses nothing.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LmcliError(f"cannot read {path}: {e.strerror or e}") from None
    lines = data.split(b"\n")
    partial = lines.pop()  # b"" when the file ends with a newline, as complete files do
    kept: list[bytes] = []
    finished: dict[str, dict] = {}
    for number, raw in enumerate(lines, start=1):
        try:
            row = json.loads(raw)
            key = _id_key(row["id"])
        except (ValueError, KeyError, TypeError):
            raise LmcliError(
                f"{path}, line {number}: not a row written by lmcli; fix or remove that line, then --resume"
            ) from None
        if "error" in row:
            continue  # failed rows are retried
        if key in finished:
            raise LmcliError(f"{path}, line {number}: id {key} appears twice; remove one, then --resume")
        finished[key] = row
        kept.append(raw)
    if partial or len(kept) != len(lines):
        temporary = path.with_name(path.name + ".resume-tmp")
        with open(temporary, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    return finished


# ----------------------------------------------------------------------------- generation


@dataclass
class PreparedRow:
    """A row ready for the model: tokenised, with the seed it will use."""

    id: int | str
    prompt: str
    settings: GenerationSettings
    prompt_ids: list[int]
    seed: int | None
    input_hash: str


def encode_prompt(tokenizer, prompt: str, settings: GenerationSettings) -> list[int]:
    if not settings.chat:
        return list(tokenizer.encode(prompt))
    messages = [{"role": "system", "content": settings.system}] if settings.system is not None else []
    messages.append({"role": "user", "content": prompt})
    return list(tokenizer.encode_chat(messages, add_generation_prompt=True))


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError("this checkpoint's tokenizer has no chat template, so --chat cannot be used")


def prepare_row(tokenizer, row_id, prompt: str, settings: GenerationSettings, hash_: str | None = None) -> PreparedRow:
    """Tokenise a prompt and fix its seed; raises RowError for an empty prompt."""
    ids = encode_prompt(tokenizer, prompt, settings)
    if not ids:
        raise RowError("the prompt is empty (it encodes to no tokens)")
    seed = settings.seed
    if seed is None and not settings.greedy:
        seed = secrets.randbelow(2**32)  # recorded in the output, so the row can be reproduced
    return PreparedRow(row_id, prompt, settings, ids, seed, hash_ or input_hash(prompt, settings))


@dataclass
class RowResult:
    """A row as it generates: its tokens, its text, and why it stopped."""

    row: PreparedRow
    text: Any  # streaming.RowText
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    finish_reason: str | None = None  # "eos", "length" or "stop"
    started: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def to_json(self) -> dict:
        out = {
            "id": self.row.id,
            "prompt": self.row.prompt,
            "completion": self.text.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.row.prompt_ids),
            "completion_tokens": len(self.tokens),
            "seed": self.row.seed,
            "settings": self.row.settings.used(),  # what decided the text: flags, row, model or lmcli defaults
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        out["input_hash"] = self.row.input_hash
        return out


def plan_batches(rows: list[PreparedRow], batch_size: int) -> Iterator[list[PreparedRow]]:
    """Batches of rows that can share one `generate` call, with little padding to waste."""
    groups: dict[tuple, list[PreparedRow]] = {}
    for row in rows:
        groups.setdefault(row.settings.batch_key(), []).append(row)
    for group in groups.values():
        # Similar max_new_tokens first (finished rows still ride along until the
        # batch ends), then similar prompt lengths (less left padding).
        group.sort(key=lambda r: (r.settings.max_new_tokens, len(r.prompt_ids)))
        for start in range(0, len(group), batch_size):
            yield group[start : start + batch_size]


def generate_batch(
    model,
    tokenizer,
    rows: list[PreparedRow],
    *,
    on_text: Callable[[RowResult, str], None] | None = None,
    on_done: Callable[[RowResult], None] | None = None,
) -> list[RowResult]:
    """Generate every row in one `model.generate` call (rows must share `batch_key()`).

    Rows end on their own: at EOS, at their own stop strings or at their own
    max_new_tokens. `on_text(result, piece)` gets each row's final text as it
    appears; `on_done(result)` is called the step a row finishes.
    """
    import torch

    from lmcli.streaming import RowText

    settings = rows[0].settings
    device = next(model.parameters()).device
    eos_ids = list(tokenizer.eos_token_ids or [])
    stop_at_eos = set() if settings.ignore_eos else set(eos_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    width = max(len(r.prompt_ids) for r in rows)
    # Left padding, masked out: generate() gives each row what it gives alone.
    input_ids = torch.tensor([[pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in rows], device=device)
    attention_mask = None
    if any(len(r.prompt_ids) < width for r in rows):
        attention_mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows], device=device
        )
    vocab_size = model.config.vocab_size if settings.logit_bias else None
    bias = settings.logit_bias_ids(tokenizer, vocab_size) if vocab_size is not None else {}
    # The whole chain (penalties, then temperature and truncation) is built here, in transformers'
    # order; generate()'s own temperature/top_k/top_p stay neutral.
    do_sample, processors = dataclasses.replace(settings.sampling, logit_bias=bias).policy(
        prompt_length=width, pad_counts=[width - len(r.prompt_ids) for r in rows],
        eos_token_ids=sorted(stop_at_eos), vocab_size=vocab_size,
    )
    top_logprobs = settings.logprobs

    started = time.perf_counter()
    results = [
        RowResult(r, RowText(tokenizer, r.settings.stop, r.prompt_ids), started=started, logprobs=[] if top_logprobs is not None else None)
        for r in rows
    ]

    def finish(result: RowResult, reason: str) -> None:
        piece = result.text.finish()
        if piece and on_text:
            on_text(result, piece)
        result.finish_reason = reason
        result.finished_at = time.perf_counter()
        if on_done:
            on_done(result)

    def on_token(event):
        now = time.perf_counter()
        token_ids = event.token_id.tolist()
        steps = _logprob_steps(tokenizer, event, top_logprobs) if top_logprobs is not None else None
        ended = [False] * len(results)
        for i, result in enumerate(results):
            if result.done:
                ended[i] = True
                continue
            token = token_ids[i]
            result.tokens.append(token)
            if result.first_token_at is None:
                result.first_token_at = now
            if steps is not None:
                result.logprobs.append(steps(i))
            if token in stop_at_eos:
                finish(result, "eos")
            else:
                piece = result.text.push(token)
                if piece and on_text:
                    on_text(result, piece)
                if result.text.stopped:
                    finish(result, "stop")
                elif len(result.tokens) >= result.row.settings.max_new_tokens:
                    finish(result, "length")
            ended[i] = result.done
        return torch.tensor(ended, device=event.token_id.device)

    model.generate(
        input_ids,
        max_new_tokens=max(r.settings.max_new_tokens for r in rows),
        do_sample=do_sample,
        attention_mask=attention_mask,
        eos_token_id=sorted(stop_at_eos) or None,
        pad_token_id=pad_id,
        seed=[r.seed for r in rows] if do_sample else None,
        logits_processors=processors,
        on_token=on_token,
        ignore_output=True,  # on_token has seen every token already
    )
    for result in results:
        if not result.done:  # generate stopped before the row's own limit (e.g. the context is full)
            finish(result, "length")
    return results


def _logprob_steps(tokenizer, event, k: int):
    """Per-row logprob entries for this step, from the raw logits (before temperature)."""
    import torch

    logprobs = torch.log_softmax(event.logits.float(), dim=-1)
    chosen = logprobs.gather(1, event.token_id.view(-1, 1).to(logprobs.device)).view(-1).tolist()
    token_ids = event.token_id.tolist()
    k = min(k, logprobs.shape[-1])
    top_values, top_ids = (logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "id": token_id, "logprob": round(logprob, 5)}

    def step(i: int) -> dict:
        out = entry(token_ids[i], chosen[i])
        out["top"] = [entry(t, v) for t, v in zip(top_ids[i], top_values[i])]
        return out

    return step


# ----------------------------------------------------------------------------- jobs


@dataclass
class JobReport:
    rows: int = 0  # rows in the input
    skipped: int = 0  # already done (--resume)
    written: int = 0
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0


class JobProgress:
    """A rich progress bar on stderr (rows, tokens/s, ETA); silent when stderr is not a terminal."""

    def __init__(self, total: int, completed: int = 0, enabled: bool = True):
        self._bar = None
        self._tokens = 0
        self._started = time.perf_counter()
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        if not console.is_terminal:
            return
        self._bar = Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rows"),
            TextColumn("{task.fields[speed]}"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._bar.add_task("rows", total=total, completed=completed, speed="")
        self._bar.start()

    def advance(self, tokens: int = 0) -> None:
        self._tokens += tokens
        if self._bar is not None:
            speed = self._tokens / max(time.perf_counter() - self._started, 1e-9)
            self._bar.update(self._task, advance=1, speed=f"{speed:.1f} tok/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def run_job(
    input_path: Path,
    output_path: Path | None,
    settings: GenerationSettings,
    *,
    load: Callable[[], tuple[Any, Any]],
    batch_size: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    stdout: IO[str] | None = None,
    show_progress: bool = True,
) -> JobReport:
    """Run a batch job; `load()` is only called when some row needs the model."""
    import sys

    started = time.perf_counter()
    rows = read_rows(input_path, settings)
    report = JobReport(rows=len(rows))

    finished: dict[str, dict] = {}
    if output_path is not None and output_path.exists():
        if resume:
            finished = read_finished(output_path)
        elif not overwrite:
            raise UsageError(f"{output_path} already exists; use --resume to finish it or --overwrite to replace it")
    for row in rows:
        done = finished.get(_id_key(row.id))
        if done is not None and done.get("input_hash") != row.input_hash:
            raise LmcliError(
                f"row {_id_key(row.id)} (input line {row.line}) is not the row that produced it in {output_path}:"
                " its prompt or settings changed; use a new --output, or --overwrite"
            )
    todo = [row for row in rows if _id_key(row.id) not in finished]
    report.skipped = len(rows) - len(todo)

    if output_path is None:
        stream, durable = (stdout or sys.stdout), False
    else:
        try:
            stream = open(output_path, "a" if resume else "w", encoding="utf-8", newline="\n")
        except OSError as e:
            raise LmcliError(f"cannot write {output_path}: {e.strerror or e}") from None
        durable = True
    writer = RowWriter(stream, durable)
    progress = JobProgress(0, enabled=False)
    try:
        for row in todo:
            if row.error is not None:
                _write_error(writer, row.id, row.prompt, row.error, row.input_hash)
        pending = [row for row in todo if row.error is None]
        if pending:
            model, tokenizer = load()
            # Started only now: the load shows its own spinner, and its time is no part of tokens/s.
            progress = JobProgress(len(todo), writer.rows, enabled=output_path is not None and show_progress)
            if any(row.settings.chat for row in pending):
                require_chat_template(tokenizer)
            prepared = []
            for row in pending:
                try:
                    prepared.append(prepare_row(tokenizer, row.id, row.prompt, row.settings, row.input_hash))
                except RowError as e:
                    _write_error(writer, row.id, row.prompt, f"line {row.line}: {e}", row.input_hash)
                    progress.advance()

            def done(result: RowResult) -> None:
                writer.write(result.to_json())
                report.tokens += len(result.tokens)
                progress.advance(len(result.tokens))

            def failed(row: PreparedRow, message: str) -> None:
                _write_error(writer, row.id, row.prompt, message, row.input_hash)
                progress.advance()

            for batch in plan_batches(prepared, batch_size or default_batch_size(model)):
                _generate_isolating_failures(model, tokenizer, batch, done, failed)
    finally:
        progress.close()
        if output_path is not None:
            stream.close()
    report.written = writer.rows
    report.failed = writer.failed
    report.seconds = time.perf_counter() - started
    return report


def default_batch_size(model) -> int:
    # A CPU is busy with a few rows already; a GPU needs many to be kept busy.
    return 32 if next(model.parameters()).device.type == "cuda" else 8


def _write_error(writer: RowWriter, row_id, prompt, message, hash_) -> None:
    row = {"id": row_id}
    if prompt is not None:
        row["prompt"] = prompt
    row.update(error=message, input_hash=hash_)
    writer.write(row)


def _generate_isolating_failures(model, tokenizer, batch, done, failed) -> None:
    """Run a batch; if it fails, run its unfinished rows one by one so only the bad row fails."""
    finished_ids: set[str] = set()

    def on_done(result: RowResult) -> None:
        finished_ids.add(_id_key(result.row.id))
        done(result)

    try:
        generate_batch(model, tokenizer, batch, on_done=on_done)
        return
    except (ValueError, RuntimeError, LmcliError) as e:
        if len(batch) == 1:
            failed(batch[0], _one_line(e))
            return
    for row in batch:
        if _id_key(row.id) not in finished_ids:
            _generate_isolating_failures(model, tokenizer, [row], done, failed)


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, LmcliError) else f"{type(error).__name__}: {text}"
