"""Continuous batching, the prefix cache and the streamed job input at the edges the earlier tests did not
reach (found by the planted-bug audit, docs/testing.md): a prompt of whole blocks that begins a longer
one seen before, rows done at their first token, the batch occupancy --stats reports, a data-parallel
share of a resumed job's rows, and a row or a batched step that fails.

References: `model.generate` on each row alone (called directly), the counts of steps and rows in
flight written out from the rows' lengths, and the row ids the test wrote (which rows fail, where).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)

import lmcli
from lmcli.errors import UsageError
from lmcli.generation.continuous import ContinuousRun
from lmcli.generation.prefix_cache import PrefixCache
from lmcli.generation.rows import prepare_row
from lmcli.jobs.input import JobRows, id_key
from lmcli.settings.generation_settings import GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_checkpoint):
    """int4, so that rows are batch-invariant (the path jobs take by default)."""
    model, tokenizer = lmcli.load(tiny_checkpoint, quantize="int4")
    assert model.batch_invariant
    return model, tokenizer


def alone(model, tokenizer, row) -> list[int]:
    """The row's new tokens from `model.generate` on it by itself (greedy, or sampled at its temperature)."""
    s = row.settings
    out = model.generate(torch.tensor([row.prompt_ids]), max_new_tokens=s.max_new_tokens, do_sample=not s.greedy,
                         temperature=1.0 if s.greedy else s.temperature, seed=None if s.greedy else row.seed,
                         eos_token_id=None if s.ignore_eos else tokenizer.eos_token_ids)
    return out[0, len(row.prompt_ids):].tolist()


def run_continuously(model, tokenizer, rows, batch_size: int, prefix_cache=None):
    """Each row's tokens, and how many times each row was reported done (once, always)."""
    done: list = []
    run = ContinuousRun(model, tokenizer, batch_size, on_done=lambda r: done.append((r.row.id, list(r.tokens))),
                        alone=lambda row: pytest.fail(f"row {row.id} ran alone"), prefix_cache=prefix_cache)
    run.run(rows, lambda stranded: pytest.fail(f"rows {[r.id for r in stranded]} failed"))
    assert Counter(row_id for row_id, _ in done) == Counter(row.id for row in rows)  # each row once
    return dict(done), run.stats


