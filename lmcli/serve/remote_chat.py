"""`lmcli chat --server URL`: the chat REPL (lmcli.chat) over a running `lmcli serve`.

The session keeps the messages, /system, /clear, /undo, /set and /save as a local chat does
(chat_session.ChatSession's own methods); each turn sends the whole conversation to the server's
/v1/chat/completions and streams the reply back. Nothing here loads torch or a model: the server
has them, and applies its model's chat template and defaults to what no flag or /set gave.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcli.chat.session import ChatError, ChatSession, check_messages
from lmcli.errors import LmcliError
from lmcli.serve import client
from lmcli.settings.generation_settings import GenerationSettings

# A setting a /set (or a resumed transcript) may change, and the request field that carries it.
FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
          "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
          "stop": "stop", "logit_bias": "logit_bias"}
STOP_REASONS = {"length": "token limit", "stop": "end of text or stop string"}  # OpenAI's finish_reason
NO_CONTEXT = 1 << 30  # the server checks the context (400); the client does not know it


def body_value(name: str, value: Any) -> Any:
    """A setting's value as its request field takes it."""
    if name == "stop":
        return list(value)
    if name == "logit_bias":
        return {token: bias for token, bias in value}
    return value


@dataclass
class RemoteTurn:
    """What ChatRepl needs of a turn (chat_session.Turn's names), from the server's stream."""

    reply: str
    interrupted: bool
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None
    seconds: float
    first_token_seconds: float | None
    dropped_messages: int = 0  # the server refuses a conversation past its context; nothing is dropped here

    def summary(self) -> str:
        parts = [f"{self.completion_tokens} tokens",
                 f"{self.completion_tokens / max(self.seconds, 1e-9):.1f} tokens/s"]
        if self.first_token_seconds is not None:
            parts.append(f"{self.first_token_seconds * 1000:.0f} ms to first token")
        reason = "Ctrl-C" if self.interrupted else STOP_REASONS.get(self.finish_reason or "", self.finish_reason)
        parts.append(f"stopped: {reason}")
        parts.append(f"prompt {self.prompt_tokens} tokens")
        return " · ".join(parts)


class RemoteChatSession(ChatSession):
    """A ChatSession whose replies come from the server at `url`. `body` holds the request fields the
    command line gave (client.request_body's, checked there); /set and a resumed transcript add theirs."""

    def __init__(self, url: str, body: dict[str, Any], settings: GenerationSettings, *, context: int | None,
                 system: str | None, messages: list[dict] | None, changed: set[str], api_key: str | None = None):
        self.url, self.api_key = url, api_key or os.environ.get(client.API_KEY_ENV)
        self.model, self.tokenizer = None, None
        self.context = context or NO_CONTEXT
        self.settings = settings
        self.body = body
        self.changed = set(changed)  # settings whose value goes in every request (over `body`)
        for name in self.changed:
            self._check_carried(name, ChatError)
        self.messages = check_messages(messages or [], "messages")
        if system is not None:
            self.set_system(system)
        self.hidden = 0
        self._stop_requested = False

    def _check_carried(self, name: str, error: type[Exception]) -> None:
        if name not in FIELDS and getattr(self.settings, name) != getattr(GenerationSettings(), name):
            raise error(f"{name} is not supported with --server (no request field carries it)")

    def set_setting(self, name: str, value: str) -> GenerationSettings:
        before = self.settings
        settings = super().set_setting(name, value)
        changed = {f.name for f in dataclasses.fields(GenerationSettings)
                   if f.name not in ("sources", "model_defaults")  # bookkeeping: /set marks its setting the user's
                   and getattr(settings, f.name) != getattr(before, f.name)}
        try:
            for setting in changed:
                self._check_carried(setting, ChatError)
        except ChatError:
            self.settings = before
            raise
        self.changed |= changed & set(FIELDS)
        return settings

    def _check_room(self, settings: GenerationSettings, name: str, error: type[Exception]) -> None:
        if self.context != NO_CONTEXT:
            super()._check_room(settings, name, error)  # type: ignore[arg-type]

    def request(self, messages: list[dict]) -> dict[str, Any]:
        """The /v1/chat/completions body for this conversation."""
        body = {key: value for key, value in self.body.items() if key not in ("prompt", "messages")}
        for name in self.changed:
            body[FIELDS[name]] = body_value(name, getattr(self.settings, name))
        body["messages"] = messages
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return body

    def reply(self, text: str, on_text: Callable[[Any, str], None] | None = None, *,  # type: ignore[override]
              logprobs: bool = False) -> RemoteTurn:
        messages = [*self.messages, {"role": "user", "content": text}]
        self._stop_requested = False
        pieces: list[str] = []
        started, first = time.monotonic(), None
        finish, usage, interrupted = None, None, False
        stream = client.events(self.url, "/v1/chat/completions", self.request(messages), self.api_key)
        try:
            for payload in stream:
                for choice in payload.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first if first is not None else time.monotonic() - started
                        pieces.append(piece)
                        if on_text is not None:
                            on_text(None, piece)
                    finish = choice.get("finish_reason") or finish
                usage = payload.get("usage") or usage
                if self._stop_requested:  # Ctrl-C: the connection closes, the server frees the row
                    interrupted = True
                    break
        finally:
            stream.close()
        reply = "".join(pieces)
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        usage = usage or {}
        return RemoteTurn(reply, interrupted, usage.get("completion_tokens", len(pieces)),
                          usage.get("prompt_tokens", 0), finish, time.monotonic() - started, first)


def run_remote_chat(url: str, body: dict[str, Any], settings: GenerationSettings, options: Any,
                    api_key: str | None = None) -> None:
    """`lmcli chat --server URL`: as chat.run_chat, with the server in place of the model."""
    from lmcli.chat.repl import ChatRepl, _show_transcript, piped_messages
    from lmcli.chat.session import load_transcript, resumed_settings

    interactive = sys.stdin.isatty()
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")  # pipes get UTF-8 whatever the locale says
    saved, changed = None, set()
    if options.resume is not None:
        saved = load_transcript(options.resume)
        resumed = resumed_settings(saved.get("settings", {}), settings, set(options.explicit), options.resume)
        changed = {name for name in saved.get("settings", {}) if name not in options.explicit
                   and name not in ("sources", "model_defaults")  # bookkeeping, not settings
                   and getattr(resumed, name) != getattr(settings, name)}
        settings = resumed
    context = options.context
    if context is None and saved is not None and isinstance(saved.get("context"), int):
        context = saved["context"] if saved["context"] < NO_CONTEXT else None
    session = RemoteChatSession(url, body, settings, context=context, system=settings.system,
                                messages=saved["messages"] if saved is not None else None, changed=changed,
                                api_key=api_key)
    model_info: dict[str, str] = {"server": url}
    try:  # what a transcript records of the model: the served one's name and fingerprint, as a local chat's
        from lmcli.serve.remote_job import server_model

        served = server_model(url, session.api_key)["model"]
        model_info = {"checkpoint": str(served["name"]), "fingerprint": str(served["fingerprint"]), "server": url}
    except LmcliError:
        pass  # not reachable now: the first message says so
    repl = ChatRepl(session, options, model_info, interactive)
    if saved is not None and interactive:
        _show_transcript(repl, session.messages)
    if interactive:
        repl.note(f"chatting with the server at {url} · /help for commands, Ctrl-D to quit")
        repl.run()
    else:
        repl.run(piped_messages(sys.stdin))
