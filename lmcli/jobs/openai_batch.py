"""The OpenAI Batch API's JSONL, as vLLM's `run-batch` reads and writes it: request rows in, response rows out.

A request row:  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
                 "body": {"messages": [...] | "prompt": "...", "max_tokens": 64, "temperature": 0.7, ...}}
A response row: {"id": "batch_req_…", "custom_id": "a",
                 "response": {"status_code": 200, "request_id": "…", "body": {"id", "object", "created", "model",
                              "choices": [...], "usage": {...}, "system_fingerprint": "…"}},
                 "error": null, "lmcli": {"input_hash", "model", "settings", "seed"}}
A failed row has "response": null and "error": {"code", "message"}. The "lmcli" member is lmcli's own
record (what --resume checks); OpenAI's and vLLM's readers ignore members they do not know.

Body fields map onto lmcli's row settings (so they rank as a row's fields do: over the model's
defaults, under the command-line flags); a field lmcli does not know, or knows but cannot honour (n > 1, stream, echo), makes
that row an error row instead of being dropped silently.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from lmcli.settings.generation_settings import RowError
from lmcli.settings.table import SETTINGS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

# Body field -> lmcli row field, for the fields both endpoints share (lmcli.settings.table's table names them).
SETTINGS_FIELDS = {body: name for name, setting in SETTINGS.items() for body in setting.openai}
# Accepted and without effect here: the model is whatever lmcli loaded; "user" is a tag for the API's logs.
IGNORED_FIELDS = ("model", "user")
# Accepted only at the value that means "nothing special" (OpenAI's penalties and logit_bias are taken
# only when off: lmcli's row fields of the same name are not offered through this API).
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1,), "stream": (False,), "echo": (False,), "best_of": (1,), "suffix": (None,),
    "presence_penalty": (SETTINGS["presence_penalty"].off,), "frequency_penalty": (SETTINGS["frequency_penalty"].off,),
    "logit_bias": (None, {}),
}
# A live server (lmcli.serve) also takes these: OpenAI's penalties and logit_bias set lmcli's row settings
# of the same names (the same rules: generated tokens only, biases from -100 to 100 by token id), and
# the server itself reads stream, stream_options and n.
SERVED_SETTINGS = ("presence_penalty", "frequency_penalty", "logit_bias")
SERVED_FIELDS = ("stream", "stream_options", "n")
CHAT_FIELDS = ("messages", "logprobs", "top_logprobs")
COMPLETION_FIELDS = ("prompt", "logprobs")
MAX_TOP_LOGPROBS = 20  # what OpenAI allows


def is_request(obj: Any) -> bool:
    """Whether a file's first row is an OpenAI batch request (rather than an lmcli row)."""
    return isinstance(obj, dict) and ("custom_id" in obj or ("url" in obj and "body" in obj))


def request_id(obj: Any) -> str | None:
    """The row's custom_id when it has a usable one, else None."""
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def parse_request(obj: dict) -> tuple[str, str | list[dict], dict, int | None]:
    """(url, prompt or chat messages, lmcli row overrides, logprobs count or None); RowError naming the field.

    The caller has checked `custom_id` already.
    """
    for key in sorted(set(obj) - {"custom_id", "method", "url", "body"}):
        raise RowError(f'unknown field "{key}" (a request has custom_id, method, url and body)')
    if obj.get("method", "POST") != "POST":
        raise RowError(f'"method" must be "POST", got {obj.get("method")!r}')
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise RowError(f'"url" must be "{CHAT}" or "{COMPLETIONS}", got {url!r}')
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RowError('"body" must be a JSON object')
    return (url, *parse_body(url, body))


