"""generate(): one or more tests for every sentence of its contract.

    generate(x, max_new_tokens, do_sample, temperature=1.0, top_k=None, top_p=None, use_cache=True,
             attention_mask=None, eos_token_id=None, pad_token_id=None,
             *, seed=None, logits_processors=None, on_token=None, ignore_output=False)

Per architecture (every case of tests/tiny.py): greedy output equals transformers' generate, cached
and not; a left-padded batch equals each row alone; EOS handling equals transformers'; past
max_position_embeddings the output equals a reference loop over the last max_position_embeddings
tokens. The rest of the contract is pinned on one model with sliding-window layers (mistral).
"""

from __future__ import annotations

import pytest
import torch
from tiny import CASES, PAD, VOCAB, left_pad, prompts, save_reference

import lmcli
from lmcli.generation.loop import TokenEvent
from lmcli.generation.sampling import RepetitionPenalty, sample, sampling_transforms

MAX_POSITIONS = 64  # max_position_embeddings of every tiny model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(case, transformers model, lmcli model) loaded from the same saved HF directory."""
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_reference(request.param, directory)
    # Our generate() has no EOS unless one is passed; make the reference's default the same.
    reference.generation_config.eos_token_id = None
    model, _ = lmcli.load(directory)
    return request.param, reference, model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(transformers model, lmcli model) for the contract tests: GQA and sliding-window (5) layers, so
    the rolling cache is in play."""
    directory = tmp_path_factory.mktemp("mistral")
    reference = save_reference("mistral", directory)
    reference.generation_config.eos_token_id = None
    return reference, lmcli.load(directory)[0]


@pytest.fixture(scope="module")
def model(mistral):
    return mistral[1]


def hf_greedy(reference, ids, max_new_tokens, eos_token_id=None):
    kwargs = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    with torch.no_grad():
        return reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=PAD, **kwargs)


@torch.inference_mode()
def overflow_logits(model, text, prompt_len):
    """The logits the overflow rule predicts each token of `text` [L] after the prompt from: the text
    before it, or past max_position_embeddings its last max_position_embeddings tokens, fed without a
    cache at positions 0... Computed teacher-forced on the generated text in two batched forwards: if
    every generated token is what these logits pick, the text equals a step-by-step reference loop
    (by induction over the steps). Returns [L - prompt_len, V]."""
    length = len(text)
    parts = []
    if prompt_len <= MAX_POSITIONS:
        head = min(length - 1, MAX_POSITIONS)  # tokens prompt_len..head see their whole prefix
        parts.append(model(text[None, :head])[0, prompt_len - 1:])
    first = max(prompt_len, MAX_POSITIONS + 1)
    if first < length:
        windows = torch.stack([text[t - MAX_POSITIONS:t] for t in range(first, length)])  # (n, 64)
        parts.append(model(windows)[:, -1])
    return torch.cat(parts).float()


def choose(logits, seed=None, temperature=1.0, top_k=None, top_p=None):
    """Replay token choice over a row's per-step logits [n, V]: argmax, or sampling with the row's own
    stream (a generator seeded with `seed`, one draw per step)."""
    if seed is None:
        return logits.argmax(-1).tolist()
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for row in logits:
        scores = row[None]
        for transform in sampling_transforms(temperature, top_k, top_p):
            scores = transform(torch.empty(1, 0, dtype=torch.long), scores)  # they do not read the text
        tokens.append(int(sample(scores, [generator])))
    return tokens


def assert_follows_overflow_rule(model, text, prompt_len, **choice):
    assert text[prompt_len:].tolist() == choose(overflow_logits(model, text, prompt_len), **choice)


def expected_with_eos(tokens, prompt_len, eos_ids, pad):
    """What EOS handling must make of trajectories generated without EOS: each row keeps its tokens up
    to and including its first EOS, then pads; the output ends when every row has finished."""
    rows, ends = [], []
    for row in tokens:
        new = row[prompt_len:].tolist()
        hits = [i for i, t in enumerate(new) if t in eos_ids]
        end = hits[0] + 1 if hits else len(new)
        rows.append(row[:prompt_len].tolist() + new[:end] + [pad] * (len(new) - end))
        ends.append(end)
    return torch.tensor(rows)[:, :prompt_len + max(ends)]


class Recorder:
    """An on_token hook that keeps copies of every event."""

    def __init__(self, result=None):
        self.events = []
        self.result = result

    def __call__(self, event):
        self.events.append(event.__class__(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                              for k, v in vars(event).items()}))
        return self.result(event) if callable(self.result) else self.result


# --- every architecture: parity with transformers ------------------------------------------------


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_greedy_equals_transformers(pair, use_cache):
    """A prompt of 12 is longer than every sliding window in tests/tiny.py (4, 5, 6); 20 more tokens."""
    _, reference, model = pair
    (prompt,) = prompts([12])
    want = hf_greedy(reference, prompt[None], 20)
    got = model.generate(prompt[None], 20, do_sample=False, use_cache=use_cache)
    assert got.dtype == torch.long and got.shape == (1, 32)
    assert got.tolist() == want.tolist()


def test_left_padded_batch_equals_each_row_alone(pair):
    _, reference, model = pair
    rows = prompts([3, 12, 7], seed=2)
    ids, mask = left_pad(rows)
    n = 16
    alone = [model.generate(row[None], n, do_sample=False)[0] for row in rows]
    for row, mine in zip(rows, alone):
        assert mine.tolist() == hf_greedy(reference, row[None], n)[0].tolist()
    for use_cache in (True, False):
        batch = model.generate(ids, n, do_sample=False, attention_mask=mask, use_cache=use_cache)
        assert batch.shape == (3, ids.shape[1] + n)
        for i, (row, mine) in enumerate(zip(rows, alone)):
            pads = ids.shape[1] - len(row)
            assert batch[i, :pads].tolist() == [PAD] * pads  # the prompt's own padding, kept
            assert batch[i, pads:].tolist() == mine.tolist(), f"row {i}, use_cache={use_cache}"


def test_eos_equals_transformers(pair):
    """Pick as EOS a token the first row really produces; rows that finish get the pad id."""
    _, reference, model = pair
    rows = prompts([3, 12, 7], seed=2)
    ids, mask = left_pad(rows)
    n = 16
    free = model.generate(ids, n, do_sample=False, attention_mask=mask)
    eos = int(free[0, ids.shape[1] + 3])
    want = expected_with_eos(free, ids.shape[1], {eos}, PAD)
    got = model.generate(ids, n, do_sample=False, attention_mask=mask, eos_token_id=eos, pad_token_id=PAD)
    assert got.tolist() == want.tolist()
    # Alone, the first row stops at its EOS, as transformers' generate does.
    alone = model.generate(rows[0][None], n, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    assert alone.tolist() == hf_greedy(reference, rows[0][None], n, eos_token_id=eos).tolist()
    assert alone.shape[1] <= len(rows[0]) + 4 and alone[0, -1] == eos


# --- every architecture: past max_position_embeddings --------------------------------------------


def test_past_max_position_embeddings_equals_reference_loop(pair):
    """3x max_position_embeddings tokens in all, greedy and sampled (two rows, each with its own seed)."""
    _, _, model = pair
    (prompt,) = prompts([8], seed=3)
    n = 3 * MAX_POSITIONS - len(prompt)
    positions_seen = []
    hook = None
    if hasattr(model.model, "embed_positions"):  # gpt2: learned positions, a table of 64 rows
        hook = model.model.embed_positions.register_forward_hook(
            lambda module, args, out: positions_seen.append(int(args[0].max())))
    try:
        greedy = model.generate(prompt[None], n, do_sample=False)
        sampled = model.generate(prompt[None].expand(2, -1), n, do_sample=True, temperature=0.8, seed=[11, 12])
    finally:
        if hook is not None:
            hook.remove()
    assert greedy.shape == (1, 3 * MAX_POSITIONS) and sampled.shape == (2, 3 * MAX_POSITIONS)
    if hook is not None:
        assert positions_seen and max(positions_seen) == MAX_POSITIONS - 1
    assert_follows_overflow_rule(model, greedy[0], len(prompt))
    for row, seed in zip(sampled, [11, 12]):
        assert_follows_overflow_rule(model, row, len(prompt), seed=seed, temperature=0.8)


def test_prompt_longer_than_max_position_embeddings(pair):
    _, _, model = pair
    (prompt,) = prompts([MAX_POSITIONS + 6], seed=4)
    for use_cache in (True, False):
        got = model.generate(prompt[None], 5, do_sample=False, use_cache=use_cache)
        assert_follows_overflow_rule(model, got[0], len(prompt))


# --- the shape of the call -----------------------------------------------------------------------


def test_returns_prompt_followed_by_new_tokens(model):
    ids = torch.stack(prompts([9, 9]))
    out = model.generate(ids.int(), 7, do_sample=False)
    assert out.dtype == torch.long
    assert out.shape == (2, 16)
    assert torch.equal(out[:, :9], ids)
    assert ((out >= 0) & (out < VOCAB)).all()


def test_zero_new_tokens_returns_the_prompt(model):
    ids = torch.stack(prompts([4]))
    assert model.generate(ids, 0, do_sample=True).tolist() == ids.tolist()


def test_runs_in_inference_mode(model):
    assert any(p.requires_grad for p in model.parameters())  # so "no gradient" is not a given
    modes = []
    out = model.generate(torch.stack(prompts([5])), 3, do_sample=False,
                         on_token=lambda e: modes.append((torch.is_inference_mode_enabled(), e.logits.requires_grad)))
    assert modes == [(True, False)] * 3
    assert out.is_inference() and not out.requires_grad


@pytest.mark.parametrize("kwargs", [{"max_length": 10}, {"num_beam": 2}, {"seeds": 1}, {"on_step": print}])
def test_unknown_keyword_is_type_error(model, kwargs):
    with pytest.raises(TypeError):
        model.generate(torch.stack(prompts([5])), 3, do_sample=False, **kwargs)


def test_keyword_only_arguments_cannot_be_positional(model):
    with pytest.raises(TypeError):  # the 11th positional argument would be seed
        model.generate(torch.stack(prompts([5])), 3, True, 1.0, None, None, True, None, None, None, 7)


def test_ignore_output_returns_none(model):
    steps: list[TokenEvent] = []
    assert model.generate(torch.stack(prompts([5])), 4, do_sample=False, ignore_output=True,
                          on_token=steps.append) is None
    assert len(steps) == 4


@pytest.mark.parametrize("prompt_len", [5, MAX_POSITIONS + 9])
def test_ignore_output_keeps_a_bounded_history_and_streams_the_same_tokens(model, prompt_len):
    """A streaming consumer's run holds at most what the model can still see (plus a window of room),
    however long it goes, and streams exactly the tokens of an ordinary run, sampled ones included."""
    from lmcli.generation.loop import history_capacity

    n = 5 * MAX_POSITIONS
    assert history_capacity(prompt_len, n, MAX_POSITIONS, trim=True) <= max(prompt_len, MAX_POSITIONS) + MAX_POSITIONS
    assert history_capacity(prompt_len, n, MAX_POSITIONS, trim=False) == prompt_len + n
    ids, mask = left_pad(prompts([prompt_len, prompt_len - 3], seed=9))
    streamed = []
    kwargs = dict(do_sample=True, temperature=0.9, attention_mask=mask, seed=[3, 4])
    assert model.generate(ids, n, ignore_output=True, on_token=lambda e: streamed.append(e.token_id.clone()),
                          **kwargs) is None
    full = model.generate(ids, n, **kwargs)
    assert torch.equal(torch.stack(streamed, dim=1), full[:, ids.shape[1]:])


# --- greedy --------------------------------------------------------------------------------------


def test_greedy_takes_the_most_likely_token_every_step(model):
    ids, mask = left_pad(prompts([4, 9]))
    hook = Recorder()
    out = model.generate(ids, 10, do_sample=False, attention_mask=mask, on_token=hook)
    assert len(hook.events) == 10
    for step, event in enumerate(hook.events):
        assert event.token_id.tolist() == event.logits.argmax(-1).tolist()
        assert event.token_id.tolist() == out[:, ids.shape[1] + step].tolist()


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=-2.0), dict(top_k=0), dict(top_p=1.5),
    dict(top_k=3, top_p=0.5), dict(temperature=0.01, top_k=1), dict(top_p=0.3),
])
def test_greedy_ignores_temperature_top_k_and_top_p(model, kwargs):
    """Neither validated nor applied: even invalid values change nothing."""
    ids = torch.stack(prompts([6]))
    plain = model.generate(ids, 8, do_sample=False)
    assert model.generate(ids, 8, False, **kwargs).tolist() == plain.tolist()


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=-1.0), dict(temperature=float("nan")),
    dict(top_k=0), dict(top_k=-2), dict(top_k=2.5), dict(top_k=True),
    dict(top_p=0.0), dict(top_p=-0.1), dict(top_p=1.01), dict(top_p=float("nan")),
    dict(top_k=5, top_p=0.9), dict(top_k=1, top_p=1.0),
    dict(seed=[1, 2, 3]),  # one seed per row: the batch has two
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_invalid_sampling_arguments_are_value_errors(model, kwargs):
    steps: list[TokenEvent] = []
    with pytest.raises(ValueError):
        model.generate(torch.stack(prompts([5, 5])), 3, do_sample=True, on_token=steps.append, **kwargs)
    assert steps == []  # rejected before any work


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_k=10 * VOCAB), dict(top_p=1.0), dict(top_p=1e-9),
                                    dict(temperature=1e-3), dict(temperature=50)])
def test_boundary_sampling_arguments_are_accepted(model, kwargs):
    out = model.generate(torch.stack(prompts([5])), 3, do_sample=True, seed=0, **kwargs)
    assert out.shape == (1, 8)


@pytest.mark.parametrize("mask", [[[1, 1, 0, 1]], [[1, 1, 1, 0]], [[0, 1, 1, 1], [1, 0, 1, 1]]],
                         ids=["gap", "trailing-pad", "one-row-of-two"])
def test_right_padding_is_value_error(model, mask):
    mask = torch.tensor(mask)
    ids = torch.full(mask.shape, 5)
    with pytest.raises(ValueError, match="right padding"):
        model.generate(ids, 3, do_sample=False, attention_mask=mask)


@pytest.mark.parametrize("x,n,mask", [
    (torch.ones(1, 0, dtype=torch.long), 3, None),  # no prompt
    (torch.ones(4, dtype=torch.long), 3, None),  # not [batch, len]
    (torch.ones(1, 4), 3, None),  # float ids
    (torch.ones(1, 4, dtype=torch.long), -1, None),
    (torch.ones(1, 4, dtype=torch.long), 2.0, None),
    (torch.ones(1, 4, dtype=torch.long), 3, torch.ones(1, 5)),  # mask shape
    (torch.ones(2, 4, dtype=torch.long), 3, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])),  # an empty row
], ids=["empty", "1d", "float", "negative-n", "float-n", "mask-shape", "empty-row"])
def test_invalid_inputs_are_value_errors(model, x, n, mask):
    with pytest.raises(ValueError):
        model.generate(x, n, do_sample=False, attention_mask=mask)


# --- sampling ------------------------------------------------------------------------------------


def test_manual_seed_makes_sampling_reproducible(model):
    ids, mask = left_pad(prompts([4, 9, 6]))
    runs = []
    for global_seed in (3, 3, 4):
        torch.manual_seed(global_seed)
        runs.append(model.generate(ids, 20, do_sample=True, temperature=1.5, attention_mask=mask))
    assert runs[0].tolist() == runs[1].tolist()
    assert runs[0].tolist() != runs[2].tolist()  # seed=None draws the row seeds from the global generator


def test_seed_argument_is_independent_of_global_state(model):
    ids = torch.stack(prompts([6, 6]))
    torch.manual_seed(1)
    a = model.generate(ids, 20, do_sample=True, temperature=1.5, seed=[5, 6])
    torch.manual_seed(2)
    torch.rand(10)
    b = model.generate(ids, 20, do_sample=True, temperature=1.5, seed=torch.tensor([5, 6]))
    assert a.tolist() == b.tolist()


def test_each_row_has_its_own_stream(model):
    (prompt,) = prompts([6])
    same = prompt[None].expand(3, -1)
    torch.manual_seed(0)
    drawn = model.generate(same, 20, do_sample=True, temperature=2.0)
    assert len({tuple(r) for r in drawn.tolist()}) == 3  # seed=None: one seed per row
    shared = model.generate(same, 20, do_sample=True, temperature=2.0, seed=9)
    assert len({tuple(r) for r in shared.tolist()}) == 1  # an int seed: every row gets it
    alone = model.generate(prompt[None], 20, do_sample=True, temperature=2.0, seed=9)
    assert shared[0].tolist() == alone[0].tolist()


@pytest.mark.parametrize("settings", [dict(temperature=1.3), dict(temperature=0.9, top_k=7),
                                      dict(temperature=1.1, top_p=0.8)], ids=["temperature", "top-k", "top-p"])
def test_seeded_row_is_the_same_alone_or_in_any_batch(model, settings):
    rows = prompts([4, 11, 7], seed=5)
    seeds = [101, 202, 303]
    alone = [model.generate(row[None], 15, do_sample=True, seed=[s], **settings)[0] for row, s in zip(rows, seeds)]
    for order in ([0, 1, 2], [2, 0, 1]):  # each row at another position, next to other rows
        ids, mask = left_pad([rows[i] for i in order])
        for seed in ([seeds[i] for i in order], torch.tensor([seeds[i] for i in order])):
            batch = model.generate(ids, 15, do_sample=True, attention_mask=mask, seed=seed, **settings)
            for position, i in enumerate(order):
                pads = ids.shape[1] - len(rows[i])
                assert batch[position, pads:].tolist() == alone[i].tolist()
    # and the same row with the same seed alone, but in a batch with a duplicate of itself
    twice = model.generate(rows[0][None].expand(2, -1), 15, do_sample=True, seed=[seeds[0], seeds[0]], **settings)
    assert twice[0].tolist() == twice[1].tolist() == alone[0].tolist()


def test_top_k_one_is_greedy(model):
    ids, mask = left_pad(prompts([4, 9]))
    greedy = model.generate(ids, 12, do_sample=False, attention_mask=mask)
    assert model.generate(ids, 12, do_sample=True, top_k=1, attention_mask=mask, seed=[1, 2]).tolist() == greedy.tolist()


def _nucleus(logits, temperature, p):
    """Indices of the smallest set of most likely tokens whose probability adds up to >= p (float64)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    values, order = probs.sort(descending=True)
    size = int((values.cumsum(-1) < p).sum()) + 1
    return set(order[:size].tolist())


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_emits_a_token_outside_the_k_most_likely(model, k):
    hook = Recorder()
    model.generate(torch.stack(prompts([5, 5, 5, 5], seed=6)), 30, do_sample=True, temperature=3.0, top_k=k,
                   seed=[1, 2, 3, 4], on_token=hook)
    distinct = set()
    for event in hook.events:
        allowed = event.logits.topk(k, dim=-1).indices
        assert (allowed == event.token_id[:, None]).any(-1).all()
        distinct.update(event.token_id.tolist())
    if k > 1:
        assert len(distinct) > k  # hot enough that the cut-off is what kept the samples in


