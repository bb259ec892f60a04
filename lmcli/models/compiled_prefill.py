"""Prefill in chunks of CHUNK prompt tokens through a program built ahead of time (AOTInductor).

The decode step's program (models/compiled_step.py) takes one token a row; this one takes CHUNK
tokens of one row, writes their keys and values into the cache in place and returns the last
token's logits. It is the same exported module (`compiled_step.DecodeStep`, every length but the
chunk's left dynamic), given each chunk's batch-invariant key plan as two tensors (`chunk_plan`),
built once per model, machine and chunk length and kept in the same cache of compiled programs
(io/compiled_cache.py: key, SHA-256 check, staging, one `note:` and a rebuild for a damaged entry; a
program that fails to build, to match eager prefill on a fixed text, to load or to run is recorded as
bad and never tried again).
A prompt runs its whole chunks through the program and the tokens left over eagerly. Installed
beside the compiled decode step (`BaseModel.compile_decode`), for batch 1 on CPU, where it can pay
(`pays_here`: a CPU with AMX, whose int4 micro-GEMM inductor then chooses under max_autotune).
Without AMX the program calls the eager int4 kernel (`_weight_int4pack_mm_for_cpu`) and gains nothing
(README, "Compiled prefill chunks"); `lmcli bench --sections prefill` measures it anyway.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmcli.errors import first_line
from lmcli.io import compiled_cache
from lmcli.models import compiled_step

if TYPE_CHECKING:
    from lmcli.models.cache import ModelCache

BaseModel = Any  # models/base.py's BaseModel, which imports this module (no import circle, even for types)

CHUNK = 64  # prompt tokens a program call takes: the rows of each matrix product


def chunk_plan(slot_is_token: torch.Tensor, query_slots: torch.Tensor, end: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys for the queries at `query_slots` [T] (all of them tokens, the last at end - 1): the
    decode step's plan (the token slots before `end` in slot order, padded to a multiple of KEY_BLOCK),
    each query seeing those at or before its own slot. -> index [B, P] long, mask [B, T, 1, P]."""
    index, visible = compiled_step.decode_plan(slot_is_token, end, dtype)  # (B, P), (B, 1, 1, P)
    causal = index[:, None, :] <= query_slots[None, :, None]  # (B, T, P): a full cache holds slot s at index s
    mask = visible[:, 0].masked_fill(~causal, float("-inf"))  # (B, T, P)
    return index, mask[:, :, None]


def chunk_inputs(model: BaseModel, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                 slot_is_token: torch.Tensor, cache: ModelCache) -> tuple[Any, ...]:
    """`DecodeStep`'s inputs for one chunk (its last query slot + 1 is the history's length)."""
    end = int(query_slots[-1]) + 1
    return compiled_step.program_inputs(input_ids, positions, query_slots, slot_is_token, cache, end,
                                        chunk_plan(slot_is_token, query_slots, end, model.dtype))


def example(model: BaseModel) -> tuple[ModelCache, tuple[Any, ...]]:
    """A scratch cache and inputs to export on: a chunk at slots CHUNK + 5 .. 2 * CHUNK + 4, so that no
    dynamic length (history 2 * CHUNK + 5, its key plan padded past it, cache 2 * CHUNK + 37, text
    2 * CHUNK + 43) equals the chunk's fixed one, which would tie them in the exported graph."""
    start, capacity = CHUNK + 5, 2 * CHUNK + 37
    cache = model.init_cache(1, capacity)
    slot_is_token = torch.ones((1, capacity + 6), dtype=torch.bool)
    query_slots = torch.arange(start, start + CHUNK)
    input_ids = torch.zeros((1, CHUNK), dtype=torch.long)
    return cache, chunk_inputs(model, input_ids, query_slots[None].clone(), query_slots, slot_is_token, cache)


