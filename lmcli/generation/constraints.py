"""Structured output: a JSON Schema, any JSON object, a regular expression or a Lark grammar that each
row's completion must follow, enforced by masking the tokens the constraint cannot continue with.

The engine is llguidance (Rust, CPU, no torch): it compiles a schema in milliseconds and computes a
token mask from a token trie in tens of microseconds on a 49k vocabulary, where matching characters
against every candidate token (GBNF-style) costs milliseconds per token. xgrammar needs torch
builds with triton; outlines-core compiles a whole DFA up front (seconds for a schema).

    from lmcli.generation.constraints import Constraint, ConstraintMask
    mask = ConstraintMask(tokenizer, [Constraint.parse("json_schema", schema)], model.config.vocab_size)
    model.generate(ids, max_new_tokens=200, do_sample=False, eos_token_id=tokenizer.eos_token_ids,
                   logits_processors=[mask])

`ConstraintMask` takes one constraint (or None) per row, so rows with different constraints, and rows
with none, share one batch; each row's mask depends only on its own tokens, so a row gets what it gets
alone. The end-of-text token is allowed only where the row's grammar accepts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcli.settings.constraint import (
    CONSTRAINED_MAX_NEW_TOKENS,
    FLAGS,
    KINDS,
    MAX_SOURCE_BYTES,
    Constraint,
    ConstraintError,
    IncompleteOutput,
    _one_line,
    constraint_from_setting,
    one_constraint,
    read_source,
)

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    import llguidance
    import numpy as np
    import torch

    from lmcli.io.tokenizer import Tokenizer

# The constraint as a setting lives below the settings (lmcli/settings/constraint.py); re-exported here.
__all__ = [
    "CONSTRAINED_MAX_NEW_TOKENS", "FLAGS", "KINDS", "MAX_SOURCE_BYTES", "Constraint", "ConstraintError",
    "ConstraintMask", "IncompleteOutput", "constraint_from_setting", "engine_tokenizer", "one_constraint", "read_source",
    "token_bytes",
]


# ----------------------------------------------------------------------------- the engine's tokenizer


_TOKENIZERS: dict[tuple[int, int], tuple[Tokenizer, llguidance.LLTokenizer]] = {}


def engine_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of lmcli's tokenizer, built once per tokenizer and model vocabulary size.

    Built from each token's raw bytes (TokenizerWrapper) when the decoder is one lmcli's tokenizers use
    (byte-level BPE; SentencePiece spaces with byte fallback, as GGUF vocabularies are built): that takes
    3 s on Gemma 3's 262k vocabulary where the tokenizer.json route takes 11 s. Any other decoder goes
    through tokenizer.json, which llguidance reads itself."""
    import llguidance

    key = (id(tokenizer), vocab_size)
    if key in _TOKENIZERS and _TOKENIZERS[key][0] is tokenizer:
        return _TOKENIZERS[key][1]
    eos = tokenizer.eos_token_ids or None
    pieces = token_bytes(tokenizer, vocab_size)
    if pieces is not None:
        built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, pieces)),
                                       n_vocab=vocab_size, eos_token=eos)
    else:
        try:
            built = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:  # a decoder the engine cannot read (e.g. Metaspace without byte fallback)
            raise ConstraintError(f"this model's tokenizer cannot be used with a constraint: {_one_line(str(exc))}") from None
    _TOKENIZERS[key] = (tokenizer, built)
    return built


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes] | None:
    """Each id's bytes as it adds them to the text (special tokens marked with a 0xFF lead byte, as
    llguidance expects), or None for a decoder this does not know."""
    from lmcli.io.tokenizer.gguf import _byte_alphabet  # byte-level BPE's byte <-> character table

    decoder = repr(tokenizer.backend.decoder)
    byte_level = decoder.startswith("ByteLevel")
    if not byte_level and not ("Replace" in decoder and "ByteFallback" in decoder):
        return None
    char_to_byte = {char: byte for byte, char in _byte_alphabet().items()}
    byte_token = re.compile(r"<0x([0-9A-Fa-f]{2})>")
    specials = tokenizer.special_ids
    pieces = []
    for token_id in range(vocab_size):
        piece = tokenizer.backend.id_to_token(token_id)
        if piece is None:
            pieces.append(b"")  # padding rows of the embedding: never allowed
        elif token_id in specials:
            pieces.append(b"\xff" + piece.encode())
        elif byte_level:
            if any(char not in char_to_byte for char in piece):
                return None
            pieces.append(bytes(char_to_byte[char] for char in piece))
        else:
            match = byte_token.fullmatch(piece)
            pieces.append(bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode())
    return pieces


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: the tokens' bytes, the special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, pieces: list[bytes]):
        self._tokenizer = tokenizer
        self.tokens = pieces
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- the mask, step by step


