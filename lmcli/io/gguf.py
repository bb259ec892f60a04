"""GGUF checkpoints, turned into exactly what an HF directory gives: a config.json dict and HF-named tensors.

The rest of lmcli then has one loading path. llama.cpp's converter changes some tensors on the way
into a GGUF, and each change is undone here:
  - llama-family q/k rows are interleaved for its RoPE kernel        -> `unpermute_rope_rows`
  - gemma RMSNorm weights are stored as (1 + w)                       -> 1 is subtracted back
  - gpt2's Conv1D weights are stored transposed                       -> transposed back
  - mixtral experts are stacked into one tensor per projection        -> split back per expert
  - llama 3 RoPE scaling is baked into a `rope_freqs` tensor          -> turned back into rope_scaling

The header is parsed here, every count and length checked against the file size before anything is
allocated (gguf.GGUFReader builds numpy views per vocabulary entry: 25 s on Gemma's 262k tokens, where
this takes 0.3 s). Dequantisation is the `gguf` package's.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmcli.errors import GGUFError
from lmcli.models.linear import GroupQuantized

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4

# Metadata value types (GGUF spec): id -> struct format of a scalar.
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.uint8, 10: np.uint64, 11: np.int64, 12: np.float64}
# Fewest bytes one value of a type can take: bounds array counts before any loop runs.
_MIN_VALUE_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first); GGUF stores it innermost first
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    file_size: int


@dataclass
class GGUFCheckpoint:
    path: Path
    metadata: dict[str, Any]  # every GGUF key/value as plain Python values
    hf_config: dict[str, Any]  # what config.json would hold, with transformers' field names
    tensors: dict[str, Any]  # HF names and layout ("lm_head.weight" only if untied): torch.Tensor or GroupQuantized


# --- header ----------------------------------------------------------------------------------------


class _Cursor:
    """Little-endian reads over the mapped file; every read is checked against the bytes left."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.size - self.pos:
            raise self.fail(f"truncated file: {what} at byte {self.pos} needs {nbytes} bytes, {self.size - self.pos} left")

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        length = self.unpack("<Q", f"length of {what}")
        self.need(length, what)
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        # Some vocabularies hold tokens that are not valid UTF-8 on their own; keep them readable.
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int, what: str, depth: int = 0) -> Any:
        if value_type == _STRING:
            return self.string(what)
        if value_type == _ARRAY:
            return self.array(what, depth)
        if value_type not in _SCALAR_FORMATS:
            raise self.fail(f"{what} has unknown value type {value_type}")
        value = self.unpack(_SCALAR_FORMATS[value_type], what)
        if value_type == _BOOL:
            return bool(value)
        if value_type == 6:
            return _shortest_float32(value)
        return value

    def array(self, what: str, depth: int) -> list[Any]:
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_NESTING} levels")
        item_type = self.unpack("<I", f"item type of {what}")
        count = self.unpack("<Q", f"length of {what}")
        if item_type not in _MIN_VALUE_BYTES:
            raise self.fail(f"{what} has unknown item type {item_type}")
        if count * _MIN_VALUE_BYTES[item_type] > self.size - self.pos:
            raise self.fail(f"{what} claims {count} items, more than the file can hold")
        if item_type in _NUMPY_TYPES:  # numbers in one go: vocab scores are 100k+ items
            items = np.frombuffer(self.buf, dtype=_NUMPY_TYPES[item_type], count=count, offset=self.pos)
            self.pos += items.nbytes
            return [bool(x) for x in items] if item_type == _BOOL else items.tolist()
        return [self.value(item_type, what, depth + 1) for _ in range(count)]


def _shortest_float32(value: float) -> float:
    """The shortest decimal that reads back as the same float32: 1e-05 rather than 9.99999974e-06."""
    return float(str(np.float32(value)))


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type id {ggml_type}"


