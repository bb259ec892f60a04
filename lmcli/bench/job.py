"""`lmcli bench --sections job`: a batch job's throughput, planned batches against continuous batching.

The job is the file named by LMCLI_BENCH_JOB (or BenchSettings.job_file), else the target job below:
chat rows sharing a system message of about 100 tokens, greedy and sampled at different temperatures
and top-p, answers ending at the model's end-of-text token after different lengths (max_new_tokens 128).
Both schedulers run the same rows on one loaded model, each row written to memory as a job writes it.

Reported: rows/s, generated tokens/s, prefill tokens computed of those requested, the batch's
occupancy, and its efficiency: the job's generated tokens/s over the decode tokens/s of a full batch
of the same size running without stops, measured right after it. That full batch is the job's own
first `batch_size` rows, each with its own settings (so it samples as the job does), EOS ignored and
every row asking for the same number of tokens (the most any of them asks, at most FULL_BATCH_TOKENS),
run through the continuous scheduler: its decode rate is the tokens of its batched steps over their
time, the rows' prefill left out. Beside it, as earlier versions of this bench measured: the efficiency
against a greedy batch of the first prompts decoding GREEDY_TOKENS tokens, which pays neither the
rows' sampling nor their longer histories, so it reads lower.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

JOB_ENV = "LMCLI_BENCH_JOB"
SCHEDULERS = ("batches", "continuous")
FULL_BATCH_TOKENS = 128  # tokens each row of the full-batch reference makes, at most
GREEDY_TOKENS = 32  # decode steps of the greedy reference

SYSTEM = (
    "You are a careful assistant for a public library's help desk. Answer the visitor's question "
    "directly and truthfully, in plain English, without greetings, apologies or closing remarks. "
    "Keep to the length the question asks for: a word, a sentence or a short paragraph. If a fact is "
    "uncertain, say so in a few words rather than guessing. Never invent titles, authors or dates, and "
    "do not use lists, headings or bold text unless the visitor asks for them."
)
QUESTIONS = (
    "In one word: what colour is the sky on a clear day?",
    "What is the capital of France? Answer with the city only.",
    "In one sentence, what is a library card for?",
    "Name one planet of the solar system.",
    "Explain in two sentences why leaves change colour in autumn.",
    "What is 7 times 8? Answer with the number only.",
    "In a short paragraph, describe how to look for a book in a library catalogue.",
    "Is water wet? Answer yes or no.",
    "Give one sentence about the history of printing.",
    "What does a librarian do? Answer in two sentences.",
    "In one word: the opposite of hot.",
    "Describe in a short paragraph why reading to children matters.",
    "Which animal is known as the king of the jungle?",
    "In one sentence, what is photosynthesis?",
    "Write three sentences about the ocean.",
    "What language is spoken in Brazil? One word.",
)
# (temperature, top_p): greedy rows and sampled ones with different settings, in one job
ROW_SETTINGS = ((0, None), (0.7, 0.9), (1.0, None), (0.5, 0.8), (0, None), (0.9, 0.95))


def target_job_rows(count: int = 48) -> list[dict]:
    """The target job's rows; every row carries its settings, so it runs with --chat alone."""
    rows = []
    for i in range(count):
        temperature, top_p = ROW_SETTINGS[i % len(ROW_SETTINGS)]
        row: dict[str, Any] = {"id": i + 1, "prompt": QUESTIONS[i % len(QUESTIONS)], "system": SYSTEM,
                               "max_new_tokens": 128, "temperature": temperature}
        if temperature:
            row["seed"] = 1000 + i
            if top_p is not None:
                row["top_p"] = top_p
        rows.append(row)
    return rows