class ConstraintMask:
    """A logits processor: each step, every constrained row's disallowed tokens get -inf.

    `constraints` has one entry per batch row (None: the row is free). The masks of all rows are built
    in one pass per step, into one bitmask, in the calling thread. The processor follows
    the text it is given: at its first call it takes the prompt as it is, and at each later call it
    feeds each row's newest token to that row's matcher. A new generate() call (text not one token
    longer than at the last call) starts the rows again. Raises ConstraintError for a constraint that
    the vocabulary cannot express or that exceeds the engine's limits.

    With `overlap`, generate() hands it each step's chosen tokens (`chosen`) before the next forward
    pass, and the next masks are built on a worker thread while the model runs; the next call only
    waits for them. It is off by default because it measured slower (`lmcli bench --sections
    structured`, docs/generation.md): 2.9 against 8.6 tok/s at batch 1 and 11.4 against 17.7 at batch 8
    on the busy 2-core machine. A mask takes a fraction of a millisecond, and the worker's Python (feeding
    tokens, unpacking bits) needs the GIL that the forward pass's Python holds between ops, so each step
    pays thread hand-offs that cost far more than the mask they hide.
    """

    needs_history = True  # it reads each row's newest token
    follows_text_step_by_step = True  # its matchers take every token as it is chosen: no speculation

    def __init__(self, tokenizer: Tokenizer, constraints: Sequence[Constraint | None], vocab_size: int,
                 names: Sequence[str] | None = None, overlap: bool = False):
        self.vocab_size = vocab_size
        self.engine = engine_tokenizer(tokenizer, vocab_size)
        self.eos_ids = list(tokenizer.eos_token_ids)
        self.constraints = list(constraints)
        self.names = list(names) if names is not None else [FLAGS.get(c.kind, c.kind) if c else "" for c in constraints]
        self.matchers: list[llguidance.LLMatcher | None] = [
            self._matcher(c, name) if c is not None else None for c, name in zip(self.constraints, self.names)
        ]
        self.overlap = overlap
        self._worker: ThreadPoolExecutor | None = None
        self._pending: tuple[Future[np.ndarray], list[int], int] | None = None  # (masks, tokens fed, text length)
        self._seen = -1  # text length at the last call
        self.mask_seconds: list[float] = []  # per step: feeding the tokens and building the masks, wherever it ran
        self.blocked_seconds: list[float] = []  # per call: what the caller waited for (masks, then applying them)

    def _matcher(self, constraint: Constraint, name: str) -> llguidance.LLMatcher:
        import llguidance

        limits = llguidance.LLParserLimits(verbose_errors=False)  # errors without the parser's state dump
        matcher = llguidance.LLMatcher(self.engine, constraint.grammar, log_level=0, limits=limits)
        if not matcher.is_error():
            first = _allowed(matcher.compute_bitmask(), self.vocab_size)
            if not matcher.is_error() and (matcher.is_accepting() or any(i not in self.eos_ids for i in first)):
                return matcher
        if not matcher.is_error() or matcher.get_error().split()[0] in ("NoExtension", "NoExtensionBias"):
            if _matches_nothing(constraint.grammar):
                hint = ' (a "$ref" that leads only back to itself?)' if '"$ref"' in constraint.source else ""
                raise ConstraintError(f"{name}: no text at all can satisfy it{hint}")
            raise ConstraintError(f"{name}: no token of this model's vocabulary can start it")
        raise ConstraintError(f"{name}: {_one_line(matcher.get_error())}")  # e.g. past the engine's limits

    def reset(self) -> None:
        self._settle()
        for matcher in self.matchers:
            if matcher is not None:
                matcher.reset()

    def chosen(self, tokens: torch.Tensor) -> None:
        """generate()'s hook: the tokens [B] just chosen, before the forward pass that follows them. With
        `overlap`, the rows' matchers take them and the next masks are built meanwhile on a thread."""
        if not self.overlap or self._seen == -1:
            return
        from concurrent.futures import ThreadPoolExecutor

        fed = tokens.tolist()
        self._settle()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcli-masks")
        self._pending = (self._worker.submit(self._build, fed), fed, self._seen + 1)

    def _settle_keep(self) -> None:
        """Wait for masks being built on the worker, keeping them for the next call."""
        if self._pending is not None:
            self._pending[0].result()

    def _settle(self) -> np.ndarray | None:
        """Wait for masks being built on the worker, if any, so that the matchers are the caller's again."""
        pending, self._pending = self._pending, None
        return pending[0].result() if pending is not None else None

    def _build(self, newest: list[int] | None) -> np.ndarray:
        """Feed each live row its newest token (None: the prompt, nothing to feed), then build every row's
        mask of disallowed tokens: (B, W*32) bool, False throughout a free row. Runs on the worker with
        `overlap`; it touches only the matchers and its own arrays."""
        import time

        import numpy as np

        started = time.perf_counter()
        if newest is not None:
            for matcher, token in zip(self.matchers, newest):
                if matcher is not None and not matcher.is_error() and not matcher.is_stopped():
                    matcher.consume_token(token)  # once stopped (after end-of-text) the row only pads
        rows, words = len(self.matchers), (self.vocab_size + 31) // 32
        bitmask = np.full((rows, words), -1, dtype=np.int32)  # (B, W): 32 tokens a word, bit set = allowed
        live = [(m, i) for i, m in enumerate(self.matchers) if m is not None and not m.is_error()]
        # Row by row in this thread: llguidance's LLExecutor would hand the rows to its own thread pool,
        # whose wake-up cost 3-4 ms at p99 on a busy 2-core machine against 0.1 ms here (batch 8).
        for matcher, i in live:
            matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data + i * words * 4, words * 4)
        for i, matcher in enumerate(self.matchers):
            if matcher is not None and matcher.is_error():
                bitmask[i] = 0  # only end-of-text, so the row ends (it is finished, or the engine failed)
                for eos in self.eos_ids:
                    bitmask.view(np.uint32)[i, eos // 32] |= np.uint32(1 << (eos % 32))
        # numpy unpacks bits in one single-threaded pass: several small torch ops would each wake
        # torch's thread pool, which costs milliseconds on a busy machine.
        disallowed = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little").view(np.bool_)  # (B, W*32)
        self.mask_seconds.append(time.perf_counter() - started)
        return disallowed

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] (the text so far), logits [B, V] -> logits with disallowed tokens at -inf."""
        import time

        import torch

        if len(self.matchers) != logits.shape[0]:
            raise ValueError(f"ConstraintMask has {len(self.matchers)} rows but the batch has {logits.shape[0]}")
        started = time.perf_counter()
        length = input_ids.shape[1]
        pending = self._pending
        ahead = self._settle()
        if ahead is not None and pending is not None and pending[2] == length and (
                input_ids[:, -1].tolist() == pending[1]):
            disallowed = ahead  # built on the worker from this text's newest tokens
        else:
            restart = ahead is not None or (self._seen != -1 and length != self._seen + 1)
            if restart:
                self.reset()  # a new text: the rows start again from its prompt
            disallowed = self._build(None if restart or self._seen == -1 else input_ids[:, -1].tolist())
            ahead = None
        self._seen = length
        blocked = torch.from_numpy(disallowed)
        vocab = logits.shape[-1]
        if blocked.shape[1] < vocab:  # logits wider than the engine's vocabulary: the rest only for free rows
            constrained = torch.tensor([m is not None for m in self.matchers])
            blocked = torch.cat([blocked, constrained[:, None].expand(-1, vocab - blocked.shape[1])], 1)
        blocked = blocked[:, :vocab]
        released = [i for i, m in enumerate(self.matchers) if m is None]
        if released and ahead is not None:  # rows released while their masks were being built
            blocked = blocked.clone()
            blocked[released] = False
        masked = logits.masked_fill(blocked.to(logits.device), float("-inf"))
        self.blocked_seconds.append(time.perf_counter() - started)
        return masked

    def release(self, row: int) -> None:
        """The row has ended (stop string, token limit): its matcher is dropped, and the padding that
        follows is not fed to it."""
        self._settle_keep()
        self.matchers[row] = None
        self.constraints[row] = None

    def end_row(self, row: int) -> str | None:
        """The chain's per-row hook (sampling.end_row): the row has ended; its error (`row_error`), then
        its matcher dropped (`release`)."""
        error = self.row_error(row)
        self.release(row)
        return error

    def row_error(self, row: int) -> str | None:
        """The engine's error for a row whose text broke its constraint, after the constraint's name
        (None when it has not): e.g. a pattern that exhausted the engine's limits."""
        self._settle_keep()
        matcher = self.matchers[row]
        if matcher is None or not matcher.is_error():
            return None
        return f"{self.names[row]}: {_one_line(matcher.get_error())}"


