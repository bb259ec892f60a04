"""Continuous batching (generation/continuous.py): rows entering and leaving a running batch give exactly
the tokens `model.generate` gives each of them alone (the reference, called directly here), greedy and
seeded, with a rolling-window (sliding) model, with the columns moved left and right, with a shared
prefix reused, and on the real default model."""

from __future__ import annotations

import pytest
import torch
import transformers
from cli_fixtures import build_tokenizer, tiny_checkpoint  # noqa: F401 (fixture)
from real_models import smollm2_gguf  # noqa: F401 (fixture)

import lmcli
from lmcli.bench.job import SYSTEM
from lmcli.generation import continuous
from lmcli.generation.continuous import ContinuousRun
from lmcli.generation.prefix_cache import PrefixCache, prefix_cache_for
from lmcli.generation.rows import prepare_row
from lmcli.generation.sampling import RepetitionPenalty, Temperature, TopP
from lmcli.settings.generation_settings import GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def window_checkpoint(tmp_path_factory):
    """A tokenizer and a random Qwen2 whose later layers attend over a window of 8 (rolling caches)."""
    directory = tmp_path_factory.mktemp("tiny-window")
    vocab_size = build_tokenizer(directory, "byte-level")
    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)  # peaked logits, as tiny_checkpoint's
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint, window_checkpoint):
    """name -> (model, tokenizer), int4 so that rows are batch-invariant; each loaded once."""
    models: dict = {}

    def get(name: str):
        if name not in models:
            models[name] = lmcli.load(tiny_checkpoint if name == "llama" else window_checkpoint, quantize="int4")
        return models[name]

    return get


def job_rows(tokenizer, count: int, *, long: bool = False):
    """Rows with their own settings (greedy, sampled at other temperatures and top-p, a repetition
    penalty), lengths and seeds, all starting with the same words."""
    rows = []
    for i in range(count):
        fields = {"temperature": [0, 0.8, 1.3][i % 3], "max_new_tokens": 2 + (i * 5) % 19, "seed": 50 + i}
        if i % 3 == 1:
            fields["top_p"] = 0.9
        if i % 5 == 4:
            fields["repetition_penalty"] = 1.3
        words = f"word{i} " * (1 + i % 3) * (4 if long and i % 4 == 0 else 1)
        rows.append(prepare_row(tokenizer, i, "the same opening words for every row, then " + words,
                                GenerationSettings().for_row(fields)))
    return rows


def alone(model, tokenizer, row) -> list[int]:
    """The row's new tokens from `model.generate` on it by itself."""
    s = row.settings
    temperature, top_p = (1.0 if s.greedy else s.temperature), (s.top_p if s.top_p != 1.0 else None)
    processors: list | None = None
    if s.repetition_penalty not in (None, 1.0):  # before temperature and top-p, as transformers orders them
        processors = [RepetitionPenalty(s.repetition_penalty)]
        if not s.greedy:
            processors += [Temperature(temperature), *([TopP(top_p)] if top_p is not None else [])]
        temperature, top_p = 1.0, None
    out = model.generate(torch.tensor([row.prompt_ids]), max_new_tokens=s.max_new_tokens, do_sample=not s.greedy,
                         temperature=temperature, top_p=top_p, seed=None if s.greedy else row.seed,
                         eos_token_id=tokenizer.eos_token_ids, logits_processors=processors)
    return out[0, len(row.prompt_ids):].tolist()


def continuously(model, tokenizer, rows, batch_size: int, prefix_cache=None):
    got: dict = {}
    run = ContinuousRun(model, tokenizer, batch_size, on_done=lambda r: got.setdefault(r.row.id, r.tokens),
                        alone=lambda row: pytest.fail(f"row {row.id} ran alone"), prefix_cache=prefix_cache)
    run.run(rows, lambda stranded: pytest.fail(f"rows {[r.id for r in stranded]} failed"))
    assert len(got) == len(rows)
    return got, run.stats


@pytest.mark.parametrize("case", ["llama", "window"])
def test_rows_entering_and_leaving_give_their_single_run_tokens(case, loaded, monkeypatch):
    model, tokenizer = loaded(case)
    assert model.batch_invariant
    # Columns just twice the longest row: they fill up and move left while rows are in flight.
    monkeypatch.setattr(continuous, "MIN_CAPACITY", 0)
    rows = job_rows(tokenizer, 12, long=True)
    got, stats = continuously(model, tokenizer, rows, 4, PrefixCache(block=4))
    for row in rows:
        assert got[row.id] == alone(model, tokenizer, row), (row.id, row.settings.temperature)
    assert stats.steps < sum(r.settings.max_new_tokens for r in rows) / 2  # the rows really shared steps
    assert stats.shifts >= 2 and 0 < stats.prefill_computed < stats.prefill_requested
    assert len({row.settings.max_new_tokens for row in rows}) > 5  # rows left at many different steps


