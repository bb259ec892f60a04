"""Build the model a ResolvedModel names (lmcli.resolve.model_ref): read its config, weights and tokenizer.

Accepted checkpoints: an HF directory (config.json + safetensors, single or sharded), a single
.safetensors file with a preset/architecture name supplying the config (or a config.json beside it),
a .gguf file, or None for the embedded default model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import mmap
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lmcli.errors import CheckpointError, TokenizerError, UsageError, first_line
from lmcli.resolve.model_ref import ResolvedModel, resolve_model

if TYPE_CHECKING:
    from lmcli.generation.models import GeneratingModel
    from lmcli.io.tokenizer import Tokenizer
    from lmcli.models.base import BaseModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu)")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, config_dtype: str | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        # float32 on CPUs (half precision measured slower there); on GPUs the checkpoint's own
        # half-precision dtype, else bfloat16.
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if config_dtype == "float16" else torch.bfloat16
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: unknown dtype (use auto, float32, bfloat16 or float16)")
    return DTYPES[dtype]


def _read_config_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read config ({exc})") from None


@contextmanager
def _uninitialised_parameters() -> Iterator[None]:
    """Build modules without random initialisation: every parameter is about to be replaced by the
    checkpoint's tensor, and `torch.empty` memory that is never written costs nothing. (Building on
    the meta device does the same but spends seconds importing torch's meta kernels.)"""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding, nn.LayerNorm)}
    for cls in saved:
        cls.reset_parameters = lambda self: None  # type: ignore[method-assign]  # undone below
    try:
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset  # type: ignore[method-assign]


QUANTIZE_CHOICES = ("none", "int4", "int8")


def _quantizable_names(model: nn.Module) -> set[str]:
    """The weights `--quantize` applies to: every linear layer and the token embedding, but not a
    mixture-of-experts router (small, and its choice of expert is sensitive to rounding)."""
    names = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return {n for n in names if not n.endswith("block_sparse_moe.gate.weight")} | {"model.embed_tokens.weight"}


def load(checkpoint: str | Path | ResolvedModel | None = None, model: str | None = None,
         dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
         tokenizer_path: str | Path | None = None, tp: int | None = None,
         quantize: str | None = None) -> tuple[GeneratingModel, Tokenizer | None]:
    """Load a model and its tokenizer. Returns (GeneratingModel, Tokenizer | None): a BaseModel with
    `generate()` (lmcli.generation.models; an encoder-decoder's is GeneratingEncoderDecoder).

    `checkpoint` and `model` are resolved as lmcli.resolve.model_ref.resolve_model resolves them; a command
    that has resolved them already passes its ResolvedModel as `checkpoint` (then `model` and
    `tokenizer_path` are its own).

    `tp=N` in a process group of N ranks (torchrun) loads this rank's tensor-parallel shard; see
    lmcli.distributed.

    `tokenizer_path` (a tokenizer.json, a tokenizer.model or an HF directory) replaces the
    checkpoint's own tokenizer, e.g. for a lone .safetensors file.

    quantize: None keeps a GGUF file's own quantization (Q4_0/Q4_1/Q4_K -> int4, Q8_0/Q5_x/Q6_K -> int8)
    and loads other checkpoints as they are; "none" dequantises everything to `dtype`; "int4" / "int8"
    quantizes the float weights at load (group-wise, round to nearest). `dtype` is the activation
    dtype; None or "auto" picks the fastest measured one for quantized weights on this device.
    """
    if quantize not in (None, *QUANTIZE_CHOICES):
        raise UsageError(f"--quantize {quantize}: unknown (use {', '.join(QUANTIZE_CHOICES)})")
    device = resolve_device(device)
    if not isinstance(checkpoint, ResolvedModel):
        checkpoint = resolve_model(checkpoint, model, tokenizer_path)
    if tp is not None and tp > 1 and quantize in ("int4", "int8"):
        raise UsageError(f"--tp {tp} with --quantize {quantize}: tensor parallel needs float weights for now")
    with ExitStack() as open_files:  # a GGUF file stays mapped while its tensors are placed one by one
        built, tokenizer = _load(checkpoint, dtype, device, tp, quantize, open_files)
    setattr(built, "resolved", checkpoint)  # noqa: B010 - nn.Module types its attributes; its fingerprint keys the prompt cache's blocks on disk (generation/prefix_cache.py)
    return built, tokenizer