@pytest.mark.parametrize("temperature,p", [(0.7, 0.6), (1.0, 0.9), (2.0, 0.5)])
def test_top_p_never_emits_a_token_outside_the_nucleus(model, temperature, p):
    """The nucleus is computed after temperature: at T=0.7 it is smaller than on the raw logits, and
    samples from the raw-logit nucleus would land outside it."""
    hook = Recorder()
    model.generate(torch.stack(prompts([5, 5, 5, 5], seed=7)), 30, do_sample=True, temperature=temperature, top_p=p,
                   seed=[1, 2, 3, 4], on_token=hook)
    sizes = []
    for event in hook.events:
        for row in range(4):
            allowed = _nucleus(event.logits[row], temperature, p)
            sizes.append(len(allowed))
            assert int(event.token_id[row]) in allowed
    assert max(sizes) > 1  # not a degenerate (greedy) test


# --- EOS -----------------------------------------------------------------------------------------


def test_exactly_max_new_tokens_without_eos(model):
    ids, mask = left_pad(prompts([3, 8]))
    for do_sample in (False, True):
        out = model.generate(ids, 25, do_sample, attention_mask=mask, seed=[1, 2])
        assert out.shape == (2, ids.shape[1] + 25)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_finished_rows_are_padded_and_generation_stops_when_all_finish(model, do_sample):
    ids, mask = left_pad(prompts([4, 9, 6], seed=8))
    settings = dict(do_sample=do_sample, temperature=1.5, attention_mask=mask, seed=[7, 8, 9])
    n, prompt_len = 30, ids.shape[1]
    free = model.generate(ids, n, **settings)
    new = free[:, prompt_len:]
    # EOS ids: the tokens rows 0 and 1 produce at steps 2 and 5, so rows finish at different steps.
    eos = [int(new[0, 2]), int(new[1, 5])]
    for eos_token_id, pad, pad_token_id in [(eos[0], eos[0], None), (eos, eos[0], None), (eos, 1, 1)]:
        eos_ids = set(eos) if isinstance(eos_token_id, list) else {eos_token_id}
        want = expected_with_eos(free, prompt_len, eos_ids, pad)
        got = model.generate(ids, n, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **settings)
        assert got.tolist() == want.tolist(), (eos_token_id, pad_token_id)
    # Every row stops early (at its first EOS among the three rows' step-2 tokens): the output is shorter.
    all_eos = [int(t) for t in new[:, 2]]
    stopped = model.generate(ids, n, eos_token_id=all_eos, **settings)
    assert stopped.shape[1] <= prompt_len + 3
    assert stopped.tolist() == expected_with_eos(free, prompt_len, set(all_eos), all_eos[0]).tolist()