def test_shared_prefix_gives_what_no_prefix_gives(loaded):
    model, tokenizer = loaded("window")
    rows = job_rows(tokenizer, 9)
    without, plain = continuously(model, tokenizer, rows, 3)
    prefix = PrefixCache(block=4)
    got, stats = continuously(model, tokenizer, rows, 3, prefix)
    assert got == without
    assert plain.prefill_computed == plain.prefill_requested
    shared = len(tokenizer.encode("the same opening words for every row, then")) // 4 * 4
    # Every row after the first reuses at least the shared opening's whole blocks.
    assert stats.prefill_computed <= stats.prefill_requested - (len(rows) - 1) * (shared - 4)


def test_prefix_cache_memory_bound_and_eviction(loaded):
    from lmcli.models.cache import KVCache, ModelCache

    model, _ = loaded("llama")
    config = model.config

    def filled(ids):
        cache = ModelCache([KVCache(1, config.num_key_value_heads, len(ids), config.head_dim, model.dtype,
                                    model.device) for _ in config.layer_types])
        x = torch.tensor([ids])
        slots = torch.arange(len(ids))
        with torch.inference_mode():
            model.forward_slots(x, slots[None], slots, torch.ones(1, len(ids), dtype=torch.bool), cache)
        return cache

    element = torch.finfo(model.dtype).bits // 8
    block_bytes = 2 * len(config.layer_types) * config.num_key_value_heads * 4 * config.head_dim * element
    prefix = PrefixCache(max_bytes=3 * block_bytes, block=4)
    a, b = list(range(3, 16)), list(range(40, 53))  # 13 tokens: 3 whole blocks each
    prefix.store(a, filled(a), len(a))
    assert prefix.bytes == 3 * block_bytes and len(prefix) == 3
    fresh = filled(a)
    target = filled(a)
    target.layers[0].keys.zero_()
    assert prefix.restore(a, target) == 12
    assert torch.equal(target.layers[0].keys[:, :, :12], fresh.layers[0].keys[:, :, :12])
    prefix.store(b, filled(b), len(b))  # within the bound only by dropping a's blocks, oldest first
    assert prefix.bytes <= prefix.max_bytes and prefix.stats.evicted == 3
    assert prefix.restore(a, filled(a)) == 0 and prefix.restore(b, filled(b)) == 12
    # Least recently used first: restoring b used its blocks in order; c shares b's first block (storing c
    # uses it again), so c's own second block takes the place of b's second.
    c = [*b[:4], 90, 91, 92, 93, 94]
    prefix.store(c, filled(c), 8)
    assert prefix.restore(b, filled(b)) == 4 and prefix.restore(c, filled(c)) == 8
    small = PrefixCache(max_bytes=block_bytes - 1, block=4)
    small.store(a, filled(a), 13)
    assert small.bytes == 0 and len(small) == 0  # a block bigger than the bound is kept nowhere


# About 11 s on two idle cores (a 100-token prompt prefilled alone for each reference): in the default
# suite, as the one case of rows entering and leaving on the real model.
def test_real_default_model_rows_entering_and_leaving(smollm2_gguf):
    """As loaded by default, with the prefix cache a job gets (prefix_cache_for)."""
    model, tokenizer = lmcli.load(smollm2_gguf)
    assert model.batch_invariant
    prefix = prefix_cache_for(model)
    assert prefix is not None
    settings = GenerationSettings(chat=True, system=SYSTEM)  # about 100 tokens, shared
    rows = [prepare_row(tokenizer, i, question, settings.for_row({"temperature": [0, 0.7][i % 2], "seed": i,
                                                                    "max_new_tokens": 3 + 2 * i}))
            for i, question in enumerate(["Hi.", "Name a colour.", "What is 2+2?", "Say yes."])]
    got, stats = continuously(model, tokenizer, rows, 2, prefix)
    for row in rows:
        assert got[row.id] == alone(model, tokenizer, row), row.id
    assert stats.prefill_computed <= stats.prefill_requested - 3 * 96  # each row after the first reuses 96+


def test_rows_are_taken_as_places_free_up(loaded):
    """The scheduler pulls a row only when a place is free: a job's input is read as it is consumed."""
    model, tokenizer = loaded("llama")
    pool = job_rows(tokenizer, 12)
    pulled = []

    def source():
        for row in pool:
            pulled.append(row.id)
            yield row

    finished: list = []

    def on_done(result):
        finished.append(result.row.id)
        assert len(pulled) <= len(finished) + 3  # the rows in flight, and no more

    run = ContinuousRun(model, tokenizer, 3, on_done=on_done, alone=lambda row: pytest.fail("alone"))
    run.run(source(), lambda stranded: pytest.fail("failed"))
    assert sorted(finished) == list(range(12))
