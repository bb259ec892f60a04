"""Peak resident memory of a run on a compiled decode step, against issue 9's bound (tests/test_memory.py):

    peak RSS <= torch's own import footprint + 1.5 x the GGUF file size + the KV cache

The program holds no copy of the weights (it runs on the model's own packed tensors, given to it at
load), so a later process that loads it stays within the bound, and the package on disk is a small
fraction of the file. The first process builds it (export and inductor in this process: not what a
later run pays, so its peak is not held to the bound)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_models import smollm2_gguf  # noqa: F401
from test_memory import _PEAK, BOUND_OF_FILE, NEW_TOKENS, PROMPT_TOKENS, _run, torch_import_bytes  # noqa: F401

_COMPILED_RUN = _PEAK + """
import json, sys
import torch
import lmcli

path, prompt_tokens, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tokenizer = lmcli.load(path)
assert model.compile_decode()
prompt = torch.randint(3, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    out = model.generate(prompt, new_tokens, False)
c = model.config
print(json.dumps({"peak": peak_rss_bytes(), "generated": out.shape[1] - prompt_tokens,
                  "layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                  "compiled": type(model._compiled_decode).__name__}))
"""


@pytest.mark.full  # the first process builds the default model's program: a minute or more
def test_a_run_on_the_compiled_step_stays_within_the_memory_bound(smollm2_gguf, torch_import_bytes, tmp_path,
                                                                  monkeypatch):
    from lmcli.io import compiled_cache

    monkeypatch.setenv("LMCLI_KERNEL", "int4pack")  # compiled programs run torch's kernels (lmcli's are not exported)

    args = (str(smollm2_gguf), str(PROMPT_TOKENS), str(NEW_TOKENS))
    _run(_COMPILED_RUN, *args, cache_dir=tmp_path, packed_cache=True)  # builds the program (as a user's run: packed cache on)
    packages = list((tmp_path / "compiled").glob(f"*/{compiled_cache.PACKAGE}"))
    file_size = Path(smollm2_gguf).stat().st_size
    assert len(packages) == 1 and packages[0].stat().st_size < 0.1 * file_size  # no weights inside
    run = json.loads(_run(_COMPILED_RUN, *args, cache_dir=tmp_path, packed_cache=True))  # loads it
    assert run["generated"] == NEW_TOKENS and run["compiled"] == "CachedDecode"
    kv_cache = 2 * run["layers"] * run["kv_heads"] * run["head_dim"] * (PROMPT_TOKENS + NEW_TOKENS) * 4
    bound = torch_import_bytes + BOUND_OF_FILE * file_size + kv_cache
    mib = 2**20
    assert run["peak"] <= bound, (
        f"peak RSS {run['peak'] / mib:.0f} MiB > bound {bound / mib:.0f} MiB (import torch "
        f"{torch_import_bytes / mib:.0f} MiB + {BOUND_OF_FILE} x file {file_size / mib:.0f} MiB + KV {kv_cache / mib:.1f} MiB)")
