"""Structured output (lmcli.generation.constraints) on the real default model: every completion that ends
at end-of-text (not cut by the token limit) is checked by an independent judge (the jsonschema library,
Python's re.fullmatch, a parser written here), a batch of mixed constraints equals each row alone, and
each bad input is one clear error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from real_models import gemma_gguf, smollm2_gguf  # noqa: F401

import lmcli
from lmcli.generation.constraints import Constraint, ConstraintError, ConstraintMask, one_constraint
from lmcli.generation.sampling import LogitBias

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10},
                   "minItems": 2, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "scores"],
    "additionalProperties": False,
}
TAGS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
# Sums of small numbers in brackets, e.g. "[3+[10+2]]"; checked below by a parser written for the test.
SUMS = 'start: expr\nexpr: NUMBER | "[" expr "+" expr "]"\nNUMBER: /[1-9][0-9]?/\n'


def is_sum(text: str) -> bool:
    def expr(i: int) -> int:
        if text.startswith("[", i):
            i = expr(i + 1)
            if not text.startswith("+", i):
                raise ValueError
            i = expr(i + 1)
            if not text.startswith("]", i):
                raise ValueError
            return i + 1
        number = re.match(r"[1-9][0-9]?", text[i:])
        if number is None:
            raise ValueError
        return i + number.end()

    try:
        return expr(0) == len(text)
    except ValueError:
        return False


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return lmcli.load(smollm2_gguf)


def run(model, tokenizer, prompts, constraints, seeds, max_new_tokens=60, extra=(), chat=True, overlap=True):
    """Completions as (text, ended_at_eos) per row, from one left-padded generate() call; `overlap`:
    the masks built beside the forward pass (the default) or after it."""
    encoded = [tokenizer.encode_chat([{"role": "user", "content": p}]) if chat else tokenizer.encode(p)
               for p in prompts]
    width = max(map(len, encoded))
    pad = tokenizer.eos_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    attention = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    mask = ConstraintMask(tokenizer, constraints, model.config.vocab_size, overlap=overlap)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=seeds is not None, seed=seeds,
                         attention_mask=attention, eos_token_id=tokenizer.eos_token_ids, pad_token_id=pad,
                         logits_processors=[*extra, mask])
    rows = []
    for row in out[:, width:].tolist():
        ended = pad in row
        rows.append((tokenizer.decode(row[: row.index(pad)] if ended else row), ended))
    return rows


@pytest.mark.full  # the same constraints, sampled and judged on the real model, run as job rows in
# test_structured_cli.py::test_job_rows_each_with_their_own_constraint
def test_json_schemas_regex_and_grammar_in_one_sampled_batch(smol):
    """Rows with nested objects, bounded arrays, enums, integer ranges, string patterns, a regex, a Lark
    grammar and no constraint at all, sampled with several seeds in one batch."""
    model, tokenizer = smol
    cases = [
        ("Give a person as JSON.", Constraint.parse("json_schema", PERSON), 1),
        ("Give a person as JSON.", Constraint.parse("json_schema", PERSON), 2),
        ("Give a person as JSON.", Constraint.parse("json_schema", json.dumps(PERSON)), 3),
        ("List some colours.", Constraint.parse("json_schema", TAGS), 4),
        ("What is your phone number?", Constraint.parse("regex", PHONE), 5),
        ("Write a sum.", Constraint.parse("grammar", SUMS), 6),
        ("Give me any JSON object.", Constraint.parse("json", True), 7),
        ("Say hello.", None, 8),
    ]
    rows = run(model, tokenizer, [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases], 80)
    ended = 0
    for (_, constraint, _), (text, at_eos) in zip(cases, rows):
        if constraint is None or not at_eos:
            continue  # a row cut by the token limit is not claimed to be valid
        ended += 1
        if constraint.kind == "json_schema":
            jsonschema.validate(json.loads(text), json.loads(constraint.source))
        elif constraint.kind == "json":
            assert isinstance(json.loads(text), dict), text
        elif constraint.kind == "regex":
            assert re.fullmatch(PHONE, text), text
        else:
            assert is_sum(text), text
    assert ended >= 5, rows  # the checks above must not pass by having nothing to check


def test_greedy_json_schema_rows_validate(smol):
    model, tokenizer = smol
    schemas = [PERSON, TAGS, {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                               "n": {"type": "integer", "minimum": -5, "maximum": 5}},
                              "required": ["ok", "n"], "additionalProperties": False}]
    rows = run(model, tokenizer, ["Answer in JSON."] * 3, [Constraint.parse("json_schema", s) for s in schemas], None, 80)
    for schema, (text, at_eos) in zip(schemas, rows):
        assert at_eos, text
        jsonschema.validate(json.loads(text), schema)


def test_end_of_text_only_where_the_grammar_accepts(smol):
    """End-of-text pushed far above every other token: the row still writes the whole pattern, and
    then ends, since nothing else can follow it."""
    model, tokenizer = smol
    eos_first = LogitBias(dict.fromkeys(tokenizer.eos_token_ids, 100.0))
    [(text, at_eos)] = run(model, tokenizer, ["Digits?"], [Constraint.parse("regex", "[0-9]{7}")], None, 20,
                           extra=[eos_first])
    assert at_eos and re.fullmatch("[0-9]{7}", text), text
    [(free, _)] = run(model, tokenizer, ["Digits?"], [None], None, 5, extra=[eos_first])
    assert free == ""  # the bias does end an unconstrained row at once


# Greedy under `make test-full`: the masks and their overlap are the same path for a sampled row.
@pytest.mark.parametrize("sampled", [True, pytest.param(False, marks=pytest.mark.full)])
def test_batch_equals_each_row_alone_with_mixed_constraints(smol, sampled):
    """Each row of a mixed batch (masks built beside the forward pass) equals the row alone with its
    masks built after it: neither the neighbours nor the overlap change a row."""
    model, tokenizer = smol
    cases = [("Give a person as JSON.", Constraint.parse("json_schema", PERSON), 11),
             ("Tell me a story.", None, 12),
             ("Phone?", Constraint.parse("regex", PHONE), 13)]
    seeds = [c[2] for c in cases] if sampled else None
    batch = run(model, tokenizer, [c[0] for c in cases], [c[1] for c in cases], seeds, 40)
    for i, (case, together) in enumerate(zip(cases, batch)):
        alone = run(model, tokenizer, [case[0]], [case[1]], [seeds[i]] if seeds else None, 40, overlap=False)
        assert alone == [together]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("kind", "value", "message"), [
    ("json_schema", '{"type": "object", "requird": ["a"]}', "unsupported schema keyword 'requird' at /"),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     'unsupported schema keyword(s) ["uniqueItems"]'),
    ("json_schema", '{"type": "object",', "not valid JSON"),
    ("json_schema", "[1, 2]", "a JSON Schema must be an object"),
    ("json_schema", '{"type": "strng"}', "Invalid type: strng"),
    ("regex", "(ab", "unclosed group"),
    ("regex", r"(\w)\1", "backreferences are not supported"),
    ("grammar", "start: missing_rule", 'unknown name: "missing_rule"'),
    ("json", "yes", "must be true"),
])
def test_bad_constraints_are_one_line_errors(kind, value, message):
    with pytest.raises(ConstraintError) as caught:
        Constraint.parse(kind, value)
    text = str(caught.value)
    assert message in text and "\n" not in text and text.startswith("--"), text
    assert caught.value.exit_code == 2


def test_two_constraints_at_once_are_refused():
    with pytest.raises(ConstraintError, match="--json-schema and --regex cannot be combined"):
        one_constraint({"json_schema": "{}", "regex": "a"})
    assert one_constraint({"json": False, "regex": None}) is None


def test_constraint_nothing_can_satisfy(smol):
    model, tokenizer = smol
    with pytest.raises(ConstraintError, match="no text at all can satisfy it"):
        ConstraintMask(tokenizer, [Constraint.parse("regex", r"[^\x00-\U0010FFFF]")], model.config.vocab_size)


@pytest.mark.full  # the same pattern through the CLI and as a job row beside a good one: test_structured_cli.py
def test_pathological_pattern_stopped_by_the_engine_limits(smol):
    """A pattern that grows the engine's lexer without bound ends its row with the engine's error,
    quickly, and the other rows are unharmed."""
    model, tokenizer = smol
    mask = ConstraintMask(tokenizer, [Constraint.parse("regex", "((((a|b|c|d|e){1,10}){1,10}){1,10}){1,10}"), None],
                          model.config.vocab_size)
    ids = torch.tensor([tokenizer.encode("aaaa")] * 2)
    model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=tokenizer.eos_token_ids,
                   logits_processors=[mask])
    error = mask.row_error(0)
    assert error is not None and "too many" in error, error
    assert mask.row_error(1) is None


@pytest.mark.full  # Gemma 3's 262k-token vocabulary: the engine's tokenizer alone takes seconds to build
def test_gemma_rows_validate_greedy_and_sampled(gemma_gguf):
    """The same checks on Gemma 3 (Q4_K_M): JSON Schema rows judged by `jsonschema`, a regex by re.fullmatch."""
    model, tokenizer = lmcli.load(gemma_gguf)
    cases = [("Give a person as JSON.", Constraint.parse("json_schema", PERSON)),
             ("List some colours.", Constraint.parse("json_schema", TAGS)),
             ("What is your phone number?", Constraint.parse("regex", PHONE))]
    checked = 0
    for seeds in (None, [1, 2, 3], [4, 5, 6]):
        # this GGUF has no chat template: plain completion prompts
        rows = run(model, tokenizer, [c[0] for c in cases], [c[1] for c in cases], seeds, 80, chat=False)
        for (_, constraint), (text, at_eos) in zip(cases, rows):
            if not at_eos:
                continue  # cut by the token limit: not claimed to be valid
            checked += 1
            if constraint.kind == "json_schema":
                jsonschema.validate(json.loads(text), json.loads(constraint.source))
            else:
                assert re.fullmatch(PHONE, text), text
    assert checked >= 6
