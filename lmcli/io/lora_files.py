"""LoRA adapter files: a PEFT adapter directory or a GGUF LoRA file (llama.cpp's convert_lora_to_gguf.py).

Either is read into one `AdapterFile`: per target module (by its HF name: `model.layers.0.self_attn.q_proj`,
GPT-2's `transformer.h.0.attn.c_attn`), the down matrix A [r, in] and the up matrix B [out, r] in float32,
and the scale its update takes (alpha / r, or alpha / sqrt(r) for rsLoRA, times the user's SCALE).
Nothing is unpickled and nothing outside the directory is read: adapter_config.json and
adapter_model.safetensors only, each a regular file inside it (a symlink out of it is refused), the
safetensors header bounded and checked (names, dtypes, shapes, offsets) before any tensor is read.
Which modules of a loaded model the targets are, and whether their shapes fit it, kernels/lora.py decides.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmcli.errors import CheckpointError
from lmcli.io.bounded import MAX_CONFIG_FILE, read_bounded, size_text

MAX_HEADER = 16 * 2**20  # adapter_model.safetensors' JSON header: a rank-64 adapter of a 70B model has ~3 MB
MAX_TENSORS = 20_000  # lora_A and lora_B of 7 modules in 128 layers, or a MoE's experts, fit well under it
MAX_RANK = 4096
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_PEFT_NAME = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")

# adapter_config.json keys that change nothing at inference (or whose effect is read from the tensors).
_HARMLESS = {"alpha_pattern", "auto_mapping", "base_model_name_or_path", "bias", "exclude_modules", "fan_in_fan_out",
             "inference_mode", "init_lora_weights", "layers_pattern", "layers_to_transform", "lora_alpha",
             "lora_dropout", "peft_type", "peft_version", "r", "rank_pattern", "revision", "target_modules",
             "task_type", "use_rslora", "loftq_config", "megatron_config", "megatron_core", "eva_config",
             "corda_config", "ensure_weight_tying", "qalora_group_size", "target_parameters"}
# Options that change the arithmetic and that lmcli does not implement: refused when set.
_UNSUPPORTED = {"use_dora": "DoRA (use_dora)", "lora_bias": "LoRA biases (lora_bias)",
                "modules_to_save": "modules_to_save (full copies of modules)",
                "layer_replication": "layer_replication",
                "trainable_token_indices": "trainable_token_indices", "use_qalora": "QA-LoRA (use_qalora)",
                "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_bdlora": "use_bdlora"}


class AdapterError(CheckpointError):
    """An adapter that cannot be used: one line naming the file and what is wrong."""


@dataclass
class Target:
    """One adapted module: x -> x·Aᵀ·Bᵀ·scale added to its output."""

    a: torch.Tensor  # (r, in) float32
    b: torch.Tensor  # (out, r) float32
    scale: float
    # A mixture-of-experts block's experts as one stacked parameter (PEFT's target_parameters on
    # transformers' fused experts): A [E*r, in], B [out, r*E]; which parameter it is (gate_up_proj or
    # down_proj) and so its alpha and rank are told from the shapes by kernels/lora.py.
    stacked: dict[str, Any] | None = None


@dataclass
class AdapterFile:
    name: str  # what a job row's "lora" names it by: the directory's or file's name
    path: Path
    kind: str  # "peft" or "gguf"
    targets: dict[str, Target]  # HF module name -> its update
    base_model: str | None = None  # what adapter_config.json says it was trained on
    architecture: str | None = None  # a GGUF adapter's general.architecture
    alpha: float | None = None
    rope_permuted: bool = False  # lora_b of q/k in llama.cpp's interleaved row order (GGUF llama files)
    notes: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({t.a.shape[0] for t in self.targets.values()})

    @property
    def parameters(self) -> int:
        return sum(t.a.numel() + t.b.numel() for t in self.targets.values())

    def module_kinds(self) -> list[str]:
        """The targets' last names (q_proj, c_attn, w1, ...), each once, in order."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.targets})


