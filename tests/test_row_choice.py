"""The rows of a continuous batch choose their tokens side by side (generation/row_choice.py): each row
still gets exactly the tokens `model.generate` gives it alone (the reference, called directly here) on
two threads, greedy and sampled rows mixed, rows whose processors must stay on the caller's thread
among them; and the workers run torch on one OpenMP thread each, not a team of their own."""

from __future__ import annotations

import os
import threading
from functools import partial

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)

import lmcli
from lmcli.generation import continuous
from lmcli.generation.continuous import ContinuousRun
from lmcli.generation.row_choice import RowChooser
from lmcli.generation.rows import prepare_row
from lmcli.generation.sampling import SamplingSettings
from lmcli.settings.generation_settings import GenerationSettings


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


ROW_FIELDS: list[dict[str, float]] = [  # greedy and sampled; typical-p's row-wide sum splits by thread count, so it stays on the caller
    {"temperature": 0}, {"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.2, "top_p": 0.8},
    {"temperature": 0.7, "min_p": 0.05}, {"temperature": 0.9, "typical_p": 0.9}, {"temperature": 0},
    {"temperature": 1.0, "top_k": 20}, {"temperature": 0.6, "repetition_penalty": 1.3},
    {"temperature": 1.1}, {"temperature": 0, "repetition_penalty": 1.2},
]


def alone(model, tokenizer, row) -> list[int]:
    """The row's new tokens from `model.generate` on it by itself, its settings' chain given whole."""
    do_sample, processors = SamplingSettings.of(row.settings, logit_bias={}).policy(
        prompt_length=len(row.prompt_ids), eos_token_ids=tokenizer.eos_token_ids)
    out = model.generate(torch.tensor([row.prompt_ids]), max_new_tokens=row.settings.max_new_tokens,
                         do_sample=do_sample, seed=row.seed if do_sample else None,
                         eos_token_id=tokenizer.eos_token_ids, logits_processors=processors)
    return out[0, len(row.prompt_ids):].tolist()


def test_rows_choosing_side_by_side_give_their_single_run_tokens(tiny_checkpoint, two_threads, monkeypatch):
    model, tokenizer = lmcli.load(tiny_checkpoint, quantize="int4")
    assert model.batch_invariant
    rows = [prepare_row(tokenizer, i, f"the same opening words, then row {i} " * (1 + i % 3),
                        GenerationSettings().for_row({**fields, "seed": 70 + i, "max_new_tokens": 3 + (i * 5) % 11}))
            for i, fields in enumerate(ROW_FIELDS)]
    where: dict[int, set[str]] = {}
    token = continuous._token

    def spy(live, logits):
        where.setdefault(live.result.row.id, set()).add(threading.current_thread().name)
        return token(live, logits)

    monkeypatch.setattr(continuous, "_token", spy)
    got: dict = {}
    run = ContinuousRun(model, tokenizer, 4, on_done=lambda r: got.setdefault(r.row.id, r.tokens),
                        alone=lambda row: pytest.fail(f"row {row.id} ran alone"))
    run.run(rows, lambda stranded: pytest.fail(f"rows {[r.id for r in stranded]} failed"))
    assert torch.get_num_threads() == 2
    for row in rows:
        assert got[row.id] == alone(model, tokenizer, row), (row.id, ROW_FIELDS[int(row.id)])
    on_workers = {i for i, names in where.items() if any(name.startswith("lmcli-choice") for name in names)}
    assert on_workers == set(range(len(rows))) - {4}  # all but the typical-p row chose on workers at times
    assert where[4] == {threading.current_thread().name}
    assert not any(t.name.startswith("lmcli-choice") for t in threading.enumerate())  # closed with the run


def _threads_of_this_process() -> int:
    return len(os.listdir("/proc/self/task"))


def test_workers_run_torch_on_one_thread_each(two_threads):
    chooser = RowChooser()
    big = torch.ones(1 << 20)
    (big + 1).sum()  # the caller's own OpenMP team exists before counting
    before = _threads_of_this_process() if os.path.isdir("/proc/self/task") else None

    def task(n: int):
        return n, threading.current_thread().name, torch.get_num_threads(), float((big * n).sum())

    try:
        results = chooser.run([partial(task, n) for n in range(6)], [n != 2 for n in range(6)])
        if before is not None:
            assert _threads_of_this_process() == before + 2  # the two workers, and no OpenMP team of theirs
    finally:
        chooser.close()
    assert [r[0] for r in results] == list(range(6))  # in the tasks' order
    assert results[2][1] == threading.current_thread().name and results[2][2] == 2  # kept on the caller
    workers = [r for n, r in enumerate(results) if n != 2]
    assert all(r[1].startswith("lmcli-choice") and r[2] == 1 for r in workers)
    assert all(r[3] == n * (1 << 20) for n, r in enumerate(results))
    assert torch.get_num_threads() == 2  # the caller's count is untouched


def test_one_thread_means_no_workers_and_errors_come_back_in_order():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chooser = RowChooser()
        names = chooser.run([lambda: threading.current_thread().name] * 3, [True] * 3)
        assert names == [threading.current_thread().name] * 3 and chooser._workers is None
    finally:
        torch.set_num_threads(previous)
    torch.set_num_threads(2)
    chooser = RowChooser()

    def fail(n: int):
        raise ValueError(f"row {n}")

    try:
        with pytest.raises(ValueError, match="row 1"):
            chooser.run([lambda: 0, lambda: fail(1), lambda: fail(3)], [True] * 3)
        assert chooser.run([lambda: 5, lambda: 6], [True, True]) == [5, 6]  # the workers still serve
    finally:
        chooser.close()
        torch.set_num_threads(previous)


def test_which_chains_may_choose_on_a_worker():
    """Only processors known to give the same numbers on any thread count: not typical-p (a row-wide float
    sum that torch splits by thread), not a constraint's mask (its matcher's state), not a plain callable."""
    from lmcli.generation.constraints import ConstraintMask
    from lmcli.generation.sampling import ProcessorChain, TypicalP

    _, builtin = SamplingSettings(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
                                  presence_penalty=0.3, frequency_penalty=0.2, no_repeat_ngram_size=3,
                                  min_new_tokens=2, logit_bias={3: 1.0}).policy(eos_token_ids=[1])
    assert len(builtin) == 10 and ProcessorChain(builtin).same_on_any_thread
    assert ProcessorChain([]).same_on_any_thread  # greedy: the argmax alone
    assert not ProcessorChain([*builtin, TypicalP(0.9)]).same_on_any_thread
    assert not ProcessorChain([lambda ids, logits: logits]).same_on_any_thread
    assert not hasattr(ConstraintMask, "same_on_any_thread")
