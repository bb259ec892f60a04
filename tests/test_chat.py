"""lmcli chat: the conversation kept in the KV cache between turns, its commands, the REPL in a pty,
the pipe mode, and --color-probs.

Every reply is checked against `model.generate` called directly, without a cache (full recomputation
at every step), over the whole conversation as the chat template renders it: the chat's cache reuse,
turn dropping and resumed transcripts must all give what a fresh run over the same messages gives.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import ClassVar, cast

import pytest
import torch
from cli_fixtures import run_lmcli, subprocess_env, tiny_checkpoint  # noqa: F401
from real_models import smollm2_gguf  # noqa: F401

import lmcli
from lmcli.chat.repl import ChatError, ChatSession, piped_messages
from lmcli.console import ProbabilityShading, probability_style
from lmcli.settings.generation_settings import GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- helpers


def greedy(max_new_tokens: int, **values) -> GenerationSettings:
    return GenerationSettings.from_flags(greedy=True, max_new_tokens=max_new_tokens, chat=True, **values)


def fresh_reply(model, tokenizer, messages: list[dict], max_new_tokens: int) -> list[int]:
    """The reply tokens of a fresh greedy run over the rendered conversation, without any cache."""
    ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, use_cache=False,
                         eos_token_id=tokenizer.eos_token_ids)
    return out[0, len(ids):].tolist()


def reply_text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class CharTokenizer:
    """One character per id, so a reply's text tokenises back to exactly the tokens sampled; a chat
    template of role markers. Over tests/tiny.py's 97-token vocabulary: 2 is EOS, 3-5 mark roles."""

    chat_template = "<role> content </s> ... (rendered in encode_chat)"
    eos_token_ids: ClassVar[list[int]] = [2]
    pad_token_id = 0
    special_ids = frozenset({2})
    OFFSET = 0x400  # ids map to Cyrillic letters and beyond: printable, one character each
    ROLES: ClassVar[dict[str, int]] = {"system": 3, "user": 4, "assistant": 5}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - self.OFFSET for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(self.OFFSET + i) for i in ids if not (skip_special_tokens and i in self.special_ids))

    def is_byte_token(self, token_id: int) -> bool:
        return False

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids = [1]
        for message in messages:
            ids += [self.ROLES[message["role"]], *self.encode(message["content"]), 2]
        return [*ids, self.ROLES["assistant"]] if add_generation_prompt else ids

    def text(self, *ids: int) -> str:
        return "".join(chr(self.OFFSET + i) for i in ids)


# ----------------------------------------------------------------------------- the session


@pytest.mark.parametrize("case", ["llama", "gemma2"])  # a static cache; sliding layers with a ring buffer
def test_turns_reuse_the_cache_and_equal_a_fresh_run(tiny_models, case):
    model, tokenizer, n = tiny_models(case), CharTokenizer(), 6
    session = ChatSession(model, tokenizer, greedy(n), context=64)
    u1, u2, u3 = tokenizer.text(10, 11, 12, 13), tokenizer.text(20, 21, 22), tokenizer.text(30, 31, 32, 33, 34)

    first = session.reply(u1)
    ids1 = tokenizer.encode_chat([{"role": "user", "content": u1}])
    assert first.result.tokens == fresh_reply(model, tokenizer, [{"role": "user", "content": u1}], n)
    assert first.prefill_tokens == len(ids1)
    a1 = {"role": "assistant", "content": reply_text(tokenizer, first.result.tokens)}

    second = session.reply(u2)
    conversation = [{"role": "user", "content": u1}, a1, {"role": "user", "content": u2}]
    ids2 = tokenizer.encode_chat(conversation)
    assert second.result.tokens == fresh_reply(model, tokenizer, conversation, n)
    # Only the new tokens: the last reply token (sampled, never fed to the model), the template's end
    # of the reply and the new user message. Everything before came from the cache.
    assert second.prefill_tokens == len(ids2) - (len(ids1) + len(first.result.tokens) - 1)
    assert second.prefill_tokens < len(ids2) - len(ids1)

    # /undo goes back in the text: a static cache keeps the common prefix, a ring buffer starts over.
    cached = ids2 + second.result.tokens[:-1]
    assert session.undo()
    third = session.reply(u3)
    conversation = [conversation[0], a1, {"role": "user", "content": u3}]
    ids3 = tokenizer.encode_chat(conversation)
    assert third.result.tokens == fresh_reply(model, tokenizer, conversation, n)
    rolling = case == "gemma2"
    assert third.prefill_tokens == (len(ids3) if rolling else len(ids3) - common_prefix(ids3, cached))

    # A new system message changes the start of the text: all is recomputed, and right.
    session.set_system(tokenizer.text(40, 41))
    fourth = session.reply(u2)
    conversation = [{"role": "system", "content": tokenizer.text(40, 41)}, *conversation,
                    {"role": "assistant", "content": reply_text(tokenizer, third.result.tokens)},
                    {"role": "user", "content": u2}]
    assert fourth.result.tokens == fresh_reply(model, tokenizer, conversation, n)
    assert session.messages == [*conversation, {"role": "assistant", "content": fourth.reply}]


