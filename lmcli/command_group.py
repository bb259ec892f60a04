"""How every lmcli command fails: one line on stderr (exit 2 for usage, 1 otherwise), quietly on a
closed stdout, and with the traceback only under --debug. The Typer app in cli.py runs through it."""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperGroup

from lmcli.errors import LmcliError

_debug = False  # set by --debug (anywhere on the command line); shows tracebacks
_collection_deferred = False

# Commands whose start-up ends with a model loaded (cli._load), where collection resumes.
LOADING_COMMANDS = ("generate", "chat", "info")


def defer_collection(args: Sequence[str]) -> None:
    """Before a model loads, turn Python's cyclic garbage collector off (`args`: the command line).

    A start-up makes about a million objects that live as long as the process (torch's, typer's,
    the model's modules); the collector walks all of them at each full collection, three times
    before the first token (0.2-0.3 s of CPU on the default model). Refcounting still frees
    everything else; `resume_collection` turns the collector back on once the model is loaded.
    Only the console script does this, and only for a command that loads a model."""
    global _collection_deferred
    if args[1:2] and args[1] in LOADING_COMMANDS and gc.isenabled():
        gc.disable()
        _collection_deferred = True


def resume_collection() -> None:
    """The model is loaded: what exists now is kept out of future collections (`gc.freeze`: it
    lives until exit anyway) and the collector runs again, for what the run makes from here."""
    global _collection_deferred
    if _collection_deferred:
        gc.freeze()
        gc.enable()
        _collection_deferred = False


class LmcliGroup(TyperGroup):
    """Runs the commands with lmcli's error handling, for the console script and CliRunner alike."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        global _debug
        args = list(sys.argv[1:] if args is None else args)
        # --debug is accepted anywhere before a `--` so `lmcli generate ... --debug` works too.
        end = args.index("--") if "--" in args else len(args)
        _debug = "--debug" in args[:end]
        if "--fast-kernels" in args[:end]:  # like --debug, anywhere; read by kernels/plan.py
            os.environ["LMCLI_FAST_KERNELS"] = "1"
        if "--offline" in args[:end]:  # like --debug, anywhere; read by lmcli/resolve/hub.py (and huggingface_hub)
            os.environ["HF_HUB_OFFLINE"] = "1"
        if "--verbose" in args[:end]:  # like --debug, anywhere; read by io/prompt_blocks.py
            os.environ["LMCLI_VERBOSE"] = "1"
        args = [a for a in args[:end] if a not in ("--debug", "--fast-kernels", "--offline", "--verbose")] + args[end:]
        try:
            code = super().main(args, prog_name or "lmcli", complete_var, standalone_mode=False,
                               windows_expand_args=windows_expand_args, **extra)
            sys.stdout.flush()  # here, where a failure is reported, rather than at interpreter exit
        except typer.Abort:
            code = _fail("aborted", 1)
        except LmcliError as e:
            code = _fail(str(e), e.exit_code)
        except _StdoutClosed:
            code = _stdout_closed()
        except OSError as e:  # a stream that cannot be written (a full disk, /dev/full); files name themselves
            _discard_stdout()
            where = e.filename if e.filename is not None else "the output"
            code = _fail(f"cannot write {where}: {e.strerror or e}", 1)
        except Exception as e:
            code = _click_exception_code(e)
            if code is None:  # a bug in lmcli: say so in one line; --debug shows where
                code = _fail(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", 1)
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # raised past click's own EPIPE handling, which would exit 1
            raise _StdoutClosed() from None


class _StdoutClosed(Exception):
    """stdout's reader went away (EPIPE)."""


def _click_exception_code(e: Exception) -> int | None:
    """The exit code for one of click's exceptions (a usage error, ...), after saying what it is; None
    for anything else. Recognised by click's exception interface (`exit_code`, `format_message`), since
    Typer raises them from its private copy of click and older Typers from click itself."""
    exit_code, format_message = getattr(e, "exit_code", None), getattr(e, "format_message", None)
    if not isinstance(exit_code, int) or format_message is None:
        return None
    if type(e).__name__ == "NoArgsIsHelpError":  # `lmcli` alone: the help, which is no error
        typer.echo(format_message())
        return 0
    message = " ".join(format_message().split())
    context = getattr(e, "ctx", None)  # usage errors know the command they are about
    if context is not None:
        message += f" (see '{context.command_path} --help')"
    return _fail(message, exit_code)


def _stdout_closed() -> int:
    """The reader of stdout went away (`lmcli ... | head`): stop quietly with exit 0, as `| head` expects.

    Single prompts and batch jobs alike; a job writing to --output is unaffected (stdout carries nothing).
    """
    _discard_stdout()
    return 0


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush has nowhere to fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (CliRunner): nothing to flush at exit
        pass


def _fail(message: str, code: int) -> int:
    if _debug and sys.exc_info()[0] is not None:
        traceback.print_exc()
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    return code
