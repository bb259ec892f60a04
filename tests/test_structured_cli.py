"""Structured output through the command line, an lmcli job and an OpenAI batch file, on the real default
model (the JSON checked by the jsonschema library, regexes by re.fullmatch), and the flags' bad input."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from real_models import gemma_gguf, smollm2_gguf  # noqa: F401 (fixtures)
from test_structured import PERSON, PHONE, SUMS, TAGS, is_sum
from typer.testing import CliRunner

from lmcli.cli import app

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_generate_with_a_schema_file_streams_its_final_text(smollm2_gguf, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    flags = ("-c", smollm2_gguf, "--chat", "--seed", "3", "--json-schema", schema)
    streamed = cli("generate", *flags, "Describe a person.")
    assert streamed.exit_code == 0, streamed.output
    row = cli("generate", *flags, "--format", "jsonl", "Describe a person.")
    [line] = row.stdout.splitlines()
    result = json.loads(line)
    assert streamed.stdout.rstrip("\n") == result["completion"]
    assert result["finish_reason"] == "eos", result  # the default limit with a schema holds a whole object
    jsonschema.validate(json.loads(result["completion"]), PERSON)
    assert result["settings"]["json_schema"] == PERSON


def test_job_rows_each_with_their_own_constraint(smollm2_gguf, tmp_path):
    grammar = tmp_path / "sums.lark"
    grammar.write_text(SUMS)
    rows = [
        {"id": "person", "prompt": "A person as JSON:", "json_schema": PERSON, "seed": 1, "max_new_tokens": 120},
        {"id": "tags", "prompt": "Colours:", "json_schema": TAGS, "seed": 2, "max_new_tokens": 120},
        {"id": "phone", "prompt": "Phone number:", "regex": PHONE, "seed": 3, "max_new_tokens": 120},
        {"id": "sum", "prompt": "A sum:", "grammar": SUMS, "seed": 4, "max_new_tokens": 120},
        {"id": "any", "prompt": "Some JSON:", "json": True, "seed": 5, "max_new_tokens": 120},
        {"id": "free", "prompt": "Hello", "max_new_tokens": 5, "seed": 6},
        {"id": "bad", "prompt": "x", "regex": "(unclosed"},
        {"id": "two", "prompt": "x", "regex": "a", "json": True},
        {"id": "keyword", "prompt": "x", "json_schema": {"type": "array", "contains": {"type": "integer"}}},
    ]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    result = cli("generate", "-c", smollm2_gguf, "--chat", "--input", source, "-o", out)
    assert result.exit_code == 1, result.output  # some rows are errors; the others are written
    by_id = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert len(by_id) == len(rows)
    assert '"regex"' in by_id["bad"]["error"] and "unclosed group" in by_id["bad"]["error"]
    assert "cannot be combined" in by_id["two"]["error"]
    assert '["contains"]' in by_id["keyword"]["error"]
    judges = {"person": lambda t: jsonschema.validate(json.loads(t), PERSON),
              "tags": lambda t: jsonschema.validate(json.loads(t), TAGS),
              "phone": lambda t: re.fullmatch(PHONE, t) or pytest.fail(t),
              "sum": lambda t: is_sum(t) or pytest.fail(t),
              "any": lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)}
    for name, judge in judges.items():
        row = by_id[name]
        assert "error" not in row, row
        if row["finish_reason"] != "length":  # a row cut by the token limit is not claimed valid
            assert row["finish_reason"] == "eos", row
            judge(row["completion"])
    assert sum(by_id[name]["finish_reason"] == "eos" for name in judges) >= 4
    assert by_id["free"]["finish_reason"] == "length"


def test_openai_batch_response_format(smollm2_gguf, tmp_path):
    def request(custom_id, response_format, **body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "Reply in JSON."}], "seed": 7,
                         "response_format": response_format, "max_tokens": 120, **body}}

    requests = [
        request("schema", {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS, "strict": True}}),
        request("object", {"type": "json_object"}),
        request("text", {"type": "text"}, max_tokens=4),
        request("bad-type", {"type": "yaml"}),
        request("bad-schema", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}),
    ]
    source = tmp_path / "batch.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp_path / "out.jsonl"
    result = cli("generate", "-c", smollm2_gguf, "--input", source, "-o", out)
    assert result.exit_code == 1, result.output
    by_id = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    for name, check in (("schema", lambda v: jsonschema.validate(v, TAGS)), ("object", lambda v: isinstance(v, dict))):
        choice = by_id[name]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice  # OpenAI's name for end-of-text
        assert check(json.loads(choice["message"]["content"])) is not False
    assert by_id["text"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert "response_format" in by_id["bad-type"]["error"]["message"]
    assert "Invalid type: strng" in by_id["bad-schema"]["error"]["message"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--json", "--regex", "a"], "--json and --regex cannot be combined"),
    (["--json-schema", '{"type": "object"'], "--json-schema: not valid JSON"),
    (["--json-schema", "missing.json"], "--json-schema missing.json: No such file or directory"),
    (["--json-schema", '{"type": "object", "requird": []}'], "unsupported schema keyword 'requird'"),
    (["--regex", "(?=a)b"], "look-around"),
    (["--grammar", "missing.lark"], "--grammar missing.lark: No such file or directory"),
    (["--json", "--ignore-eos"], "--ignore-eos cannot be combined with a constraint"),
])
def test_bad_flags_are_usage_errors_before_the_model_loads(flags, message, tmp_path):
    result = cli("generate", "-c", tmp_path, *flags, "hi")  # an empty directory: loading it would fail
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_bad_grammar_file_is_named(tmp_path):
    grammar = tmp_path / "bad.lark"
    grammar.write_text("start: (\n")
    result = cli("generate", "-c", tmp_path, "--grammar", grammar, "hi")
    assert result.exit_code == 2 and f"--grammar {grammar}:" in result.output, result.output


def test_chat_set_changes_the_constraint(tiny_checkpoint):
    from lmcli.chat.repl import ChatError, ChatSession
    from lmcli.loading import load
    from lmcli.settings.generation_settings import GenerationSettings

    model, tokenizer = load(tiny_checkpoint)
    session = ChatSession(model, tokenizer, GenerationSettings.from_flags(chat=True, seed=1, max_new_tokens=8))
    constraint = session.set_setting("regex", "[0-9]{3}").constraint
    assert constraint is not None and constraint.source == "[0-9]{3}"
    turn = session.reply("Digits?")
    assert re.fullmatch("[0-9]{3}", session.messages[-1]["content"]), turn
    assert session.set_setting("regex", "off").constraint is None
    with pytest.raises(ChatError, match="/set regex: invalid regex"):
        session.set_setting("regex", "(a")


PATHOLOGICAL = "((((a|b|c|d|e){1,10}){1,10}){1,10}){1,10}"  # grows the engine's lexer past its limits


def test_stop_string_streams_its_final_text(smollm2_gguf, tmp_path):
    """A stop string inside constrained text: the text held back while it might be the stop string is
    the same streamed as written, and the row says "stop" (its text is cut, so not claimed valid)."""
    flags = ("-c", smollm2_gguf, "--chat", "--seed", "3", "--json-schema", json.dumps(PERSON), "--stop", '"role"')
    streamed = cli("generate", *flags, "Describe a person.")
    assert streamed.exit_code == 3 and "a --stop string" in streamed.stderr, streamed.output  # cut: not valid
    [line] = cli("generate", *flags, "--format", "jsonl", "Describe a person.").stdout.splitlines()
    result = json.loads(line)
    assert result["finish_reason"] == "stop", result
    assert streamed.stdout.rstrip("\n") == result["completion"]
    assert result["completion"].startswith('{"name": "') and '"ro' not in result["completion"], result


# --grammar under `make test-full`: the flag reads its file as --json-schema does (tested above), and grammars
# are judged on the real model in the job rows test.
@pytest.mark.parametrize("kind", ["regex", pytest.param("grammar", marks=pytest.mark.full)])
def test_regex_and_grammar_flags_on_the_default_model(smollm2_gguf, tmp_path, kind):
    grammar = tmp_path / "sums.lark"
    grammar.write_text(SUMS)
    flag, prompt, judge = {"regex": (["--regex", PHONE], "What is the phone number?", lambda t: re.fullmatch(PHONE, t)),
                           "grammar": (["--grammar", grammar], "Write a sum.", is_sum)}[kind]
    result = cli("generate", "-c", smollm2_gguf, "--chat", "--greedy", *flag, "--format", "jsonl", prompt)
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["finish_reason"] == "eos" and judge(row["completion"]), row


def test_a_row_cut_by_the_token_limit_says_length(smollm2_gguf):
    result = cli("generate", "-c", smollm2_gguf, "--chat", "--greedy", "-n", "6", "--json-schema", json.dumps(PERSON),
                 "--format", "jsonl", "Describe a person.")
    assert result.exit_code == 3 and "-n 6" in result.stderr, result.output  # the row is written, and said to be cut
    row = json.loads(result.stdout)
    assert row["finish_reason"] == "length" and row["completion_tokens"] == 6 and "error" not in row, row
    with pytest.raises(json.JSONDecodeError):
        json.loads(row["completion"])  # an unfinished object: nothing may take it for a valid one


def test_a_pathological_regex_is_stopped_and_reported(smollm2_gguf):
    result = cli("generate", "-c", smollm2_gguf, "--greedy", "-n", "30", "--regex", PATHOLOGICAL, "aaaa")
    assert result.exit_code == 1, result.output
    [message] = [line for line in result.output.splitlines() if "--regex" in line]
    assert "too many" in message and "Traceback" not in result.output, result.output


def test_job_rows_the_engine_or_the_vocabulary_refuse_are_error_rows(smollm2_gguf, tmp_path):
    """A row no token can start, and one past the engine's limits, are error rows; the job goes on."""
    rows = [{"id": "impossible", "prompt": "x", "regex": r"[^\x00-\U0010FFFF]"},
            {"id": "limits", "prompt": "aaaa", "regex": PATHOLOGICAL, "temperature": 0, "max_new_tokens": 30},
            {"id": "free", "prompt": "Hello", "max_new_tokens": 3, "seed": 1}]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    result = cli("generate", "-c", smollm2_gguf, "--input", source, "-o", out)
    assert result.exit_code == 1, result.output
    by_id = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert "no text at all can satisfy it" in by_id["impossible"]["error"], by_id
    assert "too many" in by_id["limits"]["error"], by_id
    assert "error" not in by_id["free"] and by_id["free"]["finish_reason"] == "length", by_id


