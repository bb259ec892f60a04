"""GGUF checkpoints, turned into exactly what an HF directory gives: a config.json dict and HF-named tensors.

The rest of lmcli then has one loading path. llama.cpp's converter changes some tensors on the way
into a GGUF, and each change is undone here:
  - llama-family q/k rows are interleaved for its RoPE kernel        -> `unpermute_rope_rows`
  - gemma RMSNorm weights are stored as (1 + w)                       -> 1 is subtracted back
  - gpt2's Conv1D weights are stored transposed                       -> transposed back
  - mixtral experts are stacked into one tensor per projection        -> split back per expert
  - llama 3 RoPE scaling is baked into a `rope_freqs` tensor          -> turned back into rope_scaling

Each architecture's specifics live with it, in lmcli/models/<arch>.py (`config_from_gguf`,
`tensors_from_gguf`); what they share is `GGUFFile`, here. The header is read by
lmcli/io/gguf_reader.py; dequantisation is the `gguf` package's.
"""

from __future__ import annotations

import json
import math
import mmap
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from lmcli.errors import GGUFError, TokenizerError
from lmcli.io.gguf_reader import BF16, F16, F32, NATIVE_BLOCKS, GGUFHeader, TensorInfo, mapped_gguf
from lmcli.io.group_quantized import GroupQuantized


@dataclass
class GGUFCheckpoint:
    path: Path
    metadata: dict[str, Any]  # every GGUF key/value as plain Python values
    hf_config: dict[str, Any]  # what config.json would hold, with transformers' field names
    tensors: dict[str, Any]  # HF names and layout ("lm_head.weight" only if untied): torch.Tensor or GroupQuantized


# --- dequantisation --------------------------------------------------------------------------------


