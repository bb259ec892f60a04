"""The ASGI app: OpenAI's routes over the scheduler, with the server's limits, its key and its request log.

starlette, not FastAPI: the bodies are checked by lmcli's own rules (jobs/openai_batch.py, settings/generation_settings.py), so
FastAPI's pydantic models would be a second, diverging copy of them; plain starlette is a small
dependency with the streaming response and disconnect detection needed here. Server-sent events are a
StreamingResponse of `data: {...}` lines (sse-starlette's pings and event ids are not part of OpenAI's
stream), ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lmcli.jobs import openai_batch
from lmcli.serve.requests import ApiError, ServeRequest, parse
from lmcli.serve.scheduler import TIMED_OUT, Event, QueueFull, RowSink, Scheduler

POLL_SECONDS = 0.5  # how often a non-streaming request looks whether its client is still there


@dataclass
class ServerState:
    """What the routes share: the scheduler, the model's name, the settings base and the limits."""

    scheduler: Scheduler
    tokenizer: Any
    vocab_size: int
    base: Any  # GenerationSettings: lmcli's defaults under the model's
    model_name: str
    fingerprint: str
    context: int  # the most tokens a request's row may hold (prompt + max_tokens)
    max_body: int = 1 << 20
    timeout: float = 600.0  # per request, seconds
    api_key: str | None = None
    log_format: str = "text"
    ids: Any = field(default_factory=lambda: itertools.count(1))
    draining: bool = False  # SIGTERM: no new request is admitted
    model_record: dict[str, Any] | None = None  # lmcli's {"name", "fingerprint"}: what a job row records

    def log(self, record: dict[str, Any]) -> None:
        record = {key: value for key, value in record.items() if value is not None}
        if self.log_format == "json":
            line = json.dumps({"time": round(time.time(), 3), **record}, ensure_ascii=False)
        else:
            line = " ".join(f"{key}={value}" for key, value in record.items())
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def build_app(state: ServerState) -> Starlette:
    async def health(request: Request) -> Response:
        scheduler = state.scheduler
        status = "draining" if state.draining else "ok"
        return JSONResponse({"status": status, "model": state.model_name, "waiting": scheduler.waiting(),
                             "running": scheduler.running}, status_code=503 if state.draining else 200)

    async def models(request: Request) -> Response:
        if (refused := _refuse_key(state, request)) is not None:
            return refused
        # An extension member, "lmcli": what `lmcli generate --input --server` needs to write the rows a
        # local job writes (the model's record and sampling defaults, the context).
        defaults = state.base.model_defaults
        own = {"model": state.model_record or {"name": state.model_name, "fingerprint": state.fingerprint},
               "defaults": {"values": dict(defaults.values), "source": defaults.source}, "context": state.context}
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": 0, "owned_by": "lmcli", "lmcli": own}]})

    async def chat(request: Request) -> Response:
        return await _completion(state, request, openai_batch.CHAT)

    async def completions(request: Request) -> Response:
        return await _completion(state, request, openai_batch.COMPLETIONS)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = {404: f"no route {request.url.path} (lmcli serves /v1/chat/completions, /v1/completions, "
                        "/v1/models and /health)",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(status, str(exc))
        return error_response(ApiError(status, message))

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route(openai_batch.CHAT, chat, methods=["POST"]),
              Route(openai_batch.COMPLETIONS, completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def _refuse_key(state: ServerState, request: Request) -> Response | None:
    """401 unless the request carries the server's key (compared in constant time), when it has one."""
    if state.api_key is None:
        return None
    given = request.headers.get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    if hmac.compare_digest(token.encode(), state.api_key.encode()):
        return None
    return error_response(ApiError(401, "Incorrect API key provided (Authorization: Bearer KEY; see --api-key)",
                                   code="invalid_api_key"))


async def _read_body(state: ServerState, request: Request) -> Any:
    """The body as JSON, at most max_body bytes (else 413, read no further)."""
    too_large = ApiError(413, f"the request body is larger than the server's limit of {state.max_body} bytes "
                              "(--max-body)", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > state.max_body:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body:
            raise too_large
        chunks.append(chunk)

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(b"".join(chunks), parse_constant=refuse_constant)
    except (ValueError, UnicodeDecodeError) as e:
        reason = f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ApiError(400, f"We could not parse the JSON body of your request ({reason})") from None


async def _completion(state: ServerState, request: Request, url: str) -> Response:
    started = time.monotonic()
    record: dict[str, Any] = {"method": "POST", "path": url, "client": request.client.host if request.client else None}

    def logged(response: Response, **more: Any) -> Response:
        record.update(status=response.status_code, seconds=round(time.monotonic() - started, 3), **more)
        state.log(record)
        return response

    if (refused := _refuse_key(state, request)) is not None:
        return logged(refused)
    try:
        if state.draining:
            raise ApiError(503, "the server is shutting down", type="server_error")
        body = await _read_body(state, request)
        first_id = next(state.ids) * 1000  # room for n choices
        parsed = await asyncio.to_thread(parse, url, body, state.base, state.tokenizer, state.vocab_size,
                                         state.context, first_id)
        _check_lora(state, parsed)
    except ApiError as e:
        return logged(error_response(e))
    record.update(stream=parsed.stream, n=len(parsed.rows), prompt_tokens=len(parsed.rows[0].prompt_ids))
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    deadline = started + state.timeout
    sinks = [RowSink(loop, events, i, deadline) for i in range(len(parsed.rows))]
    try:
        state.scheduler.submit(parsed.rows, sinks)
    except QueueFull:
        error = ApiError(429, f"the server's queue is full ({state.scheduler.max_queue} rows waiting, --max-queue); "
                              "retry later", type="rate_limit_error", code="queue_full")
        return logged(error_response(error, {"Retry-After": "1"}))
    except RuntimeError:
        return logged(error_response(ApiError(503, "the server is shutting down", type="server_error")))
    exchange = _Exchange(state, parsed, sinks, events, deadline)
    if not parsed.stream:
        try:
            response = await exchange.whole(request)
        finally:
            exchange.cancel()
        return logged(response, completion_tokens=exchange.completion_tokens,
                      disconnected=exchange.disconnected or None)
    # Streaming: the status is decided by the first event (a row that fails at once is an error response).
    try:
        first = await exchange.next_event()
    except BaseException:
        exchange.cancel()
        raise
    if isinstance(first, ApiError):
        exchange.cancel()
        return logged(error_response(first))

    async def stream() -> AsyncIterator[bytes]:
        complete = False
        try:
            async for chunk in exchange.chunks(first):
                yield chunk
            complete = True
        finally:
            exchange.cancel()  # the client went away (or the stream ended): the rows end at the next step
            logged(Response(status_code=200), completion_tokens=exchange.completion_tokens,
                   disconnected=None if complete else True)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _check_lora(state: ServerState, parsed: ServeRequest) -> None:
    """A request's "lora" must name an adapter the server loaded (--lora), or "none": 400 otherwise."""
    name = parsed.rows[0].settings.lora
    if name is None:
        return
    from lmcli.kernels import lora
    from lmcli.serve.requests import bad
    from lmcli.settings.generation_settings import RowError

    try:
        lora.check_row(state.scheduler.model, name)
    except RowError as e:
        raise bad(f"body field {e}", "lora") from None


class _Exchange:
    """One request's rows on their way back: events in, a response (or SSE chunks) out."""

    def __init__(self, state: ServerState, parsed: ServeRequest, sinks: list[RowSink],
                 events: asyncio.Queue[tuple[int, Event]], deadline: float):
        self.state, self.parsed, self.sinks, self.events, self.deadline = state, parsed, sinks, events, deadline
        self.results: list[Any] = [None] * len(sinks)
        self.completion_tokens = 0
        self.seen = [0] * len(sinks)  # each row's tokens so far
        self.disconnected = False
        key = f"{parsed.rows[0].id:x}-{time.time_ns():x}"
        self.id = ("chatcmpl-" if parsed.url == openai_batch.CHAT else "cmpl-") + key
        self.created = int(time.time())

    def cancel(self) -> None:
        for sink in self.sinks:
            sink.cancelled = True

    async def next_event(self, poll: Request | None = None) -> tuple[int, Event] | ApiError:
        """The next event of any row; an ApiError for a failed row or past the time limit."""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return self._timed_out()
            try:
                index, event = await asyncio.wait_for(self.events.get(), min(left, POLL_SECONDS))
            except asyncio.TimeoutError:
                if poll is not None and await poll.is_disconnected():
                    self.disconnected = True
                    return ApiError(499, "the client closed the request")
                continue
            if event.kind == "token":
                self.seen[index] = event.tokens
                self.completion_tokens = sum(self.seen)
            if event.kind == "error":
                if event.status == 503:
                    return ApiError(503, event.message, type="server_error", code="shutting_down")
                return ApiError(event.status, f"generation failed: {event.message}", type="server_error")
            if event.kind == "done":
                assert event.result is not None
                if event.result.finish_reason == TIMED_OUT:
                    return self._timed_out()
                if event.result.error is not None:  # the constraint's engine gave up on the text
                    return ApiError(500, f"generation failed: {event.result.error}", type="server_error")
                self.results[index] = event.result
                self.seen[index] = len(event.result.tokens)
                self.completion_tokens = sum(self.seen)
            return index, event

    def _timed_out(self) -> ApiError:
        self.cancel()
        return ApiError(504, f"the request ran past the server's time limit of {self.state.timeout:g} s "
                             "(--request-timeout)", type="timeout", code="request_timeout")

    async def whole(self, request: Request) -> Response:
        while any(result is None for result in self.results):
            got = await self.next_event(request)
            if isinstance(got, ApiError):
                return error_response(got)
        body = openai_batch.response_body(self.parsed.url, self.results, self.state.model_name,
                                          self.id.split("-", 1)[1], self.state.fingerprint)
        body["id"], body["created"] = self.id, self.created
        # An extension member, one entry per choice: lmcli's own finish reason ("eos" and "stop" are both
        # OpenAI's "stop"), the seed the row sampled with and its logprobs as a job row records them.
        body["lmcli"] = [{"finish_reason": result.finish_reason, "seed": result.row.seed,
                          "logprobs": result.logprobs} for result in self.results]
        return JSONResponse(body)

    async def chunks(self, first: tuple[int, Event]) -> AsyncIterator[bytes]:
        """The SSE stream: a role chunk per choice (chat), then each event as a chunk, the usage chunk when
        asked for, then [DONE]. A row that fails mid-stream ends it with an error event instead of [DONE]."""
        chat = self.parsed.url == openai_batch.CHAT
        if chat:
            for index in range(len(self.sinks)):
                yield self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}])
        got: tuple[int, Event] | ApiError = first
        chars = [len(row.prompt) if isinstance(row.prompt, str) else 0 for row in self.parsed.rows]
        while True:
            if isinstance(got, ApiError):
                # OpenAI's way after the headers: a data event holding an `error` object, and no [DONE]
                # (the openai client raises APIError on it, with that object as the body).
                yield _sse(got.body())
                return
            index, event = got
            if event.kind == "token":
                steps = event.logprobs if self.parsed.rows[index].settings.logprobs is not None else None
                if chat:
                    choice: dict[str, Any] = {"index": index, "delta": {"content": event.text},
                                              "logprobs": openai_batch.chat_logprobs(steps) if steps else None,
                                              "finish_reason": None}
                else:
                    choice = {"index": index, "text": event.text,
                              "logprobs": openai_batch.completion_logprobs(steps, chars[index]) if steps else None,
                              "finish_reason": None}
                    chars[index] += sum(len(step["token"]) for step in steps or ())
                yield self._chunk([choice])
            elif event.kind == "done":
                assert event.result is not None
                reason = event.result.finish_reason or ""
                finish = openai_batch.FINISH_REASONS.get(reason, reason)
                done: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
                if chat:
                    done["delta"] = {}
                else:
                    done["text"] = ""
                yield self._chunk([done])
                if all(result is not None for result in self.results):
                    if self.parsed.include_usage:
                        prompt_tokens = len(self.parsed.rows[0].prompt_ids)
                        yield self._chunk([], usage=openai_batch.usage(prompt_tokens, self.completion_tokens, None))
                    break
            got = await self.next_event()
        yield b"data: [DONE]\n\n"

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        chat = self.parsed.url == openai_batch.CHAT
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                                 "created": self.created, "model": self.state.model_name,
                                 "system_fingerprint": self.state.fingerprint, "choices": choices}
        if self.parsed.include_usage:
            chunk["usage"] = usage
        return _sse(chunk)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