def test_an_openai_row_the_engine_gave_up_on_is_an_error_row():
    from types import SimpleNamespace

    from lmcli.jobs.openai_batch import CHAT, response_row

    result = SimpleNamespace(error="--json-schema: too many lexer states", text=SimpleNamespace(text='{"a'))
    row = response_row("r1", CHAT, result, "model", {"input_hash": "abc"})
    assert row["response"] is None and row["error"]["message"] == "--json-schema: too many lexer states", row


@pytest.mark.full  # Gemma 3's 262k vocabulary: its engine tokenizer alone takes seconds to build
def test_gemma_job_and_openai_batch(gemma_gguf, tmp_path):
    """On Gemma 3 (its GGUF has no chat template: plain prompts), an lmcli job and an OpenAI batch file
    of completions with a schema, a regex and response_format; judged by jsonschema and re.fullmatch."""
    rows = [{"id": f"person{seed}", "prompt": "A person as JSON:", "json_schema": PERSON, "seed": seed,
             "max_new_tokens": 120} for seed in (1, 2)]
    rows.append({"id": "phone", "prompt": "Phone number:", "regex": PHONE, "seed": 3})
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    result = cli("generate", "-c", gemma_gguf, "--input", source, "-o", out)
    assert result.exit_code == 0, result.output
    ended = 0
    for row in map(json.loads, out.read_text().splitlines()):
        if row["finish_reason"] == "eos":
            ended += 1
            if row["id"] == "phone":
                assert re.fullmatch(PHONE, row["completion"]), row
            else:
                jsonschema.validate(json.loads(row["completion"]), PERSON)
    requests = [{"custom_id": f"tags{seed}", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": "Colours as JSON:", "seed": seed, "max_tokens": 120, "response_format":
                          {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS, "strict": True}}}}
                for seed in (4, 5)]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in requests))
    result = cli("generate", "-c", gemma_gguf, "--input", batch, "-o", tmp_path / "batch_out.jsonl")
    assert result.exit_code == 0, result.output
    for row in map(json.loads, (tmp_path / "batch_out.jsonl").read_text().splitlines()):
        choice = row["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            ended += 1
            jsonschema.validate(json.loads(choice["text"]), TAGS)
    assert ended >= 3