def test_a_prompt_of_whole_blocks_after_a_longer_one_and_then_again(model_and_tokenizer):
    """A prompt of whole blocks that begins a longer prompt seen before finds all its tokens cached but
    no logits for its last one: it must compute that token. Met again (n samples of one question), it
    reuses the whole prompt and its kept logits."""
    model, tokenizer = model_and_tokenizer
    block = 4
    ids = tokenizer.encode("the same question, asked again and again")
    ids = ids[: len(ids) // block * block]  # whole blocks only
    longer = ids + tokenizer.encode(" and then some more")
    assert len(ids) >= 3 * block
    settings = GenerationSettings()
    rows = [prepare_row(tokenizer, i, "", settings.for_row({"temperature": t, "seed": 7 + i, "max_new_tokens": 4}),
                        prompt_ids=prompt) for i, (t, prompt) in enumerate([(0, longer), (0, ids), (0.9, ids), (0.9, ids)])]
    got, stats = run_continuously(model, tokenizer, rows, 2, PrefixCache(block=block))
    for row in rows:
        assert got[row.id] == alone(model, tokenizer, row), row.id
    # The longer prompt computes all of it, the first of the others its last token, the rest nothing.
    assert stats.prefill_computed == len(longer) + 1


def test_rows_done_at_their_first_token_are_reported_once(model_and_tokenizer):
    """-n 1 rows (a classification job) finish at the token their prefill chooses: written once, as alone."""
    model, tokenizer = model_and_tokenizer
    settings = GenerationSettings(ignore_eos=True)
    rows = [prepare_row(tokenizer, i, f"label this: item {i} " * (1 + i % 3),
                        settings.for_row({"max_new_tokens": 1 if i % 2 else 5, "temperature": [0, 0.8, 0.8][i % 3],
                                          "seed": 30 + i}))
            for i in range(6)]
    got, _ = run_continuously(model, tokenizer, rows, 3)
    for row in rows:
        assert got[row.id] == alone(model, tokenizer, row), row.id
        assert len(got[row.id]) == row.settings.max_new_tokens


def test_occupancy_counts_the_rows_in_flight(model_and_tokenizer):
    """--stats' "batch N% full": rows in flight over places, summed over the batched steps. Eight places
    and eight rows without EOS, one of 2 new tokens and seven of 4: the prefill chooses each row's first
    token and a batched step each of the others, so 3 steps carry 1 + 7 * 3 = 22 row-steps of 24."""
    model, tokenizer = model_and_tokenizer
    settings = GenerationSettings(ignore_eos=True)
    lengths = [2, 4, 4, 4, 4, 4, 4, 4]
    rows = [prepare_row(tokenizer, i, f"prompt {i}", settings.for_row({"max_new_tokens": m, "temperature": 0}))
            for i, m in enumerate(lengths)]
    _, stats = run_continuously(model, tokenizer, rows, 8)
    assert stats.steps == 3 and stats.busy == sum(m - 1 for m in lengths) == 22
    assert stats.to_json()["occupancy"] == round(22 / 24, 4)


def test_a_ranks_share_of_the_rows_still_to_do(tmp_path):
    """A data-parallel rank of a resumed job takes rows[rank::world] of the rows not yet finished."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(10)), encoding="utf-8")
    finished = {id_key(i) for i in (0, 1, 4, 7)}
    todo = JobRows(path, GenerationSettings()).where(lambda row: id_key(row.id) not in finished)
    assert [row.id for row in todo[0::2]] == [2, 5, 8]
    assert [row.id for row in todo[1::2]] == [3, 6, 9]
    assert len(todo[1::2]) == 3


class FailingModel:
    """The model, but its forward pass raises for the prompts of some lengths (their prefill) and at one
    batched step, as a row's engine or the batch's memory can fail."""

    def __init__(self, model, prompt_lengths=(), step: int | None = None):
        self._model, self.prompt_lengths, self.step, self.steps = model, set(prompt_lengths), step, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward_slots(self, x, *args, **kwargs):
        if x.shape[1] == 1 and x.shape[0] > 1:  # (B, 1): a batched step
            self.steps += 1
            if self.steps == self.step:
                raise RuntimeError("this step fails")
        elif x.shape[1] in self.prompt_lengths:  # (1, n): a prompt's prefill
            raise ValueError("this row fails")
        return self._model.forward_slots(x, *args, **kwargs)


def run_failing(model, tokenizer, rows, batch_size: int):
    """(tokens by row done in the batch, rows handed to isolate), wired as jobs/runner.py wires them (a row that
    runs alone is isolated too)."""
    done: list = []
    isolated: list = []

    def isolate(stranded):
        isolated.extend(row.id for row in stranded)

    run = ContinuousRun(model, tokenizer, batch_size, on_done=lambda r: done.append((r.row.id, list(r.tokens))),
                        alone=lambda row: isolate([row]))
    run.run(rows, isolate)
    assert Counter(row_id for row_id, _ in done) + Counter(isolated) == Counter(row.id for row in rows)  # once each
    return dict(done), isolated


def test_a_failed_step_hands_its_rows_to_isolate_once(model_and_tokenizer):
    """The rows in flight when a batched step fails are run one by one (isolate) and nowhere else; the
    rows after them start a new batch and give their single run's tokens."""
    model, tokenizer = model_and_tokenizer
    settings = GenerationSettings(ignore_eos=True)
    rows = [prepare_row(tokenizer, i, f"row {i} " * (1 + i % 3), settings.for_row({"max_new_tokens": 3 + i % 4,
                                                                                   "temperature": 0}))
            for i in range(7)]
    got, isolated = run_failing(FailingModel(model, step=2), tokenizer, rows, 3)
    assert sorted(isolated) == [0, 1, 2]  # the first three rows are in flight at the second step
    for row in rows[3:]:
        assert got[row.id] == alone(model, tokenizer, row), row.id


def test_a_row_that_fails_to_start_is_isolated_and_the_others_go_on(model_and_tokenizer):
    """A row whose prefill fails is handed over once (jobs/runner.py writes its error row); the others are unchanged."""
    model, tokenizer = model_and_tokenizer
    settings = GenerationSettings(ignore_eos=True)
    rows = [prepare_row(tokenizer, i, f"row {i} " * (1 + i), settings.for_row({"max_new_tokens": 4, "temperature": 0}))
            for i in range(4)]
    failing = len(rows[2].prompt_ids)
    assert [len(row.prompt_ids) for row in rows].count(failing) == 1
    got, isolated = run_failing(FailingModel(model, prompt_lengths=[failing]), tokenizer, rows, 2)
    assert isolated == [2]
    for row in (rows[0], rows[1], rows[3]):
        assert got[row.id] == alone(model, tokenizer, row), row.id


def test_a_repeated_id_far_from_its_first_line_is_refused(tmp_path):
    """Between the two lines of one id lie 2,999 others (some of them in any bucket of the digests)."""
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"r{i}", "prompt": f"p{i}"}) for i in range(3000)] + [json.dumps({"id": "r5", "prompt": "x"})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(UsageError, match='input lines 6 and 3001 have the same id "r5"'):
        JobRows(path, GenerationSettings())
