"""Structured output at its limits (issue 31): an output a limit cuts before its constraint is complete
says so and exits 3; schema and grammar files are read with a bound whatever they are (/dev/zero, a
FIFO); JSON nested past the depth limit is one error (a flag's, a chat /set's, a job row's) and never
a RecursionError, and the good rows of a job still run; OpenAI's response_format refuses what it
would otherwise drop; the engine's errors give the real reason.

Judges: the JSON parser and re.fullmatch for the text, a recursive depth count written here
for the depth scanner, a job without the bad rows for the good rows' results.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import threading

import pytest
from cli_fixtures import subprocess_env, tiny_checkpoint, tiny_spm_checkpoint  # noqa: F401 (fixtures)
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lmcli.cli import app
from lmcli.generation.constraints import Constraint, ConstraintError, ConstraintMask

# The issue's repro: without "additionalProperties": false the default model adds keys until the limit.
CITY = {"type": "object", "required": ["city", "capital"],
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}, "capital": {"type": "boolean"}}}
PROMPT = "The capital of France is"
# lmcli.io.bounded's limits, written out so this module imports on a checkout without them (the test of
# each defect then fails there one by one, rather than the whole module at import).
MAX_JSON_DEPTH, MAX_ROW_DEPTH = 100, 110


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def run(*args, limit_memory: int | None = None, timeout: float = 120):
    """`python -m lmcli ARGS` in a subprocess, optionally under an address-space bound (bytes)."""
    def bound() -> None:
        if limit_memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_memory, limit_memory))

    return subprocess.run([sys.executable, "-m", "lmcli", *map(str, args)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=timeout, preexec_fn=bound)


def one_line(stderr: str) -> str:
    assert stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr
    return stderr.removeprefix("error: ").rstrip("\n")


def nested_schema(levels: int) -> dict:
    """An array of arrays ... of strings: 1 JSON level per schema level (each "items" an object)."""
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def depth(value) -> int:
    """The reference: how deep arrays and objects nest, counted recursively."""
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


# --- defect 3: a limit that cuts a structured output -----------------------------------------------


@pytest.mark.full  # 200 masked tokens; the same cut at -n 6 on the real model: test_structured_cli.py
def test_a_schema_cut_by_n_says_so_names_the_limit_and_exits_3(smollm2_gguf):
    """The issue's repro (as a JSONL row, to see its finish reason; plain text takes the same path): the
    text is written and is not JSON (the parser says so), stderr names -n 200, exit 3, and the row keeps
    finish_reason "length"."""
    result = cli("generate", "-c", smollm2_gguf, "--greedy", "-n", "200", "--json-schema", json.dumps(CITY),
                 "--format", "jsonl", PROMPT)
    assert result.exit_code == 3, result.output
    message = one_line(result.stderr)
    assert "-n 200" in message and "JSON Schema" in message and "not valid" in message, message
    [line] = result.stdout.splitlines()
    row = json.loads(line)
    assert row["finish_reason"] == "length" and row["completion_tokens"] == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(row["completion"])


def test_a_complete_output_exits_0_even_when_the_limit_lands_on_its_last_token(tiny_checkpoint):
    """A regex of exactly five letters ends at end-of-text: exit 0. Given exactly its tokens as -n, the row
    ends by the limit with the text complete (re.fullmatch is the judge): still exit 0, nothing on stderr;
    one token fewer is cut, and says so."""
    import re

    flags = ("generate", "-c", tiny_checkpoint, "--greedy", "--regex", "[a-z]{5}", "--format", "jsonl")
    whole = cli(*flags, "hello")
    assert whole.exit_code == 0, whole.output
    row = json.loads(whole.stdout)
    assert row["finish_reason"] == "eos" and re.fullmatch("[a-z]{5}", row["completion"])
    tokens = row["completion_tokens"] - 1  # without its end-of-text
    exact = cli(*flags, "-n", tokens, "hello")
    assert exact.exit_code == 0 and exact.stderr == "", exact.output
    cut_there = json.loads(exact.stdout)
    assert cut_there["finish_reason"] == "length" and cut_there["completion"] == row["completion"]
    short = cli(*flags, "-n", tokens - 1, "hello")
    assert short.exit_code == 3 and f"-n {tokens - 1}" in one_line(short.stderr), short.output
    assert not re.fullmatch("[a-z]{5}", json.loads(short.stdout)["completion"])


def test_a_regex_cut_by_the_models_limit_and_by_a_stop_string_names_each(tiny_checkpoint, tmp_path):
    """The tiny model under a regex that cannot end before 4,000 characters: a limit from the model's
    generation_config.json is named as such (no -n given); -n and a stop string that cut it are named too."""
    import shutil

    checkpoint = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint, checkpoint)
    (checkpoint / "generation_config.json").write_text('{"max_new_tokens": 12}')
    result = cli("generate", "-c", checkpoint, "--greedy", "--regex", "[a-z ]{4000}", "hello")
    assert result.exit_code == 3, result.output
    limit = f"the token limit of 12 (from {checkpoint / 'generation_config.json'}; set one with -n)"
    assert limit in one_line(result.stderr)
    row = cli("generate", "-c", checkpoint, "--greedy", "-n", 10, "--regex", "[a-z ]{4000}", "--format", "jsonl", "hello")
    assert row.exit_code == 3 and "-n 10" in one_line(row.stderr) and json.loads(row.stdout)["finish_reason"] == "length"
    stopped = cli("generate", "-c", checkpoint, "--greedy", "-n", 30, "--regex", "[a-z ]{4000}", "--stop", "e", "hello")
    assert stopped.exit_code == 3 and "a --stop string" in one_line(stopped.stderr), stopped.output


# --- defect 5: schema and grammar files read with a bound ------------------------------------------


@pytest.mark.parametrize("flag", ["--json-schema", "--grammar"])
def test_a_device_file_is_refused_within_a_memory_bound(flag, tmp_path):
    """/dev/zero never ends: read past 1 MiB it is refused in one line, in a process whose address space
    is bounded (1.5 GiB: the interpreter and its libraries, not the gigabytes an unbounded read takes)."""
    result = run("generate", flag, "/dev/zero", "hi", limit_memory=3 << 29, timeout=60)
    assert result.returncode == 2, result.stderr
    assert one_line(result.stderr) == f"{flag} /dev/zero: more than the 1 MiB lmcli reads"


@pytest.mark.parametrize("flag", ["--json-schema", "--grammar"])
def test_a_fifo_is_read_with_the_same_bound(flag, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def feed() -> None:  # 2 MiB of schema-looking text, then the end of the pipe
        with contextlib.suppress(BrokenPipeError), open(fifo, "w") as pipe:  # the reader may stop at its bound
            pipe.write(" " * (2 << 20))

    writer = threading.Thread(target=feed)
    writer.start()
    result = run("generate", flag, fifo, "hi", limit_memory=3 << 29, timeout=60)
    writer.join(timeout=60)
    assert result.returncode == 2 and one_line(result.stderr) == f"{flag} {fifo}: more than the 1 MiB lmcli reads"


# --- defect 6: nesting ---------------------------------------------------------------------------


def test_the_depth_scanner_agrees_with_a_recursive_count():
    """text_deeper_than (no parse, no recursion) and value_deeper_than against `depth` on random JSON,
    strings full of brackets included."""
    from lmcli.io import bounded
    from lmcli.io.bounded import text_deeper_than, value_deeper_than

    assert (bounded.MAX_JSON_DEPTH, bounded.MAX_ROW_DEPTH) == (MAX_JSON_DEPTH, MAX_ROW_DEPTH)
    rng = random.Random(0)

    def value(level: int):
        kind = rng.choice(["dict", "list", "str", "num"] if level < 12 else ["str", "num"])
        if kind == "dict":
            return {f"k{i}[{{": value(level + 1) for i in range(rng.randint(0, 3))}
        if kind == "list":
            return [value(level + 1) for _ in range(rng.randint(0, 3))]
        return rng.choice(['[[{"', "]}\\", "x", "\\\"[", "plain"]) if kind == "str" else rng.random()

    for _ in range(300):
        item = value(0)
        text = json.dumps(item)
        for limit in (0, 1, 2, 3, 5, 8):
            assert text_deeper_than(text, limit) == (depth(item) > limit), (text, limit)
            assert value_deeper_than(item, limit) == (depth(item) > limit), (text, limit)
    assert text_deeper_than("[" * 100_000 + "]" * 100_000, MAX_ROW_DEPTH)
    assert not value_deeper_than(json.loads("[" * 100 + "]" * 100), MAX_JSON_DEPTH)


def test_a_schema_at_the_depth_limit_works_and_one_level_more_is_one_error():
    at_limit = nested_schema(MAX_JSON_DEPTH)
    assert depth(at_limit) == MAX_JSON_DEPTH
    Constraint.parse("json_schema", at_limit)
    Constraint.parse("json_schema", json.dumps(at_limit))
    deep_text = '{"type": "array", "items": ' * 2999 + '{"type": "string"}' + "}" * 2999  # json.dumps would recurse
    for deeper in (nested_schema(MAX_JSON_DEPTH + 1), deep_text):
        with pytest.raises(ConstraintError, match=f"nests arrays and objects more than {MAX_JSON_DEPTH} levels"):
            Constraint.parse("json_schema", deeper)


def test_a_3000_level_schema_on_the_command_line_is_a_usage_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"type": "array", "items": ' * 2999 + "{}" + "}" * 2999)
    for given in (deep, deep.read_text()):
        result = run("generate", "--json-schema", given, "hi")
        assert result.returncode == 2
        assert one_line(result.stderr) == f"--json-schema: the schema nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"


def test_a_deep_schema_or_stop_list_in_chat_is_an_error_the_session_survives(tmp_path):
    """`/set json_schema deep.json` (and a deep `/set stop [[[...]]]`) raise the one-line ChatError that
    the interactive loop prints; the session keeps its settings."""
    from types import SimpleNamespace

    from lmcli.chat.session import ChatError, ChatSession
    from lmcli.settings.generation_settings import GenerationSettings

    deep = tmp_path / "deep.json"
    deep.write_text('{"type": "array", "items": ' * 2999 + "{}" + "}" * 2999)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256))
    session = ChatSession(model, SimpleNamespace(chat_template="{{ x }}"), GenerationSettings(max_new_tokens=8))
    with pytest.raises(ChatError, match="more than 100 levels deep"):
        session.set_setting("json_schema", str(deep))
    with pytest.raises(ChatError, match="cannot read"):
        session.set_setting("stop", "[" * 5000 + "]" * 5000)
    assert session.settings.constraint is None and session.settings.stop == ()
    from lmcli.chat.session import load_transcript

    transcript = tmp_path / "deep-transcript.json"  # what `lmcli chat --resume` reads
    transcript.write_text('{"format": "lmcli-chat", "messages": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(ChatError, match=f"nest more than {MAX_ROW_DEPTH} levels deep"):
        load_transcript(transcript)


def test_deep_rows_are_error_rows_and_the_good_rows_run(tiny_checkpoint, tmp_path):
    """Rows nested 5,000 deep (a row's json_schema, its logit_bias) among good rows: the job goes on;
    the bad rows are error rows naming the depth; the good rows equal a job of them alone."""
    deep_list = "[" * 5000 + "]" * 5000
    good = ['{"id": "a", "prompt": "hello"}', '{"id": "b", "prompt": "the quick"}']
    rows = [good[0],
            '{"id": "s", "prompt": "x", "json_schema": ' + '{"type": "array", "items": ' * 2500 + "{}" + "}" * 2500 + "}",
            '{"id": "l", "prompt": "x", "logit_bias": {"5": ' + deep_list + "}}",
            good[1]]
    source, alone = tmp_path / "in.jsonl", tmp_path / "alone.jsonl"
    source.write_text("\n".join(rows) + "\n")
    alone.write_text("\n".join(good) + "\n")
    out, reference = tmp_path / "out.jsonl", tmp_path / "reference.jsonl"
    result = cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", 4, "--input", source, "-o", out)
    assert result.exit_code == 1, result.output
    assert cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", 4, "--input", alone, "-o", reference).exit_code == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    errors = sorted(row["error"] for row in written if "error" in row)
    assert errors == [f"line {n}: arrays and objects nest more than {MAX_ROW_DEPTH} levels deep" for n in (2, 3)]
    by_id = {row["id"]: row["completion"] for row in written if "error" not in row}
    assert by_id == {row["id"]: row["completion"] for row in map(json.loads, reference.read_text().splitlines())}


@pytest.mark.parametrize("deep_first", [False, True])
def test_a_deep_openai_response_format_is_an_error_row_wherever_it_is(tiny_checkpoint, tmp_path, deep_first):
    """An OpenAI request whose response_format nests 5,000 deep: an error row, even as the first line
    (which decides the file's format), and the other requests are answered."""
    schema = '{"type": "array", "items": ' * 2500 + "{}" + "}" * 2500
    deep = ('{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", '
            '"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": ' + schema + "}}}}")
    good = [json.dumps({"custom_id": c, "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": p, "max_tokens": 3, "temperature": 0}}) for c, p in (("a", "hello"), ("b", "the"))]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([deep, *good] if deep_first else [good[0], deep, good[1]]) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli("generate", "-c", tiny_checkpoint, "--input", source, "-o", out).exit_code == 1
    written = [json.loads(line) for line in out.read_text().splitlines()]
    answered = {row["custom_id"] for row in written if row["response"] is not None}
    failed = [row["error"]["message"] for row in written if row["response"] is None]
    assert answered == {"a", "b"}
    assert failed == [f"line {1 if deep_first else 2}: arrays and objects nest more than {MAX_ROW_DEPTH} levels deep"]


# --- defect 8: response_format drops nothing -------------------------------------------------------


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_object", "schema": {"type": "object"}},
     'body field "response_format" has "schema", which "type": "json_object" does not take (it takes type)'),
    ({"type": "text", "json_schema": {}},
     'body field "response_format" has "json_schema", which "type": "text" does not take (it takes type)'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "bogus": 1}},
     'body field "response_format": "json_schema" has "bogus", which lmcli does not know '
     "(it takes name, description, schema, strict)"),
    ({"type": "xml"}, 'body field "response_format" must be an object with "type": "text", "json_object" or '
                      '"json_schema" (it has "type": "xml")'),
    ("json", 'body field "response_format" must be an object with "type": "text", "json_object" or '
             '"json_schema" (it has no "type")'),
])
def test_response_format_refuses_what_it_does_not_take(response_format, message):
    from lmcli.jobs.openai_batch import in_body_terms, parse_request
    from lmcli.settings.generation_settings import RowError

    request = {"custom_id": "a", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format}}
    with pytest.raises(RowError) as caught:
        parse_request(request)
    assert in_body_terms(str(caught.value), request) == message


