"""`lmcli chat`: a multi-turn conversation over the checkpoint's chat template.

`ChatSession` is the conversation (no input or output of its own); `run_chat` is the REPL around it.

The conversation stays in the model's KV cache between turns. Each turn renders the whole
conversation with the chat template and tokenises it, which is exactly what a fresh `generate`
over the conversation would be given, then feeds the model only the tokens after the longest
prefix the cache already holds. A template renders earlier turns the same way every time, so the
new rendering extends the previous one and only the new turn is processed. Where it does not
(a template that rewrites history, a reply whose text tokenises differently from the tokens that
were sampled, /system, /undo), the common prefix is shorter and more is recomputed; the result is
the same as a fresh run either way.

One concern, so one file even past ~450 lines: the conversation and its REPL (the session, its
transcripts and /set settings, reading messages, showing replies); generating a turn is
generation/rows.py's, what a setting may be is settings.py's.
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
from typing import Any

from lmcli.console import PROBABILITY_COLOURS, ProbabilityShading, probability_style, row_summary, visible_controls
from lmcli.errors import LmcliError, TokenizerError, UsageError
from lmcli.generation.rows import RowResult, generate_batch, prepare_row
from lmcli.io.atomic import write_atomically
from lmcli.settings import DEFAULT_TEMPERATURE, GenerationSettings

DEFAULT_CONTEXT = 4096  # tokens a chat keeps unless --context says otherwise (the cache is allocated for it)
TRANSCRIPT_FORMAT = "lmcli-chat/1"
ROLES = ("system", "user", "assistant")
# Settings that belong to a one-shot prompt, not to a conversation's sampling.
NOT_SETTABLE = ("chat", "system", "logprobs", "constraint")  # a constraint: /set json_schema etc.


class ChatError(LmcliError):
    """A problem with one chat input (a command, a message); the REPL reports it and goes on."""


def settable_names() -> list[str]:
    return [f.name for f in dataclasses.fields(GenerationSettings) if f.name not in NOT_SETTABLE]


@dataclass
class Turn:
    """One exchange: the reply and what it cost."""

    result: RowResult
    prompt_tokens: int  # the whole rendered conversation, this turn's message included
    prefill_tokens: int  # of those, the ones the model processed (the rest came from the cache)
    dropped_messages: int  # old messages dropped this turn to fit the context
    interrupted: bool

    @property
    def reply(self) -> str:
        return self.result.text.text


class ChatSession:
    """A conversation with one model, its messages and the KV cache that holds them."""

    def __init__(self, model, tokenizer, settings: GenerationSettings, *, context: int | None = None,
                 system: str | None = None, messages: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerError("this checkpoint's tokenizer has no chat template, so it cannot chat;"
                                 " 'lmcli generate' completes plain text")
        self.model, self.tokenizer = model, tokenizer
        model_context = model.config.max_position_embeddings
        if context is not None and context > model_context:
            raise UsageError(f"--context {context} is more than the model's context ({model_context} tokens)")
        self.context = context or min(model_context, DEFAULT_CONTEXT)
        self.settings = settings
        self._check_room(settings, "--max-new-tokens", UsageError)
        self.messages: list[dict] = check_messages(messages or [], "messages")
        if system is not None:
            self.set_system(system)
        self.hidden = 0  # leading non-system messages the model no longer sees (dropped to fit the context)
        self._cache = None
        self._cached_ids: list[int] = []  # the tokens whose keys/values the cache holds, in order
        self._stop_requested = False
        self._turns = 0

    # --- the conversation -----------------------------------------------------------------------

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    def set_system(self, text: str) -> None:
        if self.system is not None:
            self.messages[0] = {"role": "system", "content": text}
        else:
            self.messages.insert(0, {"role": "system", "content": text})

    def clear(self) -> None:
        """Forget the exchanges, keep the system message."""
        self.messages = self.messages[:1] if self.system is not None else []
        self.hidden = 0

    def undo(self) -> bool:
        """Drop the last exchange (the last user message and what followed it); False if there is none."""
        first = self._first_exchange_index()
        for index in range(len(self.messages) - 1, first - 1, -1):
            if self.messages[index]["role"] == "user":
                del self.messages[index:]
                self.hidden = min(self.hidden, len(self.messages) - first)
                return True
        return False

    def _first_exchange_index(self) -> int:
        return 1 if self.system is not None else 0

    def _visible(self, messages: list[dict], hidden: int) -> list[dict]:
        first = 1 if messages and messages[0]["role"] == "system" else 0
        return messages[:first] + messages[first + hidden:]

    # --- settings ---------------------------------------------------------------------------------

    def set_setting(self, name: str, value: str) -> GenerationSettings:
        """`/set NAME VALUE`: one sampling setting, parsed by its type and validated like a flag."""
        field_name = name.strip().lstrip("-").replace("-", "_")
        if field_name in ("json_schema", "json", "regex", "grammar"):  # the one constraint, replaced
            from lmcli.generation.constraints import ConstraintError, constraint_from_setting

            try:
                self.settings = dataclasses.replace(self.settings, constraint=constraint_from_setting(field_name, value))
            except ConstraintError as e:
                raise ChatError(str(e).replace("--", "/set ", 1)) from None
            return self.settings
        if field_name == "greedy":
            field_name, value = "temperature", "0" if _parse_bool(value, name) else str(DEFAULT_TEMPERATURE)
        fields = {f.name: f for f in dataclasses.fields(GenerationSettings) if f.name not in NOT_SETTABLE}
        if field_name not in fields:
            raise ChatError(f"unknown setting '{name}' (one of: {', '.join(fields)})")
        parsed = _parse_setting(field_name, str(fields[field_name].type), value)
        settings = self.settings.changed(lambda n: n, ChatError, **{field_name: parsed})
        self._check_room(settings, "max_new_tokens", ChatError)
        self.settings = settings
        return settings

    def _check_room(self, settings: GenerationSettings, name: str, error: type[LmcliError]) -> None:
        if settings.max_new_tokens >= self.context:
            raise error(
                f"{name} {settings.max_new_tokens} leaves no room for the conversation in the"
                f" {self.context}-token context; lower it or raise --context"
            )

    # --- a turn -----------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop the reply in progress after the current step (Ctrl-C); the session goes on."""
        self._stop_requested = True

    def reply(self, text: str, on_text: Callable[[RowResult, str], None] | None = None, *,
              logprobs: bool = False) -> Turn:
        """Add the user message `text`, generate the reply (streamed to `on_text`) and add it too.

        With `logprobs`, the result records each token's log-probability (for --color-probs)."""
        import torch

        from lmcli.generation.loop import generate_from_cache

        messages = [*self.messages, {"role": "user", "content": text}]
        ids, hidden = self._fit(messages)
        reused = self._reusable_prefix(ids)
        settings = dataclasses.replace(self.settings, logprobs=0) if logprobs else self.settings
        self._turns += 1
        row = prepare_row(self.tokenizer, self._turns, text, settings, prompt_ids=ids)

        self._stop_requested = False
        stopped_early = False
        cached_after = 0

        def run(x, *, on_token, ignore_output, **kwargs):
            def on_token_or_stop(event):
                nonlocal stopped_early
                ended = on_token(event)
                if self._stop_requested and not bool(ended.all()):
                    stopped_early = True
                    return torch.ones_like(ended)
                return ended

            nonlocal cached_after
            with torch.inference_mode():
                if self._cache is None:
                    self._cache = self.model.init_cache(1, self.context)
                _, cached_after = generate_from_cache(
                    self.model, x, on_token=on_token_or_stop, ignore_output=True, cache=self._cache,
                    cached=reused, **kwargs,
                )

        self._cached_ids = []  # unknown until the run returns
        try:
            [result] = generate_batch(self.model, self.tokenizer, [row], on_text=on_text, run=run)
        except BaseException:
            self._cache = None  # what a failed run left in it is unknown (a ring may hold stray slots)
            raise
        self._cached_ids = (ids + result.tokens)[:cached_after]
        if stopped_early:
            result.finish_reason = "interrupted"
        dropped = hidden - self.hidden
        self.messages = [*messages, {"role": "assistant", "content": result.text.text}]
        self.hidden = hidden
        return Turn(result, len(ids), len(ids) - reused, dropped, stopped_early)

    def _fit(self, messages: list[dict]) -> tuple[list[int], int]:
        """The conversation's tokens, after dropping the oldest exchanges if it has outgrown the context.

        When it has, exchanges are dropped until it takes at most half of the room, so that the
        conversation is recomputed once, not again at every following turn."""
        room = self.context - self.settings.max_new_tokens
        hidden = self.hidden
        first = 1 if messages[0]["role"] == "system" else 0
        ids = self.tokenizer.encode_chat(self._visible(messages, hidden), add_generation_prompt=True)
        if len(ids) <= room:
            return ids, hidden
        while first + hidden < len(messages) - 1 and len(ids) > room // 2:
            hidden += 1  # the oldest visible message, then whatever follows it up to the next user message
            while first + hidden < len(messages) - 1 and messages[first + hidden]["role"] != "user":
                hidden += 1
            ids = self.tokenizer.encode_chat(self._visible(messages, hidden), add_generation_prompt=True)
        if len(ids) > room:
            raise ChatError(
                f"the message does not fit: the conversation would be {len(ids)} tokens, and with"
                f" {self.settings.max_new_tokens} for the reply that exceeds the {self.context}-token context"
                " (shorten it, /set max_new_tokens lower, or raise --context)"
            )
        return ids, hidden

    def _reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` the cache can supply (at least one token is always fed)."""
        common = 0
        limit = min(len(self._cached_ids), len(ids) - 1)
        while common < limit and self._cached_ids[common] == ids[common]:
            common += 1
        back = len(self._cached_ids) - common
        if back and self._cache is not None and self._cache.trim(back) < back:
            # The cache cannot go back that far (a ring buffer has overwritten the keys before its
            # window): start again with an empty one.
            self._cache = None
            return 0
        return common

    # --- transcripts ------------------------------------------------------------------------------

    def transcript(self, model_info: dict) -> dict:
        settings = {k: v for k, v in dataclasses.asdict(self.settings).items() if k not in NOT_SETTABLE}
        return {"format": TRANSCRIPT_FORMAT, "messages": self.messages, "settings": settings, "model": model_info,
                "context": self.context}

    def save(self, path: str | Path, model_info: dict) -> Path:
        """Write the transcript as JSON, atomically (a temporary file renamed over the target)."""
        path = Path(path).expanduser()
        try:
            write_atomically(path, json.dumps(self.transcript(model_info), indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise ChatError(f"cannot write {path}: {e.strerror or e}") from None
        return path


# ----------------------------------------------------------------------------- transcripts and settings


def check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list):
        raise ChatError(f"{where} must be a list of messages")
    checked = []
    for number, message in enumerate(messages, start=1):
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise ChatError(f'{where}: message {number} must be {{"role": system|user|assistant, "content": text}}')
        if message["role"] == "system" and number != 1:
            raise ChatError(f"{where}: message {number} is a system message; only the first may be one")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def load_transcript(path: Path) -> dict:
    """A transcript written by /save; raises ChatError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ChatError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ChatError(f"{path}: not a JSON transcript ({e})") from None
    if not isinstance(data, dict) or data.get("format") != TRANSCRIPT_FORMAT:
        raise ChatError(f'{path}: not a transcript saved by lmcli chat (no "format": "{TRANSCRIPT_FORMAT}")')
    data["messages"] = check_messages(data.get("messages"), str(path))
    if not isinstance(data.get("settings", {}), dict):
        raise ChatError(f'{path}: "settings" must be an object')
    return data


def resumed_settings(saved: dict, flags: GenerationSettings, explicit: set[str], path: Path) -> GenerationSettings:
    """The saved settings, except those given on the command line this time."""
    return flags.resumed(saved, settable_names(), explicit, str(path), ChatError)


def _parse_bool(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("on", "true", "yes", "1"):
        return True
    if lowered in ("off", "false", "no", "0"):
        return False
    raise ChatError(f"{name} takes on or off, got '{value}'")


def _parse_setting(name: str, type_name: str, value: str) -> Any:
    from lmcli.jobs import unescape_line

    value = value.strip()
    if "None" in type_name and value.lower() in ("none", "off", "default", ""):
        return None
    try:
        if type_name.startswith("bool"):
            return _parse_bool(value, name)
        if type_name.startswith("int"):
            return int(value)
        if type_name.startswith("float"):
            return float(value)
        if type_name.startswith("tuple[str"):
            # One string (\n for a newline), or a JSON list of strings; "none" for none.
            if value.lower() in ("none", "off", ""):
                return ()
            items = json.loads(value) if value.startswith("[") else [unescape_line(value)]
            if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
                raise ValueError(value)
            return tuple(items)
    except ValueError:
        raise ChatError(f"{name}: cannot read '{value}' as {type_name}") from None
    raise ChatError(f"{name} cannot be changed with /set")


def checkpoint_fingerprint(path: Path) -> str:
    """Identifies a checkpoint's content cheaply: size and a hash of the first 16 MiB, per file."""
    import hashlib

    from lmcli.default_model import gguf_fingerprint

    if path.is_file():
        return gguf_fingerprint(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".model")):
        digest.update(f"{file.name}:{gguf_fingerprint(file)}\n".encode())
    return digest.hexdigest()[:32]


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
/set NAME VALUE     change a sampling setting, e.g. /set temperature 0.7 (/set alone lists them)
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
            self.note(f"saved {len(session.messages)} messages to {path}")
        elif name == "undo":
            self.note("last exchange dropped" if session.undo() else "nothing to undo")
        else:
            raise ChatError(f"unknown command /{name} (/help lists them; //text sends text that starts with /)")
        return True

    def _settings_line(self) -> str:
        settings = dataclasses.asdict(self.session.settings)
        return " · ".join(f"{name} {_show(settings[name])}" for name in settable_names())

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
        if self.options.stats:
            self.note(_turn_summary(turn))
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


def _turn_summary(turn: Turn) -> str:
    # How much of the conversation the model had to process: the rest came from the cache.
    return f"{row_summary(turn.result)} · prefill {turn.prefill_tokens} of {turn.prompt_tokens} tokens"


# ----------------------------------------------------------------------------- the command


def run_chat(load: Callable[[], tuple[Any, Any]], settings: GenerationSettings, options: ChatOptions,
             checkpoint: Path | None) -> None:
    """`lmcli chat`: load the model, set up the session (resumed or new) and talk until the end of input."""
    interactive = sys.stdin.isatty()
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")  # pipes get UTF-8 whatever the locale says

    saved = None
    if options.resume is not None:
        saved = load_transcript(options.resume)
        settings = resumed_settings(saved.get("settings", {}), settings, set(options.explicit), options.resume)
    model, tokenizer = load()
    if checkpoint is None:
        from lmcli.default_model import default_checkpoint_path

        checkpoint = Path(default_checkpoint_path())
    model_info = {"checkpoint": str(checkpoint), "fingerprint": checkpoint_fingerprint(checkpoint)}
    context = options.context
    if context is None and saved is not None and isinstance(saved.get("context"), int):
        context = min(saved["context"], model.config.max_position_embeddings)
    session = ChatSession(model, tokenizer, settings, context=context, system=settings.system,
                          messages=saved["messages"] if saved is not None else None)
    repl = ChatRepl(session, options, model_info, interactive)
    if saved is not None:
        if saved.get("model", {}).get("fingerprint") != model_info["fingerprint"]:
            repl.note(f"note: {options.resume} was saved with another model"
                      f" ({saved.get('model', {}).get('checkpoint', '?')}); continuing with this one", style="yellow")
        if interactive:
            _show_transcript(repl, session.messages)
    if interactive:
        repl.note(f"chatting with {checkpoint.name} · context {session.context} tokens · /help for commands,"
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