def _parse_header(buf: mmap.mmap, path: Path) -> GGUFHeader:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cursor(buf, path)
    if cur.size < 4 or buf[:4] != MAGIC:
        if cur.size < 4:
            raise cur.fail(f"truncated file: {cur.size} bytes, too short to be GGUF")
        raise cur.fail(f"not a GGUF file (starts with {bytes(buf[:4])!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            raise cur.fail("big-endian GGUF files are not supported")
        raise cur.fail(f"unsupported GGUF version {version} (lmcli reads versions 2 and 3)")
    tensor_count = cur.unpack("<Q", "tensor count")
    kv_count = cur.unpack("<Q", "metadata count")
    left = cur.size - cur.pos
    if kv_count * _MIN_KV_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES > left:
        raise cur.fail(f"truncated or corrupt header: it claims {kv_count} metadata entries and {tensor_count} "
                       f"tensors, more than a {cur.size}-byte file can hold")

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string("metadata key")
        value_type = cur.unpack("<I", f"type of metadata '{key}'")
        if key in metadata:
            raise cur.fail(f"metadata key '{key}' appears twice")
        metadata[key] = cur.value(value_type, f"metadata '{key}'")

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment must be a power of two, got {alignment!r}")

    raw_infos = []
    for _ in range(tensor_count):
        name = cur.string("tensor name")
        n_dims = cur.unpack("<I", f"dimension count of tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions (expected 1 to {MAX_DIMS})")
        dims = [cur.unpack("<Q", f"shape of tensor '{name}'") for _ in range(n_dims)]
        ggml_type = cur.unpack("<I", f"type of tensor '{name}'")
        offset = cur.unpack("<Q", f"offset of tensor '{name}'")
        raw_infos.append((name, dims, ggml_type, offset))

    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset in raw_infos:
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor '{name}' has unknown tensor type id {ggml_type}") from None
        if dims[0] % block_size:
            raise cur.fail(f"tensor '{name}' ({_type_name(ggml_type)}) has rows of {dims[0]} values, "
                           f"not a multiple of its block size {block_size}")
        nbytes = math.prod(dims) // block_size * type_size
        start = data_start + offset
        if offset % alignment:
            raise cur.fail(f"tensor '{name}' data offset {offset} is not aligned to {alignment} bytes")
        if start + nbytes > cur.size:
            raise cur.fail(f"truncated file: tensor '{name}' data extends past the end of the file "
                           f"(needs bytes {start}..{start + nbytes}, the file has {cur.size})")
        if name in tensors:
            raise cur.fail(f"tensor '{name}' appears twice")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)
    return GGUFHeader(path, version, metadata, tensors, cur.size)


