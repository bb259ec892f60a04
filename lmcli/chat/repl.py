"""`lmcli chat`: the REPL around a ChatSession (chat/session.py): reading messages and commands
from a terminal or a pipe, showing replies, /save and --resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# NOT_SETTABLE and ChatError are re-exported: callers (and tests) find the chat's names here.
from lmcli.chat.session import NOT_SETTABLE as NOT_SETTABLE
from lmcli.chat.session import ChatError, ChatSession, Turn, load_transcript, resumed_settings, settable_names
from lmcli.console import PROBABILITY_COLOURS, ProbabilityShading, probability_style, row_summary, visible_controls
from lmcli.errors import LmcliError
from lmcli.generation.rows import RowResult
from lmcli.settings.generation_settings import GenerationSettings

if TYPE_CHECKING:
    from lmcli.resolve.model_ref import ResolvedModel


# ----------------------------------------------------------------------------- input


FENCE = '"""'


def read_terminal_message(prompt: str = ">>> ", more: str = "... ") -> str:
    """One message from a person at a terminal (readline editing and history).

    A line opening with \"\"\" starts a multi-line message that ends at a line closing with \"\"\".
    Pasted lines arrive as one message through readline's bracketed paste (on by default since
    readline 8.1): the paste is inserted whole and sent with Enter. Lines typed ahead while a reply
    streams stay separate messages. Raises EOFError on Ctrl-D and KeyboardInterrupt on Ctrl-C."""
    first = input(prompt)
    if first.lstrip().startswith(FENCE):
        return _read_fenced(first.lstrip()[len(FENCE):], lambda: input(more))
    return first


def _read_fenced(rest: str, next_line: Callable[[], str]) -> str:
    if rest.rstrip().endswith(FENCE):  # """one line"""
        return rest.rstrip()[: -len(FENCE)]
    lines = [rest] if rest else []
    while True:
        line = next_line()
        if line.rstrip().endswith(FENCE):
            lines.append(line.rstrip()[: -len(FENCE)])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def piped_messages(stream) -> Iterator[str]:
    """Messages from a pipe: each line is one (blank lines skipped); \"\"\" fences work here too."""
    lines = iter(stream)
    for raw in lines:
        line = raw.rstrip("\n").removesuffix("\r")
        if line.lstrip().startswith(FENCE):
            def next_line() -> str:
                try:
                    return next(lines).rstrip("\n").removesuffix("\r")
                except StopIteration:
                    raise ChatError('a """ block was not closed before the end of the input') from None

            yield _read_fenced(line.lstrip()[len(FENCE):], next_line)
        elif line.strip():
            yield line


# ----------------------------------------------------------------------------- the REPL

HELP = """\
/help               this list
/system TEXT        set the system message (/system alone shows it)
/clear              forget the conversation, keep the system message
/set NAME VALUE     change a sampling setting, e.g. /set temperature 0.7 (/set alone lists them);
                    /set num_beams 4 searches with beams: a reply then shows when its search ends
/save FILE          write the transcript (messages, settings, model) as JSON
/undo               drop the last exchange
/exit               quit (Ctrl-D does too)
\"\"\"                 start and end a multi-line message
Ctrl-C stops a reply; //text sends a message that starts with /."""


@dataclass
class ChatOptions:
    markdown: bool = False
    color_probs: bool = False
    stats: bool = False
    context: int | None = None
    resume: Path | None = None
    explicit: frozenset[str] = frozenset()  # settings given on the command line (they win over --resume's)