def _load(resolved: ResolvedModel, dtype: str | torch.dtype | None, device: torch.device, tp: int | None,
          quantize: str | None, open_files: ExitStack) -> tuple[GeneratingModel, Tokenizer | None]:
    from lmcli import registry
    from lmcli.generation.models import GeneratingModel
    from lmcli.io.checkpoint import fill_model, read_safetensors, safetensors_files

    path, model = resolved.path, resolved.check_as
    parallel = None
    tokenizer = None
    origin: dict[str, Path] = {}
    # Quantized weights stay quantized (a GGUF file's own, or --quantize's); the activation dtype
    # is then chosen from what the weights' kernels measure fastest with, and each weight is
    # placed in the model as it is read, so the whole checkpoint is never held twice.
    quantized_load = quantize in ("int4", "int8") or (quantize is None and resolved.kind == "gguf")
    stored_kinds: list[str] = []  # the file's own quantized forms, one per tensor
    # What a packed entry keeps of the tokenizer (io/packed_cache.py): the file's own, with its JSON
    # taken before the weights are placed, whatever --tokenizer replaces it with for this run.
    stored_tokenizer: tuple[Tokenizer, torch.Tensor] | None = None
    weights: Iterator[tuple[str, Any]]

    packed = _packed_entry(resolved, quantize, dtype, device, tp)
    loaded = None if packed is None else _from_packed(resolved, packed)
    if loaded is not None:
        return loaded
    if resolved.kind == "gguf":
        if tp is not None and tp > 1:
            from lmcli.distributed import refuse_gguf

            raise refuse_gguf(tp, path)
        from lmcli.io.tokenizer import tokenizer_from_gguf
        from lmcli.resolve.default_model import load_gguf_cached

        if quantized_load:  # read tensor by tensor: float32 or quantized blocks
            from lmcli.io.gguf import open_gguf

            gguf = open_files.enter_context(open_gguf(path, keep_quantized=quantize is None))
            hf_config, metadata = gguf.hf_config, gguf.metadata
            hf_config["torch_dtype"] = "float32"
            stored_kinds = gguf.quantized_kinds()
            weights = cast(Iterator[tuple[str, Any]], gguf.tensors())
        else:  # GGUF weights are quantised or float: `auto` is decided by the device alone.
            checkpoint = load_gguf_cached(path, resolve_dtype(dtype, device))
            hf_config, metadata = checkpoint.hf_config, checkpoint.metadata
            weights = _drained(checkpoint.tensors)
        config = registry.config_from_hf(hf_config, model, source=resolved.config_source)
        try:
            tokenizer = tokenizer_from_gguf(metadata)
        except TokenizerError as e:  # what is wrong with the vocabulary, in the file it came from
            raise TokenizerError(f"{path}: {e}") from None
        if packed is not None and tokenizer is not None:
            from lmcli.io import packed_cache

            stored_tokenizer = (tokenizer, packed_cache.tokenizer_bytes(tokenizer))
        if quantized_load:
            gguf.forget_vocabulary()
        release_freed_memory()  # the vocabulary's strings and the JSON's temporaries, before the weights
        source = str(path)
    else:
        hf_config = dict(resolved.preset) if resolved.preset is not None else _read_config_json(
            resolved.checkpoint_dir / "config.json")
        files = safetensors_files(path) if resolved.kind == "hf" else [path]
        config = registry.config_from_hf(hf_config, model, source=resolved.config_source)
        target_dtype = torch.float32 if quantized_load else resolve_dtype(dtype, device, config.torch_dtype)
        if tp is not None and getattr(config, "is_encoder_decoder", False):
            raise UsageError(f"--tp {tp}: tensor parallel does not support encoder-decoder models ({config.model_type})")
        if tp is not None:
            from lmcli import distributed

            parallel = distributed.parallel_for(tp, config)  # checks the split before reading weights
        if parallel is not None:
            device = distributed.rank_device(device)
            lazy, origin = distributed.lazy_safetensors(files)  # read per rank after the renames
            weights = _drained(dict(lazy))
        else:
            read, origin = read_safetensors(files, target_dtype)
            weights = _drained(dict(read))
        source = str(files[0]) if len(files) == 1 else str(path)
        from lmcli.io.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolved.checkpoint_dir)

    if resolved.tokenizer_path is not None:
        tokenizer = _tokenizer_from(resolved.tokenizer_path)

    module = registry.architecture_module(config.model_type)
    if hasattr(module, "convert_checkpoint"):  # a per-tensor rename, applied as each tensor arrives
        weights = _converted(weights, module.convert_checkpoint, config, getattr(module, "SHARED_TARGETS", frozenset()))
    if parallel is not None:
        weights = _drained(parallel.take_shards(dict(weights), target_dtype))
    _check_claimed_size(config, path if resolved.kind == "gguf" else files, source)
    built = _skeleton(config, source, module, parallel)
    if quantized_load:
        kinds = [quantize] if quantize in ("int4", "int8") else stored_kinds
        floats = _place_quantized(built, weights, quantize, kinds, dtype, device, source)
    else:
        floats = {name: t.to(device=device) for name, t in weights}
    fill_model(built, floats, source, origin)
    floats.clear()  # the model holds the weights now; fusing frees each replaced part only if nothing else does
    built.fuse_projections(after_each_layer=_release_replaced)
    # The head is copied column-major; its old storage (kept here: detach() shares it) may be file pages.
    head = built.lm_head.weight.detach() if isinstance(built.lm_head, nn.Linear) else None
    built.use_fast_layout()
    if head is not None:
        release_file_pages([head])
    del head
    built.eval()
    release_freed_memory()
    if packed is not None and type(built) is GeneratingModel:  # not a rank's part, not an encoder-decoder
        from lmcli.kernels import packed_model

        file_tokenizer, tokenizer_json = stored_tokenizer or (None, None)
        packed_model.save(built, file_tokenizer, hf_config, *packed, tokenizer_json=tokenizer_json)
        del stored_tokenizer, file_tokenizer, tokenizer_json
        release_freed_memory()
    return built, tokenizer


