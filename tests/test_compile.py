"""model.compile_decode(): greedy decoding through torch.compile gives transformers' greedy tokens, and
a compiler failure falls back to eager decoding with a one-line warning."""

from __future__ import annotations

import pytest
import torch
from tiny import PAD, prompts, save_reference

import lmcli

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(case: str, directory):
    reference = save_reference(case, directory)
    reference.generation_config.eos_token_id = None  # lmcli's generate() has no EOS unless one is passed
    return reference, lmcli.load(directory)[0]


def _hf_greedy(reference, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=PAD)


@pytest.mark.full  # inductor compiles the step twice (static, then with the history length dynamic): a minute
@pytest.mark.parametrize("case", ["mistral", "gemma3_text"])  # rolling and static caches; q/k norms, softcap-free
def test_compiled_greedy_equals_transformers(case, tmp_path):
    reference, model = _pair(case, tmp_path)
    assert model.compile_decode()
    (ids,) = prompts([7])
    want = _hf_greedy(reference, ids[None], 20)
    assert torch.equal(model.generate(ids[None], 20, False), want)
    assert model._compiled_decode is not None  # it did not fall back to eager
    assert torch.equal(model.generate(ids[None], 20, False), want)  # a second call, new cache: same


def test_a_compiler_failure_falls_back_to_eager_with_one_line(tmp_path, monkeypatch, capfd):
    reference, model = _pair("llama", tmp_path)

    def failing_compile(fn, **_):
        def compiled(*args, **kwargs):
            raise RuntimeError("inductor: no working C++ compiler found\nsecond line of the report")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.setenv("LMCLI_COMPILE_JIT", "1")  # torch.compile in this process, not the cached program
    assert model.compile_decode()
    (ids,) = prompts([7])
    capfd.readouterr()  # what saving the reference printed
    assert torch.equal(model.generate(ids[None], 12, False), _hf_greedy(reference, ids[None], 12))
    warning = capfd.readouterr().err.strip().splitlines()
    assert warning == ["warning: --compile failed (inductor: no working C++ compiler found); decoding without it"]
