"""`lmcli generate --input FILE --server URL`: a batch job whose rows run on a running `lmcli serve`.

The input is read, checked, resumed and written as a local job's (lmcli.jobs: JobRows, FileOutput,
_check_resumable, the same output rows); only the generation is the server's. Each row is one request
(its settings as request fields, its seed drawn here when it samples without one, so the output records
it), at most `concurrency` in flight. The server's /v1/models says which model answers and its sampling
defaults, so the rows' settings, input hashes and model record are a local job's. Rows that need a
setting no request field carries (min_p, a regex, ...) or that the server refuses (a prompt past its
context) become error rows, as bad rows do locally. Nothing here imports torch.
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError
from lmcli.serve import client
from lmcli.settings.generation_settings import GenerationSettings

# Row settings and the request fields that carry them (the server takes these: openai_batch.parse_body).
FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
          "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "stop": "stop",
          "logit_bias": "logit_bias"}
UNCARRIED = ("min_p", "typical_p", "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "ignore_eos")
RETRY_SECONDS = 1.0  # after a 429 (the server's queue is full)


def server_model(url: str, api_key: str | None) -> dict[str, Any]:
    """The server's "lmcli" member of /v1/models: {"model": {"name", "fingerprint"}, "defaults", "context"}."""
    answer = client.request_json(url, "GET", "/v1/models", None, api_key)
    try:
        own = answer["data"][0]["lmcli"]
        assert isinstance(own["model"]["fingerprint"], str) and isinstance(own["defaults"]["values"], dict)
        return dict(own)
    except (KeyError, IndexError, TypeError, AssertionError):
        raise LmcliError(f"the server at {url} is not an lmcli serve that runs jobs (its /v1/models has no "
                         "\"lmcli\" member)") from None


def model_defaults(own: dict[str, Any]) -> Any:
    from lmcli.settings.model_defaults import ModelDefaults

    return ModelDefaults(values=dict(own["defaults"]["values"]), source=str(own["defaults"].get("source", "")))


def request_for(row: Any, base: GenerationSettings) -> tuple[str, dict[str, Any], int | None]:
    """(endpoint, body, seed) for a job row: every setting that differs from the server's own (base: lmcli's
    and the model's defaults, as the server starts from them); LmcliError for one no field carries."""
    settings: GenerationSettings = row.settings
    for name in UNCARRIED:
        if getattr(settings, name) not in (None, False, getattr(base, name)):
            raise LmcliError(f"{name} is not supported with --server (no request field carries it)")
    if settings.beams > 1:  # never dropped: the server would decode the row without them
        raise LmcliError("num_beams is not supported with --server (lmcli serve does not search with beams)")
    body: dict[str, Any] = {}
    for name, field in FIELDS.items():
        value = getattr(settings, name)
        if value is not None and value != getattr(base, name):
            body[field] = list(value) if name == "stop" else dict(value) if name == "logit_bias" else value
    if settings.temperature == 0:  # greedy: the sampling filters are off, as the server's rule for a greedy row
        body = {key: value for key, value in body.items() if key not in ("top_k", "top_p")}
    seed = settings.seed
    if seed is None and not settings.greedy:
        seed = secrets.randbelow(2**32)  # as prepare_row draws it: recorded in the output row
    if seed is not None:
        body["seed"] = seed
    if settings.constraint is not None:
        described = settings.constraint.describe()
        if "json_schema" in described:
            schema = described["json_schema"]
            schema = json.loads(schema) if isinstance(schema, str) else schema
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
        elif "json" in described:
            body["response_format"] = {"type": "json_object"}
        else:
            raise LmcliError(f"{next(iter(described))} is not supported with --server (no request field carries it)")
    chat = settings.chat or isinstance(row.prompt, list)
    if isinstance(row.prompt, list):
        body["messages"] = row.prompt
    elif chat:
        system = [{"role": "system", "content": settings.system}] if settings.system is not None else []
        body["messages"] = [*system, {"role": "user", "content": row.prompt}]
    else:
        body["prompt"] = row.prompt
    if settings.logprobs is not None:
        if chat:
            body["logprobs"], body["top_logprobs"] = True, settings.logprobs
        else:
            body["logprobs"] = settings.logprobs
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, seed