def test_eos_id_in_the_prompt_does_not_stop_generation(model):
    (prompt,) = prompts([6])
    eos = int(prompt[2])
    out = model.generate(prompt[None], 5, do_sample=False, eos_token_id=eos)
    free = model.generate(prompt[None], 5, do_sample=False)
    assert out.tolist() == expected_with_eos(free, 6, {eos}, eos).tolist()


# --- on_token ------------------------------------------------------------------------------------


def test_on_token_is_called_once_per_step_with_batched_tensors(model):
    ids, mask = left_pad(prompts([4, 9, 6], seed=8))
    free = model.generate(ids, 12, do_sample=False, attention_mask=mask)
    eos = int(free[0, ids.shape[1] + 3])  # row 0 finishes at step 3
    hook = Recorder()
    out = model.generate(ids, 12, do_sample=False, attention_mask=mask, eos_token_id=eos, on_token=hook)
    assert len(hook.events) == out.shape[1] - ids.shape[1]
    for step, event in enumerate(hook.events):
        assert event.step == step
        assert event.token_id.shape == (3,) and event.token_id.dtype == torch.long
        assert event.finished.shape == (3,) and event.finished.dtype == torch.bool
        assert event.length.shape == (3,) and event.length.dtype == torch.long
        assert event.logits.shape == (3, VOCAB) and event.logits.dtype == torch.float32
        assert event.token_id.tolist() == out[:, ids.shape[1] + step].tolist()
        assert event.finished.tolist() == [bool((out[i, ids.shape[1]:ids.shape[1] + step + 1] == eos).any())
                                           for i in range(3)]
    lengths = torch.stack([e.length for e in hook.events])  # (steps, B)
    finished_at = [next((s for s, e in enumerate(hook.events) if e.finished[i]), None) for i in range(3)]
    assert finished_at[0] is not None and finished_at[0] <= 3 and len(hook.events) > finished_at[0] + 1
    for i in range(3):
        at = finished_at[i]
        last = len(hook.events) - 1 if at is None else at
        # counts the EOS itself, then stops growing
        assert lengths[:, i].tolist() == [min(s, last) + 1 for s in range(len(hook.events))]


