"""`Tokenizer`: text <-> ids for one checkpoint, its special tokens, stop ids and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from lmcli.config import eos_id_list
from lmcli.errors import TokenizerError, first_line
from lmcli.io.tokenizer.chat_template import compile_template, render_bounded


class Tokenizer:
    """Text <-> ids for one checkpoint, plus its special tokens and chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        generation_eos: int | list[int] | None = None,
        extra_stop_ids: Iterable[int] = (),
        name: str = "tokenizer",
    ):
        self.backend = backend
        self.name = name
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(bos_token)
        self.pad_token_id = self._id_of(pad_token)
        self.unk_token_id = self._id_of(unk_token)
        # generation_config.json's eos (often a list for chat models) is what generation should stop on.
        self.eos_token_id: int | list[int] | None = generation_eos if generation_eos is not None else self._id_of(eos_token)
        stops = [*eos_id_list(self.eos_token_id), self._id_of(eos_token), *extra_stop_ids]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in stops if i is not None))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # Read off the post-processor rather than a flag, so a tokenizer.json's own template counts too.
        self.add_bos_token = self.bos_token_id is not None and backend.encode("").ids[:1] == [self.bos_token_id]

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` leaves out."""
        return frozenset(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)

    @cached_property
    def _byte_fallback(self) -> bool:
        return "ByteFallback" in repr(self.backend.decoder)

    def is_byte_token(self, token_id: int) -> bool:
        """A byte-fallback token like "<0xE4>": one raw byte of a character the vocabulary lacks."""
        if not self._byte_fallback:
            return False
        piece = self.backend.id_to_token(token_id)
        return piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError(f"{self.name} has no chat template; run without --chat")
        # Like the reference: keys whose value is None are dropped, since templates test for presence.
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                    "unk_token": self.unk_token, "pad_token": self.pad_token}
        try:
            return render_bounded(
                compile_template(self.chat_template), messages=messages, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt,
                **{key: value for key, value in specials.items() if value is not None},
            )
        except Exception as exc:  # jinja2's TemplateError, and anything the template's own code raises
            raise TokenizerError(f"{self.name}: chat template failed: {first_line(exc)}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes BOS itself where the model wants it, so no special tokens are added here.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write tokenizer.json and tokenizer_config.json that lmcli and AutoTokenizer both load back."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        # No add_bos_token/add_eos_token keys: the post-processor saved in tokenizer.json already
        # adds BOS/EOS, and some loaders would rebuild it from the flags.
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return out
