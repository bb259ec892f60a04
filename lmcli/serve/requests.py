"""A request body -> the rows it asks for, or an ApiError in OpenAI's error shape.

The body's fields are read by openai_batch.parse_body (one place for each field's rule, shared with batch
files) and rank as a job row's do: over the model's own defaults and lmcli's. The server adds what only
a live request has: `stream`, `stream_options.include_usage`, `n`, and the context check (OpenAI's
"maximum context length" 400, never a silently cut prompt).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from lmcli.errors import LmcliError
from lmcli.generation.rows import PreparedRow, prepare_row
from lmcli.jobs import openai_batch
from lmcli.settings.generation_settings import GenerationSettings, RowError

MAX_N = 8  # choices per request: each is a row of the batch
MAX_SEED = 2**64


@dataclass
class ApiError(Exception):
    """An error response: `status` and OpenAI's {"error": {"message", "type", "param", "code"}}."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ServeRequest:
    """A parsed request: its endpoint, one row per choice (`n`), and how to answer."""

    url: str
    rows: list[PreparedRow]
    stream: bool = False
    include_usage: bool = False


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _param(message: str) -> str | None:
    """The body field an error message names, for OpenAI's "param"."""
    found = re.search(r'body field "([^"]+)"', message)
    return found.group(1) if found else None


def parse(url: str, body: Any, base: GenerationSettings, tokenizer: Any, vocab_size: int, context: int,
          first_id: int) -> ServeRequest:
    """The rows of one request to `url` (openai_batch.CHAT or COMPLETIONS); ids first_id, first_id + 1, ...
    `base`: the server's settings (lmcli's and the model's defaults); `context`: the most tokens a row may
    hold, prompt and completion together."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f'body field "stream" must be true or false, got {stream!r}', "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad('body field "stream_options" is only allowed with "stream": true', "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad('body field "stream_options" must be {"include_usage": true|false}', "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad('body field "stream_options": "include_usage" must be true or false', "stream_options")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad(f'body field "n" must be an integer from 1 to {MAX_N}, got {n!r}', "n")

    try:
        prompt, overrides, logprobs = openai_batch.parse_body(url, body, served=True)
        settings = dataclasses.replace(base.for_row(overrides), chat=url == openai_batch.CHAT, system=None,
                                       logprobs=logprobs)
    except (RowError, LmcliError) as e:
        message = openai_batch.in_body_terms(str(e), {"body": body})
        raise bad(message, _param(message)) from None
    if settings.speculates():  # a served model does not speculate: the field would do nothing
        name = "prompt_lookup" if settings.prompt_lookup else "draft_model"
        raise bad(f'body field "{name}" is not supported by lmcli serve (no speculative decoding)', name)
    if settings.chat and not tokenizer.chat_template:
        raise bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        if settings.logit_bias:
            settings.logit_bias_ids(tokenizer, vocab_size)
        if settings.constraint is not None:
            from lmcli.generation.constraints import ConstraintMask

            ConstraintMask(tokenizer, [settings.constraint], vocab_size, names=['body field "response_format"'])
        first = prepare_row(tokenizer, first_id, prompt, settings)
    except (RowError, LmcliError) as e:
        message = openai_batch.in_body_terms(str(e), {"body": body})
        raise bad(message, _param(message) or ("messages" if settings.chat else "prompt")) from None
    prompt_tokens = len(first.prompt_ids)
    if prompt_tokens + settings.max_new_tokens > context:
        field = "messages" if settings.chat else "prompt"
        raise bad(f"This model's maximum context length is {context} tokens. However, you requested "
                  f"{prompt_tokens + settings.max_new_tokens} tokens ({prompt_tokens} in the {field}, "
                  f"{settings.max_new_tokens} in the completion). Please reduce the length of the {field} or "
                  "completion.", field, "context_length_exceeded")
    rows = [first]
    for i in range(1, n):
        # Choice i samples with seed + i when a seed is given (choice 0 is the request with n = 1), else
        # with a seed of its own.
        seed = (settings.seed + i) % MAX_SEED if settings.seed is not None else None
        rows.append(prepare_row(tokenizer, first_id + i, prompt, dataclasses.replace(settings, seed=seed),
                                prompt_ids=first.prompt_ids))
    return ServeRequest(url, rows, stream, include_usage)