def test_an_outgrown_context_drops_the_oldest_turns_keeping_the_system_message(tiny_models):
    model, tokenizer, n = tiny_models("llama"), CharTokenizer(), 4
    system = {"role": "system", "content": tokenizer.text(50, 51, 52)}
    session = ChatSession(model, tokenizer, greedy(n), context=64, system=system["content"])
    turns, dropped_at = [], None
    for index in range(8):
        turn = session.reply(tokenizer.text(*range(10 + index, 18 + index)))
        turns.append(turn)
        assert turn.prompt_tokens + n <= 64
        if turn.dropped_messages and dropped_at is None:
            dropped_at = index
    assert dropped_at is not None, "the conversation never outgrew the 64-token context"
    # Every reply equals a fresh run over what the model was shown: the system message, then the
    # messages that were not dropped.
    visible = [system, *session.messages[1 + session.hidden:]]
    assert visible[-1]["role"] == "assistant" and session.messages[0] == system
    last = turns[-1]
    assert last.result.tokens == fresh_reply(model, tokenizer, visible[:-1], n)
    # The drop leaves room, so the turn after it reuses the cache instead of recomputing again.
    after = turns[dropped_at + 1]
    assert after.dropped_messages == 0 and after.prefill_tokens < after.prompt_tokens // 2
    # The whole transcript is kept for /save, dropped messages too.
    assert len(session.messages) == 1 + 2 * len(turns)


def test_a_message_too_long_for_the_context_is_refused(tiny_models):
    tokenizer = CharTokenizer()
    session = ChatSession(tiny_models("llama"), tokenizer, greedy(8), context=32)
    with pytest.raises(ChatError, match=r"does not fit.*32-token context"):
        session.reply(tokenizer.text(*range(10, 40)))
    assert session.messages == []


def test_set_changes_any_sampling_setting_and_validates_it(tiny_models):
    session = ChatSession(tiny_models("llama"), CharTokenizer(), GenerationSettings(chat=True, max_new_tokens=8), context=64)
    session.set_setting("temperature", "0.5")
    session.set_setting("top-p", "0.9")
    session.set_setting("stop", r"\n")
    session.set_setting("repetition_penalty", "1.3")
    session.set_setting("max_new_tokens", "10")
    assert (session.settings.temperature, session.settings.top_p, session.settings.stop) == (0.5, 0.9, ("\n",))
    assert (session.settings.repetition_penalty, session.settings.max_new_tokens) == (1.3, 10)
    session.set_setting("top_p", "none")
    assert session.settings.top_p is None
    session.set_setting("greedy", "on")
    assert session.settings.greedy
    session.set_setting("greedy", "off")
    assert session.settings.temperature == GenerationSettings().temperature  # back to the default
    for name, value, message in [
        ("top_p", "2", "top_p must be in"),
        ("temperature", "hot", "cannot read 'hot'"),
        ("max_new_tokens", "64", "leaves no room"),
        ("colour", "1", "unknown setting 'colour'"),
    ]:
        with pytest.raises(ChatError, match=message):
            session.set_setting(name, value)
    assert session.settings.max_new_tokens == 10  # a refused value changes nothing


def test_piped_messages_are_lines_and_fenced_blocks():
    text = 'Hi\n\n"""\nline one\nline two\n"""\n/undo\n"""one line"""\n'
    assert list(piped_messages(text.splitlines(keepends=True))) == [
        "Hi", "line one\nline two", "/undo", "one line"]
    with pytest.raises(ChatError, match="not closed"):
        list(piped_messages(['"""\n', "open\n"]))


# ----------------------------------------------------------------------------- the command, piped


