"""ModelConfig: one dataclass describing every supported architecture.

Field names follow HuggingFace's config.json where one exists; architecture traits that HF encodes
in class code (norm kind, embedding scale, sandwich norms, ...) are explicit fields here, set by each
architecture's `config_from_hf`. The shared decoder switches on these fields, never on model names.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcli.errors import ConfigError

if TYPE_CHECKING:
    import torch

FULL = "full_attention"
SLIDING = "sliding_attention"
# HF hidden_act names -> the function each stands for (models/layers.py maps these to torch).
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}


def eos_id_list(eos_token_id: Any) -> list[int]:
    """An eos_token_id as configs, tokenizers and callers give it (None, an int, a list or tuple, a
    tensor) -> a list of ints, in order. The one place that reading lives."""
    if eos_token_id is None:
        return []
    if hasattr(eos_token_id, "flatten"):  # a tensor (or an array) of any shape
        eos_token_id = eos_token_id.flatten().tolist()
    if isinstance(eos_token_id, (list, tuple)):
        return [int(v) for v in eos_token_id]
    return [int(eos_token_id)]


@dataclass
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass
class ModelConfig:
    model_type: str  # the HF model_type (gemma3_text, llama, ...)
    architecture: str  # the lmcli module that builds it (gpt2, llama, ..., gemma)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    # normalisation
    norm_type: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False  # gemma: weight is stored as w, applied as (1 + w)
    sandwich_norms: bool = False  # gemma2/3: norms after attention and around the MLP
    qk_norm: bool = False  # gemma3: RMSNorm on q and k per head
    # attention
    attention_bias: bool = False  # q/k/v projections
    attention_out_bias: bool = False  # o projection
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    # positions
    position_embedding: str = "rope"  # rope | learned
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_local: RopeConfig | None = None  # RoPE of sliding layers when it differs (gemma3)
    # MLP
    hidden_act: str = "silu"
    gated_mlp: bool = True
    mlp_bias: bool = False
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    # embeddings and head
    tie_word_embeddings: bool = False
    scale_embeddings: bool = False  # gemma: multiply embeddings by sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    # special tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config: layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        if any(t == SLIDING for t in self.layer_types) and not self.sliding_window:
            raise ConfigError("config: sliding_attention layers need a positive sliding_window")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"config: unsupported activation '{self.hidden_act}' (supported: {', '.join(sorted(ACTIVATIONS))})"
            )
        if self.head_dim < 1:
            raise ConfigError(f"config: head_dim is {self.head_dim} (hidden_size smaller than num_attention_heads?)")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(
                f"config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts "
                f"({self.num_local_experts})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_id_list(self.eos_token_id)

    @property
    def uses_sliding_window(self) -> bool:
        return SLIDING in self.layer_types


# --- config.json validation: every field lmcli reads, by type and range, checked once --------------

# Upper bounds are far above any released model and keep a hostile config from asking for absurd sizes.
_SIZE = 1 << 20  # hidden, intermediate, head sizes
_COUNT = 1 << 16  # layers, heads, experts
_TOKENS = 1 << 24  # vocabulary, token ids, sliding windows, learned positions
_CONTEXT = (1 << 31) - 1  # context lengths (RoPE positions cost nothing until used)


@dataclass(frozen=True)
class _Field:
    kind: str  # int | float | bool | str | token_ids | layer_types | object
    low: float = 0  # ints: the inclusive range; floats are always positive and finite
    high: float = math.inf
    nullable: bool = True  # the readers treat null as "not given"; False where they would not


_ROPE_FIELDS = {
    "rope_theta": _Field("float", nullable=False),
    "rope_type": _Field("str"),
    "type": _Field("str"),
    "factor": _Field("float"),
    "low_freq_factor": _Field("float", nullable=False),
    "high_freq_factor": _Field("float", nullable=False),
    "original_max_position_embeddings": _Field("int", 1, _CONTEXT),
}

HF_FIELDS = {
    "model_type": _Field("str"),
    "vocab_size": _Field("int", 1, _TOKENS, nullable=False),
    "hidden_size": _Field("int", 1, _SIZE),
    "intermediate_size": _Field("int", 1, _SIZE),
    "num_hidden_layers": _Field("int", 1, _COUNT),
    "num_attention_heads": _Field("int", 1, _COUNT),
    "num_key_value_heads": _Field("int", 1, _COUNT),
    "head_dim": _Field("int", 1, _SIZE),
    "max_position_embeddings": _Field("int", 1, _CONTEXT),
    "rms_norm_eps": _Field("float", nullable=False),
    "tie_word_embeddings": _Field("bool", nullable=False),
    "attention_bias": _Field("bool", nullable=False),
    "mlp_bias": _Field("bool", nullable=False),
    "hidden_act": _Field("str", nullable=False),
    "hidden_activation": _Field("str"),
    "sliding_window": _Field("int", 1, _CONTEXT),
    "use_sliding_window": _Field("bool"),
    "max_window_layers": _Field("int", 0, _COUNT, nullable=False),
    "sliding_window_pattern": _Field("int", 1, _COUNT),
    "layer_types": _Field("layer_types"),
    "query_pre_attn_scalar": _Field("float"),
    "attn_logit_softcapping": _Field("float"),
    "final_logit_softcapping": _Field("float"),
    "rope_local_base_freq": _Field("float", nullable=False),
    "num_local_experts": _Field("int", 1, _COUNT),
    "num_experts_per_tok": _Field("int", 1, _COUNT),
    "bos_token_id": _Field("token_ids"),
    "eos_token_id": _Field("token_ids"),
    "pad_token_id": _Field("token_ids"),
    "torch_dtype": _Field("str"),
    "dtype": _Field("str"),
    # gpt2 spells its sizes its own way
    "n_embd": _Field("int", 1, _SIZE, nullable=False),
    "n_head": _Field("int", 1, _COUNT, nullable=False),
    "n_layer": _Field("int", 1, _COUNT, nullable=False),
    "n_inner": _Field("int", 1, _SIZE),
    "n_positions": _Field("int", 1, _TOKENS, nullable=False),
    "layer_norm_epsilon": _Field("float", nullable=False),
    "activation_function": _Field("str", nullable=False),
    "rope_theta": _Field("float", nullable=False),
    "rope_scaling": _Field("object"),
    "rope_parameters": _Field("object"),
}


def is_number(value: Any) -> bool:
    """An int or float (or another real number: numpy's), but not a bool, which Python counts as an int."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as HF configs, cache keys and reports spell it."""
    return str(dtype).removeprefix("torch.")


def _problem(value: Any, spec: _Field) -> str | None:
    """Why `value` does not fit `spec`, or None when it does."""
    if value is None:
        return None if spec.nullable else "must not be null"
    if spec.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        if not spec.low <= value <= spec.high:
            return f"must be between {spec.low:.0f} and {spec.high:.0f}"
    elif spec.kind == "float":
        if not is_number(value):
            return "must be a number"
        if not (math.isfinite(value) and value > 0):
            return "must be a positive finite number"
    elif spec.kind == "bool" and not isinstance(value, bool):
        return "must be true or false"
    elif spec.kind == "str" and not (isinstance(value, str) and len(value) <= 100 and value.isprintable()):
        return "must be a short one-line string"
    elif spec.kind == "object" and not isinstance(value, dict):
        return "must be an object"
    elif spec.kind == "token_ids":
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < _TOKENS for i in ids):
            return "must be a token id (a non-negative integer) or a list of them"
    elif spec.kind == "layer_types" and not (isinstance(value, list) and all(t in (FULL, SLIDING) for t in value)):
        return f"must be a list of '{FULL}' / '{SLIDING}'"
    return None


