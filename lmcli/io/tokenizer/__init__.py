"""Tokenizers: HF directories (tokenizer.json / tokenizer.model), GGUF vocabularies, and chat templates.

Every source becomes one in-memory `tokenizers.Tokenizer`, configured the way transformers'
AutoTokenizer configures it for the same files, so ids match the reference exactly. transformers
itself is never imported here: it is only the yardstick in the tests.

- facade.py         `Tokenizer`: encode, decode, special tokens, stop ids, chat templates
- hf.py             `load_tokenizer(directory)`: HF directories
- gguf.py           `tokenizer_from_gguf(metadata)`: GGUF vocabularies (byte-level BPE, SentencePiece, Gemma)
- backend.py        what both share: SentencePiece spaces, BOS/EOS wrapping, implied BPE merges
- chat_template.py  the sandboxed Jinja environment templates render in
"""

from lmcli.io.tokenizer.backend import implied_merges
from lmcli.io.tokenizer.facade import Tokenizer
from lmcli.io.tokenizer.gguf import tokenizer_from_gguf
from lmcli.io.tokenizer.hf import load_tokenizer, read_spm_pieces

__all__ = ["Tokenizer", "implied_merges", "load_tokenizer", "read_spm_pieces", "tokenizer_from_gguf"]
