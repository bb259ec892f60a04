"""The decoding step (lmcli/generation/step.py): prefill in chunks against the whole prompt and against
transformers, numerics handed to the step rather than switched on the model, the one caller of
forward_slots outside the models, lmcli.generate against model.generate and transformers' greedy."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from tiny import BASE, prompts, random_reference, save_reference

import lmcli
from lmcli.generation.step import Step
from lmcli.kernels.numerics import Numerics

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(lmcli.__file__).parent


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(lmcli's float llama, transformers' same model)."""
    directory = tmp_path_factory.mktemp("llama")
    reference = save_reference("llama", directory)
    return lmcli.load(directory)[0], reference


def prefill(step: Step, ids: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """The last logits [1, V] of `ids` [1, T] prefilled through `step` into a fresh cache."""
    n = ids.shape[1]
    cache = step.model.init_cache(1, n)
    slots = torch.arange(n)
    with torch.inference_mode():
        return step.prefill(ids, slots[None], slots, torch.ones(1, n, dtype=torch.bool), cache, chunk).float()


def test_prefill_in_chunks_equals_whole_and_transformers(llama):
    model, reference = llama
    ids = prompts([23])[0][None]
    with torch.no_grad():
        want = reference(ids).logits[:, -1]  # (1, V)
    step = Step.of(model)
    whole = prefill(step, ids, None)
    for chunk in (1, 5, 16):
        torch.testing.assert_close(prefill(step, ids, chunk), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(whole, want, atol=1e-4, rtol=1e-4)


def test_numerics_travel_with_the_step_not_the_model(llama):
    """A step handed batch-invariant numerics computes a float model's logits that way (per-row attention:
    still transformers' numbers), and the model's own record is untouched."""
    model, reference = llama
    ids = prompts([17])[0][None]
    with torch.no_grad():
        want = reference(ids).logits[:, -1]
    invariant = Step(model, Numerics(batch_invariant=True))
    torch.testing.assert_close(prefill(invariant, ids, 4), want, atol=1e-4, rtol=1e-4)
    assert model.numerics == Numerics() and not model.batch_invariant


def test_a_quantized_prefill_in_chunks_is_the_whole_prompts_exactly(tmp_path, monkeypatch):
    """Batch-invariant numerics (int4 weights, bfloat16 products): chunking changes no bit (tiny.tiny_int4's
    recipe, inline: that fixture wants a module-scoped cache)."""
    from lmcli.kernels import plan as kernel_plan

    monkeypatch.setenv("LMCLI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LMCLI_KERNEL", raising=False)
    monkeypatch.setattr(kernel_plan, "_PROBE_SHAPE", (128, 256))
    kernel_plan._cached_plans.cache_clear()
    try:
        # Every projection a multiple of the int4 group (32), so each is quantized: a float weight left
        # beside them (tiny.BASE's intermediate 48) multiplies through F.linear, whose sums differ with
        # the row count.
        random_reference("llama", dict(BASE, intermediate_size=64, tie_word_embeddings=False)).save_pretrained(
            tmp_path / "llama")
        model, _ = lmcli.load(tmp_path / "llama", quantize="int4")
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        assert model.numerics.batch_invariant and model.numerics.activation_dtype == torch.bfloat16
        ids = prompts([29])[0][None]
        step = Step.of(model)
        whole = prefill(step, ids, None)
        for chunk in (1, 7, 16):
            assert torch.equal(prefill(step, ids, chunk), whole)
    finally:
        kernel_plan._cached_plans.cache_clear()


def test_a_models_numerics_are_one_frozen_record(llama):
    model, _ = llama
    assert isinstance(model.numerics, Numerics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.numerics.batch_invariant = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        model.batch_invariant = True  # a view of the record, not a switch
    with pytest.raises(TypeError):
        model.numerics.kernel_choices["int4"] = None  # type: ignore[index]


def _calls(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text(), str(path))
    return sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
               for node in ast.walk(tree))


def test_forward_slots_has_one_caller_outside_the_models():
    callers = {str(path.relative_to(ROOT)): n for path in sorted(ROOT.rglob("*.py"))
               if "models" not in path.relative_to(ROOT).parts and (n := _calls(path, "forward_slots"))}
    assert callers == {"generation/step.py": 1}


def test_no_scheduler_asks_the_model_for_its_numerics():
    """The schedulers ask the step; only the model's own code reads its numerics' fields by name."""
    for path in sorted((ROOT / "generation").glob("*.py")):
        text = path.read_text()
        for name in ("batch_invariant", "kernel_choices", "activation_dtype"):
            assert f'getattr(model, "{name}"' not in text and f"model.{name}" not in text, (path.name, name)


def test_lmcli_generate_is_model_generate_and_transformers_greedy(llama):
    model, reference = llama
    ids = prompts([9])[0][None]
    got = lmcli.generate(model, ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, model.generate(ids, max_new_tokens=8, do_sample=False))
    config = reference.generation_config
    config.eos_token_id = None  # lmcli's generate() without eos_token_id does not stop at EOS either
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                  pad_token_id=0, generation_config=config)
    assert got.tolist() == want.tolist()


class _RowState:
    """A processor with per-row state, as a constraint's mask keeps it."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        self.ended: list[int] = []

    def __call__(self, input_ids, logits):
        return logits

    def end_row(self, row: int) -> str | None:
        self.ended.append(row)
        return self.errors.get(row)


def test_a_constraint_is_the_chains_first_step_and_ends_rows_like_any_processor(monkeypatch):
    """The constraint comes from the one chain factory, before the processors it would otherwise follow
    (the chain without it, built independently), and a row's end reaches every processor with row state."""
    from lmcli.generation import constraints
    from lmcli.generation.sampling import ProcessorChain, RowConstraints, SamplingSettings

    made = []

    class Mask(_RowState):
        def __init__(self, tokenizer, rows, vocab_size):
            super().__init__({0: "json_schema: the engine gave up"})
            made.append((tokenizer, rows, vocab_size))

    monkeypatch.setattr(constraints, "ConstraintMask", Mask)
    settings = SamplingSettings(temperature=0.7, top_k=3, repetition_penalty=1.1)
    free = settings.policy()[1]
    rows = ["a constraint", None]
    do_sample, chain = settings.policy(constraints=RowConstraints("tokenizer", rows, 97))
    assert do_sample and made == [("tokenizer", rows, 97)]
    assert isinstance(chain[0], Mask) and [type(p) for p in chain[1:]] == [type(p) for p in free]
    assert len(settings.policy(constraints=RowConstraints("tokenizer", [None, None], 97))[1]) == len(free)
    other = _RowState({0: "second", 1: "only here"})
    processors = ProcessorChain([*chain, other])
    assert processors.end_row(0) == "json_schema: the engine gave up"  # the first error, in chain order
    assert processors.end_row(1) == "only here"
    assert chain[0].ended == [0, 1] and other.ended == [0, 1]