def test_pipe_mode_prints_each_reply_on_its_own_line(tiny_checkpoint):
    model, tokenizer = lmcli.load(tiny_checkpoint)
    u1, u2 = "Hi", "And again?"
    r1 = reply_text(tokenizer, fresh_reply(model, tokenizer, [{"role": "user", "content": u1}], 6))
    conversation = [{"role": "user", "content": u1}, {"role": "assistant", "content": r1},
                    {"role": "user", "content": u2}]
    r2 = reply_text(tokenizer, fresh_reply(model, tokenizer, conversation, 6))

    result = run_lmcli("chat", "-c", str(tiny_checkpoint), "--greedy", "-n", "6", "--stats", input=f"{u1}\n{u2}\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == f"{r1}\n{r2}\n"
    summaries = re.findall(r"prefill (\d+) of (\d+) tokens", result.stderr.decode())
    assert len(summaries) == 2
    (prefill1, total1), (prefill2, total2) = [(int(a), int(b)) for a, b in summaries]
    assert prefill1 == total1 == len(tokenizer.encode_chat(conversation[:1]))
    assert total2 == len(tokenizer.encode_chat(conversation)) and prefill2 <= total2 - total1


def cli(*args, input=None):
    from typer.testing import CliRunner

    from lmcli.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def test_pipe_mode_commands_write_to_stderr_and_errors_end_the_run(tiny_checkpoint):
    result = cli("chat", "-c", tiny_checkpoint, "--greedy", "-n", "3", input="/set temperature 0.5\n/bogus\nHi\n")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        "error: unknown command /bogus (/help lists them; //text sends text that starts with /)")


def test_resume_refuses_a_file_that_is_not_a_transcript(tiny_checkpoint, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "lmcli-chat/1", "messages": [{"role": "robot", "content": "hi"}]}))
    result = cli("chat", "-c", tiny_checkpoint, "--resume", bad, input="Hi\n")
    assert result.exit_code == 1
    assert result.stderr == f'error: {bad}: message 1 must be {{"role": system|user|assistant, "content": text}}\n'


def test_generate_on_a_chat_model_is_raw_completion_unless_chat(tiny_checkpoint):
    _, tokenizer = lmcli.load(tiny_checkpoint)
    prompt = "Hello world"
    for flags, expected in (([], tokenizer.encode(prompt)),
                            (["--chat"], tokenizer.encode_chat([{"role": "user", "content": prompt}]))):
        result = cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", "2", "--format", "jsonl", *flags, prompt)
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["prompt_tokens"] == len(expected)


def test_chat_has_every_generation_flag_of_generate():
    from typer.core import TyperGroup
    from typer.main import get_command

    from lmcli.cli import app

    group = get_command(app)
    assert isinstance(group, TyperGroup)
    commands = group.commands
    shared_panels = ("Decoding", "Stopping")

    def flags(name):
        return {opt for p in commands[name].params if getattr(p, "rich_help_panel", None) in shared_panels
                for opt in p.opts}

    assert flags("generate") and flags("generate") <= flags("chat")


# ----------------------------------------------------------------------------- the REPL in a pty

ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-B]|[=>])")