@cache
def _can_dequantise(ggml_type: int) -> bool:
    """Whether lmcli or the gguf package dequantises this type; the package is asked of its public
    API with one zero block (it raises NotImplementedError for the types it lacks)."""
    if ggml_type in NATIVE_BLOCKS:
        return True
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    kind = GGMLQuantizationType(ggml_type)
    _, block_bytes = GGML_QUANT_SIZES[kind]
    try:
        quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def _dequantise(buf: mmap.mmap, info: TensorInfo) -> torch.Tensor:
    """float32 tensor of `info.shape`, owning its memory (the map may close right after)."""
    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    if info.ggml_type in (F32, F16, BF16):  # float tensors (norms, biases): read here, no gguf import
        if info.ggml_type == BF16:  # bfloat16 is the high half of a float32
            values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.view("<f4" if info.ggml_type == F32 else "<f2").astype(np.float32)
        return torch.from_numpy(values.reshape(info.shape))
    from gguf import GGMLQuantizationType, quants

    rows = math.prod(info.shape[:-1])
    raw = raw.reshape(rows, info.nbytes // max(1, rows))  # (rows, bytes per row)
    values = np.empty((rows, info.shape[-1]), dtype=np.float32)
    slab = max(1, (1 << 20) // info.shape[-1])  # rows at a time: gguf's temporaries are several copies
    for start in range(0, rows, slab):
        values[start:start + slab] = quants.dequantize(raw[start:start + slab], GGMLQuantizationType(info.ggml_type))
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


# --- one GGUF file, as an architecture module reads it -----------------------------------------------

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)")
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
DECODER_BLOCK = {
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
# Mixtral experts, named as HF checkpoints name them: w1 gate, w3 up, w2 down.
_EXPERT_LEAF = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
_STACKED_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
# Tensors that configure rather than parameterise: read into the config, not returned.
_CONFIG_ONLY = {"rope_freqs.weight"}


class GGUFFile:
    """One mapped GGUF file for an architecture module's `config_from_gguf` / `tensors_from_gguf`.

    Metadata is read by its architecture-scoped key (`get("block_count")` is `llama.block_count`),
    with errors that name the file. The llama-style translation most architectures share is here once.
    """

    def __init__(self, header: GGUFHeader, buf: mmap.mmap, arch: str):
        self.header, self.buf, self.arch = header, buf, arch
        self.path, self.metadata = header.path, header.metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key '{full}'")
        return self.metadata[full]

    def integer(self, key: str, default: Any = ...) -> int | None:
        """An integer key; a per-layer list is accepted when all layers agree."""
        value = self.require(key) if default is ... else self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise GGUFError(f"{self.path}: '{self.arch}.{key}' differs between layers ({value[:8]}...), "
                                "which lmcli does not support")
            value = value[0]
        return value if value is None else int(value)

    def has_tensor(self, suffix: str) -> bool:
        return any(name.endswith(suffix) for name in self.header.tensors)

    def shape(self, name: str) -> tuple[int, ...] | None:
        info = self.header.tensors.get(name)
        return info.shape if info else None

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor of the file, dequantised to float32."""
        return _dequantise(self.buf, self.header.tensors[name])

    def same_bytes(self, first: str, second: str) -> bool:
        """Whether two tensors are stored with the same type and bytes (False if either is missing)."""
        a, b = self.header.tensors.get(first), self.header.tensors.get(second)
        if a is None or b is None or a.ggml_type != b.ggml_type or a.nbytes != b.nbytes:
            return False
        return self.buf[a.offset:a.offset + a.nbytes] == self.buf[b.offset:b.offset + b.nbytes]

    @staticmethod
    def fitted(value: float) -> float:
        """Values fitted from a file come back as 3.9999998; config files hold 4.0."""
        return round(value, 4)

    # --- metadata -> config.json fields

    def token_ids(self) -> dict[str, Any]:
        ids = {}
        for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
            value = self.metadata.get(f"tokenizer.ggml.{gguf_key}_token_id")
            if value is not None:
                ids[hf_key] = int(value)
        return ids

    def vocab_size(self) -> int:
        embedding = self.shape("token_embd.weight")
        if embedding is not None:  # the embedding's rows are what the model needs, padding included
            return embedding[0]
        if self.get("vocab_size") is not None:
            return int(self.get("vocab_size"))
        if "tokenizer.ggml.tokens" in self.metadata:
            return len(self.metadata["tokenizer.ggml.tokens"])
        raise GGUFError(f"{self.path}: cannot tell the vocabulary size (no token_embd.weight, vocab_size or tokens)")

    def decoder_fields(self) -> dict[str, Any]:
        """Fields llama-style configs share: llama, mistral, mixtral, qwen2 and the gemmas."""
        hidden = self.integer("embedding_length")
        heads = self.integer("attention.head_count")
        assert hidden is not None and heads is not None  # required keys
        head_dim = self.integer("attention.key_length", None) or self.integer("rope.dimension_count", None) or hidden // heads
        return {
            "vocab_size": self.vocab_size(),
            "hidden_size": hidden,
            "intermediate_size": self.integer("feed_forward_length"),
            "num_hidden_layers": self.integer("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.integer("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": self.integer("context_length"),
            "rms_norm_eps": self.require("attention.layer_norm_rms_epsilon"),
            "rope_theta": self.get("rope.freq_base", 10000.0),
            "rope_scaling": self.rope_scaling(),
            "tie_word_embeddings": "output.weight" not in self.header.tensors,
            **self.token_ids(),
        }

    def rope_scaling(self) -> dict[str, Any] | None:
        kind = self.get("rope.scaling.type")
        factor = self.get("rope.scaling.factor") or self.get("rope.scale_linear")  # the latter: older files
        if kind == "none" or (kind is None and factor in (None, 0, 1)):
            return None
        kind = kind or "linear"
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
        if self.get("rope.scaling.original_context_length") is not None:
            scaling["original_max_position_embeddings"] = int(self.get("rope.scaling.original_context_length"))
        if kind == "yarn" and self.get("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(self.get("rope.scaling.attn_factor"))
        return scaling

    # --- GGUF tensor names -> HF names

    def unexpected(self, name: str, config: dict[str, Any]) -> GGUFError:
        return GGUFError(f"{self.path}: unexpected tensor '{name}' for a {config['model_type']} GGUF")

    @staticmethod
    def top_level(name: str, tensor: torch.Tensor, config: dict[str, Any],
                  names: dict[str, str] = _TOP_LEVEL) -> list[tuple[str, torch.Tensor]] | None:
        """A tensor outside the blocks, renamed by `names` (none for a tied output head), or None
        for a block tensor."""
        stem, _, leaf = name.rpartition(".")
        if stem not in names:
            return None
        if stem == "output" and config["tie_word_embeddings"]:
            return []
        return [(f"{names[stem]}.{leaf}", tensor)]

    @staticmethod
    def block_parts(name: str) -> tuple[str, str, str | None, str] | None:
        """`blk.3.attn_q.weight` -> ("3", "attn_q", None, "weight"); the third part is an expert index."""
        match = _BLOCK.fullmatch(name)
        return match.groups() if match else None  # type: ignore[return-value]

    def decoder_tensors(self, name: str, tensor: torch.Tensor, config: dict[str, Any], *,
                        block_names: dict[str, str] = DECODER_BLOCK,
                        unpermute_qk: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF (name, tensor) pairs one llama-style GGUF tensor becomes (float32 in, float32 out).

        `block_names` maps GGUF block tensors to HF module names; `unpermute_qk` undoes llama.cpp's
        q/k row order (see `unpermute_rope_rows`)."""
        top = self.top_level(name, tensor, config)
        if top is not None:
            yield from top
            return
        parts = self.block_parts(name)
        if parts is None:
            raise self.unexpected(name, config)
        layer, kind, expert, leaf = parts
        prefix = f"model.layers.{layer}"
        if kind in _STACKED_EXPERTS:  # (experts, out, in) -> one (out, in) per expert
            for index, weight in enumerate(tensor.unbind(0)):
                yield f"{prefix}.block_sparse_moe.experts.{index}.{_STACKED_EXPERTS[kind]}.{leaf}", weight.clone()
            return
        if expert is not None:  # older mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight
            if kind not in _EXPERT_LEAF:
                raise self.unexpected(name, config)
            yield f"{prefix}.block_sparse_moe.experts.{expert}.{_EXPERT_LEAF[kind]}.{leaf}", tensor
            return
        if kind not in block_names:
            raise self.unexpected(name, config)
        if unpermute_qk and kind in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
            if tensor.shape[0] % (2 * heads):
                raise GGUFError(f"{self.path}: tensor '{name}' has {tensor.shape[0]} rows, not a whole number of "
                                f"rotary pairs for {heads} heads")
            tensor = unpermute_rope_rows(tensor, heads)
        yield f"{prefix}.{block_names[kind]}.{leaf}", tensor


def _architecture_module(header: GGUFHeader) -> tuple[str, ModuleType]:
    from lmcli import registry

    arch = header.metadata.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{header.path}: no 'general.architecture' in the metadata")
    if arch not in registry.GGUF_ARCHITECTURES:
        raise GGUFError(f"{header.path}: unsupported architecture '{arch}' "
                        f"(lmcli reads {', '.join(registry.GGUF_ARCHITECTURES)} GGUF files)")
    return arch, registry.gguf_architecture_module(arch)


# --- public -----------------------------------------------------------------------------------------


def _kept_as(info: TensorInfo) -> str | None:
    """"int4" / "int8" for a weight matrix whose block type maps onto codes and scales without loss
    (io/gguf_quant.py); None for a tensor that is dequantised."""
    from lmcli.io.gguf_quant import quantized_kind

    return quantized_kind(info.ggml_type) if len(info.shape) >= 2 else None


def _read_tensor(buf: mmap.mmap, info: TensorInfo, keep_quantized: bool) -> torch.Tensor | GroupQuantized:
    """A quantized weight as its codes and scales if asked and `_kept_as` says it can be; otherwise
    dequantised to float32."""
    from lmcli.io.gguf_quant import decode_blocks

    if keep_quantized and _kept_as(info) is not None:
        raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return decode_blocks(raw, info.ggml_type, info.shape)
    return _dequantise(buf, info)


class GGUFTensors:
    """An open GGUF file whose tensors are read one at a time, in HF names and layout.

    `metadata` and `hf_config` are ready at once; `tensors()` then yields each HF (name, tensor), so a
    loader can place one tensor before the next is read and never holds the whole file twice.
    """

    def __init__(self, buf: mmap.mmap, header: GGUFHeader, keep_quantized: bool):
        self.path, self.metadata = header.path, header.metadata
        self._buf, self._header, self._keep_quantized = buf, header, keep_quantized
        arch, self._module = _architecture_module(header)
        for info in header.tensors.values():
            if not _can_dequantise(info.ggml_type):
                raise GGUFError(f"{self.path}: tensor '{info.name}' has unsupported tensor type {info.type_name} "
                                "(lmcli dequantises F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, K-quants and IQ types)")
        self._source = GGUFFile(header, buf, arch)
        self.hf_config: dict[str, Any] = self._module.config_from_gguf(self._source)

    def quantized_kinds(self) -> list[str]:
        """The stored form ("int4" / "int8") of each tensor that stays quantized, before reading any."""
        if not self._keep_quantized:
            return []
        kinds = (_kept_as(info) for info in self._header.tensors.values())
        return [kind for kind in kinds if kind is not None]

    def forget_vocabulary(self) -> None:
        """Drop the vocabulary lists from `metadata` once a tokenizer holds them (about 10 MB of
        Python strings for a 50k vocabulary, otherwise alive while the tensors are read)."""
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            self.metadata.pop(key, None)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
        """Each tensor in HF names: float32, or `GroupQuantized` where kept quantized."""
        infos = self._header.tensors.values()
        self._release(0, min((info.offset for info in infos), default=0))  # the header, parsed already
        for info in infos:
            if info.name in _CONFIG_ONLY:
                continue
            try:
                values = _read_tensor(self._buf, info, self._keep_quantized)
            except (NotImplementedError, ValueError) as exc:
                raise GGUFError(f"{self.path}: cannot dequantise tensor '{info.name}' ({info.type_name}): {exc}") from None
            self._release(info.offset - _FAULT_AROUND_MARGIN, info.offset + info.nbytes)
            produced = list(self._module.tensors_from_gguf(self._source, info.name, values, self.hf_config))
            del values  # handed on one at a time, so the consumer's `del` frees each
            while produced:
                yield produced.pop(0)

    def _release(self, start: int, end: int) -> None:
        """Drop the file's pages in [start, end) from this process's resident memory: mapped pages
        count as resident until unmapped, so reading a whole file would otherwise add its size."""
        start = max(0, start)
        start -= start % mmap.PAGESIZE
        if hasattr(self._buf, "madvise") and end > start:
            self._buf.madvise(mmap.MADV_DONTNEED, start, end - start)


# The kernel maps a few neighbouring pages on each page fault (fault-around, 64 KB by default), so
# reading a tensor maps the tail of the one before again: each release reaches back this far.
_FAULT_AROUND_MARGIN = 1 << 20


@contextmanager
def open_gguf(path: str | Path, keep_quantized: bool = False) -> Iterator[GGUFTensors]:
    """The GGUF file at `path`, mapped, for reading tensor by tensor; the map closes with the block."""
    with mapped_gguf(Path(path)) as (buf, header):
        yield GGUFTensors(buf, header, keep_quantized)


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Read and rename a GGUF checkpoint into HF form (config dict + HF-named tensors).

    Tensors are dequantised to `dtype`, or with `keep_quantized` Q4_0/Q4_1/Q4_K/Q5_x/Q6_K/Q8_0
    weights stay as `GroupQuantized` codes (the others are dequantised). The architecture's module
    (lmcli/models/<arch>.py) says how to rename: `config_from_gguf(file)` gives config.json's dict,
    `tensors_from_gguf(file, name, tensor, config)` the HF tensors."""
    path = Path(path)
    with open_gguf(path, keep_quantized) as gguf:
        hf_config = gguf.hf_config
        hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
        tensors = {name: tensor.to(dtype) for name, tensor in gguf.tensors()}
    return GGUFCheckpoint(path=path, metadata=gguf.metadata, hf_config=hf_config, tensors=tensors)


def write_hf_weights(checkpoint: GGUFCheckpoint, out_dir: str | Path) -> None:
    """config.json and model.safetensors, as an HF directory holds them."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(checkpoint.hf_config, indent=2) + "\n")
    save_file(checkpoint.tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write an HF-style directory (config.json, model.safetensors, tokenizer files) from a GGUF file.

    `out_dir` appears complete or not at all (lmcli.io.atomic).
    """
    from lmcli.io.atomic import atomic_directory
    from lmcli.io.tokenizer import tokenizer_from_gguf

    checkpoint = read_gguf(path, dtype)
    try:
        tokenizer = tokenizer_from_gguf(checkpoint.metadata)
    except TokenizerError as e:  # what is wrong with the vocabulary, in the file it came from
        raise TokenizerError(f"{path}: {e}") from None
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as work:  # a killed convert leaves no half-written out_dir
        write_hf_weights(checkpoint, work)
        tokenizer.save_pretrained(work)
    return out_dir