class ChatRepl:
    """Reads messages and commands, prints replies. Interactive on a terminal, line by line on a pipe."""

    def __init__(self, session: ChatSession, options: ChatOptions, model_info: dict, interactive: bool):
        from rich.console import Console

        self.session = session
        self.options = options
        self.model_info = model_info
        self.interactive = interactive
        self.out = Console(highlight=False)
        self.err = Console(stderr=True, highlight=False)
        self.terminal = self.out.is_terminal

    def note(self, text: str, style: str = "dim") -> None:
        self.err.print(text, style=style, markup=False, emoji=False, soft_wrap=True)

    def run(self, messages: Iterator[str] | None = None) -> None:
        if self.interactive:
            self._run_interactive()
        else:
            for message in messages or ():
                if not self.handle(message):
                    break

    def _run_interactive(self) -> None:
        import readline  # importing it gives input() line editing and history

        if "libedit" not in (readline.__doc__ or ""):
            # A paste arrives whole, newlines and all, and is sent with Enter. (Python turns this off
            # for its own REPL, which cannot take several lines at once; a chat message can.)
            readline.parse_and_bind("set enable-bracketed-paste on")

        while True:
            try:
                message = read_terminal_message()
            except EOFError:
                self.out.print()
                return
            except KeyboardInterrupt:
                self.out.print()
                continue  # Ctrl-C at the prompt discards the line, as in a shell
            if not message.strip():
                continue
            try:
                if not self.handle(message):
                    return
            except LmcliError as e:
                self.note(f"error: {' '.join(str(e).split())}", style="red")

    def handle(self, message: str) -> bool:
        """One message or command; False to end the session."""
        if message.startswith("//"):
            message = message[1:]
        elif message.startswith("/"):
            return self.command(message)
        self.turn(message)
        return True

    # --- commands ---------------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        name, _, argument = line[1:].partition(" ")
        argument = argument.strip()
        session = self.session
        if name in ("exit", "quit", "bye"):
            return False
        if name in ("help", "?"):
            self.note(HELP, style="")
        elif name == "system":
            if argument:
                session.set_system(argument)
                self.note("system message set")
            else:
                self.note(f"system message: {session.system}" if session.system is not None else "no system message")
        elif name == "clear":
            session.clear()
            self.note("conversation cleared" + (" (system message kept)" if session.system is not None else ""))
        elif name == "set":
            setting, _, value = argument.partition(" ")
            if not setting:
                self.note(self._settings_line(), style="")
            else:
                if not value.strip():
                    raise ChatError(f"/set {setting} needs a value")
                session.set_setting(setting, value)
                self.note(self._settings_line())
        elif name == "save":
            if not argument:
                raise ChatError("/save needs a file name")
            path = session.save(argument, self.model_info)
            kept = session.keep_blocks()  # so that --resume restores the conversation, not computes it (0: none)
            self.note(f"saved {len(session.messages)} messages to {path}"
                      + (f" (its {kept} tokens kept in the prompt cache)" if kept else ""))
        elif name == "undo":
            self.note("last exchange dropped" if session.undo() else "nothing to undo")
        else:
            raise ChatError(f"unknown command /{name} (/help lists them; //text sends text that starts with /)")
        return True

    def _settings_line(self) -> str:
        settings = dataclasses.asdict(self.session.settings)
        shown = [name for name in settable_names() if name not in ("sources", "model_defaults")]  # bookkeeping
        return " · ".join(f"{name} {_show(settings[name])}" for name in shown)

    # --- a turn -----------------------------------------------------------------------------------

    def turn(self, message: str) -> None:
        view = _ReplyView(self.out, self.terminal and self.interactive, self.options)
        previous = signal.getsignal(signal.SIGINT)
        if self.interactive:
            signal.signal(signal.SIGINT, lambda *_: self.session.request_stop())
        try:
            with _no_echo(self.interactive):
                turn = self.session.reply(message, view.write, logprobs=view.wants_logprobs)
        except BaseException:
            view.close()
            raise
        finally:
            if self.interactive:
                signal.signal(signal.SIGINT, previous)
        if turn.dropped_messages:
            self.note(f"the conversation outgrew the {self.session.context}-token context: dropped the oldest"
                      f" {turn.dropped_messages} messages{' (the system message is kept)' if self.session.system else ''}"
                      " and recomputed the rest", style="yellow")
        view.end(turn.reply, turn.interrupted)
        # A structured reply a limit cut: said, as `generate` says it (exit 3 there); not for a server's
        # reply (lmcli.serve.remote_chat: no tokenizer here to check it with).
        if not turn.interrupted and self.session.tokenizer is not None:
            from lmcli.jobs.runs import incomplete_output

            cut = incomplete_output(turn.result, self.session.tokenizer, self.session.model.config)
            if cut is not None:
                self.note(f"warning: {cut}", style="yellow")
        if self.options.stats:
            summary = getattr(turn, "summary", None)  # a turn from a server (lmcli.serve.remote_chat) says its own
            self.note(summary() if summary is not None else _turn_summary(turn, getattr(self.session, "prefix_cache", None)))
            speculator = getattr(self.session.model, "speculator", None)  # lmcli.generation.speculative_setup: the chat's totals
            if speculator is not None:
                self.note(speculator.summary())
        if view.terminal:
            self.out.print()  # a blank line before the next prompt


@contextlib.contextmanager
def _no_echo(enabled: bool) -> Iterator[None]:
    """While a reply streams, keys typed (and Ctrl-C's "^C") are not echoed into it; typed text
    still reaches the next prompt."""
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd) if enabled else None
    except (ImportError, OSError, ValueError):
        saved = None
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