# No stored format keeps a weight in less than this (GGUF's smallest, IQ1_S, takes 1.56 bits): a config
# whose weights could not fit its files at this rate describes another model than the files hold.
MIN_BITS_PER_WEIGHT = 1


def least_weights(config: Any) -> int:
    """A lower bound on the number of weights the model `config` describes holds: its token embedding and,
    in every layer of each stack, the attention's query and output projections (hidden x heads x head_dim
    each), whatever else the architecture adds."""
    count = config.vocab_size * config.hidden_size
    count += config.num_hidden_layers * 2 * config.hidden_size * config.num_attention_heads * config.head_dim
    encoder = getattr(config, "encoder_layers", 0) if getattr(config, "is_encoder_decoder", False) else 0
    if encoder:
        count += encoder * 2 * config.hidden_size * config.encoder_attention_heads * config.encoder_head_dim
    return count


def _check_claimed_size(config: Any, files: Path | list[Path], source: str) -> None:
    """Refuse a config that claims more weights than its files can hold, before anything is built: a
    config claiming 65,536 layers otherwise built 4 GB of modules (114 s here) before the first missing
    tensor refused it."""
    stored = sum(f.stat().st_size for f in ([files] if isinstance(files, Path) else files))
    least = least_weights(config)
    if least * MIN_BITS_PER_WEIGHT > stored * 8:
        raise CheckpointError(
            f"{source}: its config describes a model of at least {least:,} weights ({config.num_hidden_layers:,} "
            f"layers of width {config.hidden_size:,}), more than its files' {stored:,} bytes can hold")


def _skeleton(config: Any, source: str, module: Any = None, parallel: Any = None) -> Any:
    """The model `config` describes, its parameters not yet filled in: an architecture's own
    (`module.build_model`, the encoder-decoders), a rank's part (`parallel`), or the shared BaseModel;
    each of the class lmcli.generation.models gives `generate()`."""
    from lmcli.generation.models import GeneratingEncoderDecoder, GeneratingModel

    try:
        with _uninitialised_parameters():
            if module is not None and hasattr(module, "build_model"):
                return module.build_model(config, GeneratingEncoderDecoder)
            return GeneratingModel(config) if parallel is None else parallel.build_model(GeneratingModel)
    except (RuntimeError, MemoryError) as exc:  # sizes that pass validation can still exceed this machine
        raise CheckpointError(f"{source}: the model its config describes cannot be allocated ({first_line(exc)})") from None


