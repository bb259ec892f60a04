"""T5's spiece.model and Marian's source.spm / target.spm / vocab.json (no tokenizer.json), against
transformers' T5Tokenizer and MarianTokenizer reading the same files."""

from __future__ import annotations

import json
import shutil

import pytest

from lmcli.errors import TokenizerError
from lmcli.io.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")  # MarianTokenizer's

SOURCE = ["translate English to German: the house is wonderful.", "a small house by the lake, above all!",
          "numbers 123 4567 and  double  spaces", "Größe café naïve"]
TARGET = ["das Haus ist wunderbar.", "ein kleines Haus am See, über alles!", "Zahlen 123 und  doppelte  Leerzeichen"]
PROBES = [*SOURCE, "  leading and trailing  ", "unknown ☃ characters", "x", ""]


def _train(tmp_path, name, lines, **ids):
    (tmp_path / f"{name}.txt").write_text("\n".join(lines * 40))
    spm.SentencePieceTrainer.train(input=str(tmp_path / f"{name}.txt"), model_prefix=str(tmp_path / name),
                                   vocab_size=60, hard_vocab_limit=False, model_type="unigram",
                                   character_coverage=1.0, minloglevel=2, **ids)
    return tmp_path / f"{name}.model"


def test_t5_spiece_model_equals_transformers(tmp_path):
    model = _train(tmp_path, "spiece", SOURCE, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    directory = tmp_path / "t5"
    directory.mkdir()
    shutil.copy(model, directory / "spiece.model")
    reference = transformers.T5Tokenizer(vocab_file=str(directory / "spiece.model"))
    reference.save_pretrained(directory)
    (directory / "tokenizer.json").unlink(missing_ok=True)  # only the SentencePiece model and the config
    reference = transformers.T5Tokenizer.from_pretrained(directory)
    ours = load_tokenizer(directory)
    assert ours is not None
    for text in [*PROBES, "fill <extra_id_0> and <extra_id_1>"]:
        ids = reference(text).input_ids
        assert ours.encode(text) == ids, text
        assert ids[-1] == ours.eos_token_ids[0] == 1  # </s> appended, as the checkpoint's files say
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.backend.token_to_id("<extra_id_0>") == ours.vocab_size - 1


@pytest.fixture
def marian_dir(tmp_path):
    source = _train(tmp_path, "source", SOURCE, unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1)
    target = _train(tmp_path, "target", TARGET, unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1)
    directory = tmp_path / "marian"
    directory.mkdir()
    shutil.copy(source, directory / "source.spm")
    shutil.copy(target, directory / "target.spm")
    pieces = ["</s>", "<unk>"]
    for model in (source, target):  # one vocabulary for both sides, numbered its own way
        processor = spm.SentencePieceProcessor(model_file=str(model))
        pieces += [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    pieces = [*dict.fromkeys(pieces), "<pad>"]
    (directory / "vocab.json").write_text(json.dumps({piece: i for i, piece in enumerate(pieces)}))
    transformers.MarianTokenizer(source_spm=str(directory / "source.spm"), target_spm=str(directory / "target.spm"),
                                 vocab=str(directory / "vocab.json")).save_pretrained(directory)
    return directory


def test_marian_source_encodes_and_shared_vocabulary_decodes(marian_dir):
    reference = transformers.MarianTokenizer.from_pretrained(marian_dir)
    ours = load_tokenizer(marian_dir)
    assert ours is not None
    for text in PROBES:
        assert ours.encode(text) == reference(text).input_ids, text
    for text in TARGET:
        ids = reference(text_target=text).input_ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_a_missing_marian_part_is_named(marian_dir):
    (marian_dir / "target.spm").unlink()
    with pytest.raises(TokenizerError, match=r"target\.spm is missing"):
        load_tokenizer(marian_dir)