def test_on_token_can_finish_rows(model):
    ids, mask = left_pad(prompts([4, 9, 6], seed=8))
    free = model.generate(ids, 10, do_sample=False, attention_mask=mask)
    prompt_len = ids.shape[1]

    def stop_row_1_at_step_3(event):
        return torch.tensor([False, event.step == 3, False])

    hook = Recorder(stop_row_1_at_step_3)
    out = model.generate(ids, 10, do_sample=False, attention_mask=mask, pad_token_id=PAD, on_token=hook)
    want = free.clone()
    want[1, prompt_len + 4:] = PAD  # the step-3 token is kept; pads after it
    assert out.tolist() == want.tolist()
    assert [bool(e.finished[1]) for e in hook.events] == [False] * 4 + [True] * 6
    assert [int(e.length[1]) for e in hook.events] == [1, 2, 3, 4] + [4] * 6

    # A plain bool finishes every row: generation stops after that step.
    stopped = model.generate(ids, 10, do_sample=False, attention_mask=mask, on_token=lambda e: e.step == 2)
    assert stopped.tolist() == free[:, :prompt_len + 3].tolist()
    everything = model.generate(ids, 10, do_sample=False, attention_mask=mask,
                                on_token=lambda e: torch.ones(3, dtype=torch.bool))
    assert everything.tolist() == free[:, :prompt_len + 1].tolist()
    # None or False: nothing changes.
    assert model.generate(ids, 10, False, attention_mask=mask, on_token=lambda e: None).tolist() == free.tolist()
    assert model.generate(ids, 10, False, attention_mask=mask, on_token=lambda e: False).tolist() == free.tolist()


