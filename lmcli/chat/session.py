"""A multi-turn conversation over the checkpoint's chat template: `ChatSession`, and its transcripts.

The session has no input or output of its own; chat/repl.py is the REPL around it (`lmcli chat`).

The conversation stays in the model's KV cache between turns. Each turn renders the whole
conversation with the chat template and tokenises it, which is exactly what a fresh `generate`
over the conversation would be given, then feeds the model only the tokens after the longest
prefix the cache already holds. A template renders earlier turns the same way every time, so the
new rendering extends the previous one and only the new turn is processed. Where it does not
(a template that rewrites history, a reply whose text tokenises differently from the tokens that
were sampled, /system, /undo), the common prefix is shorter and more is recomputed; the result is
the same as a fresh run either way. Where blocks of keys can be reused exactly (prefix_cache_for), the
conversation's blocks are also kept in a prefix cache (generation/prefix_cache.py): a system message
switched back, or another session of the process sharing that cache and starting the same way, takes
them from there.

A turn with beams (num_beams > 1: `/set num_beams N`, --num-beams, or the model's own
generation_config.json, as `lmcli generate` takes them) is searched by `model.generate`, the same beam
search as `lmcli generate --num-beams N`, over the whole rendered conversation on a cache of its own:
the chat's cache is left as it was, so the next turn reuses the prefix it still holds. A beam turn's
text is known only when the search ends, so it is shown then, not token by token.

Generating a turn is generation/rows.py's, what a setting may be is settings/generation_settings.py's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError, TokenizerError, UsageError
from lmcli.generation.rows import RowResult, generate_batch, prepare_row
from lmcli.io.atomic import write_atomically
from lmcli.settings.generation_settings import DEFAULT_TEMPERATURE, FLAG, GenerationSettings

DEFAULT_CONTEXT = 4096  # tokens a chat keeps unless --context says otherwise (the cache is allocated for it)
TRANSCRIPT_FORMAT = "lmcli-chat/1"
ROLES = ("system", "user", "assistant")
# Settings that belong to a one-shot prompt, not to a conversation's sampling.
# A constraint: /set json_schema etc.; speculation is the command's (--prompt-lookup, --draft-model).
NOT_SETTABLE = ("chat", "system", "logprobs", "constraint", "prompt_lookup", "draft_model", "num_draft_tokens")


class ChatError(LmcliError):
    """A problem with one chat input (a command, a message); the REPL reports it and goes on."""


def settable_names() -> list[str]:
    return [f.name for f in dataclasses.fields(GenerationSettings) if f.name not in NOT_SETTABLE]


@dataclass
class Turn:
    """One exchange: the reply and what it cost."""

    result: RowResult
    prompt_tokens: int  # the whole rendered conversation, this turn's message included
    prefill_tokens: int  # of those, the ones the model processed (the rest came from the cache)
    dropped_messages: int  # old messages dropped this turn to fit the context
    interrupted: bool
    from_disk: int = 0  # of the tokens not processed, those the prompt cache read from disk (a resumed chat)
    from_memory: int = 0  # and those it held in memory

    @property
    def reply(self) -> str:
        return self.result.text.text


class ChatSession:
    """A conversation with one model, its messages and the KV cache that holds them."""

    def __init__(self, model, tokenizer, settings: GenerationSettings, *, context: int | None = None,
                 system: str | None = None, messages: list[dict] | None = None, prefix_cache: Any = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerError("this checkpoint's tokenizer has no chat template, so it cannot chat;"
                                 " 'lmcli generate' completes plain text")
        self.model, self.tokenizer = model, tokenizer
        model_context = model.config.max_position_embeddings
        if context is not None and context > model_context:
            raise UsageError(f"--context {context} is more than the model's context ({model_context} tokens)")
        self.context = context or min(model_context, DEFAULT_CONTEXT)
        self.settings = settings
        self._check_room(settings, "--max-new-tokens", UsageError)
        self.messages: list[dict] = check_messages(messages or [], "messages")
        if system is not None:
            self.set_system(system)
        self.hidden = 0  # leading non-system messages the model no longer sees (dropped to fit the context)
        self._cache = None
        self._cached_ids: list[int] = []  # the tokens whose keys/values the cache holds, in order
        # generation/prefix_cache.PrefixCache, or None: the conversations' blocks kept beyond the one
        # cache (a system message switched back, sessions of one process sharing it); give one only
        # where prefix_cache_for(model) does, so a turn that reuses it is still exactly a fresh run
        self.prefix_cache = prefix_cache
        self._stop_requested = False
        self._turns = 0

    # --- the conversation -----------------------------------------------------------------------

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    def set_system(self, text: str) -> None:
        if self.system is not None:
            self.messages[0] = {"role": "system", "content": text}
        else:
            self.messages.insert(0, {"role": "system", "content": text})

    def clear(self) -> None:
        """Forget the exchanges, keep the system message."""
        self.messages = self.messages[:1] if self.system is not None else []
        self.hidden = 0

    def undo(self) -> bool:
        """Drop the last exchange (the last user message and what followed it); False if there is none."""
        first = self._first_exchange_index()
        for index in range(len(self.messages) - 1, first - 1, -1):
            if self.messages[index]["role"] == "user":
                del self.messages[index:]
                self.hidden = min(self.hidden, len(self.messages) - first)
                return True
        return False

    def _first_exchange_index(self) -> int:
        return 1 if self.system is not None else 0

    def _visible(self, messages: list[dict], hidden: int) -> list[dict]:
        first = 1 if messages and messages[0]["role"] == "system" else 0
        return messages[:first] + messages[first + hidden:]

    # --- settings ---------------------------------------------------------------------------------

    def set_setting(self, name: str, value: str) -> GenerationSettings:
        """`/set NAME VALUE`: one sampling setting, parsed by its type and validated like a flag."""
        field_name = name.strip().lstrip("-").replace("-", "_")
        if field_name in ("json_schema", "json", "regex", "grammar"):  # the one constraint, replaced
            from lmcli.generation.constraints import ConstraintError, constraint_from_setting

            try:
                self.settings = dataclasses.replace(self.settings, constraint=constraint_from_setting(field_name, value))
            except ConstraintError as e:
                raise ChatError(str(e).replace("--", "/set ", 1)) from None
            return self.settings
        if field_name == "greedy":
            field_name, value = "temperature", "0" if _parse_bool(value, name) else str(DEFAULT_TEMPERATURE)
        fields = {f.name: f for f in dataclasses.fields(GenerationSettings) if f.name not in NOT_SETTABLE}
        if field_name == "num_return_sequences":
            raise ChatError("/set num_return_sequences: a chat turn keeps one reply (with beams, the best one)")
        if field_name not in fields:
            raise ChatError(f"unknown setting '{name}' (one of: {', '.join(fields)})")
        parsed = _parse_setting(field_name, str(fields[field_name].type), value)
        # The user's own, as a flag is: it wins over the model's defaults (a /set temperature over the
        # model's beams), and the user's own beams with the user's own sampling is an error, as in generate.
        sources = {**self.settings.sources, field_name: FLAG}
        settings = self.settings.changed(lambda n: n, ChatError, **{field_name: parsed, "sources": sources})
        self._check_room(settings, "max_new_tokens", ChatError)
        self.settings = settings
        return settings

    def _check_room(self, settings: GenerationSettings, name: str, error: type[LmcliError]) -> None:
        if settings.max_new_tokens >= self.context:
            raise error(
                f"{name} {settings.max_new_tokens} leaves no room for the conversation in the"
                f" {self.context}-token context; lower it or raise --context"
            )

    # --- a turn -----------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop the reply in progress after the current step (Ctrl-C); the session goes on."""
        self._stop_requested = True

    def reply(self, text: str, on_text: Callable[[RowResult, str], None] | None = None, *,
              logprobs: bool = False) -> Turn:
        """Add the user message `text`, generate the reply (streamed to `on_text`) and add it too.

        With `logprobs`, the result records each token's log-probability (for --color-probs), except on
        a beam turn (beam search gives none: its text comes unshaded)."""
        import torch

        from lmcli.generation.loop import generate_from_cache

        messages = [*self.messages, {"role": "user", "content": text}]
        ids, hidden = self._fit(messages)
        beams = self.settings.beams > 1
        settings = dataclasses.replace(self.settings, logprobs=0) if logprobs and not beams else self.settings
        self._turns += 1
        row = prepare_row(self.tokenizer, self._turns, text, settings, prompt_ids=ids)
        self._stop_requested = False
        if beams:
            return self._beam_turn(messages, ids, hidden, row, on_text)
        reused = self._reusable_prefix(ids)
        stopped_early = False
        cached_after = 0
        restored = [0, 0]  # tokens the prompt cache gave: from disk, from memory

        def run(x, *, on_token, ignore_output, **kwargs):
            def on_token_or_stop(event):
                nonlocal stopped_early
                ended = on_token(event)
                if self._stop_requested and not bool(ended.all()):
                    stopped_early = True
                    return torch.ones_like(ended)
                return ended

            nonlocal cached_after, reused
            speculator = getattr(self.model, "speculator", None)  # lmcli.generation.speculative_setup.SpeculatingModel
            with torch.inference_mode():
                if self._cache is None:
                    self._cache = self._new_cache()
                if self.prefix_cache is not None and self.prefix_cache.longest(ids, self._cache) > reused:
                    before = (self.prefix_cache.stats.from_disk, self.prefix_cache.stats.from_memory)
                    reused = self.prefix_cache.restore(ids, self._cache)  # only full layers' caches take it
                    restored[0] = self.prefix_cache.stats.from_disk - before[0]
                    restored[1] = self.prefix_cache.stats.from_memory - before[1]
                if speculator is not None:
                    speculator.run(x, on_token=on_token_or_stop, ignore_output=True, cache=self._cache,
                                   cached=reused, **kwargs)
                    cached_after = speculator.stats.cached
                    return
                _, cached_after = generate_from_cache(
                    self.model, x, on_token=on_token_or_stop, ignore_output=True, cache=self._cache,
                    cached=reused, **kwargs,
                )

        self._cached_ids = []  # unknown until the run returns
        try:
            [result] = generate_batch(self.model, self.tokenizer, [row], on_text=on_text, run=run)
        except BaseException:
            self._cache = None  # what a failed run left in it is unknown (a ring may hold stray slots)
            raise
        self._cached_ids = (ids + result.tokens)[:cached_after]
        if self.prefix_cache is not None:
            self.prefix_cache.store(self._cached_ids, self._cache, len(self._cached_ids))
        return self._record(messages, ids, hidden, result, len(ids) - reused, stopped_early, restored)

    def _beam_turn(self, messages: list[dict], ids: list[int], hidden: int, row: Any,
                   on_text: Callable[[RowResult, str], None] | None) -> Turn:
        """A turn by beam search over the whole conversation (`ids`), on the search's own cache: the
        chat's cache and the tokens it holds stay as they were (nothing here trims it), so a later turn
        reuses what it can of them and gives what a fresh chat would. Ctrl-C ends the search before its
        next step; the reply is then the best running beam so far."""
        stopped_early = False

        def stop() -> bool:
            nonlocal stopped_early
            stopped_early = stopped_early or self._stop_requested
            return stopped_early

        [result] = generate_batch(self.model, self.tokenizer, [row], on_text=on_text, stop=stop)
        return self._record(messages, ids, hidden, result, len(ids), stopped_early)

    def _record(self, messages: list[dict], ids: list[int], hidden: int, result: RowResult, prefill: int,
                stopped_early: bool, restored: tuple[int, int] | list[int] = (0, 0)) -> Turn:
        """The turn's reply joins the conversation."""
        if stopped_early:
            result.finish_reason = "interrupted"
        dropped = hidden - self.hidden
        self.messages = [*messages, {"role": "assistant", "content": result.text.text}]
        self.hidden = hidden
        return Turn(result, len(ids), prefill, dropped, stopped_early, *restored)

    def _new_cache(self) -> Any:
        """The conversation's cache. With a prefix cache, every layer keeps every slot (a sliding-window
        layer too, masked to its window), so that its blocks can be stored and restored exactly; else a
        sliding-window layer keeps a ring of its window (speculation trims rejected guesses: the ring
        keeps room for that)."""
        speculator = getattr(self.model, "speculator", None)
        if self.prefix_cache is not None and speculator is None:
            return self.model.init_cache(1, self.context, rollback=self.context)
        rollback = {"rollback": speculator.request.num_draft_tokens} if speculator else {}
        return self.model.init_cache(1, self.context, **rollback)

    def keep_blocks(self) -> int:
        """Make sure the prompt cache holds the conversation as a resumed session renders it (/save): the
        tokens not in the session's cache are computed, and the blocks are stored (on disk too). Returns
        the tokens kept; 0 without a prefix cache or a conversation."""
        import torch

        from lmcli.generation.step import Step

        prefix = getattr(self, "prefix_cache", None)  # a server's session (serve/remote_chat.py) has no model here
        if prefix is None or getattr(self.model, "speculator", None) is not None or not self.messages:
            return 0
        visible = self._visible(self.messages, self.hidden)
        ids = self.tokenizer.encode_chat(visible, add_generation_prompt=visible[-1]["role"] != "assistant")
        if not ids or len(ids) > self.context:
            return 0
        with torch.inference_mode():
            if self._cache is None:
                self._cache = self._new_cache()
            reused = self._reusable_prefix(ids)
            if self._cache is None:  # it could not go back far enough
                self._cache = self._new_cache()
            if prefix.longest(ids, self._cache) > reused:
                reused = prefix.restore(ids, self._cache)
            n = len(ids)
            slots = torch.arange(reused, n, device=self.model.device)
            x = torch.tensor([ids[reused:]], dtype=torch.long, device=self.model.device)  # (1, n - reused)
            is_token = torch.ones(1, n, dtype=torch.bool, device=self.model.device)
            Step.of(self.model).prefill(x, slots[None], slots, is_token, self._cache)
        self._cached_ids = ids
        prefix.store(ids, self._cache, n)
        return n

    def _fit(self, messages: list[dict]) -> tuple[list[int], int]:
        """The conversation's tokens, after dropping the oldest exchanges if it has outgrown the context.

        When it has, exchanges are dropped until it takes at most half of the room, so that the
        conversation is recomputed once, not again at every following turn."""
        room = self.context - self.settings.max_new_tokens
        hidden = self.hidden
        first = 1 if messages[0]["role"] == "system" else 0
        ids = self.tokenizer.encode_chat(self._visible(messages, hidden), add_generation_prompt=True)
        if len(ids) <= room:
            return ids, hidden
        while first + hidden < len(messages) - 1 and len(ids) > room // 2:
            hidden += 1  # the oldest visible message, then whatever follows it up to the next user message
            while first + hidden < len(messages) - 1 and messages[first + hidden]["role"] != "user":
                hidden += 1
            ids = self.tokenizer.encode_chat(self._visible(messages, hidden), add_generation_prompt=True)
        if len(ids) > room:
            raise ChatError(
                f"the message does not fit: the conversation would be {len(ids)} tokens, and with"
                f" {self.settings.max_new_tokens} for the reply that exceeds the {self.context}-token context"
                " (shorten it, /set max_new_tokens lower, or raise --context)"
            )
        return ids, hidden

    def _reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` the cache can supply (at least one token is always fed)."""
        common = 0
        limit = min(len(self._cached_ids), len(ids) - 1)
        while common < limit and self._cached_ids[common] == ids[common]:
            common += 1
        back = len(self._cached_ids) - common
        if back and self._cache is not None and self._cache.trim(back) < back:
            # The cache cannot go back that far (a ring buffer has overwritten the keys before its
            # window): start again with an empty one.
            self._cache = None
            return 0
        return common

    # --- transcripts ------------------------------------------------------------------------------

    def transcript(self, model_info: dict) -> dict:
        settings = {k: v for k, v in dataclasses.asdict(self.settings).items() if k not in NOT_SETTABLE}
        return {"format": TRANSCRIPT_FORMAT, "messages": self.messages, "settings": settings, "model": model_info,
                "context": self.context}

    def save(self, path: str | Path, model_info: dict) -> Path:
        """Write the transcript as JSON, atomically (a temporary file renamed over the target)."""
        path = Path(path).expanduser()
        try:
            write_atomically(path, json.dumps(self.transcript(model_info), indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise ChatError(f"cannot write {path}: {e.strerror or e}") from None
        return path


# ----------------------------------------------------------------------------- transcripts and settings


def check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list):
        raise ChatError(f"{where} must be a list of messages")
    checked = []
    for number, message in enumerate(messages, start=1):
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise ChatError(f'{where}: message {number} must be {{"role": system|user|assistant, "content": text}}')
        if message["role"] == "system" and number != 1:
            raise ChatError(f"{where}: message {number} is a system message; only the first may be one")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def load_transcript(path: Path) -> dict:
    """A transcript written by /save; raises ChatError naming the file and what is wrong."""
    from lmcli.io.bounded import MAX_ROW_DEPTH, MAX_TRANSCRIPT, read_bounded, text_deeper_than

    try:
        text = read_bounded(path, MAX_TRANSCRIPT, ChatError).decode("utf-8")
        if text_deeper_than(text, MAX_ROW_DEPTH):  # before json.loads, which recurses a frame a level
            raise ValueError(f"arrays and objects nest more than {MAX_ROW_DEPTH} levels deep")
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ChatError(f"{path}: not a JSON transcript ({e})") from None
    if not isinstance(data, dict) or data.get("format") != TRANSCRIPT_FORMAT:
        raise ChatError(f'{path}: not a transcript saved by lmcli chat (no "format": "{TRANSCRIPT_FORMAT}")')
    data["messages"] = check_messages(data.get("messages"), str(path))
    if not isinstance(data.get("settings", {}), dict):
        raise ChatError(f'{path}: "settings" must be an object')
    if not isinstance(data.get("model", {}), dict):
        raise ChatError(f'{path}: "model" must be an object')
    return data


def resumed_settings(saved: dict, flags: GenerationSettings, explicit: set[str], path: Path) -> GenerationSettings:
    """The saved settings, except those given on the command line this time."""
    return flags.resumed(saved, settable_names(), explicit, str(path), ChatError)


def _parse_bool(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("on", "true", "yes", "1"):
        return True
    if lowered in ("off", "false", "no", "0"):
        return False
    raise ChatError(f"{name} takes on or off, got '{value}'")


def _parse_setting(name: str, type_name: str, value: str) -> Any:
    from lmcli.jobs.runner import unescape_line

    value = value.strip()
    if "None" in type_name and value.lower() in ("none", "off", "default", ""):
        return None
    try:
        if name == "early_stopping":  # bool | str: true, false (on, off...) or never, as --early-stopping
            return "never" if value.lower() == "never" else _parse_bool(value, name)
        if type_name.startswith("bool"):
            return _parse_bool(value, name)
        if type_name.startswith("int"):
            return int(value)
        if type_name.startswith("float"):
            return float(value)
        if type_name.startswith("tuple[str"):
            # One string (\n for a newline), or a JSON list of strings; "none" for none.
            if value.lower() in ("none", "off", ""):
                return ()
            from lmcli.io.bounded import MAX_JSON_DEPTH, text_deeper_than

            if text_deeper_than(value, MAX_JSON_DEPTH):  # json.loads would recurse into a RecursionError
                raise ValueError(value)
            items = json.loads(value) if value.startswith("[") else [unescape_line(value)]
            if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
                raise ValueError(value)
            return tuple(items)
    except ValueError:
        raise ChatError(f"{name}: cannot read '{value}' as {type_name}") from None
    raise ChatError(f"{name} cannot be changed with /set")