class Terminal:
    """`python -m lmcli ARGS` with a pseudo-terminal as its controlling terminal (so Ctrl-C is a
    real SIGINT from the line discipline, and readline edits the input)."""

    def __init__(self, *args: str, cwd: Path | None = None):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))

        def become_session_leader():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        env = subprocess_env(TERM="xterm-256color", COLUMNS="120", LINES="40")
        self.proc = subprocess.Popen([sys.executable, "-m", "lmcli", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, cwd=cwd, preexec_fn=become_session_leader,
                                     close_fds=True)
        os.close(slave)
        self.master = master
        self.raw = b""
        self.mark = 0

    @property
    def screen(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace")).replace("\r", "")

    def send(self, text: str) -> None:
        """Type `text`; wait_for then looks only at what the terminal shows after this."""
        self.mark = len(self.raw)
        os.write(self.master, text.encode())

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout

        def since_mark() -> str:
            return ANSI.sub("", self.raw[self.mark:].decode("utf-8", "replace")).replace("\r", "")

        while len(re.findall(pattern, since_mark())) < count:
            if time.monotonic() > deadline or (self.proc.poll() is not None and not self._read(0)):
                raise AssertionError(f"no {pattern!r} (x{count}) in the terminal:\n{self.screen[-3000:]}")
            self._read(0.2)
        return self.screen

    def _read(self, timeout: float) -> bool:
        if not select.select([self.master], [], [], timeout)[0]:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:
            return False
        self.raw += data
        return bool(data)

    def finish(self, timeout: float = 60) -> int:
        self.send("\x04")  # Ctrl-D at the prompt
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        code = self.proc.wait(timeout=5)
        os.close(self.master)
        return code


def test_repl_in_a_terminal_with_commands_save_and_resume(tiny_checkpoint, tmp_path):
    model, tokenizer = lmcli.load(tiny_checkpoint)
    n = 5
    system, u1, u2, u3 = "Be brief.", "Hello\nthere", "And again?", "One more"

    term = Terminal("chat", "-c", str(tiny_checkpoint), "--greedy", "-n", str(n), cwd=tmp_path)
    term.wait_for(">>> ")
    term.send("\x1b[200~Hello\nthere\x1b[201~\r")  # a bracketed paste of two lines, then Enter
    term.wait_for(">>> ")
    term.send(f"/system {system}\r")
    term.wait_for("system message set")
    term.send('"""\r')  # a fenced message over two lines
    term.send(f"{u2}\r")
    term.send('second line"""\r')
    term.wait_for(">>> ")
    term.send("/save first.json\r")
    screen = term.wait_for(r"saved 5 messages[^\n]*\n>>> ")  # the prompt is back: Ctrl-D now reaches readline
    assert term.finish() == 0, screen

    saved = json.loads((tmp_path / "first.json").read_text())
    messages = [{"role": "system", "content": system}, {"role": "user", "content": u1}]
    # The first reply was generated before the system message existed.
    r1 = reply_text(tokenizer, fresh_reply(model, tokenizer, messages[1:], n))
    messages += [{"role": "assistant", "content": r1}, {"role": "user", "content": f"{u2}\nsecond line"}]
    r2 = reply_text(tokenizer, fresh_reply(model, tokenizer, messages, n))
    messages.append({"role": "assistant", "content": r2})
    assert saved["messages"] == messages
    assert saved["settings"]["temperature"] == 0 and saved["settings"]["max_new_tokens"] == n
    assert saved["model"]["checkpoint"] == str(tiny_checkpoint) and saved["model"]["fingerprint"]

    # Resumed without flags: the transcript's settings (greedy, n) and messages carry on.
    term = Terminal("chat", "-c", str(tiny_checkpoint), "--resume", "first.json", cwd=tmp_path)
    term.wait_for(r"Ctrl-D to quit\n>>> ")  # after the resumed transcript is shown
    term.send(f"{u3}\r")
    term.wait_for(">>> ")
    term.send("/save second.json\r")
    screen = term.wait_for(r"saved 7 messages[^\n]*\n>>> ")
    assert term.finish() == 0, screen
    messages.append({"role": "user", "content": u3})
    r3 = reply_text(tokenizer, fresh_reply(model, tokenizer, messages, n))
    assert json.loads((tmp_path / "second.json").read_text())["messages"] == [
        *messages, {"role": "assistant", "content": r3}]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return lmcli.load(smollm2_gguf)


def test_real_model_second_turn_processes_only_its_new_tokens(smollm2):
    model, tokenizer = smollm2
    n = 24
    session = ChatSession(model, tokenizer, greedy(n), context=512)
    u1, u2 = "What is the capital of France?", "And of Italy?"
    first = session.reply(u1)
    second = session.reply(u2)
    ids1 = tokenizer.encode_chat([{"role": "user", "content": u1}])
    conversation = [{"role": "user", "content": u1}, {"role": "assistant", "content": first.reply},
                    {"role": "user", "content": u2}]
    ids2 = tokenizer.encode_chat(conversation)
    # A real reply tokenises back to the tokens sampled, so the cache held everything but the new turn.
    assert ids2[:len(ids1) + len(first.result.tokens) - 1] == ids1 + first.result.tokens[:-1]
    assert second.prefill_tokens == len(ids2) - len(ids1) - len(first.result.tokens) + 1
    fresh = model.generate(torch.tensor([ids2]), max_new_tokens=n, do_sample=False,
                           eos_token_id=tokenizer.eos_token_ids)
    assert second.result.tokens == fresh[0, len(ids2):].tolist()
    # (What the 4-bit 135M model answers is not checked: its first reply token is a near tie, "The"
    # 0.152 against "L" 0.140 in float32, which any change of rounding in the kernels can flip.)


def test_real_model_ctrl_c_stops_the_reply_not_the_session(smollm2_gguf, smollm2, tmp_path):
    term = Terminal("chat", "-c", str(smollm2_gguf), "--greedy", "-n", "300", "--ignore-eos", cwd=tmp_path)
    term.wait_for(">>> ")
    term.send("Tell me a long story about a cat.\r")
    term.wait_for(r"\n[A-Za-z].{12,}")  # the reply has begun streaming
    term.send("\x03")
    term.wait_for(r"\[interrupted\][^>]*>>> ")
    term.send("/set max_new_tokens 4\r")
    term.wait_for("max_new_tokens 4 ·")  # the settings line, not the echo
    term.send("Thanks!\r")
    term.wait_for(">>> ")
    term.send("/save t.json\r")
    screen = term.wait_for(r"saved 4 messages[^\n]*\n>>> ")
    assert term.finish() == 0, screen
    messages = json.loads((tmp_path / "t.json").read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    _, tokenizer = smollm2
    # The interrupted reply is kept as far as it got: well short of its 300 tokens.
    assert 0 < len(tokenizer.encode(messages[1]["content"])) < 200
    assert 0 < len(tokenizer.encode(messages[3]["content"])) <= 4


# ----------------------------------------------------------------------------- --color-probs


def test_probability_colours_and_shading():
    assert [probability_style(p) for p in (0.05, 0.2, 0.5, 0.8, 0.95, None)] == [
        "bright_red", "dark_orange", "yellow", "green", None, None]

    class Result:
        logprobs: ClassVar[list[dict]] = [{"logprob": -0.01}, {"logprob": -3.0}]

    shading = ProbabilityShading()
    # A piece made of two tokens takes the less likely one's probability; the next piece only its own.
    assert shading.probability(Result()) == pytest.approx(torch.tensor(-3.0).exp().item())
    Result.logprobs.append({"logprob": -0.05})
    assert shading.probability(Result()) == pytest.approx(torch.tensor(-0.05).exp().item())
    assert shading.probability(Result()) is None


def sgr_code(colour: str) -> str:
    """The escape code rich writes for `colour` on a 256-colour terminal (as the pty's TERM says)."""
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="256").print("x", style=colour, end="")
    return re.findall(r"\x1b\[([0-9;]+)m", out.getvalue())[0]


def test_color_probs_in_a_terminal_shades_the_streamed_text(tiny_checkpoint):
    from lmcli.console import visible_controls

    prompt = "Hello world"
    row = json.loads(cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", "12", "--format", "jsonl",
                         "--logprobs", "0", prompt).stdout)
    term = Terminal("generate", "-c", str(tiny_checkpoint), "--greedy", "-n", "12", "--color-probs", prompt)
    term.wait_for("stopped:")
    term.finish()
    # Each piece takes the colour of its least likely token, so every colour shown is one that some
    # token's probability (from the JSON logprobs, computed apart from the colouring) calls for.
    expected = cast(set[str], {probability_style(math.exp(step["logprob"])) for step in row["logprobs"]} - {None})
    assert expected, "every token had p >= 0.9: nothing to colour"
    streamed = term.raw.decode("utf-8", "replace").rpartition(prompt)[2]  # after the (dim) prompt echo
    shown = set(re.findall(r"\x1b\[([0-9;]+)m", streamed)) - {"0", "2"}
    assert shown and shown <= {sgr_code(colour) for colour in expected}
    assert visible_controls(row["completion"]) in term.screen


def test_markdown_redraws_the_finished_reply_rendered():
    import io

    from rich.console import Console

    from lmcli.chat.repl import ChatOptions, _ReplyView

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=60, color_system=None)
    view = _ReplyView(console, terminal=True, options=ChatOptions(markdown=True))
    reply = "Rivers:\n\n- **Danube**\n- Rhine"
    for piece in ("Rivers:\n\n", "- **Danube**\n", "- Rhine"):
        view.write(None, piece)  # type: ignore[arg-type]  # no shading: the row is never read
    view.end(reply, interrupted=False)
    final = ANSI.sub("", out.getvalue()).rpartition("Rivers:")[2]  # the last redraw of the live region
    assert "• Danube" in final and "• Rhine" in final and "**" not in final


def test_a_checkpoint_without_a_chat_template_cannot_chat(tiny_checkpoint, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(tiny_checkpoint, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    result = cli("chat", "-c", plain, input="Hi\n")
    assert result.exit_code == 1
    assert result.stderr == ("error: this checkpoint's tokenizer has no chat template, so it cannot chat;"
                             " 'lmcli generate' completes plain text\n")


def test_context_flags_are_checked_against_the_model(tiny_checkpoint):
    result = cli("chat", "-c", tiny_checkpoint, "--context", "1024", input="Hi\n")
    assert result.exit_code == 2
    assert result.stderr == "error: --context 1024 is more than the model's context (512 tokens)\n"
    result = cli("chat", "-c", tiny_checkpoint, "--context", "64", "-n", "64", input="Hi\n")
    assert result.exit_code == 2 and result.stderr == (
        "error: --max-new-tokens 64 leaves no room for the conversation in the 64-token context;"
        " lower it or raise --context\n")