def test_response_format_schema_errors_still_name_the_body_field(tiny_checkpoint, tmp_path):
    request = {"custom_id": "a", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "hi"}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"requird": []}}}}}
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(request) + "\n")
    cli("generate", "-c", tiny_checkpoint, "--input", source, "-o", out)
    [row] = map(json.loads, out.read_text().splitlines())
    assert row["error"]["message"] == "line 1: body field \"response_format\": unsupported schema keyword 'requird' at /"


# --- defect 10: the engine's reasons ----------------------------------------------------------------


def ascii_tokenizer(directory):
    """A byte-level BPE tokenizer trained on ASCII text only, without the byte alphabet: no token holds
    the bytes of "Ω" (0xCE 0xA9), so this vocabulary cannot write it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lmcli.io.tokenizer import load_tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["</s>"], initial_alphabet=[], show_progress=False)
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog 0123456789 {}[]:,\""] * 10, trainer)
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    loaded = load_tokenizer(directory)
    assert loaded is not None
    return loaded, loaded.backend.get_vocab_size()


def test_an_empty_language_is_told_apart_from_a_vocabulary_that_cannot_write_it(tiny_checkpoint, tmp_path):
    """{"$ref": "#"} and an empty character class match no text at all, whatever the vocabulary; "Ω" is
    text an ASCII-only vocabulary cannot write, and a byte-level one with every byte can."""
    import lmcli

    model, tokenizer = lmcli.load(tiny_checkpoint)
    for kind, value in (("json_schema", {"$ref": "#"}), ("regex", r"[^\x00-\U0010FFFF]")):
        with pytest.raises(ConstraintError, match="no text at all can satisfy it") as caught:
            ConstraintMask(tokenizer, [Constraint.parse(kind, value)], model.config.vocab_size)
        assert ('"$ref"' in str(caught.value)) == (kind == "json_schema")
    ascii_only, size = ascii_tokenizer(tmp_path / "ascii")
    with pytest.raises(ConstraintError, match="no token of this model's vocabulary can start it"):
        ConstraintMask(ascii_only, [Constraint.parse("regex", "Ω+")], size)
    ConstraintMask(ascii_only, [Constraint.parse("regex", "o+")], size)
    ConstraintMask(tokenizer, [Constraint.parse("regex", "Ω+")], model.config.vocab_size)


def test_a_tokenizer_the_engine_cannot_read_is_one_error(tiny_spm_checkpoint):
    import lmcli

    model, tokenizer = lmcli.load(tiny_spm_checkpoint)
    with pytest.raises(ConstraintError, match="this model's tokenizer cannot be used with a constraint"):
        ConstraintMask(tokenizer, [Constraint.parse("regex", "a+")], model.config.vocab_size)


def test_a_oneof_error_names_an_option_lmcli_takes_and_the_option_works():
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    with pytest.raises(ConstraintError) as caught:
        Constraint.parse("json_schema", overlapping)
    message = str(caught.value)
    assert "anyOf" in message and '"x-guidance": {"coerce_one_of": true}' in message, message
    assert "Enable" not in message  # the engine's own wording names a Rust option, not a schema key
    Constraint.parse("json_schema", {**overlapping, "x-guidance": {"coerce_one_of": True}})
    Constraint.parse("json_schema", {"anyOf": overlapping["oneOf"]})


def test_a_chat_reply_a_limit_cuts_is_said_and_the_chat_goes_on(tiny_checkpoint):
    """In `lmcli chat` the cut reply is shown as it came, with one warning line per reply; the session
    goes on to the next message (exit 0: a conversation is not one output)."""
    result = CliRunner().invoke(app, ["chat", "-c", str(tiny_checkpoint), "--greedy", "--regex", "[a-z ]{4000}",
                                      "-n", "5"], input="Hi\nHello\n")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: the output stopped at -n 5 before its regular expression (--regex) was complete, "
                        "so it is not valid: raise -n"] * 2, result.stderr
