"""Tokenizers from GGUF metadata (tokenizer.ggml.*), built as transformers builds them (gguf_file=)."""

from __future__ import annotations

import re
from functools import lru_cache
from itertools import repeat
from typing import Any, cast

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from lmcli.errors import TokenizerError
from lmcli.io.tokenizer.backend import SPIECE_SPACE, implied_merges, llama_text_handling, set_bos_eos
from lmcli.io.tokenizer.facade import Tokenizer
from lmcli.registry import GGUF_ARCHITECTURES

# GGUF token types (llama.cpp's llama_token_type).
GGUF_CONTROL = 3
GGUF_USER_DEFINED = 4

# Pre-tokenizer splits by `tokenizer.ggml.pre`: the regex the vocabulary's merges were learned with.
# Names missing here (gpt-2, smollm, default, ...) keep GPT-2's own byte-level split.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe",
                     "midm-2.0", "lfm2"], LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], QWEN2_SPLIT),
    "tekken": TEKKEN_SPLIT,
}


def tokenizer_from_gguf(metadata: dict) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes, built as transformers builds it (gguf_file=).
    Errors name the metadata key; the caller adds the file."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = _texts(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise TokenizerError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    try:
        return _tokenizer_from_gguf(metadata, kind, tokens)
    except _BadMetadata as exc:
        raise TokenizerError(str(exc)) from None


class _BadMetadata(Exception):
    """A tokenizer.ggml value of the right type but the wrong shape; the message names the key."""


def _bpe_backend(**options: Any) -> Backend:
    """A BPE tokenizer; the tokenizers library's refusal (a plain Exception) becomes _BadMetadata."""
    try:
        return Backend(models.BPE(**options))
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _BadMetadata(f"cannot build a tokenizer from tokenizer.ggml.tokens/merges ({message})") from None


def _tokenizer_from_gguf(metadata: dict, kind: Any, tokens: list[str]) -> Tokenizer:
    types = [int(kind_) for kind_ in metadata.get("tokenizer.ggml.token_type") or []]
    architecture = _text(metadata.get("general.architecture", ""))
    if kind == "gpt2":
        backend = _byte_level_backend(tokens, metadata)
    elif kind == "llama" and GGUF_ARCHITECTURES.get(architecture) == "gemma":
        backend = _gemma_backend(tokens)
    elif kind == "llama":
        backend = _sentencepiece_backend(tokens, [float(s) for s in metadata.get("tokenizer.ggml.scores") or []])
    else:
        raise TokenizerError(f"GGUF tokenizer type {kind!r} is not supported (supported: 'gpt2', 'llama')")
    _add_gguf_tokens(backend, tokens, types, byte_level=kind == "gpt2")

    def token_at(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    specials = {"bos_token": token_at("bos_token_id"), "eos_token": token_at("eos_token_id"),
                "unk_token": token_at("unknown_token_id"), "pad_token": token_at("padding_token_id")}
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = [token for token in dict.fromkeys(specials.values()) if token is not None and token not in present]
    if missing:
        backend.add_tokens([AddedToken(token, special=True, normalized=False) for token in missing])
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    set_bos_eos(backend, specials["bos_token"], specials["eos_token"], bool(add_bos),
                 bool(metadata.get("tokenizer.ggml.add_eos_token", False)))
    # End-of-turn tokens stop a chat reply even where they are not the file's eos.
    turn_ends = [int(metadata[key]) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if metadata.get(key) is not None]
    template = metadata.get("tokenizer.chat_template")
    return Tokenizer(backend, bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                     unk_token=specials["unk_token"], pad_token=specials["pad_token"],
                     chat_template=_text(template) if template else None,
                     extra_stop_ids=turn_ends, name=_text(metadata.get("general.name", "GGUF model")))


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def _texts(values: list[Any]) -> list[str]:
    """`_text` of each value; a list of str (what the GGUF reader gives) is taken as it is, without a
    Python loop over 50k-260k items."""
    return list(values) if set(map(type, values)) <= {str} else [_text(value) for value in values]


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            stand_ins[byte] = chr(byte)
        else:
            stand_ins[byte] = chr(256 + extra)
            extra += 1
    return stand_ins


@lru_cache(maxsize=1)
def _outside_byte_alphabet() -> re.Pattern[str]:
    """A character that is not one of GPT-2's stand-ins: a token holding one is spelled in plain text."""
    return re.compile(f"[^{re.escape(''.join(_byte_alphabet().values()))}]")


def _byte_level_backend(tokens: list[str], metadata: dict) -> Backend:
    stand_ins = _byte_alphabet()
    outside_alphabet = _outside_byte_alphabet().search
    # Tokens already written in the byte alphabet stay; others (added tokens in plain text) are respelled.
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = "".join(stand_ins[b] for b in token.encode("utf-8")) if outside_alphabet(token) else token
        vocab[spelled] = index
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if raw_merges is not None:
        merges = _merges(raw_merges)
    else:
        merges = implied_merges(vocab)
    backend = _bpe_backend(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                           end_of_word_suffix="", fuse_unk=False)
    split = GGUF_PRE_SPLITS.get(_text(metadata.get("tokenizer.ggml.pre", "")))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges(raw_merges: list[Any]) -> list[tuple[str, str]]:
    """Each merge as its two tokens. Split and checked without a Python loop per merge (50k-260k of
    them); where one is malformed, `_merge` says which."""
    pairs = list(map(tuple, map(str.split, _texts(raw_merges), repeat(" "))))
    if set(map(len, pairs)) <= {2} and all(map(all, pairs)):
        return cast(list[tuple[str, str]], pairs)
    return [_merge(merge, number) for number, merge in enumerate(raw_merges)]


def _merge(merge: Any, number: int) -> tuple[str, str]:
    pair = tuple(_text(merge).split(" "))
    if len(pair) != 2 or not all(pair):
        raise _BadMetadata(f"metadata 'tokenizer.ggml.merges' item {number} must be two tokens separated by one space, "
                           f"got {_text(merge)[:40]!r}")
    return cast(tuple[str, str], pair)


def _sentencepiece_backend(tokens: list[str], scores: list[float]) -> Backend:
    """A SentencePiece vocabulary from llama.cpp: merges ranked by piece score, Llama's spaces."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = implied_merges(vocab, dict(zip(tokens, scores)) if scores else None)
    backend = _bpe_backend(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    llama_text_handling(backend, add_prefix_space=True, legacy=False)
    return backend


def _gemma_backend(tokens: list[str]) -> Backend:
    """Gemma's vocabulary: runs of spaces are stored as spaces but looked up as "▁"s, and the
    merges follow the order of the tokens in the file (its scores do not)."""
    respelled = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    ranks = {token: -index for index, token in enumerate(respelled)}
    if "<unk>" not in vocab:  # the model falls back on it for any text it cannot spell
        raise _BadMetadata("metadata 'tokenizer.ggml.tokens' has no '<unk>', which a Gemma vocabulary needs")
    backend = _bpe_backend(vocab=vocab, merges=implied_merges(vocab, ranks), fuse_unk=True, unk_token="<unk>",
                           byte_fallback=True, dropout=None)
    backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    return backend


def _add_gguf_tokens(backend: Backend, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so both are
    matched whole in the text. A byte-level file's "control" token outside the byte alphabet is a
    llama.cpp mislabel and is left alone (adding it would grow the vocabulary)."""
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, types)
               if kind == GGUF_CONTROL and (alphabet is None or set(token) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    user_defined = [AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, types)
                    if kind == GGUF_USER_DEFINED and backend.token_to_id(token) is not None]
    if user_defined:
        backend.add_tokens(user_defined)
