"""Tokenizers: HF directories (tokenizer.json / tokenizer.model), GGUF vocabularies, and chat templates.

Every source becomes one in-memory `tokenizers.Tokenizer`, configured the way transformers'
AutoTokenizer configures it for the same files, so ids match the reference exactly. transformers
itself is never imported here: it is only the yardstick in the tests.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from lmcli.errors import TokenizerError

SPIECE_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# GGUF token types (llama.cpp's llama_token_type).
GGUF_CONTROL = 3
GGUF_USER_DEFINED = 4


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
        stops = list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        stops += [self._id_of(eos_token), *extra_stop_ids]
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
            return _compile_template(self.chat_template).render(
                messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                **{key: value for key, value in specials.items() if value is not None},
            )
        except Exception as exc:  # jinja2's TemplateError, and anything the template's own code raises
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TokenizerError(f"{self.name}: chat template failed: {message}") from None

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


# ---------------------------------------------------------------- chat templates

@lru_cache(maxsize=8)
def _compile_template(source: str):
    environment = _chat_environment()
    return environment.from_string(source)


@lru_cache(maxsize=1)
def _chat_environment():
    """The sandbox and helpers that chat templates are written against (the reference's set)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
        # only has to render its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment


# ---------------------------------------------------------------- HF directories

# Special tokens a tokenizer class assumes when tokenizer_config.json names none.
CLASS_DEFAULT_SPECIALS = {
    "LlamaTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "GemmaTokenizer": {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
    "GPT2Tokenizer": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
    "Qwen2Tokenizer": {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(directory: Path) -> Tokenizer | None:
    """The tokenizer of an HF directory, or None when it has neither tokenizer.json nor tokenizer.model."""
    directory = Path(directory)
    json_file, spm_file = directory / "tokenizer.json", directory / "tokenizer.model"
    if not json_file.is_file() and not spm_file.is_file():
        return None
    config = _read_json(directory / "tokenizer_config.json")
    class_name = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    # Llama's class rebuilds the text handling; only these flags decide it (the reference's defaults).
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    legacy = bool(config.get("legacy", False))

    if json_file.is_file():
        try:
            backend = Backend.from_file(str(json_file))
        except Exception as exc:
            raise TokenizerError(f"{json_file}: cannot read tokenizer ({exc})") from None
        if class_name in ("LlamaTokenizer", "CodeLlamaTokenizer"):
            _llama_text_handling(backend, add_prefix_space, legacy)
    else:
        backend = _backend_from_spm(spm_file, add_prefix_space, legacy)

    specials = _named_specials(directory, config, class_name)
    _add_config_tokens(backend, config, specials)
    if not json_file.is_file():
        # With a tokenizer.json its post-processor alone decides BOS/EOS; the reference ignores
        # add_bos_token/add_eos_token then (they are often stale in real repos).
        _set_bos_eos(backend, specials.get("bos_token"), specials.get("eos_token"),
                     bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False)))

    generation = _read_json(directory / "generation_config.json")
    return Tokenizer(
        backend, **specials, chat_template=_chat_template_of(directory, config),
        generation_eos=generation.get("eos_token_id"), name=str(directory),
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_specials(directory: Path, config: dict, class_name: str) -> dict[str, str | None]:
    fallback = _read_json(directory / "special_tokens_map.json")
    defaults = CLASS_DEFAULT_SPECIALS.get(class_name, {})
    specials = {}
    for key in SPECIAL_KEYS:
        if key in config:
            specials[key] = _token_text(config[key])
        elif key in fallback:
            specials[key] = _token_text(fallback[key])
        else:
            specials[key] = defaults.get(key)
    return specials


def _add_config_tokens(backend: Backend, config: dict, specials: dict[str, str | None]) -> None:
    """Added tokens that tokenizer_config.json lists, and named specials the backend lacks."""
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    listed = []
    for _, entry in sorted(((int(i), e) for i, e in (config.get("added_tokens_decoder") or {}).items())):
        if isinstance(entry, dict) and entry.get("content") not in present:
            listed.append(AddedToken(entry["content"], single_word=entry.get("single_word", False),
                                     lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                                     normalized=entry.get("normalized", False), special=entry.get("special", False)))
    listed += [AddedToken(token, special=True, normalized=False)
               for token in dict.fromkeys(specials.values()) if token is not None and token not in present]
    if listed:
        backend.add_tokens(listed)


def _chat_template_of(directory: Path, config: dict) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _set_bos_eos(backend: Backend, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """Wrap every encoding in BOS/EOS as the flags say (the reference's TemplateProcessing)."""
    bos_id = backend.token_to_id(bos) if bos is not None else None
    eos_id = backend.token_to_id(eos) if eos is not None else None
    add_bos, add_eos = add_bos and bos_id is not None, add_eos and eos_id is not None
    single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    specials = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos and eos != bos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _llama_text_handling(backend: Backend, add_prefix_space: bool, legacy: bool) -> None:
    """SentencePiece-style spaces as transformers' Llama class sets them (it ignores the file's own)."""
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


def _backend_from_spm(path: Path, add_prefix_space: bool, legacy: bool) -> Backend:
    """tokenizer.model as the reference loads it: a byte-fallback BPE with merges implied by the
    vocabulary order, and the Llama class's space handling."""
    try:
        pieces = read_spm_pieces(path.read_bytes())
    except (ValueError, IndexError, struct.error) as exc:
        raise TokenizerError(f"{path}: not a SentencePiece model ({exc})") from None
    vocab = {piece: index for index, (piece, _, _) in enumerate(pieces)}
    backend = Backend(models.BPE(vocab=vocab, merges=implied_merges(vocab), fuse_unk=True, byte_fallback=True,
                                 dropout=None))
    _llama_text_handling(backend, add_prefix_space, legacy)
    # Control pieces (<s>, </s>) are special; user-defined ones are plain added tokens, matched whole.
    backend.add_tokens([AddedToken(piece, normalized=False, special=kind == 3)
                        for piece, _, kind in pieces if kind in (3, 4)])
    return backend


def read_spm_pieces(data: bytes) -> list[tuple[str, float, int]]:
    """(piece, score, type) of each SentencePiece vocabulary entry, from the model's protobuf.

    Only field 1 of ModelProto (repeated SentencePiece {1: piece, 2: score, 3: type}) is needed,
    so a few lines of wire-format reading spare a protobuf dependency.
    """
    pieces = []
    for field, value in _protobuf_fields(data):
        if field == 1:
            piece, score, kind = "", 0.0, 1  # type NORMAL unless stated
            for sub_field, sub_value in _protobuf_fields(value):
                if sub_field == 1:
                    piece = sub_value.decode("utf-8")
                elif sub_field == 2:
                    score = struct.unpack("<f", sub_value)[0]
                elif sub_field == 3:
                    kind = sub_value
            pieces.append((piece, score, kind))
    if not pieces:
        raise ValueError("no vocabulary pieces")
    return pieces


def _protobuf_fields(data: bytes):
    """(field number, value) pairs: ints for varints, bytes for length-delimited and fixed32."""
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _varint(data, position)
        elif wire_type == 2:
            length, position = _varint(data, position)
            value, position = data[position:position + length], position + length
        elif wire_type == 5:
            value, position = data[position:position + 4], position + 4
        elif wire_type == 1:
            value, position = data[position:position + 8], position + 8
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        yield field, value


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7


def implied_merges(vocab: dict[str, int], scores: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """BPE merges recovered from a vocabulary that lists none, ranked as the reference ranks them.

    Every way to cut a token into two tokens of the vocabulary is a merge. Without scores the
    merges follow the token's position in the vocabulary (shorter left part first); with scores,
    the best score first, then the longer left part, then first-listed token.
    """
    found = []
    known = vocab.__contains__  # the loop below runs millions of times for a 262k vocabulary
    for order, (token, score) in enumerate((scores if scores is not None else vocab).items()):
        for cut in range(1, len(token)):
            left = token[:cut]
            if known(left):
                right = token[cut:]
                if known(right):
                    found.append((score, cut, order, left, right))
    if scores is None:
        found.sort(key=lambda merge: (merge[0], merge[1]))
    else:
        found.sort(key=lambda merge: (-merge[0], -merge[1], merge[2]))
    return [(left, right) for _, _, _, left, right in found]


# ---------------------------------------------------------------- GGUF

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
GEMMA_ARCHITECTURES = {"gemma", "gemma2", "gemma3"}


def tokenizer_from_gguf(metadata: dict) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes, built as transformers builds it (gguf_file=)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = [_text(token) for token in metadata.get("tokenizer.ggml.tokens") or []]
    if not tokens:
        raise TokenizerError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = [int(kind_) for kind_ in metadata.get("tokenizer.ggml.token_type") or []]
    architecture = _text(metadata.get("general.architecture", ""))
    if kind == "gpt2":
        backend = _byte_level_backend(tokens, metadata)
    elif kind == "llama" and architecture in GEMMA_ARCHITECTURES:
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
    _set_bos_eos(backend, specials["bos_token"], specials["eos_token"], bool(add_bos),
                 bool(metadata.get("tokenizer.ggml.add_eos_token", False)))
    # End-of-turn tokens stop a chat reply even where they are not the file's eos.
    turn_ends = [int(metadata[key]) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if metadata.get(key) is not None]
    template = metadata.get("tokenizer.chat_template")
    return Tokenizer(backend, **specials, chat_template=_text(template) if template else None,
                     extra_stop_ids=turn_ends, name=_text(metadata.get("general.name", "GGUF model")))


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


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


def _byte_level_backend(tokens: list[str], metadata: dict) -> Backend:
    stand_ins = _byte_alphabet()
    alphabet = set(stand_ins.values())
    # Tokens already written in the byte alphabet stay; others (added tokens in plain text) are respelled.
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(stand_ins[b] for b in token.encode("utf-8"))
        vocab[spelled] = index
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if raw_merges is not None:
        merges = [tuple(_text(merge).split(" ")) for merge in raw_merges]
    else:
        merges = implied_merges(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
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


def _sentencepiece_backend(tokens: list[str], scores: list[float]) -> Backend:
    """A SentencePiece vocabulary from llama.cpp: merges ranked by piece score, Llama's spaces."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = implied_merges(vocab, dict(zip(tokens, scores)) if scores else None)
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    _llama_text_handling(backend, add_prefix_space=True, legacy=False)
    return backend


def _gemma_backend(tokens: list[str]) -> Backend:
    """Gemma's vocabulary: runs of spaces are stored as spaces but looked up as "▁"s, and the
    merges follow the order of the tokens in the file (its scores do not)."""
    respelled = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    ranks = {token: -index for index, token in enumerate(respelled)}
    backend = Backend(models.BPE(vocab=vocab, merges=implied_merges(vocab, ranks), fuse_unk=True,
                                 unk_token="<unk>", byte_fallback=True, dropout=None))
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
