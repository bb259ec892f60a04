"""What `lmcli generate` runs once its flags are checked: one prompt (read here), or a batch job.

The command (cli.py) resolves the model and builds the settings; here the prompt is generated and
shown (console.py) or the job is run (jobs/runner.py, jobs/distributed.py) and summarised.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from lmcli.errors import LmcliError, UsageError


class Stopped(Exception):
    """The run ended early and has said why (Ctrl-C: 130; another rank reports the failure: 1);
    the command exits with `code` and nothing more."""

    def __init__(self, code: int = 130):
        super().__init__(code)
        self.code = code


def read_prompt(prompt: str | None) -> str:
    """The PROMPT argument, or stdin for "-" or no PROMPT with stdin piped."""
    if prompt is None and sys.stdin.isatty():
        raise UsageError("no prompt: give PROMPT, pipe text on stdin, or use --input FILE")
    if prompt is None or prompt == "-":
        prompt = utf8_text(sys.stdin.buffer.read(), "the prompt on stdin")
    else:
        prompt = utf8_text(os.fsencode(prompt), "the PROMPT argument")  # argv's undecodable bytes, restored
    if not prompt:
        raise UsageError("the prompt is empty")
    return prompt


def utf8_text(raw: bytes, what: str) -> str:
    """Bytes as UTF-8; invalid sequences become U+FFFD, with a warning naming the first bad byte's offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        sys.stderr.write(
            f"warning: {what} is not valid UTF-8 (first bad byte at offset {e.start}); "
            "invalid bytes were replaced with U+FFFD\n"
        )
        return raw.decode("utf-8", errors="replace")


def generate_one(prompt: str, settings, load, jsonl: bool, stats: bool, color_probs: bool = False) -> None:
    """One prompt: its completion streamed (text), or one JSON line (`jsonl`); then the summary."""
    from lmcli.console import (
        PlainOutput,
        ProbabilityShading,
        TerminalOutput,
        print_dim,
        probability_style,
        prompt_cache_line,
        row_summary,
    )
    from lmcli.generation.prefix_cache import single_run
    from lmcli.generation.rows import generate_batch, prepare_row, require_chat_template, truncation_warning
    from lmcli.settings.generation_settings import RowError

    model, tokenizer = load()
    if settings.chat:
        require_chat_template(tokenizer)
    terminal = sys.stdout.isatty()
    # --color-probs: only for text in a terminal; the colours come from each token's recorded logprob.
    shading = ProbabilityShading() if color_probs and terminal and not jsonl else None
    if shading is not None:
        settings = dataclasses.replace(settings, logprobs=0)
    try:
        row = prepare_row(tokenizer, 1, prompt, settings, context=model.config.max_position_embeddings)
    except RowError as e:
        raise UsageError(str(e)) from None
    if row.dropped_tokens:
        sys.stderr.write(truncation_warning(row, model.config.max_position_embeddings) + "\n")

    if jsonl:
        output, on_text = None, None
    else:
        output = TerminalOutput() if terminal else PlainOutput()
        # A chat reply is not a continuation of the prompt's text, so it starts on its own line.
        # An encoder-decoder's output (a translation, a summary) does not continue its input either.
        apart = settings.chat or getattr(model.config, "is_encoder_decoder", False)
        output.prompt(prompt + "\n" if apart else prompt)

        def on_text(result, piece: str) -> None:
            if shading is not None and isinstance(output, TerminalOutput):
                output.write(piece, probability_style(shading.probability(result)))
            else:
                output.write(piece)

    prefix = single_prefix_cache(model, row)
    try:
        [result] = generate_batch(model, tokenizer, [row], on_text=on_text,
                                  run=single_run(model, prefix, row.prompt_ids) if prefix is not None else None)
    except KeyboardInterrupt:
        if output is not None:
            output.end()
        sys.stderr.write("interrupted\n")
        raise Stopped() from None
    except ValueError as e:  # generate() refusing its input, e.g. a prompt longer than the context
        raise LmcliError(" ".join(str(e).split())) from None

    if output is None:
        sys.stdout.write(json.dumps(result.to_json(), ensure_ascii=False) + "\n")
        sys.stdout.flush()
    else:
        output.end()
    if result.error is not None:  # the constraint's engine gave up on the text: it is not valid
        raise LmcliError(result.error)
    if stats or (terminal and output is not None):
        print_dim(row_summary(result))
    if stats:
        print_dim(decode_steps(model))
        print_dim(prompt_cache_line(prefix))
    cut = incomplete_output(result, tokenizer, model.config)
    if cut is not None:
        raise cut


def single_prefix_cache(model, row):
    """The prefix cache (memory, and disk: generation/prefix_cache.py) for one prompt's run, where its
    reuse is exact (prefix_cache_for) and the plain loop runs it: a decoder-only model, not split over
    ranks, not speculating, no beams. None elsewhere."""
    from lmcli.generation.prefix_cache import prefix_cache_for

    able = (hasattr(model, "forward_slots") and not getattr(model.config, "is_encoder_decoder", False)
            and getattr(model, "tensor_parallel", None) is None and getattr(model, "speculator", None) is None
            and row.settings.beams == 1)
    return prefix_cache_for(model) if able else None