# --- logits processors ---------------------------------------------------------------------------


def test_processors_see_the_text_so_far_and_apply_before_greedy_argmax(model):
    ids = torch.stack(prompts([5, 5], seed=9))
    seen = []

    def ban_the_favourite(input_ids, logits):
        seen.append(input_ids.clone())
        return logits.scatter(1, logits.argmax(-1, keepdim=True), float("-inf"))

    hook = Recorder()
    out = model.generate(ids, 6, do_sample=False, logits_processors=[ban_the_favourite], on_token=hook)
    assert [s.tolist() for s in seen] == [out[:, :5 + step].tolist() for step in range(6)]
    for event in hook.events:  # the second most likely token of the raw logits, every time
        assert event.token_id.tolist() == event.logits.topk(2, dim=-1).indices[:, 1].tolist()


def test_processors_apply_in_order(model):
    ids = torch.stack(prompts([5], seed=9))

    def boost_7(input_ids, logits):
        return logits.index_fill(1, torch.tensor([7]), 1e4)

    def ban_7(input_ids, logits):
        return logits.index_fill(1, torch.tensor([7]), float("-inf"))

    for do_sample in (False, True):
        assert set(model.generate(ids, 6, do_sample, seed=0, logits_processors=[ban_7, boost_7])[0, 5:].tolist()) == {7}
        assert 7 not in model.generate(ids, 6, do_sample, seed=0, logits_processors=[boost_7, ban_7])[0, 5:].tolist()