def measure(settings: Any, resolved: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    import lmcli
    from lmcli.jobs.runner import default_batch_size

    progress("job: loading the model")
    model, tokenizer = lmcli.load(resolved)
    batch_size = settings.batch_sizes[-1] if settings.batch_sizes else default_batch_size(model)
    job_file = settings.job_file or os.environ.get(JOB_ENV)
    with tempfile.TemporaryDirectory() as scratch:
        if job_file is None:
            path = Path(scratch) / "job.jsonl"
            rows = target_job_rows(settings.job_rows)
            path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        else:
            path = Path(job_file)
        runs = {}
        for scheduler in SCHEDULERS:
            progress(f"job: {scheduler}, batch size {batch_size}")
            runs[scheduler] = _run(model, tokenizer, path, batch_size, scheduler)
            progress(f"job: its first {batch_size} rows without stops, then a greedy batch")
            runs[scheduler]["reference"] = _full_batch(model, tokenizer, path, batch_size)
            runs[scheduler]["greedy"] = _greedy_batch_decode(model, tokenizer, path, batch_size)
    for figures in runs.values():
        figures["efficiency"] = round(figures["tokens_per_s"] / figures["reference"]["tokens_per_s"], 3)
        figures["greedy_efficiency"] = round(figures["tokens_per_s"] / figures["greedy"]["tokens_per_s"], 3)
    identical = runs["batches"].pop("completions") == runs["continuous"].pop("completions")
    return {"job": job_file or f"target job ({settings.job_rows} rows)", "batch_size": batch_size,
            "threads": _threads(), "runs": runs, "same_rows": identical}


def _run(model: Any, tokenizer: Any, path: Path, batch_size: int, scheduler: str) -> dict[str, Any]:
    from lmcli.generation.continuous import SCHEDULER_ENV
    from lmcli.jobs.runner import JobOutput, run_job
    from lmcli.settings.generation_settings import GenerationSettings

    out = io.StringIO()
    before = os.environ.get(SCHEDULER_ENV)
    os.environ[SCHEDULER_ENV] = scheduler
    try:
        started = time.perf_counter()
        report = run_job(path, JobOutput(out), GenerationSettings(chat=True), load=lambda: (model, tokenizer),
                         batch_size=batch_size)
        seconds = time.perf_counter() - started
    finally:
        if before is None:
            os.environ.pop(SCHEDULER_ENV)
        else:
            os.environ[SCHEDULER_ENV] = before
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    figures: dict[str, Any] = {
        "rows": len(rows), "seconds": round(seconds, 2), "rows_per_s": round(len(rows) / seconds, 3),
        "tokens": report.tokens, "tokens_per_s": round(report.tokens / seconds, 2),
        "finished_at_eos": sum(row.get("finish_reason") == "eos" for row in rows),
        "completions": {str(row["id"]): row.get("completion") for row in rows},
    }
    stats = report.continuous
    if stats is not None:
        figures.update(occupancy=round(stats.occupancy, 3), prefill_requested=stats.prefill_requested,
                       prefill_computed=stats.prefill_computed, steps=stats.steps)
    return figures


def _first_rows(path: Path, batch_size: int) -> list[Any]:
    """The job's first `batch_size` good rows (job_input.JobRow, as a job reads them), repeated if fewer."""
    import itertools

    from lmcli.jobs.input import JobRows
    from lmcli.settings.generation_settings import GenerationSettings

    good = (row for row in JobRows(path, GenerationSettings(chat=True))
            if row.prompt is not None and row.settings is not None)
    first = list(itertools.islice(good, batch_size))
    return list(itertools.islice(itertools.cycle(first), batch_size))


def _full_batch(model: Any, tokenizer: Any, path: Path, batch_size: int) -> dict[str, Any]:
    """Decode tokens/s of the job's first `batch_size` rows, their own settings, each making the same
    number of tokens with EOS ignored, in one continuous batch that stays full."""
    import dataclasses

    from lmcli.generation.continuous import ContinuousRun
    from lmcli.generation.rows import prepare_row

    first = _first_rows(path, batch_size)
    tokens = min(FULL_BATCH_TOKENS, max(row.settings.max_new_tokens for row in first))
    rows = [prepare_row(tokenizer, f"full-batch-{i}", row.prompt,
                        dataclasses.replace(row.settings, max_new_tokens=tokens, ignore_eos=True))
            for i, row in enumerate(first)]
    run = ContinuousRun(model, tokenizer, batch_size, on_done=lambda result: None, alone=_not_alone)
    run.run(rows, isolate=_not_alone)
    stats = run.stats
    return {"batch_size": batch_size, "row_tokens": tokens, "occupancy": round(stats.occupancy, 3),
            "tokens_per_s": round(stats.busy / stats.decode_seconds, 2)}


def _not_alone(rows: Any) -> None:
    raise RuntimeError("bench --sections job: a row of the full-batch reference could not run in the batch")


def _greedy_batch_decode(model: Any, tokenizer: Any, path: Path, batch_size: int) -> dict[str, Any]:
    """Decode tokens/s of `batch_size` of the job's prompts decoding GREEDY_TOKENS tokens greedily, no stops."""
    import torch

    from lmcli.generation.rows import prepare_row

    prompts = [prepare_row(tokenizer, row.id, row.prompt, row.settings).prompt_ids
               for row in _first_rows(path, batch_size)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    times: list[float] = []
    model.generate(ids, attention_mask=mask, max_new_tokens=GREEDY_TOKENS, do_sample=False,
                   on_token=lambda event: times.append(time.perf_counter()), ignore_output=True)
    seconds = times[-1] - times[0]  # the decode steps after the first token (the prefill's)
    return {"batch_size": batch_size, "tokens_per_s": round(batch_size * (len(times) - 1) / seconds, 2)}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"Batch job: {result['job']}, batch size {result['batch_size']}, "
                        f"{result['threads']} threads")
    for column in ("scheduler", "rows/s", "generated tok/s", "full-batch decode tok/s", "efficiency",
                   "greedy batch tok/s", "against greedy", "occupancy", "prefill computed / requested"):
        table.add_column(column, justify="left" if column == "scheduler" else "right")
    for name, figures in result["runs"].items():
        prefill = (f"{figures['prefill_computed']} / {figures['prefill_requested']}"
                   if "prefill_requested" in figures else "all")
        table.add_row(name, f"{figures['rows_per_s']:.3f}", f"{figures['tokens_per_s']:.1f}",
                      f"{figures['reference']['tokens_per_s']:.1f}", f"{figures['efficiency']:.2f}",
                      f"{figures['greedy']['tokens_per_s']:.1f}", f"{figures['greedy_efficiency']:.2f}",
                      f"{figures['occupancy']:.0%}" if "occupancy" in figures else "-", prefill)
    console.print(table)
    console.print("same completions from both schedulers: " + ("yes" if result["same_rows"] else "NO"))