def _check_fields(hf: dict[str, Any], fields: dict[str, _Field], source: str, prefix: str = "") -> None:
    for name, spec in fields.items():
        if name in hf:
            why = _problem(hf[name], spec)
            if why is not None:
                shown = json.dumps(hf[name])
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                raise ConfigError(f"{source}: field '{prefix}{name}' {why}, got {shown}")


def validate_hf_config(hf: Any, source: str = "config.json") -> dict[str, Any]:
    """Check an HF config dict's fields by type and range before any architecture reads them.

    `source` names the file in the one-line ConfigError (config.json, a preset, a GGUF file).
    Unknown fields are left alone: lmcli never reads them.
    """
    if not isinstance(hf, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {_json_kind(hf)}")
    _check_fields(hf, HF_FIELDS, source)
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key)
        if not isinstance(params, dict):
            continue
        nested = [(f"{key}.{t}.", params[t]) for t in (FULL, SLIDING) if t in params]
        for prefix, value in nested or [(f"{key}.", params)]:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: field '{prefix[:-1]}' must be an object, got {_json_kind(value)}")
            _check_fields(value, _ROPE_FIELDS, source, prefix)
    return hf


def _json_kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# --- helpers shared by the architectures' config_from_hf ------------------------------------------


def require(hf: dict[str, Any], *names: str) -> Any:
    """The first of `names` present in the HF config (they are aliases), or a ConfigError."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    raise ConfigError(f"config.json: missing field '{names[0]}'")


def rope_from_hf(hf: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0) -> RopeConfig:
    """RoPE settings from either config generation.

    Older files: `rope_theta` + `rope_scaling`; newer ones: `rope_parameters`, possibly keyed by layer type.
    """
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    elif isinstance(params, dict) and (FULL in params or SLIDING in params):
        params = params.get(FULL)
    scaling: dict[str, Any] = {}
    if isinstance(params, dict):
        scaling = dict(params)
        theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    else:
        theta = hf.get("rope_theta", default_theta)
        scaling = dict(hf.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(f"config.json: unsupported rope_type '{rope_type}' (supported: default, linear, llama3)")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0) or 1.0),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=scaling.get("original_max_position_embeddings"),
    )


def common_decoder_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Fields that llama-style configs (llama, mistral, mixtral, qwen2, gemma*) name the same way."""
    hidden = int(require(hf, "hidden_size"))
    heads = int(require(hf, "num_attention_heads"))
    return dict(
        model_type=hf.get("model_type", ""),
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(require(hf, "intermediate_size")),
        num_hidden_layers=int(require(hf, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **token_and_source_fields(hf),
    )


def token_and_source_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Special token ids, the saved dtype and the raw dict: named alike in every architecture's config."""
    return dict(
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        hf_config=dict(hf),
    )