@pytest.mark.parametrize("settings", [dict(temperature=0.5, top_k=4), dict(temperature=2.0, top_p=0.7)])
def test_processors_apply_after_temperature_and_top_k_top_p(model, settings):
    received = []
    hook = Recorder()

    def record(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        received.append(scores.clone())
        return scores

    model.generate(torch.stack(prompts([5, 5], seed=9)), 5, do_sample=True, seed=[1, 2], on_token=hook,
                   logits_processors=[record], **settings)
    temperature = settings["temperature"]
    for scores, event in zip(received, hook.events, strict=True):
        want = event.logits / temperature
        for row in range(2):
            if "top_k" in settings:
                kept = set(event.logits[row].topk(settings["top_k"]).indices.tolist())
            else:
                kept = _nucleus(event.logits[row], temperature, settings["top_p"])
            finite = set(torch.isfinite(scores[row]).nonzero().flatten().tolist())
            assert finite == kept
            torch.testing.assert_close(scores[row, list(kept)], want[row, list(kept)])


def test_repetition_penalty_greedy_equals_transformers(mistral):
    reference, model = mistral
    (prompt,) = prompts([6], seed=10)
    with torch.no_grad():
        want = reference.generate(prompt[None], attention_mask=torch.ones(1, 6, dtype=torch.long),
                                        max_new_tokens=15, do_sample=False, pad_token_id=PAD, repetition_penalty=1.8)
    got = model.generate(prompt[None], 15, do_sample=False, logits_processors=[RepetitionPenalty(1.8)])
    assert got.tolist() == want.tolist()
    assert got.tolist() != model.generate(prompt[None], 15, do_sample=False).tolist()  # the penalty mattered


def test_processors_in_a_left_padded_batch_see_each_row_as_alone(model):
    rows = prompts([3, 10, 6], seed=11)
    ids, mask = left_pad(rows)
    penalty = [RepetitionPenalty(1.8)]
    for do_sample in (False, True):
        batch = model.generate(ids, 12, do_sample, attention_mask=mask, seed=[1, 2, 3], logits_processors=penalty)
        for i, row in enumerate(rows):
            alone = model.generate(row[None], 12, do_sample, seed=[i + 1], logits_processors=penalty)
            assert batch[i, ids.shape[1] - len(row):].tolist() == alone[0].tolist()


def test_use_cache_does_not_change_sampling(model):
    ids, mask = left_pad(prompts([3, 10], seed=12))
    kwargs = dict(do_sample=True, temperature=1.2, top_p=0.95, attention_mask=mask, seed=[4, 5])
    assert model.generate(ids, 20, use_cache=True, **kwargs).tolist() == model.generate(ids, 20, use_cache=False,
                                                                                         **kwargs).tolist()


def test_sampling_past_max_positions_with_a_left_padded_batch(model):
    """Rows of different lengths cross max_position_embeddings at different steps; each still equals itself alone."""
    rows = prompts([3, 20], seed=13)
    ids, mask = left_pad(rows)
    n = MAX_POSITIONS + 10
    batch = model.generate(ids, n, do_sample=True, temperature=0.9, attention_mask=mask, seed=[21, 22])
    for i, row in enumerate(rows):
        assert_follows_overflow_rule(model, batch[i, ids.shape[1] - len(row):], len(row), seed=21 + i, temperature=0.9)
