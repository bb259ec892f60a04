"""Synthetic GGUF models for the benchmark and the memory tests: no download, random weights.

`synthetic_llama_gguf()` gives a llama of about 1.04 billion parameters stored as Q4_0 (about 590 MB),
the shape of Llama 3.2 1B with a 32,000-token SentencePiece-style vocabulary. Its weights are random
Q4_0 blocks written straight as bytes (a float32 copy of 1B weights would need 4 GB just to be
quantised), so writing it takes seconds plus the disk. It is written once under the lmcli cache and
reused; the file name carries SYNTHETIC_FORMAT so a change to the recipe writes a new file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmcli.io.atomic import atomic_file

if TYPE_CHECKING:  # numpy loads only when a file is written
    import numpy as np

SYNTHETIC_FORMAT = 1  # bump when the file written below changes

Q4_0_BLOCK = 32  # weights per block
Q4_0_BLOCK_BYTES = 18  # float16 scale + 16 bytes of 4-bit values


@dataclass(frozen=True)
class SyntheticLlama:
    """Sizes of the synthetic model (Llama 3.2 1B's, with a smaller vocabulary)."""

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    context_length: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def matrices(self) -> list[tuple[str, int, int]]:
        """(GGUF tensor name, rows, columns) of every quantized matrix, in file order."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        shapes = [("token_embd.weight", self.vocab_size, h)]  # tied: also the output head
        for i in range(self.num_layers):
            shapes += [
                (f"blk.{i}.attn_q.weight", h, h),
                (f"blk.{i}.attn_k.weight", kv, h),
                (f"blk.{i}.attn_v.weight", kv, h),
                (f"blk.{i}.attn_output.weight", h, h),
                (f"blk.{i}.ffn_gate.weight", self.intermediate_size, h),
                (f"blk.{i}.ffn_up.weight", self.intermediate_size, h),
                (f"blk.{i}.ffn_down.weight", h, self.intermediate_size),
            ]
        return shapes

    def norms(self) -> list[str]:
        return ["output_norm.weight"] + [
            f"blk.{i}.{kind}.weight" for i in range(self.num_layers) for kind in ("attn_norm", "ffn_norm")]

    def parameter_count(self) -> int:
        return sum(rows * cols for _, rows, cols in self.matrices()) + self.hidden_size * len(self.norms())


def _vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """A minimal SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens, then word pieces."""
    normal, unknown, control, byte = 1, 2, 3, 6  # llama.cpp's token types
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [unknown, control, control] + [byte] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    singles = ["\u2581"] + [f"\u2581{c}" for c in letters] + list(letters)
    tokens += singles
    types += [normal] * len(singles)
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]  # distinct filler pieces
    types += [normal] * (size - len(types))
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(size - 259)]
    return tokens[:size], scores[:size], types[:size]


def _random_q4_0(rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """[rows, cols // 32 * 18] bytes of Q4_0 blocks: a float16 scale near `scale`, random 4-bit values."""
    import numpy as np

    blocks = rows * (cols // Q4_0_BLOCK)
    data = rng.integers(0, 256, size=(blocks, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    scales = (scale * (0.5 + rng.random(blocks, dtype=np.float32))).astype(np.float16)
    data[:, :2] = scales.view(np.uint8).reshape(blocks, 2)
    return data.reshape(rows, -1)


def write_synthetic_llama(path: str | Path, sizes: SyntheticLlama = SyntheticLlama(), seed: int = 0) -> Path:
    """Write the synthetic llama as a Q4_0 GGUF at `path` (atomically: a partial file is renamed)."""
    import gguf
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(None, arch="llama")  # the file is opened by write_header_to_file
    writer.add_name(f"synthetic llama {sizes.parameter_count() / 1e9:.2f}B Q4_0")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_context_length(sizes.context_length)
    writer.add_embedding_length(sizes.hidden_size)
    writer.add_feed_forward_length(sizes.intermediate_size)
    writer.add_block_count(sizes.num_layers)
    writer.add_head_count(sizes.num_heads)
    writer.add_head_count_kv(sizes.num_kv_heads)
    writer.add_rope_dimension_count(sizes.head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(sizes.vocab_size)
    tokens, scores, types = _vocabulary(sizes.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    # Tensors are declared first and then streamed one at a time, so at most one is in memory.
    for name, rows, cols in sizes.matrices():
        nbytes = rows * cols // Q4_0_BLOCK * Q4_0_BLOCK_BYTES
        writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes,
                               raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    for name in sizes.norms():
        writer.add_tensor_info(name, (sizes.hidden_size,), np.dtype(np.float32), sizes.hidden_size * 4)
    with atomic_file(path) as partial:
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for _, rows, cols in sizes.matrices():
            # Q4_0 values are (q - 8) * scale with q uniform in 0..15: std about 4.6 * scale.
            # 1 / (4.6 * sqrt(cols)) keeps each projection's output near unit size.
            writer.write_tensor_data(_random_q4_0(rows, cols, rng, 1.0 / (4.6 * np.sqrt(cols))))
        for _ in sizes.norms():
            writer.write_tensor_data(np.ones(sizes.hidden_size, dtype=np.float32))
        writer.close()
    return path


def synthetic_llama_gguf(directory: str | Path | None = None) -> Path:
    """The synthetic 1B Q4_0 llama, written on first use under `directory` (default: the lmcli cache)."""
    from lmcli.paths import cache_dir

    folder = Path(directory) if directory is not None else cache_dir() / "synthetic"
    path = folder / f"synthetic-llama-1b-q4_0-v{SYNTHETIC_FORMAT}.gguf"
    if not path.is_file():
        write_synthetic_llama(path)
    return path


# ----------------------------------------------------------------------------- fixed inputs

# The real-model prompts: the end-to-end greedy checks in tests/ and the bench's quality figures use these.
TEXT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "Water boils at a temperature of",
]

# A fixed text for the KL divergence of quantized formats (written for lmcli; any plain prose would do).
# About 700 tokens with a 49k BPE vocabulary; the bench takes its first 512.
QUALITY_TEXT = """\
The lighthouse at the end of the northern breakwater was built in 1871, after three ships had been lost on \
the same reef in a single winter. Its first keeper, a retired ship's carpenter named Elias Ward, kept a log \
of every vessel that passed, every change in the weather and every repair he made to the lamp. The log still \
exists. It is a plain book bound in brown leather, and most of its entries are short: "Wind north-east, \
fresh. Fog from four until nine. Brig Margaret passed inward at noon." Read one after another, though, the \
entries tell a longer story about how a small town learned to live with the sea.

In the first years the lamp burned whale oil, and the keeper trimmed the wicks every four hours through the \
night. Soot blackened the glass, so each morning began with cleaning it. Ward wrote that a clean lens could \
be seen from eighteen miles away on a clear night, but only from six when the glass was dirty, and that the \
difference had nothing to do with the oil and everything to do with patience. When kerosene replaced the \
oil in 1884, the light grew brighter and the work grew easier, yet he kept cleaning the glass twice a day.

The town changed around the tower. The harbour was dredged, a railway reached the quay, and the fishing \
fleet that had once numbered forty small boats gave way to a dozen larger ones with engines. Warehouses went \
up along the waterfront and came down again when the trade moved south. Through all of it the light turned \
every night, and the log recorded the names of the ships, the state of the tide and the hour of sunrise.

Modern readers tend to look for drama in such records, and there is some. On the night of the great storm \
of 1893, Ward noted that the waves broke over the gallery, forty feet above the water, and that he tied \
himself to the railing to reach the lamp when the draught put it out. Two fishing boats were saved that \
night because their crews could still see the light between the squalls. The entry for the following \
morning reads only: "Storm passed. Glass cracked on the seaward side. Replaced it."

What stands out more, on a careful reading, is the attention to ordinary things. Ward measured the rain, \
counted the seabirds nesting on the rocks, and recorded the first swallow of each spring. He noticed that \
the herring arrived later each decade and wrote down his guesses about why. Scientists who study the \
coast have since used his numbers, because so few people were measuring anything there at the time.

The light was automated in 1962, and the last keeper left the tower that autumn. Today a small electric \
lamp, checked once a month by an engineer who drives out from the city, does the work that once took a \
family's whole life. The keeper's cottage has become a museum, and the log sits in a glass case by the \
door, open at the page for the great storm. Visitors read it, look out at the reef, and usually go quiet \
for a moment before they walk back along the breakwater toward the town.
"""