def satisfied(tokenizer: Tokenizer, constraint: Constraint, vocab_size: int, tokens: Sequence[int]) -> bool:
    """Whether the text of `tokens` (the completion, without its end-of-text) satisfies `constraint` whole,
    as a fresh matcher judges it: the check for a row that a limit ended before end-of-text."""
    import llguidance

    matcher = llguidance.LLMatcher(engine_tokenizer(tokenizer, vocab_size), constraint.grammar, log_level=0)
    return not matcher.is_error() and matcher.try_consume_tokens(list(tokens)) == len(tokens) and matcher.is_accepting()


def satisfied_by_text(tokenizer: Tokenizer, constraint: Constraint, vocab_size: int, text: str) -> bool:
    """`satisfied` for a text (one a stop string cut), in the engine's own tokens of its bytes."""
    engine = engine_tokenizer(tokenizer, vocab_size)
    return satisfied(tokenizer, constraint, vocab_size, engine.tokenize_str(text))


class _Bytes:
    """A vocabulary of the 256 single bytes and an end-of-text token: every text can be written in it."""

    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

    def __call__(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _matches_nothing(grammar: str) -> bool:
    """Whether no text at all satisfies `grammar` (its language is empty, e.g. {"$ref": "#"}), rather
    than only none this model's tokens can write: it cannot start even with single bytes."""
    import llguidance

    engine = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257)
    matcher = llguidance.LLMatcher(engine, grammar, log_level=0)
    if matcher.is_error():
        return False
    allowed = _allowed(matcher.compute_bitmask(), 257)
    return not matcher.is_accepting() and not [i for i in allowed if i != 256]


def _allowed(bitmask: bytes, vocab_size: int) -> list[int]:
    return [i for i in range(min(vocab_size, len(bitmask) * 8)) if bitmask[i // 8] >> (i % 8) & 1]