def parse_spec(spec: str) -> tuple[str, float]:
    """--lora PATH[:SCALE] -> (PATH, SCALE); a PATH that itself holds ':' keeps it unless what follows
    the last ':' is a number."""
    path, colon, scale = spec.rpartition(":")
    if colon and path:
        try:
            value = float(scale)
        except ValueError:
            return spec, 1.0
        if not math.isfinite(value):
            from lmcli.errors import UsageError

            raise UsageError(f"--lora {spec}: the scale must be a finite number")
        return path, value
    return spec, 1.0


def read_adapter(spec: str) -> AdapterFile:
    """The adapter `spec` (PATH[:SCALE]) names, checked; AdapterError for anything wrong with it."""
    raw, scale = parse_spec(spec)
    path = Path(raw).expanduser()
    if path.is_dir():
        adapter = _read_peft(path, scale)
    elif path.is_file() and path.suffix == ".gguf":
        adapter = _read_gguf(path, scale)
    elif path.exists():
        raise AdapterError(f"--lora {raw}: expected a PEFT adapter directory or a .gguf LoRA file")
    else:
        raise AdapterError(f"--lora {raw}: no such file or directory")
    if not adapter.targets:
        raise AdapterError(f"{path}: the adapter holds no LoRA weights")
    for module, target in adapter.targets.items():
        if not (torch.isfinite(target.a).all() and torch.isfinite(target.b).all()):
            raise AdapterError(f"{path}: the LoRA weights of {module} hold NaN or infinite values")
    return adapter


# --- PEFT -------------------------------------------------------------------------------------------


def _inside(directory: Path, name: str) -> Path:
    """directory/name, a regular file whose real path is inside the directory (no symlink out of it)."""
    path = directory / name
    if not path.exists():
        raise AdapterError(f"{directory}: no {name} (a PEFT adapter directory holds adapter_config.json and "
                           "adapter_model.safetensors)")
    real, root = path.resolve(), directory.resolve()
    if root not in real.parents or not real.is_file():
        raise AdapterError(f"{path}: a link to a file outside the adapter directory is refused")
    return real


