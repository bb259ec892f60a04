"""The README's shown output is what the current code prints.

Marker format: an HTML comment on the line just before a fenced code block,

    <!-- check -->          checked in `make test`
    <!-- check: full -->    checked under `make test-full` only (slow: a job, a chat)

marks that block as a transcript. In it, each line starting with `$ ` is a command, run with bash in a
fresh directory of the block's own (so a block never depends on another); the lines after it, up to
the next `$ ` line, are what it prints (stdout and stderr together). `lmcli` runs this checkout
(`python -m lmcli`) on the real default model, on one thread. Two conveniences keep transcripts honest:

- `$ cat FILE` where FILE does not exist yet writes the lines shown under it to FILE first: that is how
  a block gives its input files, and the reader sees exactly what the command read.
- `…` in an expected line stands for any text (a timestamp, a random id, a speed); every other
  character must match. Trailing spaces and trailing blank lines are ignored.

Commands are greedy or seeded, so their text is deterministic. `LMCLI_README_UPDATE=1` rewrites the
README's transcripts with what the commands print now (keeping each `…` line as it is), for review.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_fixtures import subprocess_env
from real_models import smollm2_gguf  # noqa: F401 (a fixture: the default model, or a skip)

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r"^<!-- check(?:: (?P<kind>full))? -->\n```[\w-]*\n(?P<body>.*?)^```$", re.M | re.S)


@dataclass
class Command:
    line: str
    expected: list[str]


@dataclass
class Block:
    start: int  # line number in README.md, for the test's id
    full: bool
    commands: list[Command]
    span: tuple[int, int]  # the body's character span in the README


def blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    found = []
    for match in MARKER.finditer(text):
        commands: list[Command] = []
        for line in match.group("body").splitlines():
            if line.startswith("$ "):
                commands.append(Command(line[2:], []))
            elif commands:
                commands[-1].expected.append(line)
        assert commands, f"README.md line {text[:match.start()].count(chr(10)) + 1}: a checked block without a `$ ` command"
        found.append(Block(text[:match.start()].count("\n") + 1, match.group("kind") == "full", commands,
                           match.span("body")))
    return found


def _matches(expected: list[str], actual: list[str]) -> bool:
    def trim(lines: list[str]) -> list[str]:
        lines = [line.rstrip() for line in lines]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    expected, actual = trim(expected), trim(actual)
    return len(expected) == len(actual) and all(
        re.fullmatch(".*?".join(map(re.escape, e.split("…"))), a, re.S) if "…" in e else e == a
        for e, a in zip(expected, actual))


def run_block(block: Block, directory: Path) -> list[list[str]]:
    """Each command's output lines, in order."""
    # The user's defaults: packed weights (later starts map the loaded model: the same logits, bit for bit)
    # and a prompt cache on disk, this block's own (a first run: what another block wrote is not read).
    env = subprocess_env(LMCLI_PACKED_CACHE="1", LMCLI_PROMPT_CACHE=str(directory / ".prompt-cache"))
    prelude = f"lmcli() {{ {shlex.quote(sys.executable)} -m lmcli \"$@\"; }}\n"
    outputs = []
    for command in block.commands:
        written = re.fullmatch(r"cat (\S+)", command.line)
        if written and not (directory / written.group(1)).exists():
            (directory / written.group(1)).write_text("\n".join(command.expected).rstrip("\n") + "\n")
        result = subprocess.run(["bash", "-c", prelude + command.line], cwd=directory, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
        outputs.append(result.stdout.splitlines())
    return outputs


def _cases(full: bool) -> list:
    return [pytest.param(block, id=f"line{block.start}") for block in blocks() if block.full == full]


def _check(block: Block, tmp_path: Path) -> None:
    outputs = run_block(block, tmp_path)
    for command, actual in zip(block.commands, outputs):
        assert _matches(command.expected, actual), (
            f"README.md line {block.start}: `{command.line}` printed\n" + "\n".join(actual)
            + "\n--- where the README shows ---\n" + "\n".join(command.expected))


@pytest.mark.parametrize("block", _cases(full=False))
def test_readme_transcript(block, tmp_path, smollm2_gguf):
    _check(block, tmp_path)


@pytest.mark.full
@pytest.mark.parametrize("block", _cases(full=True))
def test_readme_transcript_full(block, tmp_path, smollm2_gguf):
    _check(block, tmp_path)


def test_the_marker_format():
    """The parser on a README written here: commands, outputs, `cat` inputs, wildcards, the full marker."""
    text = ("intro\n<!-- check -->\n```\n$ cat a.txt\nx\ny\n$ wc -l < a.txt\n2\n```\n"
            "<!-- check: full -->\n```console\n$ echo 'at 12:00'\nat …\n```\n```\n$ not checked\n```\n")
    found = blocks(text)
    assert [(b.start, b.full, [(c.line, c.expected) for c in b.commands]) for b in found] == [
        (2, False, [("cat a.txt", ["x", "y"]), ("wc -l < a.txt", ["2"])]),
        (10, True, [("echo 'at 12:00'", ["at …"])]),
    ]
    assert _matches(["at …", ""], ["at 12:00"]) and not _matches(["at …"], ["by 12:00"])
    assert not _matches(["a"], ["a", "b"])


def update_readme() -> None:
    """Rewrite every checked transcript with what its commands print now (`…` lines kept)."""
    import tempfile

    text = README.read_text()
    only = {int(n) for n in os.environ.get("LMCLI_README_LINES", "").split(",") if n}  # some blocks, by line
    for block in reversed(blocks(text)):
        if only and block.start not in only:
            continue
        with tempfile.TemporaryDirectory() as directory:
            outputs = run_block(block, Path(directory))
        lines = []
        for command, actual in zip(block.commands, outputs):
            lines.append(f"$ {command.line}")
            keep = command.expected if _matches(command.expected, actual) else actual
            lines += [line.rstrip() for line in keep]
            while lines and not lines[-1]:
                lines.pop()
        start, end = block.span
        text = text[:start] + "\n".join(lines) + "\n" + text[end:]
    README.write_text(text)


if __name__ == "__main__" and os.environ.get("LMCLI_README_UPDATE") == "1":
    import tempfile

    os.environ["LMCLI_CACHE_DIR"] = tempfile.mkdtemp(prefix="lmcli-readme-")  # as the suite: a fresh cache
    os.environ["LMCLI_COMPILE"] = "0"
    update_readme()