class _ReplyView:
    """Where a reply's pieces go: a pipe, a terminal (optionally shaded by probability), or a live
    region that becomes rendered Markdown when the reply is complete."""

    def __init__(self, console, terminal: bool, options: ChatOptions):
        self.console = console
        self.terminal = terminal
        self.color = terminal and options.color_probs
        self.wants_logprobs = self.color
        self._shading = ProbabilityShading() if self.color else None
        self._live = None
        self._text = None
        if terminal and options.markdown:
            from rich.live import Live
            from rich.text import Text

            self._text = Text()
            self._live = Live(self._text, console=console, refresh_per_second=12, vertical_overflow="visible")
            self._live.start()

    def write(self, result: RowResult, piece: str) -> None:
        style = None
        if self._shading is not None:
            style = probability_style(self._shading.probability(result))
        if not self.terminal:
            sys.stdout.write(piece)
            sys.stdout.flush()
        elif self._text is not None:
            self._text.append(visible_controls(piece), style=style)
        else:
            self.console.print(visible_controls(piece), style=style, end="", markup=False, emoji=False,
                               highlight=False, soft_wrap=True)
            self.console.file.flush()

    def close(self) -> None:
        """Stop the live region, if any (also after an error)."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def end(self, reply: str, interrupted: bool) -> None:
        if not self.terminal:
            sys.stdout.write("\n")
            sys.stdout.flush()
            return
        if self._live is not None:
            from rich.markdown import Markdown

            # The streamed text is replaced by its rendering: the live region is redrawn once more.
            self._live.update(Markdown(reply), refresh=True)
            self.close()
        else:
            self.console.print()
        if interrupted:
            self.console.print("[interrupted]", style="dim", markup=False)


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return json.dumps(list(value), ensure_ascii=False)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _turn_summary(turn: Turn, prefix: Any = None) -> str:
    # How much of the conversation the model had to process: the rest came from the cache.
    line = f"{row_summary(turn.result)} · prefill {turn.prefill_tokens} of {turn.prompt_tokens} tokens"
    if turn.from_disk or turn.from_memory:
        line += f" ({turn.from_disk} from the prompt cache on disk, {turn.from_memory} from its memory)"
    if prefix is not None and prefix.unusable:
        line += f" · prompt cache: not used ({prefix.unusable})"
    return line


# ----------------------------------------------------------------------------- the command


def run_chat(load: Callable[[], tuple[Any, Any]], settings: GenerationSettings, options: ChatOptions,
             resolved: ResolvedModel) -> None:
    """`lmcli chat`: load the model, set up the session (resumed or new) and talk until the end of input."""
    interactive = sys.stdin.isatty()
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")  # pipes get UTF-8 whatever the locale says

    saved = None
    if options.resume is not None:
        saved = load_transcript(options.resume)
        settings = resumed_settings(saved.get("settings", {}), settings, set(options.explicit), options.resume)
    model, tokenizer = load()
    model_info = resolved.record()  # the checkpoint `load` loaded, however it was named
    context = options.context
    if context is None and saved is not None and isinstance(saved.get("context"), int):
        context = min(saved["context"], model.config.max_position_embeddings)
    from lmcli.generation.prefix_cache import prefix_cache_for

    session = ChatSession(model, tokenizer, settings, context=context, system=settings.system,
                          messages=saved["messages"] if saved is not None else None,
                          prefix_cache=prefix_cache_for(model))  # where reusing blocks is exact
    repl = ChatRepl(session, options, model_info, interactive)
    if saved is not None:
        if saved.get("model", {}).get("fingerprint") != model_info["fingerprint"]:
            repl.note(f"note: {options.resume} was saved with another model"
                      f" ({saved.get('model', {}).get('checkpoint', '?')}); continuing with this one", style="yellow")
        if interactive:
            _show_transcript(repl, session.messages)
    if interactive:
        repl.note(f"chatting with {resolved.path.name} · context {session.context} tokens · /help for commands,"
                  " Ctrl-D to quit")
        if options.color_probs and repl.terminal:
            legend = " ".join(f"[{colour}]p<{bound:g}[/]" for bound, colour in PROBABILITY_COLOURS)
            repl.err.print(f"colours: {legend} plain: p>=0.9", style="dim", highlight=False)
        repl.run()
    else:
        repl.run(piped_messages(sys.stdin))


def _show_transcript(repl: ChatRepl, messages: list[dict]) -> None:
    for message in messages:
        label = {"system": "system", "user": ">>>", "assistant": ""}[message["role"]]
        repl.out.print(f"{label} {message['content']}".strip(), style="dim" if message["role"] != "assistant" else None,
                       markup=False, emoji=False, highlight=False)
        if message["role"] == "assistant":
            repl.out.print()