def incomplete_output(result, tokenizer, config) -> LmcliError | None:
    """The error for a constrained row that a limit ended before its constraint was complete (its text was
    written, but it is not valid), naming the limit; None when the row is complete or has no constraint."""
    from lmcli.generation.constraints import FLAGS, IncompleteOutput, satisfied, satisfied_by_text
    from lmcli.settings.generation_settings import DEFAULT, FLAG

    settings = result.row.settings
    constraint = settings.constraint
    if constraint is None or result.finish_reason == "eos":  # end-of-text comes only where the text is complete
        return None
    if result.finish_reason == "stop":
        if satisfied_by_text(tokenizer, constraint, config.vocab_size, result.text.text):
            return None
        limit, advice = "a --stop string", "drop the --stop string"
    else:
        if satisfied(tokenizer, constraint, config.vocab_size, result.tokens):
            return None
        if len(result.tokens) < settings.max_new_tokens:  # generate() stopped first: the context is full
            limit = f"the end of the model's context ({config.max_position_embeddings} tokens)"
            advice = "shorten the prompt"
        else:
            given = settings.source("max_new_tokens")
            origin = "lmcli's default with a constraint" if given == DEFAULT else f"from {given}"
            limit = (f"-n {settings.max_new_tokens}" if given == FLAG else
                     f"the token limit of {settings.max_new_tokens} ({origin}; set one with -n)")
            advice = "raise -n"
    what = {"json_schema": "JSON Schema", "json": "JSON object", "regex": "regular expression",
            "grammar": "grammar"}[constraint.kind]
    bound = ', or bound the schema (maxLength, maxItems, "additionalProperties": false)' if constraint.kind == "json_schema" else ""
    return IncompleteOutput(f"the output stopped at {limit} before its {what} ({FLAGS[constraint.kind]}) was complete, "
                            f"so it is not valid: {advice}{bound}")


def decode_steps(model) -> str:
    """Which step decoded the tokens (--stats): a compiled program, or eager PyTorch."""
    step = getattr(model, "_compiled_decode", None)  # BaseModel.compile_decode's choice (None: eager)
    if step is None:
        return "decode step: eager"
    runners = getattr(step, "runners", None)  # models/compiled_step.CachedDecode: a program per batch size
    if runners is None:
        return "decode step: torch.compile"
    ran = sorted(batch for batch in runners if batch not in step.eager)
    if not ran:
        return "decode step: eager (no compiled program for this model and batch in the cache; --compile builds one)"
    return f"decode step: compiled program (batch {', '.join(map(str, ran))})"


def run_job(input_path, output_path, settings, load, batch_size, resume, overwrite, stats, identity, tp=None,
            job: Callable[..., Any] | None = None) -> None:
    """A batch job (under torchrun: its share of one), then its summary; failed rows make it exit 1."""
    from lmcli.console import job_summary, print_dim, rows_text

    quiet = False
    if job is None:  # else another job function (lmcli.serve.remote_job: the rows run on a server, no torch)
        from lmcli import distributed
        from lmcli.jobs import distributed as ranks
        from lmcli.jobs import runner as jobs

        job = jobs.run_job
        if distributed.world_size() > 1:  # under torchrun: with --tp the ranks share the model, else the rows
            job = ranks.run_data_parallel_job if tp is None else ranks.run_tensor_parallel_job
            quiet = not distributed.is_output_rank()
        elif output_path is not None:
            ranks.adopt_parts(output_path, resume, overwrite)  # left by an interrupted data-parallel job
    try:
        report = job(
            input_path, output_path, settings, load=load, batch_size=batch_size, resume=resume, overwrite=overwrite,
            identity=identity,
        )
    except KeyboardInterrupt:
        where = f"; finished rows are saved in {output_path}, rerun with --resume to do the rest" if output_path else ""
        sys.stderr.write(f"interrupted{where}\n")
        raise Stopped() from None
    if report.orphans and not quiet:
        shown = ", ".join(report.orphans[:3]) + (", …" if len(report.orphans) > 3 else "")
        sys.stderr.write(f"warning: {output_path} keeps {rows_text(len(report.orphans))} whose id is not in "
                         f"{input_path} ({shown})\n")
    if (output_path is not None or stats) and not quiet:
        print_dim(job_summary(report, output_path))
    if report.failed:
        if quiet:
            raise Stopped(1)  # rank 0 says why
        raise LmcliError(f"{report.failed} of {rows_text(report.rows)} failed; see the \"error\" field of "
                         + ("that row" if report.failed == 1 else "those rows"))


def speculation_summary(shown: bool) -> None:
    """What speculation did (--stats, or a terminal), on stderr after the run's own summary."""
    from lmcli.generation import speculative_setup as speculation

    if shown and speculation.LOADED:
        from lmcli.console import print_dim

        print_dim(speculation.LOADED[-1].summary())
