"""A tiny real checkpoint for CLI and job tests: a random Llama plus a trained byte-level BPE tokenizer.

The model is gibberish by design (random weights), so tests assert relationships
(streamed == decoded, piped == JSON completion, batched == alone) rather than text.
The tokenizer is trained on English, Cyrillic and emoji so that multi-byte
characters get split across tokens, which is what incremental decoding must survive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Once upon a time there was a tiny model that wrote strange stories.",
    "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Москва, Санкт-Петербург и Новосибирск — большие города России.",
    "Emoji time: 🙂 🚀 🎉 👍🏽 ❤️ 🇺🇦 and a cat 🐈 with a hat 🎩.",
    "Numbers 0123456789, punctuation ;:!?()[]{}<>-_=+*/\\|@#$%^&~` and quotes \"'.",
    "def main():\n    print('hi')\n    return 0\n",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(directory: Path, kind: str = "byte-level", vocab_size: int = 400) -> int:
    """Train a tokenizer that adds BOS and save it as an HF directory; returns its vocab size.

    "byte-level": GPT-2 style BPE, every byte is a token, so characters split across tokens.
    "sentencepiece": Metaspace BPE ("▁" for spaces), whose decoder drops the first token's leading space.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    if kind == "byte-level":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return tokenizer.get_vocab_size()


def build_tiny_checkpoint(directory: Path, seed: int = 0, tokenizer: str = "byte-level") -> Path:
    """Tokenizer + a random LlamaForCausalLM (hidden 64, 2 layers, 4 heads, 2 kv heads) saved as safetensors."""
    import torch
    import transformers

    vocab_size = build_tokenizer(directory, tokenizer)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger than the default init, so logits are peaked enough that greedy
        # decoding is not decided by rounding noise (batched == alone must hold).
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
    model.float().eval().save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_spm_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-spm"), seed=1, tokenizer="sentencepiece")



def subprocess_env(**extra: str) -> dict:
    """The environment for `python -m lmcli` subprocesses: this checkout first, torch on one thread."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("PYTHONIOENCODING", None)  # the real default: lmcli must choose UTF-8 for pipes itself
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_lmcli(*args: str, input: str | bytes | None = None, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """`python -m lmcli ARGS` in a subprocess (real pipes: stdout is not a terminal)."""
    if isinstance(input, str):
        input = input.encode("utf-8")
    return subprocess.run(
        [sys.executable, "-m", "lmcli", *args], input=input, capture_output=True, timeout=timeout,
        env=subprocess_env(), **kwargs
    )