def _read_peft(directory: Path, user_scale: float) -> AdapterFile:
    config_path = _inside(directory, "adapter_config.json")
    if (directory / "adapter_model.bin").exists() and not (directory / "adapter_model.safetensors").exists():
        raise AdapterError(f"{directory}: only adapter_model.bin (a pickle, which lmcli never loads); save the "
                           "adapter as safetensors")
    weights_path = _inside(directory, "adapter_model.safetensors")
    try:
        config = json.loads(read_bounded(config_path, MAX_CONFIG_FILE, AdapterError))
    except ValueError as exc:
        raise AdapterError(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: expected a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{config_path}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{config_path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{config_path}: bias {config['bias']!r} is not supported (only \"none\")")
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not all(_is_number(v) for v in alpha_pattern.values()):
        raise AdapterError(f"{config_path}: alpha_pattern must map module patterns to numbers")
    parameters = config.get("target_parameters") or []
    if not isinstance(parameters, list) or not set(parameters) <= {"gate_up_proj", "down_proj"}:
        raise AdapterError(f"{config_path}: target_parameters {parameters!r} is not supported (only a mixture of "
                           "experts' gate_up_proj and down_proj)")
    unknown = sorted(k for k, v in config.items() if k not in _HARMLESS and k not in _UNSUPPORTED and v)
    if unknown:
        raise AdapterError(f"{config_path}: unknown option {unknown[0]!r} = {config[unknown[0]]!r} "
                           "(lmcli cannot tell what it changes, so it does not guess)")
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not _is_number(alpha) or isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise AdapterError(f"{config_path}: r must be an integer from 1 to {MAX_RANK} and lora_alpha a number")
    rslora = bool(config.get("use_rslora"))
    rank_pattern = config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict):
        raise AdapterError(f"{config_path}: rank_pattern must be an object")
    pairs = _read_safetensors(weights_path)
    targets: dict[str, Target] = {}
    for module, (a, b) in pairs.items():
        while module.endswith(".base_layer"):  # PEFT wraps one stacked expert parameter around another
            module = module.removesuffix(".base_layer")
        if module.endswith(".experts") and parameters:
            alphas = {p: float(_pattern_value(f"{module}.{p}", alpha_pattern, alpha)) for p in parameters}
            ranks = {p: _pattern_value(f"{module}.{p}", rank_pattern, rank) for p in parameters}
            key = f"{module}@{a.shape[1]}x{b.shape[0]}"  # one per parameter: told apart by shape
            if key in targets:
                raise AdapterError(f"{weights_path}: two stacked expert updates of {module} with the same shapes")
            targets[key] = Target(a, b, user_scale, stacked={"alphas": alphas, "ranks": ranks, "rslora": rslora})
            continue
        r = a.shape[0]
        expected = _pattern_value(module, rank_pattern, rank)
        if r != expected or b.shape[1] != r:
            raise AdapterError(f"{weights_path}: {module} has rank {r} (lora_A {list(a.shape)}, lora_B "
                               f"{list(b.shape)}) but adapter_config.json says r = {expected}")
        module_alpha = float(_pattern_value(module, alpha_pattern, alpha))
        scale = module_alpha / (math.sqrt(r) if rslora else r) * user_scale
        targets[module] = Target(a, b, scale)
    base = config.get("base_model_name_or_path")
    return AdapterFile(directory.name, directory, "peft", targets, base if isinstance(base, str) else None,
                       alpha=float(alpha), notes=["rsLoRA scaling (alpha / sqrt(r))"] if rslora else [])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value != 0


def _pattern_value(module: str, pattern: dict[str, Any], default: Any) -> Any:
    """What PEFT's rank_pattern / alpha_pattern gives `module`: the first key matching the end of its
    name, else `default`."""
    for key, value in pattern.items():
        try:
            if re.fullmatch(rf"(.*\.)?(?:{key})", module):
                return value
        except re.error:
            raise AdapterError(f"the pattern {key!r} is not a regular expression") from None
    return default


def _read_safetensors(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)} from an adapter's safetensors file, its header checked before any tensor is read."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise AdapterError(f"{path}: truncated ({size} bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or length > size - 8:
            raise AdapterError(f"{path}: its header claims {size_text(length)}, more than "
                               f"{'the file holds' if length > size - 8 else f'the {size_text(MAX_HEADER)} lmcli reads'}")
        try:
            header = json.loads(file.read(length))
        except ValueError as exc:
            raise AdapterError(f"{path}: the header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise AdapterError(f"{path}: the header is not a JSON object")
        header.pop("__metadata__", None)
        if len(header) > MAX_TENSORS:
            raise AdapterError(f"{path}: {len(header):,} tensors, more than the {MAX_TENSORS:,} an adapter may hold")
        parts: dict[str, dict[str, torch.Tensor]] = {}
        data_start = 8 + length
        for name, info in header.items():
            match = _PEFT_NAME.fullmatch(name)
            if match is None:
                raise AdapterError(f"{path}: tensor '{name}' is not a LoRA weight (lora_A / lora_B)")
            if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
                raise AdapterError(f"{path}: tensor '{name}' has dtype {info.get('dtype') if isinstance(info, dict) else '?'}"
                                   f" (expected one of {', '.join(_DTYPES)})")
            shape, offsets = info.get("shape"), info.get("data_offsets")
            if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and 0 < s < 2**31 for s in shape)):
                raise AdapterError(f"{path}: tensor '{name}' has shape {shape} (expected a matrix)")
            dtype = _DTYPES[info["dtype"]]
            nbytes = shape[0] * shape[1] * dtype.itemsize
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                    and offsets[1] - offsets[0] == nbytes and offsets[0] >= 0 and data_start + offsets[1] <= size):
                raise AdapterError(f"{path}: tensor '{name}' has data offsets {offsets} that do not fit its shape "
                                   "or the file")
            module, which = match.groups()
            if which in parts.get(module, {}):
                raise AdapterError(f"{path}: two lora_{which} tensors for {module}")
            file.seek(data_start + offsets[0])
            raw = bytearray(file.read(nbytes))
            tensor = torch.frombuffer(raw, dtype=dtype).view(shape).float() if nbytes else torch.empty(shape)
            parts.setdefault(module, {})[which] = tensor
    pairs = {}
    for module, found in parts.items():
        if set(found) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{''.join(found)} but not its lora_{'AB'.replace(''.join(found), '')}")
        a, b = found["A"], found["B"]
        if a.shape[0] != b.shape[1] or a.shape[0] > MAX_RANK:
            raise AdapterError(f"{path}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not make "
                               f"a rank-r update (A is [r, in], B is [out, r], r <= {MAX_RANK})")
        pairs[module] = (a, b)
    return pairs