@contextmanager
def _mapped(path: str | Path) -> Iterator[tuple[mmap.mmap, GGUFHeader]]:
    path = Path(path)
    try:
        file = open(path, "rb")
    except OSError as exc:
        raise GGUFError(f"{path}: cannot open ({exc.strerror or exc})") from None
    with file:
        size = file.seek(0, 2)
        if size < 4:
            raise GGUFError(f"{path}: truncated file: {size} bytes, too short to be GGUF")
        buf = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield buf, _parse_header(buf, path)
        finally:
            try:
                buf.close()
            except BufferError:  # a caller still holds a view; the map goes when that does
                pass


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor table only: no tensor data is read."""
    with _mapped(path) as (_, header):
        return header


# --- dequantisation --------------------------------------------------------------------------------


def _dequantisable_types() -> set[int]:
    from gguf import GGMLQuantizationType, quants

    # gguf.quants keeps its dequantisers in a private table; F32 and F16 are handled outside it.
    return {int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16)} | {
        int(t) for t in getattr(quants, "_type_traits", {})
    }


def _dequantise(buf: mmap.mmap, info: TensorInfo) -> torch.Tensor:
    """float32 tensor of `info.shape`, owning its memory (the map may close right after)."""
    from gguf import GGMLQuantizationType, quants

    rows = info.shape[:-1]
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    raw = raw.reshape(*rows, info.nbytes // max(1, math.prod(rows)))  # (*rows, bytes per row)
    values = quants.dequantize(raw, GGMLQuantizationType(info.ggml_type))  # (*rows, row length) float32
    if not values.flags.writeable:  # F32 comes back as a view of the file itself
        values = values.copy()
    return torch.from_numpy(values.reshape(info.shape))


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head it stores the two rotary halves interleaved.

    Its converter turns HF's row order [h][half][i] into [h][i][half]; swapping back restores HF's.
    Works for weights (rows, in) and biases (rows,).
    """
    if isinstance(weight, GroupQuantized):  # rows are whole groups: permute codes, scales and offsets alike
        return weight.map(lambda part: unpermute_rope_rows(part, num_heads))
    rows = weight.shape[0]
    per_head = rows // num_heads
    interleaved = weight.reshape(num_heads, per_head // 2, 2, *weight.shape[1:])  # (h, i, half, ...)
    return interleaved.transpose(1, 2).reshape(weight.shape)  # (h, half, i, ...) -> (rows, ...)


# --- architectures: metadata -> config.json ---------------------------------------------------------


class _Meta:
    """The architecture-scoped metadata keys (`llama.block_count`, ...) with errors that name the file."""

    def __init__(self, header: GGUFHeader, arch: str):
        self.header, self.arch, self.md = header, arch, header.metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self.md.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.md:
            raise GGUFError(f"{self.header.path}: missing metadata key '{full}'")
        return self.md[full]

    def integer(self, key: str, default: Any = ...) -> int | None:
        """An integer key; a per-layer list is accepted when all layers agree."""
        value = self.require(key) if default is ... else self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise GGUFError(f"{self.header.path}: '{self.arch}.{key}' differs between layers ({value[:8]}...), "
                                "which lmcli does not support")
            value = value[0]
        return value if value is None else int(value)

    def has_tensor(self, suffix: str) -> bool:
        return any(name.endswith(suffix) for name in self.header.tensors)

    def shape(self, name: str) -> tuple[int, ...] | None:
        info = self.header.tensors.get(name)
        return info.shape if info else None


def _token_ids(md: dict[str, Any]) -> dict[str, Any]:
    ids = {}
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = md.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if value is not None:
            ids[hf_key] = int(value)
    return ids


def _vocab_size(m: _Meta) -> int:
    embedding = m.shape("token_embd.weight")
    if embedding is not None:  # the embedding's rows are what the model needs, padding included
        return embedding[0]
    if m.get("vocab_size") is not None:
        return int(m.get("vocab_size"))
    if "tokenizer.ggml.tokens" in m.md:
        return len(m.md["tokenizer.ggml.tokens"])
    raise GGUFError(f"{m.header.path}: cannot tell the vocabulary size (no token_embd.weight, vocab_size or tokens)")


def _decoder_fields(m: _Meta) -> dict[str, Any]:
    """Fields llama-style configs share: llama, mistral, mixtral, qwen2 and the gemmas."""
    hidden = m.integer("embedding_length")
    heads = m.integer("attention.head_count")
    head_dim = m.integer("attention.key_length", None) or m.integer("rope.dimension_count", None) or hidden // heads
    return {
        "vocab_size": _vocab_size(m),
        "hidden_size": hidden,
        "intermediate_size": m.integer("feed_forward_length"),
        "num_hidden_layers": m.integer("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.integer("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": m.integer("context_length"),
        "rms_norm_eps": m.require("attention.layer_norm_rms_epsilon"),
        "rope_theta": m.get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(m),
        "tie_word_embeddings": "output.weight" not in m.header.tensors,
        **_token_ids(m.md),
    }


def _rope_scaling(m: _Meta) -> dict[str, Any] | None:
    kind = m.get("rope.scaling.type")
    factor = m.get("rope.scaling.factor") or m.get("rope.scale_linear")  # the latter: older files
    if kind == "none" or (kind is None and factor in (None, 0, 1)):
        return None
    kind = kind or "linear"
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
    if m.get("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = int(m.get("rope.scaling.original_context_length"))
    if kind == "yarn" and m.get("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(m.get("rope.scaling.attn_factor"))
    return scaling


def llama3_rope_scaling(rope_factors: torch.Tensor, theta: float, head_dim: int, path: Path | str = "") -> dict | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's `rope_freqs` tensor (one divisor per frequency).

    llama3 divides frequency i by `factor` when its wavelength is long, by 1 when short, and in between by
    1 / ((1 - s) / factor + s) with s linear in 1 / wavelength: s = old_ctx / ((high - low) * wavelen) - low / (high - low).
    Only the ratios of (old_ctx, low, high) show, so low_freq_factor is taken as 1 (Llama 3.x's value).
    """
    divisors = rope_factors.double()  # (head_dim / 2,)
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (head_dim / 2,)
    inverse_wavelength = inv_freq / (2 * math.pi)
    smooth = (1 / divisors - 1 / factor) / (1 - 1 / factor)  # 0 where fully scaled, 1 where untouched
    between = (smooth > 1e-4) & (smooth < 1 - 1e-4)
    if int(between.sum()) < 2:
        raise GGUFError(f"{path}: rope_freqs has no smooth band, so it cannot be read as llama3 RoPE scaling")
    x, y = inverse_wavelength[between], smooth[between]
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())  # old_ctx / (high - low)
    offset = float(slope * x.mean() - y.mean())  # low / (high - low)
    if slope <= 0 or offset <= 0:
        raise GGUFError(f"{path}: rope_freqs does not follow llama3 RoPE scaling")
    low = 1.0
    high = low + low / offset
    old_ctx = slope * (high - low)
    scaling = {"rope_type": "llama3", "factor": _round(factor), "low_freq_factor": low,
               "high_freq_factor": _round(high), "original_max_position_embeddings": int(round(old_ctx))}
    expected = _llama3_divisors(scaling, inv_freq)
    if not torch.allclose(expected, divisors, rtol=1e-3, atol=1e-4):
        raise GGUFError(f"{path}: rope_freqs does not follow llama3 RoPE scaling")
    return scaling


def _round(value: float) -> float:
    """Fitted values come back as 3.9999998; config files hold 4.0."""
    return round(value, 4)


def _llama3_divisors(scaling: dict[str, Any], inv_freq: torch.Tensor) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelength - low) / (high - low)).clamp(0, 1)
    return 1 / ((1 - smooth) / factor + smooth)


def _llama_config(m: _Meta, buf: mmap.mmap) -> dict[str, Any]:
    config = _decoder_fields(m)
    experts = m.integer("expert_count", 0) or 0
    name = " ".join(str(m.md.get(k, "")) for k in ("general.name", "general.basename")).lower()
    if experts:
        model_type = "mixtral"
        config.update(num_local_experts=experts, num_experts_per_tok=m.integer("expert_used_count"),
                      intermediate_size=m.integer("expert_feed_forward_length", None) or config["intermediate_size"])
    elif m.arch == "mistral" or "mistral" in name:
        model_type = "mistral"
    else:
        model_type = "llama"
    if model_type == "llama":
        config.update(attention_bias=m.has_tensor(".attn_q.bias"), mlp_bias=m.has_tensor(".ffn_up.bias"))
    else:
        # llama.cpp keeps no window for these; Mistral 7B v0.1 had 4096, later ones none.
        config["sliding_window"] = m.integer("attention.sliding_window", None)
    if "rope_freqs.weight" in m.header.tensors and config["rope_scaling"] is None:
        factors = _dequantise(buf, m.header.tensors["rope_freqs.weight"])
        config["rope_scaling"] = llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"], m.header.path)
    return {"model_type": model_type, "hidden_act": "silu", **config}


def _qwen2_config(m: _Meta, buf: mmap.mmap) -> dict[str, Any]:
    config = _decoder_fields(m)
    return {"model_type": "qwen2", "hidden_act": "silu", **config, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": config["num_hidden_layers"]}


def _gemma_config(m: _Meta, buf: mmap.mmap) -> dict[str, Any]:
    config = _decoder_fields(m)
    config["tie_word_embeddings"] = True  # gemma's head is its embedding, always
    model_type = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}[m.arch]
    config = {"model_type": model_type, "hidden_activation": "gelu_pytorch_tanh", **config}
    if model_type == "gemma":
        return config
    layers = config["num_hidden_layers"]
    # llama.cpp does not store the attention scale: it is head_dim except on the 27B models,
    # which use hidden / heads (told apart by layer count: 46 for gemma2, 62 for gemma3).
    scale = m.get("attention.scale")
    if scale:
        query_pre_attn_scalar = _round(1 / scale ** 2)
    elif layers == {"gemma2": 46, "gemma3_text": 62}[model_type]:
        query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        query_pre_attn_scalar = config["head_dim"]
    period = 2 if model_type == "gemma2" else 6  # every period-th layer is global
    pattern = m.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer files: one flag per layer, true where the window applies
        layer_types = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    else:
        period = int(pattern or period)
        layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    config.update(
        query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_window=m.integer("attention.sliding_window"),
        layer_types=layer_types,
        attn_logit_softcapping=m.get("attn_logit_softcapping"),
        final_logit_softcapping=m.get("final_logit_softcapping"),
    )
    if model_type == "gemma3_text":
        # llama.cpp fixes the local layers' RoPE base at 10000 unless the file says otherwise.
        config["rope_local_base_freq"] = m.get("rope.freq_base_swa", 10000.0)
    return config


def _gpt2_config(m: _Meta, buf: mmap.mmap) -> dict[str, Any]:
    hidden = m.integer("embedding_length")
    positions = m.integer("context_length")
    return {
        "model_type": "gpt2",
        "vocab_size": _vocab_size(m),
        "n_embd": hidden,
        "n_layer": m.integer("block_count"),
        "n_head": m.integer("attention.head_count"),
        "n_inner": m.integer("feed_forward_length", None),
        "n_positions": positions,
        "n_ctx": positions,
        "layer_norm_epsilon": m.require("attention.layer_norm_epsilon"),
        "activation_function": "gelu_new",
        "tie_word_embeddings": _gpt2_head_is_embedding(m, buf),
        **_token_ids(m.md),
    }


def _gpt2_head_is_embedding(m: _Meta, buf: mmap.mmap) -> bool:
    """llama.cpp writes GPT-2's tied head out as a copy of the embedding: same bytes means tied."""
    out, emb = m.header.tensors.get("output.weight"), m.header.tensors.get("token_embd.weight")
    if out is None:
        return True
    if emb is None or out.ggml_type != emb.ggml_type or out.nbytes != emb.nbytes:
        return False
    return buf[out.offset:out.offset + out.nbytes] == buf[emb.offset:emb.offset + emb.nbytes]


@dataclass(frozen=True)
class _Architecture:
    config: Callable[[_Meta, mmap.mmap], dict[str, Any]]
    hf_class: dict[str, str]  # model_type -> transformers class, for config.json's "architectures"
    rope_rows_permuted: bool = False  # llama.cpp reordered q/k rows for its RoPE kernel
    norms_plus_one: bool = False  # llama.cpp stored gemma's RMSNorm weights as (1 + w)
    gpt2_names: bool = False


_LLAMA_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
ARCHITECTURES = {
    "llama": _Architecture(_llama_config, _LLAMA_CLASSES, rope_rows_permuted=True),
    "mistral": _Architecture(_llama_config, _LLAMA_CLASSES, rope_rows_permuted=True),
    "qwen2": _Architecture(_qwen2_config, {"qwen2": "Qwen2ForCausalLM"}),
    "gemma": _Architecture(_gemma_config, {"gemma": "GemmaForCausalLM"}, norms_plus_one=True),
    "gemma2": _Architecture(_gemma_config, {"gemma2": "Gemma2ForCausalLM"}, norms_plus_one=True),
    "gemma3": _Architecture(_gemma_config, {"gemma3_text": "Gemma3ForCausalLM"}, norms_plus_one=True),
    "gpt2": _Architecture(_gpt2_config, {"gpt2": "GPT2LMHeadModel"}, gpt2_names=True),
}


def _architecture(header: GGUFHeader) -> tuple[str, _Architecture]:
    arch = header.metadata.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{header.path}: no 'general.architecture' in the metadata")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{header.path}: unsupported architecture '{arch}' "
                        f"(lmcli reads {', '.join(ARCHITECTURES)} GGUF files)")
    return arch, ARCHITECTURES[arch]


def _hf_config(header: GGUFHeader, buf: mmap.mmap, dtype: torch.dtype) -> dict[str, Any]:
    arch, spec = _architecture(header)
    config = spec.config(_Meta(header, arch), buf)
    config["architectures"] = [spec.hf_class[config["model_type"]]]
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


# --- tensors: GGUF names -> HF names -----------------------------------------------------------------

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)")
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_DECODER_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
# gemma2/3 put a norm on each side of attention and of the MLP.
_SANDWICH_BLOCK = {**_DECODER_BLOCK, "ffn_norm": "pre_feedforward_layernorm",
                   "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Mixtral experts, named as HF checkpoints name them: w1 gate, w3 up, w2 down.
_EXPERT_LEAF = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
_STACKED_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_GPT2_TOP_LEVEL = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                   "output_norm": "transformer.ln_f", "output": "lm_head"}
_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
               "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# Tensors that configure rather than parameterise: read into the config, not returned.
_CONFIG_ONLY = {"rope_freqs.weight"}


def _hf_tensors(name: str, tensor: torch.Tensor, spec: _Architecture, config: dict[str, Any],
                path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF (name, tensor) pairs one GGUF tensor becomes (float32 in, float32 out)."""
    unexpected = GGUFError(f"{path}: unexpected tensor '{name}' for a {config['model_type']} GGUF")
    if spec.gpt2_names:
        yield from _gpt2_tensors(name, tensor, config, unexpected)
        return
    if spec.norms_plus_one and name.endswith("norm.weight"):
        tensor = tensor - 1.0
    stem, _, leaf = name.rpartition(".")
    if stem in _TOP_LEVEL:
        if stem == "output" and config["tie_word_embeddings"]:
            return
        yield f"{_TOP_LEVEL[stem]}.{leaf}", tensor
        return
    match = _BLOCK.fullmatch(name)
    if not match:
        raise unexpected
    layer, kind, expert, leaf = match.groups()
    prefix = f"model.layers.{layer}"
    if kind in _STACKED_EXPERTS:  # (experts, out, in) -> one (out, in) per expert
        for index, weight in enumerate(tensor.unbind(0)):
            yield f"{prefix}.block_sparse_moe.experts.{index}.{_STACKED_EXPERTS[kind]}.{leaf}", weight.clone()
        return
    if expert is not None:  # older mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight
        if kind not in _EXPERT_LEAF:
            raise unexpected
        yield f"{prefix}.block_sparse_moe.experts.{expert}.{_EXPERT_LEAF[kind]}.{leaf}", tensor
        return
    names = _SANDWICH_BLOCK if spec.norms_plus_one and config["model_type"] != "gemma" else _DECODER_BLOCK
    if kind not in names:
        raise unexpected
    if spec.rope_rows_permuted and kind in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
        if tensor.shape[0] % (2 * heads):
            raise GGUFError(f"{path}: tensor '{name}' has {tensor.shape[0]} rows, not a whole number of "
                            f"rotary pairs for {heads} heads")
        tensor = unpermute_rope_rows(tensor, heads)
    yield f"{prefix}.{names[kind]}.{leaf}", tensor


def _gpt2_tensors(name: str, tensor: torch.Tensor, config: dict[str, Any],
                  unexpected: GGUFError) -> Iterator[tuple[str, torch.Tensor]]:
    stem, _, leaf = name.rpartition(".")
    if stem in _GPT2_TOP_LEVEL:
        if stem == "output" and config["tie_word_embeddings"]:
            return
        yield f"{_GPT2_TOP_LEVEL[stem]}.{leaf}", tensor
        return
    match = _BLOCK.fullmatch(name)
    if not match or match.group(3) is not None or match.group(2) not in _GPT2_BLOCK:
        raise unexpected
    layer, kind, _, leaf = match.groups()
    if leaf == "weight" and not kind.endswith("_norm"):
        tensor = tensor.t().contiguous()  # HF GPT-2 keeps Conv1D weights as (in, out)
    yield f"transformer.h.{layer}.{_GPT2_BLOCK[kind]}.{leaf}", tensor


# --- public -----------------------------------------------------------------------------------------


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/values of a GGUF file as plain Python values, without reading any tensor."""
    return read_gguf_header(path).metadata


def _read_tensor(buf: mmap.mmap, info: TensorInfo, keep_quantized: bool) -> torch.Tensor | GroupQuantized:
    """A quantized weight as its codes and scales (see io/gguf_quant.py) if asked and its block type
    maps onto them without loss; otherwise dequantised to float32."""
    from lmcli.io.gguf_quant import decode_blocks, keeps_quantized

    if keep_quantized and len(info.shape) >= 2 and keeps_quantized(info.ggml_type):
        raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return decode_blocks(raw, info.ggml_type, info.shape)
    return _dequantise(buf, info)


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Read and rename a GGUF checkpoint into HF form (config dict + HF-named tensors).

    Tensors are dequantised to `dtype`, or with `keep_quantized` Q4_0/Q4_1/Q4_K/Q5_x/Q6_K/Q8_0
    weights stay as `GroupQuantized` codes (the others are dequantised)."""
    path = Path(path)
    with _mapped(path) as (buf, header):
        arch, spec = _architecture(header)
        supported = _dequantisable_types()
        for info in header.tensors.values():
            if info.ggml_type not in supported:
                raise GGUFError(f"{path}: tensor '{info.name}' has unsupported tensor type {info.type_name} "
                                "(lmcli dequantises F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, K-quants and IQ types)")
        hf_config = _hf_config(header, buf, dtype)
        tensors: dict[str, Any] = {}
        for info in header.tensors.values():
            if info.name in _CONFIG_ONLY:
                continue
            try:
                values = _read_tensor(buf, info, keep_quantized)
            except (NotImplementedError, ValueError) as exc:
                raise GGUFError(f"{path}: cannot dequantise tensor '{info.name}' ({info.type_name}): {exc}") from None
            for hf_name, tensor in _hf_tensors(info.name, values, spec, hf_config, path):
                tensors[hf_name] = tensor.to(dtype)
            del values
    return GGUFCheckpoint(path=path, metadata=header.metadata, hf_config=hf_config, tensors=tensors)


def write_hf_weights(checkpoint: GGUFCheckpoint, out_dir: str | Path) -> None:
    """config.json and model.safetensors, as an HF directory holds them."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(checkpoint.hf_config, indent=2) + "\n")
    save_file(checkpoint.tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write an HF-style directory (config.json, model.safetensors, tokenizer files) from a GGUF file."""
    from lmcli.io.tokenizer import tokenizer_from_gguf

    checkpoint = read_gguf(path, dtype)
    tokenizer = tokenizer_from_gguf(checkpoint.metadata)
    out_dir = Path(out_dir)
    write_hf_weights(checkpoint, out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
