"""A structured-output constraint as a setting: a JSON Schema, any JSON object, a regular expression or a
Lark grammar, checked and compiled by the engine (llguidance) when a flag, a job row or a chat's `/set`
gives it, before any model loads.

The token masks that enforce it while text is generated are lmcli/generation/constraints.py's; this
module is what the settings (GenerationSettings, job rows) hold and check, so it sits below them.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from lmcli.errors import LmcliError

# A constraint's kinds, as a job row names them (and as `--json-schema` etc. spell them with dashes).
KINDS = ("json_schema", "json", "regex", "grammar")
FLAGS = {"json_schema": "--json-schema", "json": "--json", "regex": "--regex", "grammar": "--grammar"}
MAX_SOURCE_BYTES = 1 << 20
# The token limit for a constrained row that sets none: room for typical objects (a few hundred tokens).
# A complete object ends its row at end-of-text, so the larger limit costs nothing when it is not used.
CONSTRAINED_MAX_NEW_TOKENS = 512  # a schema or grammar file larger than this is refused, not read

# JSON output without free whitespace: the engine would otherwise let a small model pad an object with
# newlines until the token limit. A schema's own "x-guidance" options still override these.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Keywords that only annotate, which a JSON Schema validator ignores too.
_ANNOTATIONS = {"$schema", "$id", "$anchor", "$comment", "title", "description", "default", "examples",
                "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "x-guidance"}
# Every validation keyword of JSON Schema 2020-12 (and draft 4-7's spellings); the engine itself refuses,
# by name, those it does not implement. A key outside both sets is refused here, so a typo such as
# "requird" is never silently ignored.
_SCHEMA_VALUED = {"items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SCHEMA_LISTS = {"allOf", "anyOf", "oneOf", "prefixItems"}
_VALUE_KEYWORDS = {"type", "enum", "const", "required", "minimum", "maximum", "exclusiveMinimum",
                   "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems",
                   "maxItems", "minProperties", "maxProperties", "uniqueItems", "dependentRequired",
                   "dependencies", "minContains", "maxContains", "$ref", "$dynamicRef", "$dynamicAnchor",
                   "$vocabulary", "contentSchema"}
_KNOWN_KEYWORDS = _ANNOTATIONS | _SCHEMA_VALUED | _SCHEMA_MAPS | _SCHEMA_LISTS | _VALUE_KEYWORDS


class ConstraintError(LmcliError):
    """A constraint that cannot be used: invalid, unsupported, or impossible for this vocabulary.
    From a flag it is a usage error (exit 2); in a job it becomes the row's error."""

    exit_code = 2


class IncompleteOutput(LmcliError):
    """A single run's structured output that a limit (the token limit, the context, a stop string) cut
    before its constraint was complete: the text was written, but it is not valid. Exit 3, so that a
    script can tell it from a failed run (1) and retry with a larger -n."""

    exit_code = 3


