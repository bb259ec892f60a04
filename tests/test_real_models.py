"""End to end on the two real models: lmcli's greedy tokens equal transformers', token for token.

The reference is transformers loading the same GGUF file (`from_pretrained(dir, gguf_file=...)`) in
float32 on the CPU; see real_models.transformers_reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from real_models import GREEDY_TOKENS, TEXT_PROMPTS, encoded_text_prompts, gemma_gguf, model_reference, smollm2_gguf  # noqa: F401

import lmcli


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def real(request):
    path = request.getfixturevalue(f"{request.param}_gguf")
    model, tokenizer = lmcli.load(path, dtype="float32", device="cpu", quantize="none")
    return request.param, path, model, tokenizer


def test_greedy_generation_equals_transformers(real):
    name, path, model, tokenizer = real
    reference = model_reference(name, path)
    prompts = encoded_text_prompts(path)
    assert len(prompts) == len(TEXT_PROMPTS) == 5
    for ids, expected in zip(prompts, reference["greedy"]):
        out = model.generate(torch.tensor([ids]), GREEDY_TOKENS, False, eos_token_id=tokenizer.eos_token_ids)
        ours = out[0, len(ids):].tolist()
        # transformers stops at EOS without padding: compare up to its length, and our tail is padding.
        assert ours[: len(expected)] == expected, (tokenizer.decode(ours), tokenizer.decode(expected))
        assert len(expected) == GREEDY_TOKENS or ours[len(expected) - 1] in tokenizer.eos_token_ids


# Gemma 3 under `make test-full`: padded batches of every architecture (gemma3_text included) are checked on
# tiny models in test_generate.py, and the real Gemma keeps its greedy case above.
@pytest.mark.parametrize("real", ["smollm2", pytest.param("gemma", marks=pytest.mark.full)], indirect=True)
def test_left_padded_batch_of_real_prompts_equals_each_alone(real):
    _, path, model, tokenizer = real
    prompts = encoded_text_prompts(path)[:3]
    width = max(map(len, prompts))
    x = torch.full((3, width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, ids in enumerate(prompts):
        x[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    batched = model.generate(x, 12, False, attention_mask=mask)
    for row, ids in enumerate(prompts):
        alone = model.generate(torch.tensor([ids]), 12, False)
        assert batched[row, width:].tolist() == alone[0, len(ids):].tolist()


def test_default_model_names_paris(smollm2_gguf):
    """`lmcli generate --greedy -n 16 "The capital of France is"`, no checkpoint: the embedded SmolLM2."""
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "lmcli", "generate", "--greedy", "-n", "16", "The capital of France is"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert result.stdout.startswith(" Paris")  # piped: only the completion, no prompt echo


def test_convert_output_loads_in_lmcli_and_transformers_with_equal_logits(smollm2_gguf, tmp_path):
    import transformers
    from typer.testing import CliRunner

    from lmcli.cli import app

    out = tmp_path / "smollm2-hf"
    result = CliRunner().invoke(app, ["convert", str(smollm2_gguf), str(out)])
    assert result.exit_code == 0, result.output
    ours, tokenizer = lmcli.load(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("Converted checkpoints keep their logits.")])
    with torch.no_grad():
        want = theirs(ids).logits
    torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)
    from_gguf, gguf_tokenizer = lmcli.load(smollm2_gguf, quantize="none")
    torch.testing.assert_close(from_gguf(ids), want, atol=1e-4, rtol=0)
    text = "Mixed: Привет 👋 code = f(x)\n\tend"
    assert tokenizer.encode(text) == gguf_tokenizer.encode(text)
    assert transformers.AutoTokenizer.from_pretrained(out)(text).input_ids == tokenizer.encode(text)
    # A second convert into the same place refuses to overwrite it.
    again = CliRunner().invoke(app, ["convert", str(smollm2_gguf), str(out)])
    assert again.exit_code == 2 and "not empty" in again.output
