"""Prompt lookup over a padded batch in shared passes (generation/speculative_batch.py): on batch-invariant
(quantized) tiny models each row gets its single run's tokens (plain greedy called alone; sampled: the
row-by-row speculative draw with its seed) and its single run's counts, in as many passes as its
longest row needs."""

from __future__ import annotations

import pytest
import torch
from tiny import left_pad, prompts, save_reference

import lmcli
from lmcli.generation.speculative import SpeculationStats
from lmcli.generation.speculative_batch import can_decode_together

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 14


def repeating(lengths: list[int]) -> list[torch.Tensor]:
    """Prompts that repeat their start, so lookup has something to guess (random models sometimes agree)."""
    return [torch.cat([p, p[: max(2, len(p) // 2)]]) for p in prompts(lengths, seed=5)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quantized(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_reference(request.param, directory)
    model, _ = lmcli.load(directory, quantize="int8")
    assert model.batch_invariant and can_decode_together(model, 2, None, None)
    return model


def counted(model, monkeypatch) -> list[int]:
    calls: list[int] = []
    forward = model.forward_slots

    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward_slots", counting)
    return calls


def test_greedy_rows_share_passes_and_get_their_single_runs(quantized, monkeypatch):
    model = quantized
    rows = repeating([3, 7, 5, 9, 4])
    ids, mask = left_pad(rows)
    alone = []
    for row in rows:
        plain = model.generate(row[None], max_new_tokens=NEW, do_sample=False)[0, len(row):].tolist()
        single = SpeculationStats()
        model.generate(row[None], max_new_tokens=NEW, do_sample=False, prompt_lookup=4, stats=single)
        alone.append((plain, single))
    calls = counted(model, monkeypatch)
    stats = SpeculationStats()
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, prompt_lookup=4, stats=stats)
    for i, (plain, single) in enumerate(alone):
        assert got[i, ids.shape[1]:].tolist() == plain, i
        mine = stats.rows[i]
        assert (mine.drafted, mine.accepted, mine.passes) == (single.drafted, single.accepted, single.passes), i
    assert len(calls) == max(r.passes for r in stats.rows)  # one pass serves every row still going
    assert len({r.accepted for r in stats.rows}) > 1 and stats.accepted > 0  # ragged acceptance


def test_sampled_rows_draw_as_their_single_runs(quantized):
    model = quantized
    rows = repeating([4, 8, 6])
    ids, mask = left_pad(rows)
    seeds = [3, 4, 5]
    alone = [model.generate(row[None], max_new_tokens=NEW, do_sample=True, temperature=0.7, top_k=20, seed=[s],
                            prompt_lookup=3)[0, len(row):].tolist() for row, s in zip(rows, seeds)]
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=0.7, top_k=20,
                         seed=seeds, prompt_lookup=3)
    for i, expected in enumerate(alone):
        assert got[i, ids.shape[1]:].tolist() == expected, i


def test_where_columns_would_not_be_exact_rows_go_one_by_one(tmp_path):
    save_reference("gemma3_text", tmp_path / "g")
    windowed, _ = lmcli.load(tmp_path / "g", quantize="int8")
    assert windowed.batch_invariant and not can_decode_together(windowed, 2, None, None)
    save_reference("llama", tmp_path / "l")
    float_model, _ = lmcli.load(tmp_path / "l")
    assert not float_model.batch_invariant and not can_decode_together(float_model, 2, None, None)


def test_a_shared_cache_past_its_bound_sends_the_rows_one_by_one(quantized, monkeypatch):
    from lmcli.generation import speculative_batch

    assert can_decode_together(quantized, 8, None, None, 64, 128, 8)
    monkeypatch.setattr(speculative_batch, "MAX_SHARED_CACHE_BYTES", 1)
    assert not can_decode_together(quantized, 2, None, None, 4, 4, 2)
    rows = repeating([3, 6])
    ids, mask = left_pad(rows)
    got = quantized.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, prompt_lookup=4)
    for i, row in enumerate(rows):
        plain = quantized.generate(row[None], max_new_tokens=NEW, do_sample=False)[0, len(row):].tolist()
        assert got[i, ids.shape[1]:].tolist() == plain