class Constraint(NamedTuple):
    """One row's constraint: its kind, its source as given (schema JSON, pattern, grammar text) and the
    engine's grammar compiled from it (checked, with no tokenizer yet). A plain tuple, so settings that
    hold one still hash and serialise (input_hash)."""

    kind: str
    source: str
    grammar: str

    @classmethod
    def parse(cls, kind: str, value: Any, name: str | None = None) -> Constraint:
        """A constraint from a flag's or a row's value: for json_schema a dict or JSON text, for json a
        true value, for regex and grammar the text. `name` is how errors call it (default: the flag)."""
        import llguidance

        name = name or FLAGS.get(kind, kind)
        try:
            if kind == "json_schema":
                schema = _schema_value(value, name)
                _check_keywords(schema, name)
                source = json.dumps(schema, ensure_ascii=False)  # key order kept: properties are generated in it
                grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
            elif kind == "json":
                if value is not True:
                    raise ConstraintError(f"{name} must be true (any JSON object), got {value!r}")
                source = '{"type": "object"}'
                grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
            elif kind in ("regex", "grammar"):
                if not isinstance(value, str) or not value:
                    raise ConstraintError(f"{name} must be a non-empty string")
                source = value
                if kind == "regex":
                    grammar = llguidance.LLMatcher.grammar_from_regex(value)
                else:
                    grammar = llguidance.LLMatcher.grammar_from_lark(value)
            else:
                raise ConstraintError(f"unknown constraint {kind!r} (expected one of {', '.join(KINDS)})")
        except ValueError as exc:  # the engine refusing what it was given (its own limits, a bad value)
            raise ConstraintError(f"{name}: {_one_line(str(exc))}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ConstraintError(f"{name}: {_one_line(messages[0])}")
        return cls(kind, source, grammar)

    def describe(self) -> dict[str, Any]:
        """How a JSONL row records it: {"json_schema": {...}}, {"json": true}, {"regex": "..."}."""
        if self.kind == "json_schema":
            return {self.kind: json.loads(self.source)}
        return {self.kind: True if self.kind == "json" else self.source}


def one_constraint(values: dict[str, Any], name_of: Any = FLAGS.get) -> Constraint | None:
    """The constraint among `values` (kind -> value, None or False meaning not given): at most one."""
    given = [kind for kind in KINDS if values.get(kind) not in (None, False)]
    if len(given) > 1:
        raise ConstraintError(f"{' and '.join(name_of(kind) for kind in given)} cannot be combined: "
                              "give at most one constraint")
    return Constraint.parse(given[0], values[given[0]], name_of(given[0])) if given else None


def constraint_from_setting(kind: str, value: str) -> Constraint | None:
    """A chat's `/set KIND VALUE`: VALUE as the flag takes it (`on` for json); `off` clears it."""
    value = value.strip()
    if value.lower() in ("off", "none", ""):
        return None
    if kind == "json":
        return one_constraint({"json": value.lower() in ("on", "true", "yes", "1") or value})
    return one_constraint({kind: read_source(kind, value)})


def read_source(kind: str, value: str) -> Any:
    """A flag's value as Constraint.parse takes it: --json-schema is inline JSON (starting with "{") or a
    file, --grammar a file; --regex is the pattern itself."""
    name = FLAGS[kind]
    if kind == "regex" or (kind == "json_schema" and value.lstrip().startswith("{")):
        return value
    from lmcli.io.bounded import read_bounded

    data = read_bounded(value, MAX_SOURCE_BYTES, ConstraintError, name,
                        unreadable="{name}: {reason}", too_large="{name}: larger than {limit}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConstraintError(f"{name} {value}: not UTF-8 text") from None


def _schema_value(value: Any, name: str) -> dict:
    """The schema as a dict, its depth checked before anything walks it (json.loads, the keyword check
    and json.dumps all recurse, one level a frame)."""
    from lmcli.io.bounded import MAX_JSON_DEPTH, text_deeper_than, value_deeper_than

    deep = text_deeper_than(value, MAX_JSON_DEPTH) if isinstance(value, str) else value_deeper_than(value, MAX_JSON_DEPTH)
    if deep:
        raise ConstraintError(f"{name}: the schema nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"{name}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConstraintError(f"{name}: a JSON Schema must be an object, got {type(value).__name__}")
    return value


def _check_keywords(schema: Any, name: str, where: str = "") -> None:
    """Refuse a key that is not a JSON Schema keyword, naming it and where it is."""
    if not isinstance(schema, dict):
        return  # true/false schemas, or a malformed value the engine reports
    for key, value in schema.items():
        if key not in _KNOWN_KEYWORDS and not key.startswith("x-"):
            raise ConstraintError(f"{name}: unsupported schema keyword {key!r} at {where or '/'}")
        if key in _SCHEMA_VALUED:
            for i, item in enumerate(value if isinstance(value, list) else [value]):
                _check_keywords(item, name, f"{where}/{key}" + (f"/{i}" if isinstance(value, list) else ""))
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub, item in value.items():
                _check_keywords(item, name, f"{where}/{key}/{sub}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, item in enumerate(value):
                _check_keywords(item, name, f"{where}/{key}/{i}")


def _one_line(message: str) -> str:
    if message.startswith("Unimplemented keys: "):  # the engine's list of schema keywords it lacks
        return f"unsupported schema keyword(s) {message.removeprefix('Unimplemented keys: ')}"
    if message.startswith("oneOf constraints are not supported"):  # it names an engine option, not lmcli's
        return ('"oneOf" whose branches can overlap is not supported (the engine cannot ensure that exactly one '
                'matches): use "anyOf", or add "x-guidance": {"coerce_one_of": true} to the schema to treat it so')
    lines = [line.strip() for line in message.strip().splitlines() if line.strip() and line.strip() != "<non-verbose/>"]
    # The engine's regex errors span lines ("regex parse error:", the pattern, a caret, "error: ...").
    detail = next((line for line in lines if line.startswith("error:")), None)
    head = lines[0] if lines else "invalid"
    head = re.sub(r"^at \d+\(\d+\): | \(in regex\): regex parse error:$", "", head)
    detail = detail.removeprefix("error: ") if detail else None
    return f"{head}: {detail}" if detail and detail != head else head