# --- GGUF -------------------------------------------------------------------------------------------

_GGUF_NAME = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.weight\.lora_([ab])")
_GGUF_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}


def _read_gguf(path: Path, user_scale: float) -> AdapterFile:
    from lmcli.errors import GGUFError
    from lmcli.io.gguf import DECODER_BLOCK, _dequantise
    from lmcli.io.gguf_reader import mapped_gguf

    try:
        with mapped_gguf(path) as (buf, header):
            meta = header.metadata
            if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
                raise AdapterError(f"{path}: not a LoRA adapter (general.type {meta.get('general.type')!r}, "
                                   f"adapter.type {meta.get('adapter.type')!r})")
            alpha = meta.get("adapter.lora.alpha")
            arch = meta.get("general.architecture")
            if len(header.tensors) > MAX_TENSORS:
                raise AdapterError(f"{path}: {len(header.tensors):,} tensors, more than the {MAX_TENSORS:,} an "
                                   "adapter may hold")
            if arch not in ("llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3"):
                raise AdapterError(f"{path}: GGUF LoRA for architecture {arch!r} is not supported (llama, mistral, "
                                   "qwen2 and gemma names are; use the PEFT adapter for others)")
            parts: dict[str, dict[str, torch.Tensor]] = {}
            for name, info in header.tensors.items():
                match = _GGUF_NAME.fullmatch(name)
                if match is None:
                    raise AdapterError(f"{path}: tensor '{name}' is not a LoRA weight (blk.N.KIND.weight.lora_a/b)")
                layer, kind, expert, which = match.groups()
                if info.ggml_type not in (0, 1, 30):  # F32, F16, BF16: what the converter writes
                    raise AdapterError(f"{path}: tensor '{name}' is {info.type_name}; LoRA tensors must be float")
                tensor = _dequantise(buf, info)
                if kind in _GGUF_EXPERTS and tensor.dim() == 3:  # (experts, ...) stacked
                    for e in range(tensor.shape[0]):
                        module = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_GGUF_EXPERTS[kind]}"
                        parts.setdefault(module, {})[which] = tensor[e].clone()
                    continue
                if kind not in DECODER_BLOCK or expert is not None or tensor.dim() != 2:
                    raise AdapterError(f"{path}: tensor '{name}' targets {kind}, which lmcli does not adapt")
                module = f"model.layers.{layer}.{DECODER_BLOCK[kind]}"
                parts.setdefault(module, {})[which] = tensor
    except GGUFError as exc:
        raise AdapterError(str(exc)) from None
    if not _is_number(alpha):
        raise AdapterError(f"{path}: adapter.lora.alpha is missing or not a number")
    assert alpha is not None
    targets = {}
    for module, found in parts.items():
        if set(found) != {"a", "b"}:
            raise AdapterError(f"{path}: {module} lacks its lora_a or lora_b")
        a, b = found["a"], found["b"]
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: {module}: lora_a {list(a.shape)} and lora_b {list(b.shape)} differ in rank")
        targets[module] = Target(a, b, float(alpha) / a.shape[0] * user_scale)
    # llama.cpp interleaves the q/k rows of llama-family files (lora_b's rows with them): undone by
    # kernels/lora.py, which knows the model's heads.
    return AdapterFile(path.stem, path, "gguf", targets, architecture=str(arch), alpha=float(alpha),
                       rope_permuted=arch in ("llama", "mistral"))