def _from_packed(resolved: ResolvedModel, packed: tuple[Path, dict[str, Any]]) -> tuple[GeneratingModel, Tokenizer | None] | None:
    """The model and tokenizer as an earlier start loaded them (io/packed_cache.py), without reading
    the GGUF; None where there is no usable entry."""
    from lmcli import registry
    from lmcli.io import packed_cache
    from lmcli.kernels import packed_model

    entry = packed_cache.open_entry(*packed)
    if entry is None:
        return None
    try:
        config = registry.config_from_hf(dict(entry.hf_config), resolved.check_as, source=resolved.config_source)
        built = _skeleton(config, str(resolved.path))
        packed_model.fill(built, entry)
        tokenizer = entry.tokenizer()
    except (CheckpointError, *packed_cache.REFUSALS) as exc:
        packed_cache.refuse(packed[0], exc)
        return None
    if resolved.tokenizer_path is not None:
        tokenizer = _tokenizer_from(resolved.tokenizer_path)
    release_freed_memory()
    return built, tokenizer


def _packed_entry(resolved: ResolvedModel, quantize: str | None, dtype: str | torch.dtype | None,
                  device: torch.device, tp: int | None) -> tuple[Path, dict[str, Any]] | None:
    """Where the packed cache (io/packed_cache.py) keeps this load, and its key; None where it does
    not apply: only a GGUF kept quantized, on the CPU, in one process."""
    from lmcli.io import packed_cache

    if resolved.kind != "gguf" or quantize is not None or device.type != "cpu" or (tp or 1) > 1 \
            or not packed_cache.enabled():
        return None
    key = packed_cache.cache_key(Path(resolved.path), dtype, resolved.fingerprint)
    return packed_cache.entry_path(Path(resolved.path), key), key


def release_freed_memory() -> None:
    """Hand memory that is free but still held by the C allocator back to the system (glibc's
    `malloc_trim`; elsewhere nothing). Loading frees many large temporaries, and glibc otherwise
    keeps them for reuse, which shows as resident memory the model never uses: measured on the
    default model, about 70 MB more peak and 60 MB more after load without it."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _release_replaced(weights: list[torch.Tensor]) -> None:
    """After a layer's projections are fused: the parts' pages, where they map the checkpoint file
    (safetensors tensors do), and whatever the allocator kept of the rest. Measured on SmolLM2 float32
    (`lmcli bench`): peak 1,195 MiB with the parts' file pages left resident, against 954 for
    transformers."""
    release_file_pages(weights)
    release_freed_memory()


def release_file_pages(tensors: list[torch.Tensor]) -> None:
    """Drop from resident memory the pages that `tensors` (still alive, about to be let go) read from a
    mapped file. Only whole pages inside a tensor and inside one file-backed mapping of
    /proc/self/maps are dropped: such a page comes back from the file unchanged if anything reads
    it again, whereas dropping anonymous memory would zero it. Elsewhere (no /proc, no madvise)
    nothing is done."""
    madvise = _libc_function("madvise")
    mappings = _file_mappings()
    if madvise is None or not mappings:
        return
    page = mmap.PAGESIZE
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        first, last = -(-start // page) * page, end // page * page
        if last > first and any(low <= first and last <= high for low, high in mappings):
            madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


_MADV_DONTNEED = 4  # Linux


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of each memory mapping of a regular file, from /proc/self/maps; [] where unreadable."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    mappings = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            mappings.append((low, high))
    return mappings


@functools.cache
def _libc_function(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):  # not glibc
        return None


def _malloc_trim() -> Any:
    return _libc_function("malloc_trim")


def _drained(tensors: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The dict's items, each removed as it is taken (so a placed tensor is not kept alive here)."""
    while tensors:
        name = next(iter(tensors))  # in the checkpoint's order, so errors name what they always named
        yield name, tensors.pop(name)


