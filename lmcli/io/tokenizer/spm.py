"""SentencePiece Unigram tokenizers of the encoder-decoders, for directories without a tokenizer.json:

- T5: `spiece.model`, its 100 sentinel tokens (<extra_id_N>, numbered down from the end), and
  </s> appended to every input, as transformers' T5 tokenizer builds them.
- Marian (opus-mt): `source.spm` segments the input, `vocab.json` (the vocabulary the model shares
  between encoder and decoder) numbers the pieces, and </s> is appended; decoding joins pieces.

Both become a `tokenizers` Unigram backend, like every other lmcli tokenizer (see facade.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from lmcli.errors import TokenizerError
from lmcli.io.tokenizer.backend import SPIECE_SPACE, set_bos_eos
from lmcli.io.tokenizer.facade import Tokenizer


def load_spm_tokenizer(directory: Path, config: dict) -> Tokenizer | None:
    """The T5 or Marian tokenizer of `directory`, or None when it has neither's files.
    A Marian directory missing one of its parts is a TokenizerError naming it."""
    if (directory / "spiece.model").is_file():
        return _t5(directory, config)
    marian_parts = [directory / name for name in ("source.spm", "target.spm", "vocab.json")]
    present = [part.is_file() for part in marian_parts]
    if any(present):
        if not all(present):
            missing = marian_parts[present.index(False)].name
            raise TokenizerError(f"{directory}: a Marian tokenizer needs source.spm, target.spm and vocab.json; "
                                 f"{missing} is missing")
        return _marian(directory, config)
    return None


def _read_model(path: Path):
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # a generated protobuf module
    try:
        model.ParseFromString(path.read_bytes())
    except (DecodeError, OSError) as exc:
        raise TokenizerError(f"{path}: not a SentencePiece model ({str(exc) or 'unreadable'})") from None
    if not model.pieces:
        raise TokenizerError(f"{path}: not a SentencePiece model (no vocabulary pieces)")
    if model.trainer_spec.model_type not in (0, 1):  # 1 = unigram; 0 = unset, which means unigram
        raise TokenizerError(f"{path}: only SentencePiece Unigram models are supported here")
    return model


def _unigram(vocab: list[tuple[str, float]], unk_id: int, charsmap: bytes) -> Backend:
    backend = Backend(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False))
    if charsmap:
        backend.normalizer = normalizers.Precompiled(charsmap)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme="always", split=True),
    ])
    backend.decoder = decoders.Metaspace(replacement=SPIECE_SPACE, prepend_scheme="always", split=True)
    return backend


def _specials(config: dict) -> dict[str, str]:
    def text(key: str, default: str) -> str:
        value = config.get(key, default)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else default

    return {"eos_token": text("eos_token", "</s>"), "unk_token": text("unk_token", "<unk>"),
            "pad_token": text("pad_token", "<pad>")}


def _finish(backend: Backend, specials: dict[str, str], name: str, extra: Sequence[str] = ()) -> Tokenizer:
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    wanted = [*specials.values(), *extra]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(wanted)
                                if t not in present and backend.token_to_id(t) is not None])
    set_bos_eos(backend, None, specials["eos_token"], add_bos=False, add_eos=True)  # inputs end in </s>
    return Tokenizer(backend, eos_token=specials["eos_token"], unk_token=specials["unk_token"],
                     pad_token=specials["pad_token"], name=name)


def _t5(directory: Path, config: dict) -> Tokenizer:
    model = _read_model(directory / "spiece.model")
    extra_ids = config.get("extra_ids", 100)
    if isinstance(extra_ids, bool) or not isinstance(extra_ids, int) or not 0 <= extra_ids <= 10_000:
        raise TokenizerError(f"{directory / 'tokenizer_config.json'}: extra_ids must be an integer in [0, 10000]")
    sentinels = [f"<extra_id_{i}>" for i in range(extra_ids - 1, -1, -1)]  # <extra_id_0> gets the last id
    vocab = [(piece.piece, piece.score) for piece in model.pieces] + [(token, 0.0) for token in sentinels]
    specials = _specials(config)
    unk = next((i for i, (piece, _) in enumerate(vocab) if piece == specials["unk_token"]), 2)
    backend = _unigram(vocab, unk, model.normalizer_spec.precompiled_charsmap)
    return _finish(backend, specials, str(directory), sentinels)


def _marian(directory: Path, config: dict) -> Tokenizer:
    source = _read_model(directory / "source.spm")
    try:
        numbered = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{directory / 'vocab.json'}: not valid JSON ({exc})") from None
    if not isinstance(numbered, dict) or not all(isinstance(i, int) and 0 <= i < 1 << 24 for i in numbered.values()):
        raise TokenizerError(f"{directory / 'vocab.json'}: expected an object of piece -> token id")
    ids = sorted(numbered.values())
    if ids != list(range(len(ids))):
        raise TokenizerError(f"{directory / 'vocab.json'}: token ids must be 0..{len(ids) - 1}, each once")
    # The model's numbering, with the source model's scores; pieces only the target side uses are
    # never chosen when segmenting an input (as Marian, whose source model does not know them).
    scores = {piece.piece: piece.score for piece in source.pieces}
    lowest = min(scores.values()) - 100.0
    by_id = sorted(numbered.items(), key=lambda item: item[1])
    vocab = [(piece, scores.get(piece, lowest)) for piece, _ in by_id]
    specials = _specials(config)
    unk = numbered.get(specials["unk_token"])
    if unk is None:
        raise TokenizerError(f"{directory / 'vocab.json'}: has no {specials['unk_token']} token")
    backend = _unigram(vocab, unk, source.normalizer_spec.precompiled_charsmap)
    return _finish(backend, specials, str(directory))