def pays_here() -> bool:
    """Whether `compile_decode` installs the prefill program: where the CPU has AMX tiles, for inductor's
    int4 micro-GEMM on them (measured 13x the eager kernel at 256 rows on a Xeon). On a CPU without AMX
    (a 2-core AVX-512 EPYC) the program prefilled at 0.74x-1.02x eager and the AVX-512 micro-GEMM was no
    faster than the eager kernel (README, "Compiled prefill chunks"), so prefill stays eager there."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def build(model: BaseModel, package: Path, autotune: bool) -> None:
    """Export a chunk's step and compile it to `package`; `autotune`: let inductor choose each int4
    product's kernel (max_autotune: its C++ micro-GEMM against the eager kernel, the faster kept). The
    program is then checked against eager prefill on a fixed text (`check_against_eager`) before the cache
    keeps it."""
    _build(model, package, autotune)
    with torch.inference_mode():
        check_against_eager(model, compiled_step._load(package))


def check_against_eager(model: BaseModel, run: Callable[..., torch.Tensor]) -> None:
    """Prefill a fixed text of 2 * CHUNK + 5 tokens through `run` (two chunks, the rest eagerly, as
    `CachedPrefill` does) and eagerly; compiled_step.Rejected (one line) where `run` fails or the logits
    of the second chunk's last token or of the text's last stray from eager's (compiled_step's tolerance)."""
    length = 2 * CHUNK + 5
    text = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(33))
    positions, slots = torch.arange(length)[None], torch.arange(length)  # (1, L), (L,)
    slot_is_token = torch.ones((1, length + 3), dtype=torch.bool)
    eager_cache, cache = model.init_cache(1, length + 3), model.init_cache(1, length + 3)
    want = model._forward_slots(text, positions, slots, slot_is_token, eager_cache, length, False)[0]  # (L, vocab)
    try:
        for start in (0, CHUNK):
            part = slice(start, start + CHUNK)
            chunk = run(*chunk_inputs(model, text[:, part], positions[:, part], slots[part], slot_is_token, cache))
    except Exception as exc:  # any failure rejects the program
        raise compiled_step.Rejected(f"it failed on the check's fixed text ({type(exc).__name__}: "
                                     f"{first_line(exc)[:120]})") from None
    rest = slice(2 * CHUNK, length)
    last = model._forward_slots(text[:, rest], positions[:, rest], slots[rest], slot_is_token, cache, length, True)
    got = torch.cat([chunk[0, -1:], last[0, -1:]]).float()  # (2, vocab)
    expected = want[[2 * CHUNK - 1, length - 1]].float()
    log_got, log_want = got.log_softmax(-1), expected.log_softmax(-1)
    kl = float((log_want.exp() * (log_want - log_got)).sum(-1).mean())
    worst = float(((got - expected).abs().amax(-1) / expected.abs().amax(-1).clamp(min=1e-6)).max())
    if not kl <= compiled_step.CHECK_KL or not worst <= compiled_step.CHECK_ATOL:
        raise compiled_step.Rejected(f"its logits differ from eager prefill's on the check's fixed text (KL {kl:.2g}, "
                                     f"largest difference {worst:.2g} of the largest logit)")


def _build(model: BaseModel, package: Path, autotune: bool) -> None:
    configs: dict[str, Any] = {"emulate_precision_casts": True}  # as the decode step (compiled_step._build)
    if autotune:
        configs.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    # torch's deprecation notices and the autotuner's tables would break the progress line
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = compiled_step.export_step(model, *example(model))
        torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)


def cache_key(model: BaseModel, autotune: bool) -> dict[str, Any]:
    return {**compiled_cache.cache_key(model, 1), "program": "prefill", "chunk": CHUNK, "autotune": autotune}


class CachedPrefill:
    """What `BaseModel.compile_decode` installs beside the decode step on CPU: a batch-1 prompt of at
    least CHUNK tokens, with a full cache, prefills its whole chunks through the program (read from the
    cache of compiled programs, or built at the first such prompt) and the rest eagerly. Where the
    program cannot be had or fails, one warning line, and prefill stays eager from then on."""

    def __init__(self, model: BaseModel, autotune: bool | None = None):
        self.model = model
        self.autotune = pays_here() if autotune is None else autotune  # the micro-GEMM where it can pay
        self.runner: Callable[..., torch.Tensor] | None = None
        self.failed = False

    def takes(self, input_ids: torch.Tensor, query_slots: torch.Tensor, slot_is_token: torch.Tensor,
              cache: ModelCache) -> bool:
        """Whether this call (with last_only) is one the program covers: one row of at least CHUNK tokens,
        at consecutive slots that all hold tokens, into a cache of full layers."""
        from lmcli.models.cache import KVCache

        length = input_ids.shape[1]
        if self.failed or input_ids.shape[0] != 1 or length < CHUNK:
            return False
        if not all(type(layer) is KVCache for layer in cache.layers):
            return False
        first, last = int(query_slots[0]), int(query_slots[-1])
        return last - first == length - 1 and bool(slot_is_token[0, first:last + 1].all())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor,
                 slot_is_token: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """The last token's logits (1, 1, vocab), as `model._forward_slots(..., last_only=True)` gives them."""
        model, length = self.model, input_ids.shape[1]
        whole = length - length % CHUNK
        runner = None
        try:
            runner = self.runner or self._runner()
            self.runner = runner
            logits = None
            for start in range(0, whole, CHUNK):
                part = slice(start, start + CHUNK)
                logits = runner(*chunk_inputs(model, input_ids[:, part], positions[:, part], query_slots[part],
                                              slot_is_token, cache))
        except Exception as exc:  # any compiler or loader failure: this prompt and the later ones run eagerly
            self.failed = True
            why = first_line(exc)[:400]  # long enough for where a failed program is recorded
            if runner is not None:  # the program itself failed: recorded, so no later run loads it again
                self.runner = None
                why = compiled_cache.record_bad(*self._entry(), f"the program failed on a prompt ({type(exc).__name__}: {why[:120]})")
            sys.stderr.write(f"warning: compiled prefill failed ({why}); prefilling without it\n")
            whole, logits = 0, None  # writing the same keys and values again at the same slots is harmless
        if whole == length and logits is not None:
            return logits
        rest = slice(whole, length)
        return model._forward_slots(input_ids[:, rest], positions[:, rest], query_slots[rest], slot_is_token, cache,
                                    int(query_slots[-1]) + 1, True)

    def _entry(self) -> tuple[str, dict[str, Any]]:
        """The program's label and key in the cache of compiled programs."""
        return f"{compiled_step.label(self.model)}-prefill{CHUNK}", cache_key(self.model, self.autotune)

    def _runner(self) -> Callable[..., torch.Tensor]:
        """The cache's program, else one built now and checked against eager prefill; one that fails to build,
        check or load is recorded as bad (io/compiled_cache.record_bad) and not tried again."""
        model = self.model
        name, key = self._entry()
        what = f"the prefill of {compiled_step.label(model)} in chunks of {CHUNK} tokens"
        package = compiled_cache.obtain(name, key, lambda path: build(model, path, self.autotune), what)
        try:
            return compiled_step._load(package)
        except Exception as exc:  # checked, yet not loadable here: recorded, not built or loaded again
            why = compiled_cache.record_bad(name, key, f"it does not load ({first_line(exc)[:120]})")
            raise compiled_cache.KnownBad(why) from None