def _converted(weights: Iterator[tuple[str, Any]], convert: Any, config: Any,
               shared: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors under the architecture's names. A name in `shared` (a table that several
    of the file's tensors become, as BART's three embedding names) is handed on once: a later copy must
    equal it, else the load is refused (keeping whichever came last would be silently wrong)."""
    first: dict[str, Any] = {}
    for name, tensor in weights:
        converted = convert({name: tensor}, config)
        del tensor  # handed on one at a time, so the consumer's `del` frees each
        for key in list(converted):
            value = converted.pop(key)
            if key in shared:
                if key in first:
                    if not torch.equal(first[key], value):
                        raise CheckpointError(f"{name}: the checkpoint stores {key} under several names, and "
                                              "they differ (this architecture has one such table)")
                    continue
                first[key] = value
            yield key, value


def _place_quantized(built: BaseModel, weights: Iterator[tuple[str, Any]], quantize: str | None, kinds: list[str],
                     dtype: str | torch.dtype | None, device: torch.device, source: str) -> dict[str, torch.Tensor]:
    """Install each quantized weight into `built` as it arrives (quantizing float ones first under
    --quantize); return the float tensors, in the residual dtype (see below), for `fill_model`."""
    from lmcli.io.group_quantized import GROUP, GroupQuantized
    from lmcli.kernels.linear import QuantizedInstaller
    from lmcli.kernels.numerics import Numerics
    from lmcli.kernels.plan import fast_kernels, preferred_dtype
    from lmcli.models.base import BaseModel

    if dtype is None or str(dtype) == "auto":
        activation = preferred_dtype(max(set(kinds), key=kinds.count), device) if kinds else resolve_dtype(None, device)
    else:
        activation = resolve_dtype(dtype, device)
    # Half-precision kernels, float32 around them (the residual stream, norms, rotary, embedding rows,
    # float weights): in bfloat16 those roundings added up to a wrong answer on the default model.
    residual = torch.float32 if isinstance(built, BaseModel) and activation.itemsize < 4 else activation
    installer = QuantizedInstaller(built, activation, device, source, residual)
    release_freed_memory()  # what reading the vocabulary and measuring kernels left behind
    to_quantize = _quantizable_names(built) if quantize in ("int4", "int8") else set()
    bits = 4 if quantize == "int4" else 8
    tied = {"lm_head.weight"} if built.config.tie_word_embeddings else set()
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name in to_quantize and tensor.dim() == 2 and tensor.shape[1] % GROUP == 0:
            tensor = GroupQuantized.quantize(tensor, bits)
        if isinstance(tensor, GroupQuantized):
            if name not in tied:  # a tied head saved explicitly: the embedding's kernel serves it
                installer.install(name, tensor)
            del tensor
            release_freed_memory()  # the weight's codes and packing buffers, back to the system now
        else:
            floats[name] = tensor.to(device=device, dtype=residual if tensor.is_floating_point() else tensor.dtype)
    # What this load chose for the arithmetic, in one record the decoding step reads (kernels/numerics.py).
    built.install_numerics(Numerics(
        kernel_choices=installer.choices,
        batch_invariant=bool(installer.choices) and not fast_kernels(),  # see models/row_attention.py
        activation_dtype=activation if residual != activation else None,
    ))
    return floats


TOKENIZER_FILES = {".json": "tokenizer.json", ".model": "tokenizer.model"}


def _tokenizer_from(path: Path) -> Tokenizer | None:
    """The tokenizer in an HF directory, or in one tokenizer.json / tokenizer.model file.

    A file is read with the tokenizer_config.json beside it (its special tokens and chat template),
    through a temporary directory that holds just those two, so a sibling of the other kind cannot win.
    """
    import tempfile

    from lmcli.io.tokenizer import load_tokenizer

    if path.is_dir():
        found = load_tokenizer(path)
        if found is None:
            raise TokenizerError(f"--tokenizer {path}: the directory has no tokenizer.json or tokenizer.model")
        return found
    if not path.is_file():
        raise UsageError(f"--tokenizer {path}: no such file or directory")
    canonical = TOKENIZER_FILES.get(path.suffix)
    if canonical is None:
        raise UsageError(f"--tokenizer {path}: expected a tokenizer.json, a tokenizer.model or an HF directory")
    with tempfile.TemporaryDirectory(prefix="lmcli-tokenizer-") as staging:
        (Path(staging) / canonical).symlink_to(path.resolve())
        for companion in ("tokenizer_config.json", "special_tokens_map.json"):
            if (path.parent / companion).is_file():
                (Path(staging) / companion).symlink_to((path.parent / companion).resolve())
        return load_tokenizer(Path(staging))
