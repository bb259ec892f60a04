"""Structured output where the earlier tests did not look (found by the planted-bug audit,
docs/testing.md): a mask reused for a second generate() call, JSON without free whitespace even when
the model wants newlines, a typo inside "properties", a job row's `"json": false`, the documented
token limit of a constrained row, and a SentencePiece vocabulary ("▁" for a space, as Gemma's and Llama's).

References: Python's `re` and `json` modules and the `jsonschema` library judge the text; the README's
numbers are written out here. The tiny byte-level checkpoint keeps it fast.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from typer.testing import CliRunner

import lmcli
from lmcli.cli import app
from lmcli.generation.constraints import Constraint, ConstraintError, ConstraintMask
from lmcli.settings.generation_settings import GenerationSettings, ModelDefaults

pytestmark = pytest.mark.usefixtures("one_thread")
PATTERN = r"[a-z]{2,5} [0-9]{3}!"


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return lmcli.load(tiny_checkpoint)


def constrained(model, tokenizer, mask, prompt, n=24, bias=None):
    ids = tokenizer.encode(prompt)
    processors = [mask] + ([bias] if bias else [])
    out = model.generate(torch.tensor([ids]), n, do_sample=False, eos_token_id=tokenizer.eos_token_ids,
                         logits_processors=processors)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_a_mask_reused_for_another_generate_call_starts_again(loaded):
    model, tokenizer = loaded
    mask = ConstraintMask(tokenizer, [Constraint.parse("regex", PATTERN)], model.config.vocab_size)
    for prompt in ("Hello there", "Once upon a time", "Hello there"):
        text = constrained(model, tokenizer, mask, prompt)
        assert re.fullmatch(PATTERN, text), (prompt, text)


def test_json_has_no_free_whitespace_even_when_the_model_wants_it(loaded):
    model, tokenizer = loaded
    [newline] = tokenizer.encode("\n", add_special_tokens=False)

    def wants_newlines(_ids, scores):
        scores = scores.clone()
        scores[:, newline] += 50.0
        return scores

    mask = ConstraintMask(tokenizer, [Constraint.parse("json", True)], model.config.vocab_size)
    text = constrained(model, tokenizer, mask, "Hello there", n=40, bias=wants_newlines)
    assert "\n" not in text, text  # a raw newline is JSON only as free whitespace


def test_a_typo_inside_properties_is_refused_by_name():
    schema = {"type": "object", "properties": {"name": {"type": "string", "requird": True}}}
    with pytest.raises(ConstraintError, match="requird"):
        Constraint.parse("json_schema", schema)
    with pytest.raises(ConstraintError, match="requird"):
        Constraint.parse("json_schema", {"type": "array", "prefixItems": [{"requird": 1}]})


def test_a_row_with_json_false_is_unconstrained(tmp_path, tiny_checkpoint):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"id": "free", "prompt": "Hello", "json": False}) + "\n")
    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "--greedy", "-n", "2",
                                      "--input", str(source), "--output", str(out)])
    assert result.exit_code == 0, result.output
    [row] = map(json.loads, out.read_text().splitlines())
    assert "error" not in row and "json" not in row["settings"] and row["completion_tokens"] <= 2


def test_a_constrained_row_without_a_length_gets_the_documented_512():
    """README: with a constraint and no -n, the limit is 512 tokens (and 128 without one)."""
    over = GenerationSettings.from_flags(constraint=Constraint.parse("json", True)).with_model_defaults(ModelDefaults())
    assert over.max_new_tokens == 512
    assert GenerationSettings.from_flags().with_model_defaults(ModelDefaults()).max_new_tokens == 128


def _sentencepiece_tokenizer():
    """A Llama-style SentencePiece vocabulary as a GGUF file describes it ("▁" for a space, byte
    fallback tokens), built by lmcli's GGUF tokenizer reader (which test_gguf checks against transformers)."""
    from lmcli.io.tokenizer.gguf import tokenizer_from_gguf

    pieces = ["a", "b", "ab", "\u2581a", "\u2581b", "\u2581ab", "\u2581"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *pieces]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(pieces)))]
    return tokenizer_from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                                "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
                                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                                "tokenizer.ggml.unknown_token_id": 0}), tokens


def test_a_sentencepiece_vocabulary_is_constrained_by_the_text_its_tokens_make():
    """After "a" under the regex `[ab ]+` (not one forced text, so the engine goes by each token's bytes),
    the mask allows the tokens a SentencePiece model writes words with: "▁b" (a space and b), "▁ab",
    "▁"; and only tokens whose text, as the tokenizer decodes it after "a", is made of a, b and spaces."""
    tokenizer, tokens = _sentencepiece_tokenizer()
    vocab, a = len(tokens), tokens.index("a")  # the plain piece (as a text's first token it would be "▁a")
    mask = ConstraintMask(tokenizer, [Constraint.parse("regex", "[ab ]+")], vocab)
    bos = tokenizer.encode("", add_special_tokens=True)
    mask(torch.tensor([bos]), torch.zeros(1, vocab))  # the prompt
    allowed = torch.isfinite(mask(torch.tensor([[*bos, a]]), torch.zeros(1, vocab))[0]).nonzero().view(-1).tolist()
    assert tokenizer.decode([a, tokens.index("\u2581b")]) == "a b"  # the tokenizer's own reading
    assert {"\u2581b", "\u2581ab", "\u2581", "b"} <= {tokens[t] for t in allowed}, [tokens[t] for t in allowed]
    for t in allowed:
        if t not in tokenizer.eos_token_ids:
            text = tokenizer.decode([a, t])
            assert re.fullmatch("[ab ]+", text) and len(text) > 1, (tokens[t], text)
