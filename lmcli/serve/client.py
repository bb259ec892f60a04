"""`lmcli generate --server URL`: the prompt sent to a running `lmcli serve`, the completion streamed back.

The standard library only (http.client), and nothing of lmcli that loads torch or a model, so the
command starts as a small Python program does (`python -X importtime -m lmcli generate --server ...`).
The server applies the settings as `lmcli generate` would (the same table, the same defaults), so the
text is the same; the flags that have no request field are refused here by name.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import urllib.parse
from collections.abc import Generator
from typing import IO, Any

from lmcli.errors import LmcliError, UsageError

TIMEOUT = 600.0  # seconds without a byte from the server before the client gives up
SERVER_ENV = "LMCLI_SERVER"
API_KEY_ENV = "LMCLI_API_KEY"

# The decoding flags a request body carries: flag parameter -> body field (lmcli.settings.table's OpenAI names).
BODY_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
               "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed"}


def request_body(prompt: str, decoding: dict[str, Any], chat: bool, system: str | None) -> dict[str, Any]:
    """The /v1/completions (or, with --chat, /v1/chat/completions) body for these flags; UsageError for
    a flag the server cannot take."""
    refused = [name for name in ("min_p", "typical_p", "repetition_penalty", "no_repeat_ngram_size",
                                 "min_new_tokens", "regex", "grammar")
               if decoding.get(name) is not None] + [name for name in ("ignore_eos",) if decoding.get(name)]
    # lmcli serve does not search with beams: never dropped, or the reply would be greedy's unsaid
    refused += [name for name in ("length_penalty", "early_stopping") if decoding.get(name) is not None]
    refused += ["num_beams"] if (decoding.get("num_beams") or 1) > 1 else []
    if refused:
        raise UsageError(f"--{refused[0].replace('_', '-')} is not supported with --server (no request field "
                         "carries it); drop it or run without --server")
    body: dict[str, Any] = {field: decoding[name] for name, field in BODY_FIELDS.items()
                            if decoding.get(name) is not None}
    if decoding.get("greedy"):
        if decoding.get("temperature") not in (None, 0):
            raise UsageError(f"--greedy and --temperature {decoding['temperature']:g} contradict each other; pick one")
        body["temperature"] = 0
    if decoding.get("stop"):
        from lmcli.jobs.input import unescape_line

        body["stop"] = [unescape_line(text) for text in decoding["stop"]]
    if decoding.get("logit_bias"):
        bias = {}
        for spec in decoding["logit_bias"]:
            token, _, value = spec.rpartition("=")
            try:
                bias[token] = float(value)
            except ValueError:
                raise UsageError(f"--logit-bias {spec}: expected TOKEN=BIAS") from None
        body["logit_bias"] = bias
    if decoding.get("json_schema") is not None:
        from lmcli.generation.constraints import read_source

        try:
            schema = json.loads(read_source("json_schema", decoding["json_schema"]))
        except ValueError as e:
            raise UsageError(f"--json-schema: not valid JSON ({e})") from None
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    elif decoding.get("json_object"):
        body["response_format"] = {"type": "json_object"}
    if chat:
        messages = [{"role": "system", "content": system}] if system is not None else []
        body["messages"] = [*messages, {"role": "user", "content": prompt}]
    else:
        if system is not None:
            raise UsageError("--system only applies with --chat")
        body["prompt"] = prompt
    body["stream"] = True
    return body


def _connection(url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--server {url}: expected http://HOST:PORT")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")  # http://host:port and http://host:port/v1 both name the server
    return kind(parts.hostname, parts.port, timeout=TIMEOUT), path


class ServerAnswered(LmcliError):
    """The server answered with an error status (`status`)."""

    def __init__(self, status: int, message: str, detail: str):
        super().__init__(message)
        self.status, self.detail = status, detail  # detail: the server's own message


def request_json(url: str, method: str, endpoint: str, body: dict[str, Any] | None,
                 api_key: str | None) -> dict[str, Any]:
    """A request that is not streamed, its JSON answer; ServerAnswered for an error status, LmcliError in
    one line for an unreachable server."""
    connection, path = _connection(url)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        connection.request(method, path + endpoint, json.dumps(body).encode() if body is not None else None, headers)
        response = connection.getresponse()
        raw = response.read()
        if response.status != 200:
            detail = _message(raw)
            raise ServerAnswered(response.status, f"the server at {url} answered {response.status}: {detail}", detail)
        answer = json.loads(raw)
        if not isinstance(answer, dict):
            raise ValueError("not an object")
        return answer
    except ValueError as e:
        raise LmcliError(f"the server at {url} answered with no JSON object ({e})") from None
    except (OSError, http.client.HTTPException) as e:
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise LmcliError(f"cannot reach the server at {url}: {reason}") from None
    finally:
        connection.close()


def events(url: str, endpoint: str, body: dict[str, Any], api_key: str | None) -> Generator[dict[str, Any], None, None]:
    """The server's stream for this request, one parsed `data:` payload at a time; LmcliError in one line for
    an unreachable server, an error status or an error event."""
    connection, path = _connection(url)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        connection.request("POST", path + endpoint, json.dumps(body).encode(), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise LmcliError(f"the server at {url} answered {response.status}: {_message(response.read())}")
        for raw in response:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            payload = json.loads(data)
            if "error" in payload:
                raise LmcliError(f"the server at {url}: {_message(data.encode())}")
            yield payload
        raise LmcliError(f"the server at {url} ended the stream before [DONE]")
    except (OSError, http.client.HTTPException) as e:
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise LmcliError(f"cannot reach the server at {url}: {reason}") from None
    finally:
        connection.close()


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace").strip()[:500] or "(no body)"


def generate(url: str, prompt: str, decoding: dict[str, Any], *, chat: bool, system: str | None,
             api_key: str | None = None, stats: bool = False, out: IO[str] | None = None) -> None:
    """Stream the completion to `out` (stdout) as `lmcli generate` writes it to a pipe: the text, then a newline."""
    out = out or sys.stdout
    body = request_body(prompt, decoding, chat, system)
    if stats:
        body["stream_options"] = {"include_usage": True}
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    finish, usage = None, None
    for payload in events(url, endpoint, body, api_key or os.environ.get(API_KEY_ENV)):
        for choice in payload.get("choices") or ():
            piece = choice["delta"].get("content") if chat else choice.get("text")
            if piece:
                out.write(piece)
                out.flush()
            finish = choice.get("finish_reason") or finish
        usage = payload.get("usage") or usage
    out.write("\n")
    out.flush()
    if stats and usage is not None:
        sys.stderr.write(f"{usage['completion_tokens']} tokens, prompt {usage['prompt_tokens']} tokens, "
                         f"stopped by {finish}\n")