def parse_body(url: str, body: dict, *, served: bool = False) -> tuple[str | list[dict], dict, int | None]:
    """(prompt or chat messages, lmcli row overrides, logprobs count or None) of one request body for
    `url`; RowError naming the field. `served`: a live server's request (lmcli.serve), which also takes
    SERVED_SETTINGS and leaves SERVED_FIELDS to the server."""
    own = CHAT_FIELDS if url == CHAT else COMPLETION_FIELDS
    settings_fields = {**SETTINGS_FIELDS, **({name: name for name in SERVED_SETTINGS} if served else {})}
    known = (*settings_fields, *IGNORED_FIELDS, *NEUTRAL_VALUES, *own, "response_format",
             *(SERVED_FIELDS if served else ()))
    for key in body:
        if key not in known:
            raise RowError(f'body field "{key}" is not supported by lmcli for {url}')
    for key, neutral in NEUTRAL_VALUES.items():
        if served and key in (*SERVED_FIELDS, *SERVED_SETTINGS):
            continue
        if key in body and body[key] not in neutral:
            raise RowError(f'body field "{key}" = {body[key]!r} is not supported by lmcli (only {neutral[0]!r})')
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RowError('give "max_tokens" or "max_completion_tokens", not both')
    overrides = {settings_fields[key]: value for key, value in body.items() if key in settings_fields}
    overrides.update(_response_format(body.get("response_format")))

    if url == CHAT:
        prompt: str | list[dict] = _messages(body.get("messages"))
        logprobs = None
        if body.get("logprobs", False) not in (True, False):
            raise RowError('body field "logprobs" must be true or false for chat completions')
        if "top_logprobs" in body:
            if not body.get("logprobs"):
                raise RowError('body field "top_logprobs" needs "logprobs": true')
            logprobs = _count(body["top_logprobs"], "top_logprobs")
        elif body.get("logprobs"):
            logprobs = 0
    else:
        prompt = _prompt(body.get("prompt"))
        logprobs = _count(body["logprobs"], "logprobs") if body.get("logprobs") is not None else None
    return prompt, overrides, logprobs


# What each "type" of response_format may hold beside it; any other key is refused, never dropped (a
# "schema" beside json_object would otherwise run the row without the schema its caller set).
RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema")}
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _response_format(value: Any) -> dict:
    """The lmcli row fields a body's "response_format" stands for: {"json": true} for json_object, the
    schema for json_schema (enforced whether or not "strict" is set), nothing for text."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in RESPONSE_FORMAT_KEYS:
        shown = "no \"type\"" if kind is None else f'"type": {json.dumps(kind)}'
        raise RowError('body field "response_format" must be an object with "type": "text", "json_object" or '
                       f'"json_schema" (it has {shown})')
    for key in value:
        if key not in RESPONSE_FORMAT_KEYS[kind]:
            raise RowError(f'body field "response_format" has "{key}", which "type": "{kind}" does not take '
                           f'(it takes {", ".join(RESPONSE_FORMAT_KEYS[kind])})')
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RowError('body field "response_format": "json_schema" must be {"name", "schema": {...}, "strict"}')
    for key in spec:
        if key not in JSON_SCHEMA_KEYS:
            raise RowError(f'body field "response_format": "json_schema" has "{key}", which lmcli does not know '
                           f'(it takes {", ".join(JSON_SCHEMA_KEYS)})')
    if not isinstance(spec.get("strict", True), bool):
        raise RowError('body field "response_format": "strict" must be true or false')
    return {"json_schema": spec["schema"]}


def in_body_terms(message: str, obj: Any) -> str:
    """A settings error names lmcli's row field ("max_new_tokens"); say the body field the user wrote."""
    body = obj.get("body") if isinstance(obj, dict) else None
    for body_key, row_key in SETTINGS_FIELDS.items():
        if isinstance(body, dict) and body_key in body:
            message = message.replace(f'"{row_key}"', f'body field "{body_key}"')
    if isinstance(body, dict) and "response_format" in body:  # a schema's error, named by its row field
        for row_key in ('"json_schema"', '"json"'):
            if message.startswith(row_key):
                message = 'body field "response_format"' + message.removeprefix(row_key)
    return message


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RowError(f'body field "{name}" must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {value!r}')
    return value


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # a batch of one prompt
    if not isinstance(value, str):
        raise RowError('body field "prompt" must be a string' if value is not None else 'body field "prompt" is missing')
    if not value:  # as on the command line and in lmcli rows
        raise RowError('body field "prompt" is empty')
    return value


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError('body field "messages" must be a non-empty list' if value is not None
                       else 'body field "messages" is missing')
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"messages[{i}] must be an object with a \"role\"")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RowError(f"messages[{i}].content: lmcli reads text parts only")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RowError(f"messages[{i}].content must be a string")
        messages.append({"role": message["role"], "content": content})
    return messages


