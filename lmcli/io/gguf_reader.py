"""The bounds-checked GGUF header reader: metadata and the tensor table, nothing else.

Every count and length is checked against the file size before anything is allocated, and values
come back as plain Python values. gguf.GGUFReader builds numpy views per vocabulary entry: 25 s on
Gemma's 262k tokens, where this takes 0.3 s, hence a reader of our own.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lmcli.config import is_number as _is_number
from lmcli.errors import GGUFError

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


# ggml type ids (gguf.GGMLQuantizationType) of the types lmcli reads without the gguf package, and
# their blocks: (values, bytes). Other types are looked up in the gguf package, imported only then:
# importing it costs about 4 MB of resident memory, a few percent of a small model's budget.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
NATIVE_BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
                 Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
_NATIVE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
                 Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}


def block_layout(ggml_type: int) -> tuple[int, int] | None:
    """(values, bytes) of one block of this tensor type; None for a type id nobody knows."""
    if ggml_type in NATIVE_BLOCKS:
        return NATIVE_BLOCKS[ggml_type]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None


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


class _Cursor:
    """Little-endian reads over the mapped file; every read is checked against the bytes left."""

    def __init__(self, buf: mmap.mmap, path: Path, text_arrays: bool = True):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)
        self.text_arrays = text_arrays  # False: arrays of strings are stepped over, not decoded

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

    def array(self, what: str, depth: int) -> Any:  # a list, or _SKIPPED
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
        if item_type == _STRING and not self.text_arrays and depth == 0:
            end = _after_strings(self.buf, self.pos, count)
            if end is not None:
                self.pos = end
                return _SKIPPED
        if item_type == _STRING:  # vocabularies: 50k-260k strings, read in one tight loop
            read = _string_items(self.buf, self.pos, count)
            if read is not None:
                strings, self.pos = read
                return strings
            # One string runs past the end: the checked reader below says which, and where.
        return [self.value(item_type, what, depth + 1) for _ in range(count)]


_LENGTH = struct.Struct("<Q")


def _string_items(buf: mmap.mmap, pos: int, count: int) -> tuple[list[str], int] | None:
    """`count` GGUF strings from `pos` (each a uint64 length, then its bytes) and the position after
    them, decoded exactly as `_Cursor.string` decodes them; None if one runs past the end of `buf`.
    The caller has checked that `count` length fields fit in the file, so the list is bounded too."""
    size, unpack = len(buf), _LENGTH.unpack_from
    strings: list[str] = []
    append = strings.append
    for _ in range(count):
        start = pos + 8
        if start > size:
            return None
        end = start + unpack(buf, pos)[0]
        if end > size:
            return None
        append(buf[start:end].decode("utf-8", errors="replace"))
        pos = end
    return strings, pos


def _after_strings(buf: mmap.mmap, pos: int, count: int) -> int | None:
    """The position after `count` GGUF strings from `pos`, none of them decoded; None if one runs
    past the end of `buf` (the checked reader then says which)."""
    size, unpack = len(buf), _LENGTH.unpack_from
    for _ in range(count):
        if pos + 8 > size:
            return None
        pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            return None
    return pos


_SKIPPED = object()  # stands for an array of strings left undecoded (`read_gguf_metadata(texts=False)`)


def _shortest_float32(value: float) -> float:
    """The shortest decimal that reads back as the same float32: 1e-05 rather than 9.99999974e-06."""
    return float(str(np.float32(value)))


def _type_name(ggml_type: int) -> str:
    if ggml_type in _NATIVE_NAMES:
        return _NATIVE_NAMES[ggml_type]
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type id {ggml_type}"


# The metadata lmcli reads, by kind: checked once here, so readers further on can trust the types.
# Keys under the architecture (`llama.block_count`) are listed by what follows the architecture name.
_COUNT = "count"  # an integer >= 0, or one per layer
_NUMBER = "number"
_TEXT = "text"
_FLAG = "flag"
_TEXT_LIST = "text list"
_NUMBER_LIST = "number list"
_COUNT_LIST = "count list"
GLOBAL_METADATA_KINDS = {
    "general.architecture": _TEXT, "general.name": _TEXT, "general.basename": _TEXT, "general.alignment": _COUNT,
    "tokenizer.ggml.model": _TEXT, "tokenizer.ggml.pre": _TEXT, "tokenizer.chat_template": _TEXT,
    "tokenizer.ggml.tokens": _TEXT_LIST, "tokenizer.ggml.merges": _TEXT_LIST,
    "tokenizer.ggml.scores": _NUMBER_LIST, "tokenizer.ggml.token_type": _COUNT_LIST,
    "tokenizer.ggml.add_bos_token": _FLAG, "tokenizer.ggml.add_eos_token": _FLAG,
    **{f"tokenizer.ggml.{name}_token_id": _COUNT
       for name in ("bos", "eos", "padding", "unknown", "eot", "eom", "separator", "mask")},
}
ARCHITECTURE_METADATA_KINDS = {
    **dict.fromkeys(("context_length", "embedding_length", "feed_forward_length", "block_count",
                     "attention.head_count", "attention.head_count_kv", "attention.key_length",
                     "attention.value_length", "rope.dimension_count", "expert_count", "expert_used_count",
                     "attention.sliding_window", "attention.sliding_window_pattern", "vocab_size",
                     "rope.scaling.original_context_length"), _COUNT),
    **dict.fromkeys(("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
                     "rope.freq_base_swa", "rope.scaling.factor", "attn_logit_softcapping",
                     "final_logit_softcapping", "attention.scale"), _NUMBER),
    "rope.scaling.type": _TEXT,
}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _only_types(values: list[Any], kind: type) -> bool:
    """Every item is exactly a `kind` (not a subclass such as bool), checked without a Python loop:
    vocabulary lists hold 50k-260k items."""
    return set(map(type, values)) <= {kind}


_KIND_CHECKS = {
    _COUNT: lambda v: _is_count(v) or (isinstance(v, list) and bool(v) and all(map(_is_count, v))),
    _NUMBER: _is_number,
    _TEXT: lambda v: isinstance(v, str),
    _FLAG: lambda v: isinstance(v, bool),
    _TEXT_LIST: lambda v: isinstance(v, list) and (_only_types(v, str) or all(isinstance(x, str) for x in v)),
    _NUMBER_LIST: lambda v: isinstance(v, list) and (_only_types(v, float) or all(map(_is_number, v))),
    _COUNT_LIST: lambda v: isinstance(v, list) and ((_only_types(v, int) and min(v, default=0) >= 0)
                                                   or all(map(_is_count, v))),
}
_KIND_NAMES = {_COUNT: "a non-negative integer (or one per layer)", _NUMBER: "a number", _TEXT: "a string",
               _FLAG: "a boolean", _TEXT_LIST: "an array of strings", _NUMBER_LIST: "an array of numbers",
               _COUNT_LIST: "an array of non-negative integers"}


def check_metadata_types(metadata: dict[str, Any], path: Path) -> None:
    """A GGUFError naming the key when a value lmcli reads has the wrong type."""
    architecture = metadata.get("general.architecture")
    for key, value in metadata.items():
        kind = GLOBAL_METADATA_KINDS.get(key)
        if kind is None and isinstance(architecture, str) and key.startswith(architecture + "."):
            kind = ARCHITECTURE_METADATA_KINDS.get(key[len(architecture) + 1:])
        if kind is not None and not _KIND_CHECKS[kind](value):
            shown = type(value).__name__ if not isinstance(value, list) else f"an array of {len(value)}"
            raise GGUFError(f"{path}: metadata '{key}' must be {_KIND_NAMES[kind]}, got {shown}")


def _parse_header(buf: mmap.mmap, path: Path, text_arrays: bool = True) -> GGUFHeader:
    cur = _Cursor(buf, path, text_arrays)
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
    skipped: set[str] = set()
    for _ in range(kv_count):
        key = cur.string("metadata key")
        value_type = cur.unpack("<I", f"type of metadata '{key}'")
        if key in metadata or key in skipped:
            raise cur.fail(f"metadata key '{key}' appears twice")
        value = cur.value(value_type, f"metadata '{key}'")
        if value is _SKIPPED:
            skipped.add(key)
        else:
            metadata[key] = value

    check_metadata_types(metadata, path)
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
        layout = block_layout(ggml_type)
        if layout is None:
            raise cur.fail(f"tensor '{name}' has unknown tensor type id {ggml_type}")
        block_size, type_size = layout
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
    _refuse_overlaps(tensors.values(), cur)
    return GGUFHeader(path, version, metadata, tensors, cur.size)


def _refuse_overlaps(tensors: Iterable[TensorInfo], cur: _Cursor) -> None:
    """Each tensor's data has bytes of its own: tensors that share bytes would let a small file describe
    a model many times its size (every layer reading the same region), so they are refused."""
    previous: TensorInfo | None = None
    for tensor in sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset):
        if previous is not None and tensor.offset < previous.offset + previous.nbytes:
            raise cur.fail(f"tensor '{tensor.name}' data (bytes {tensor.offset}..{tensor.offset + tensor.nbytes}) "
                           f"overlaps tensor '{previous.name}' (bytes {previous.offset}..{previous.offset + previous.nbytes})")
        previous = tensor


@contextmanager
def mapped_gguf(path: str | Path, text_arrays: bool = True) -> Iterator[tuple[mmap.mmap, GGUFHeader]]:
    """The file memory-mapped, with its parsed header; the map closes when the block ends.
    `text_arrays=False`: metadata arrays of strings are stepped over and left out."""
    path = Path(path)
    with _opened(path) as file:
        size = file.seek(0, 2)
        if size < 4:
            raise GGUFError(f"{path}: truncated file: {size} bytes, too short to be GGUF")
        buf = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield buf, _parse_header(buf, path, text_arrays)
        finally:
            with contextlib.suppress(BufferError):  # a caller still holds a view; the map goes when that does
                buf.close()


def _opened(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")  # the caller's `with` closes it
    except OSError as exc:
        raise GGUFError(f"{path}: cannot open ({exc.strerror or exc})") from None


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor table only: no tensor data is read."""
    with mapped_gguf(path) as (_, header):
        return header


def read_gguf_metadata(path: str | Path, texts: bool = True) -> dict[str, Any]:
    """All key/values of a GGUF file as plain Python values, without reading any tensor.
    `texts=False` leaves out the arrays of strings (a vocabulary and its merges: 100k-500k strings),
    stepping over them unread, for a reader of settings: a tenth of the time."""
    with mapped_gguf(path, text_arrays=texts) as (_, header):
        return header.metadata