def remote_job(url: str, api_key: str | None, concurrency: int, model_record: dict) -> Callable[..., Any]:
    """A job function with lmcli.jobs.run_job's signature whose rows run on the server at `url`."""
    from lmcli.console import JobProgress
    from lmcli.io.output_lock import holding_output_lock
    from lmcli.jobs import openai_batch
    from lmcli.jobs import runner as jobs
    from lmcli.jobs.input import JobRows, id_key

    @holding_output_lock
    def run_job(input_path: Path, output: Path | None, settings: GenerationSettings, *, load: Any = None,
                batch_size: int | None = None, resume: bool = False, overwrite: bool = False,
                identity: Any = None) -> Any:
        out = jobs.JobOutput() if output is None else jobs.FileOutput(output, resume, overwrite)
        started = time.perf_counter()
        rows = JobRows(input_path, settings)
        report = jobs.JobReport(rows=len(rows))
        finished = out.finished()
        if finished:
            report.orphans, report.skipped = jobs._check_resumable(rows, finished, out.path, model_record)
        todo = rows.where(lambda row: id_key(row.id) not in finished) if finished else rows
        base = GenerationSettings().with_model_defaults(settings.model_defaults)  # the server's own start
        model_name = model_record["name"]

        def record(row: Any, seed: int | None, made: bool) -> dict:
            kept: dict[str, Any] = {"input_hash": row.input_hash, "model": model_record}
            if made:
                kept["settings"], kept["seed"] = jobs.settings_record(row.settings), seed
            return kept

        def error_row(row: Any, message: str) -> dict:
            if row.url is not None:
                return openai_batch.error_row(row.id if isinstance(row.id, str) else None, message,
                                              record(row, None, False))
            kept: dict[str, Any] = {"id": row.id}
            if isinstance(row.prompt, str):
                kept["prompt"] = row.prompt
            return {**kept, "error": message, "model": model_record, "input_hash": row.input_hash}

        def result_row(row: Any, seed: int | None, answer: dict) -> dict:
            [choice], [own] = answer["choices"], answer["lmcli"]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            result = _Result(row, seed, text, answer["usage"], own)
            if row.url is not None:
                return openai_batch.response_row(str(row.id), row.url, result, model_name, record(row, seed, True))
            made = result.to_json()
            row_hash = made.pop("input_hash")
            made["model"] = model_record
            made["settings"] = jobs.settings_record(row.settings)
            made["input_hash"] = row_hash
            return made

        def one(row: Any) -> dict:
            try:
                endpoint, body, seed = request_for(row, base)
            except LmcliError as e:
                return error_row(row, f"line {row.line}: {e}")
            while True:
                try:
                    return result_row(row, seed, client.request_json(url, "POST", endpoint, body, api_key))
                except client.ServerAnswered as e:
                    if e.status == 429:
                        time.sleep(RETRY_SECONDS)
                        continue
                    return error_row(row, f"line {row.line}: {e.detail}" if e.status == 400 else str(e))

        writer = out.open()
        progress = JobProgress(len(todo) if out.progress else 0, writer.rows, enabled=out.progress)
        pool = concurrent.futures.ThreadPoolExecutor(concurrency)
        try:
            pending: set[concurrent.futures.Future] = set()

            def drain(until: int) -> None:
                nonlocal pending
                while len(pending) > until:
                    done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                    for future in done:
                        made = future.result()  # the server gone: the job stops, its rows so far kept
                        writer.write(made)
                        tokens = (made.get("completion_tokens") or
                                  ((made.get("response") or {}).get("body") or {}).get("usage", {})
                                  .get("completion_tokens", 0))
                        report.tokens += tokens
                        progress.advance(tokens)

            for row in todo:
                if row.error is not None or row.prompt is None or row.settings is None:
                    writer.write(error_row(row, row.error or "no prompt"))
                    progress.advance()
                    continue
                pending.add(pool.submit(one, row))
                drain(2 * concurrency - 1)  # the input is read as the rows go, never all at once
            drain(0)
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            progress.close()
            out.close()
        report.written, report.failed = writer.rows, writer.failed
        report.seconds = time.perf_counter() - started
        return report

    return run_job


class _Text:
    def __init__(self, text: str):
        self.text = text


class _Row:
    """What lmcli.generation.rows.PreparedRow says of a row, for RowResult.to_json and openai_batch."""

    def __init__(self, row: Any, seed: int | None, prompt_tokens: int):
        self.id, self.prompt, self.settings, self.seed = row.id, row.prompt, row.settings, seed
        self.input_hash = row.input_hash
        self.prompt_ids = [0] * prompt_tokens  # only its length is read


class _Result:
    """A server's answer as the RowResult a local job would have made of the row."""

    def __init__(self, row: Any, seed: int | None, text: str, usage: dict, own: dict):
        from lmcli.generation.rows import RowResult

        self.row = _Row(row, seed, int(usage["prompt_tokens"]))
        self.text = _Text(text)
        self.tokens = [0] * int(usage["completion_tokens"])
        self.logprobs = own.get("logprobs")
        self.finish_reason = own["finish_reason"]
        self.error = None
        self.speculation = None
        self.to_json = lambda: RowResult.to_json(self)  # type: ignore[arg-type]