# ----------------------------------------------------------------------------- output


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def response_row(custom_id: str, url: str, result: Any, model_name: str, record: dict) -> dict:
    """A successful response row for a finished RowResult; `record` is lmcli's own (input hash, model, ...)."""
    if result.error is not None:  # the constraint's engine gave up on the text: no valid response
        return error_row(custom_id, result.error, record)
    key = _key(custom_id, record["input_hash"])
    body = response_body(url, [result], model_name, key, record["model"]["fingerprint"])
    return {"id": "batch_req_" + key, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": key, "body": body}, "error": None, "lmcli": record}


def response_body(url: str, results: list[Any], model_name: str, key: str, fingerprint: str) -> dict:
    """The body of a completion response: one choice per finished RowResult (a server's request with n > 1
    has several, of one prompt), usage over them all."""
    choices = [choice(url, index, result) for index, result in enumerate(results)]
    prompt_tokens = len(results[0].row.prompt_ids)
    completion_tokens = sum(len(result.tokens) for result in results)
    speculation = results[0].speculation if len(results) == 1 else None
    return {
        "id": ("chatcmpl-" if url == CHAT else "cmpl-") + key,
        "object": "chat.completion" if url == CHAT else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, speculation),
        "system_fingerprint": fingerprint,
    }


def choice(url: str, index: int, result: Any) -> dict[str, Any]:
    """A finished row as a response's choice."""
    finish = FINISH_REASONS.get(result.finish_reason, result.finish_reason)
    if url == CHAT:
        return {"index": index, "message": {"role": "assistant", "content": result.text.text},
                "logprobs": chat_logprobs(result.logprobs), "finish_reason": finish}
    prompt_chars = len(result.row.prompt) if isinstance(result.row.prompt, str) else 0
    return {"index": index, "text": result.text.text,
            "logprobs": completion_logprobs(result.logprobs, prompt_chars), "finish_reason": finish}


def usage(prompt_tokens: int, completion_tokens: int, speculation: dict | None) -> dict:
    """OpenAI's usage; a speculating row adds its guesses kept and dropped as OpenAI counts predicted
    tokens, and lmcli's own counts (lmcli.generation.speculative_setup.row_counts) as an extension member."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if speculation is not None:
        if "drafted" in speculation:
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": speculation["accepted"],
                "rejected_prediction_tokens": speculation["drafted"] - speculation["accepted"]}
        usage["speculation"] = speculation
    return usage


def error_row(custom_id: Any, message: str, record: dict) -> dict:
    key = _key(str(custom_id), record["input_hash"])
    return {"id": "batch_req_" + key, "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request" if message.startswith("line ") else "generation_failed",
                      "message": message},
            "lmcli": record}


def _key(custom_id: str, input_hash: str) -> str:
    return hashlib.sha256(f"{custom_id}\0{input_hash}".encode()).hexdigest()[:24]


def chat_logprobs(steps: list[dict] | None) -> dict | None:
    if steps is None:
        return None

    def entry(item: dict) -> dict:
        return {"token": item["token"], "logprob": item["logprob"], "bytes": list(item["token"].encode("utf-8"))}

    return {"content": [{**entry(step), "top_logprobs": [entry(t) for t in step["top"]]} for step in steps]}


def completion_logprobs(steps: list[dict] | None, start: int) -> dict | None:
    if steps is None:
        return None
    offsets, at = [], start
    for step in steps:
        offsets.append(at)
        at += len(step["token"])
    return {
        "tokens": [step["token"] for step in steps],
        "token_logprobs": [step["logprob"] for step in steps],
        "top_logprobs": [_by_text(step["top"]) for step in steps],
        "text_offset": offsets,
    }


def _by_text(top: list[dict]) -> dict[str, float]:
    """Token text -> logprob; when two tokens decode alike the likelier one's entry is kept."""
    out: dict[str, float] = {}
    for item in top:  # most likely first
        out.setdefault(item["token"], item["logprob"])
    return out

