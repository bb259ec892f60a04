"""The fast path of `lmcli generate --server URL PROMPT`: straight to lmcli.serve.client, without Typer.

Building the Typer app (typer, pydantic's adapters, lmcli.cli and what it imports) costs more than the
whole request to a warm server. This path reads only a command line it fully understands: `generate`
with the decoding flags, --chat, --system, --stats, --server (or LMCLI_SERVER) and one PROMPT. Anything
else (--help, --input, another flag, a value that is not a number, --debug, `--`) returns None and the
full command line runs as before, so every usage error is still the Typer command's own. The values go
through the same checks as the full path (client.request_body, runs.read_prompt). FLAGS is checked
against the `generate` command's own declarations by a test (tests/test_serve.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

# flag -> (the `generate` parameter it sets, its value type; None for a switch, list for a repeatable TEXT)
FLAGS: dict[str, tuple[str, Callable[[str], Any] | type | None]] = {
    "--max-new-tokens": ("max_new_tokens", int), "--max-tokens": ("max_new_tokens", int),
    "-n": ("max_new_tokens", int), "--temperature": ("temperature", float), "--top-k": ("top_k", int),
    "--top-p": ("top_p", float), "--min-p": ("min_p", float), "--typical-p": ("typical_p", float),
    "--repetition-penalty": ("repetition_penalty", float), "--presence-penalty": ("presence_penalty", float),
    "--frequency-penalty": ("frequency_penalty", float), "--no-repeat-ngram-size": ("no_repeat_ngram_size", int),
    "--logit-bias": ("logit_bias", list), "--greedy": ("greedy", None), "--seed": ("seed", int),
    "--stop": ("stop", list), "--min-new-tokens": ("min_new_tokens", int), "--ignore-eos": ("ignore_eos", None),
    "--json-schema": ("json_schema", str), "--json": ("json_object", None), "--regex": ("regex", str),
    "--grammar": ("grammar", str),
    # generate's own, on this path
    "--chat": ("chat", None), "--system": ("system", str), "--stats": ("stats", None), "--server": ("server", str),
}
DECODING = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "no_repeat_ngram_size", "logit_bias", "greedy", "seed", "stop",
            "min_new_tokens", "ignore_eos", "json_schema", "json_object", "regex", "grammar")
SWITCH_DEFAULTS = {"greedy": False, "ignore_eos": False, "json_object": False, "chat": False, "stats": False}


def parse(args: Sequence[str]) -> dict[str, Any] | None:
    """generate's parameters from `args` (after `generate`), as the Typer command receives them; None when
    the command line is not one this path takes."""
    values: dict[str, Any] = {name: None for name, _ in FLAGS.values()} | dict(SWITCH_DEFAULTS)
    values["prompt"] = None
    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        i += 1
        if arg.startswith("-") and arg != "-":
            flag, has_value, given = arg.partition("=") if arg.startswith("--") else (arg, "", "")
            if flag not in FLAGS:
                return None
            name, kind = FLAGS[flag]
            if kind is None:
                if has_value:
                    return None
                values[name] = True
                continue
            if not has_value:
                if i >= len(items):
                    return None
                given = items[i]
                i += 1
            try:
                value = given if kind in (str, list) else kind(given)
            except ValueError:
                return None  # the full path says what is wrong with it
            if kind is list:
                values[name] = [*(values[name] or []), value]
            else:
                values[name] = value
        elif values["prompt"] is None:
            values["prompt"] = arg
        else:
            return None
    return values


def run(argv: Sequence[str]) -> int | None:
    """The exit code of `lmcli ARGV` on the fast path, or None when it is not one for this path."""
    if len(argv) < 1 or argv[0] != "generate":
        return None
    values = parse(argv[1:])
    if values is None:
        return None
    server = values["server"] or os.environ.get("LMCLI_SERVER")
    if not server:
        return None
    from lmcli.errors import LmcliError

    try:
        from lmcli.jobs import runs
        from lmcli.serve import client

        decoding = {name: values[name] for name in DECODING}
        client.generate(server, runs.read_prompt(values["prompt"]), decoding, chat=values["chat"],
                        system=values["system"], stats=values["stats"])
        sys.stdout.flush()
    except LmcliError as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        return e.exit_code
    except BrokenPipeError:  # `| head`: quietly, as the full path does
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except KeyboardInterrupt:  # as the full path (click's Abort)
        sys.stderr.write("error: aborted\n")
        return 1
    return 0
