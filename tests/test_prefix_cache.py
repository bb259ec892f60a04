"""The prefix cache's tails and whole prompts (generation/prefix_cache.py): a prompt that shares part of
a block with one seen before reuses those tokens, a prompt seen before reuses all of it and its logits,
and every row still gives exactly the tokens `model.generate` gives it alone (called directly here);
tails and logits count against the memory bound and are evicted like blocks."""

from __future__ import annotations

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from test_continuous import alone, continuously, loaded, window_checkpoint  # noqa: F401 (fixtures)

from lmcli.generation.prefix_cache import PrefixCache
from lmcli.generation.rows import prepare_row
from lmcli.models.cache import KVCache, ModelCache
from lmcli.settings.generation_settings import GenerationSettings

pytestmark = pytest.mark.usefixtures("one_thread")


def rows_repeating_prompts(tokenizer):
    """Three prompts, each asked three times with other settings (greedy, sampled with its own seed and
    top-p), the second and third leaving the first part-way through a block (of 8)."""
    prompts = ["the same opening words, then a question mark", "the same opening words, then a questionnaire",
               "the same opening words, then a question"]
    rows = []
    for i in range(9):
        fields = {"temperature": [0, 0.9, 1.2][i % 3], "max_new_tokens": 3 + (i * 7) % 11, "seed": 7 + i}
        if i % 3 == 1:
            fields["top_p"] = 0.8
        rows.append(prepare_row(tokenizer, i, prompts[i // 3], GenerationSettings().for_row(fields)))
    return rows


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("case", ["llama", "window"])
def test_repeated_and_overlapping_prompts_give_their_single_run_tokens(case, loaded):
    model, tokenizer = loaded(case)
    rows = rows_repeating_prompts(tokenizer)
    prefix = PrefixCache(block=8)
    got, stats = continuously(model, tokenizer, rows, 2, prefix)  # rows start one after another
    for row in rows:
        assert got[row.id] == alone(model, tokenizer, row), row.id
    ids = [row.prompt_ids for row in rows]
    first, second, third = ids[0], ids[3], ids[6]
    assert second != first and third != first
    # Each prompt is computed once, from where it leaves the prompts before it (to the token, not the
    # block), leaving one token whose logits choose its first; its repeats compute nothing (their
    # logits were kept).
    def computed(prompt, before):
        return len(prompt) - min(len(prompt) - 1, max(common(prompt, other) for other in before))

    assert common(second, first) % 8 and common(third, first) % 8 and len(second) > common(second, first)
    assert stats.prefill_computed == len(first) + computed(second, [first]) + computed(third, [first, second])
    assert stats.prefill_requested == sum(len(i) for i in ids)


def one_row_cache(model, ids):
    config = model.config
    cache = ModelCache([KVCache(1, config.num_key_value_heads, len(ids), config.head_dim, model.dtype,
                                model.device) for _ in config.layer_types])
    x = torch.tensor([ids])
    slots = torch.arange(len(ids))
    with torch.inference_mode():
        logits = model.forward_slots(x, slots[None], slots, torch.ones(1, len(ids), dtype=torch.bool), cache,
                                     last_only=True)[:, -1].float()
    return cache, logits


def test_tails_and_logits_count_against_the_bound_and_are_evicted(loaded):
    model, _ = loaded("llama")
    config = model.config
    element = torch.finfo(model.dtype).bits // 8
    token_bytes = 2 * len(config.layer_types) * config.num_key_value_heads * config.head_dim * element
    logits_bytes = config.vocab_size * 4
    a, b = list(range(3, 13)), list(range(40, 50))  # 10 tokens: 2 blocks of 4 and a tail of 2
    prompt_bytes = 10 * token_bytes + logits_bytes
    prefix = PrefixCache(max_bytes=2 * prompt_bytes - 1, block=4)  # not quite room for a and b
    cache, logits = one_row_cache(model, a)
    prefix.store(a, cache, len(a), logits)
    assert prefix.bytes == prompt_bytes and len(prefix) == 3
    kept = prefix.logits(a)
    assert kept is not None and torch.equal(kept, logits)
    assert prefix.restore(a, one_row_cache(model, a)[0]) == 9  # without its logits, one token to compute
    assert prefix.restore([*a[:9], 99], one_row_cache(model, a)[0]) == 9  # 9 shared tokens: a tail's first one
    assert prefix.restore([*a[:8], 99, 98], one_row_cache(model, a)[0]) == 8
    assert prefix.restore([*a[:6], 99, 98, 97, 96], one_row_cache(model, a)[0]) == 6  # part of a block too
    target, _ = one_row_cache(model, a)
    target.layers[0].keys.zero_()
    assert prefix.restore(a, target, whole=True) == 10  # all of it: the logits come with it
    assert torch.equal(target.layers[0].keys, cache.layers[0].keys)
    # b's tail needs room: a's least recently used entry goes (its first block), and without it nothing
    # of a is reachable, its logits no help.
    cache_b, logits_b = one_row_cache(model, b)
    prefix.store(b, cache_b, len(b), logits_b)
    assert prefix.bytes <= prefix.max_bytes and prefix.stats.evicted == 1
    assert prefix.logits(a) is not None and prefix.restore(a, one_row_cache(model, a)[0], whole=True) == 0
    assert prefix.restore(b, one_row_cache(model, b)[0], whole=True) == 10
    prefix.store(b, cache_b, len(b), logits_b)  # stored again: nothing more is kept
    assert prefix.stats.evicted == 1 and len(prefix) == 5
    for first in (60, 70):  # two more blocks: a's second block goes, then its tail (and the tail's index)
        ids = list(range(first, first + 4))
        prefix.store(ids, one_row_cache(model, ids)[0], 4)
    assert prefix.stats.evicted == 3 and prefix.logits(a) is None and tuple(a[:8]) not in prefix._children
    assert prefix.restore(b, one_row_cache(model, b)[0], whole=True) == 10
    small = PrefixCache(max_bytes=4 * token_bytes + logits_bytes - 1, block=8)
    cache_4, logits_4 = one_row_cache(model, a[:4])
    small.store(a[:4], cache_4, 4, logits_4)  # a tail alone, bigger than the bound: kept nowhere
    assert small.bytes == 0 and len(small) == 0 and small.logits(a[:4]) is None


def fresh_reply(model, tokenizer, messages: list[dict], max_new_tokens: int) -> list[int]:
    """`model.generate` over the whole rendered conversation, greedy: what a chat turn must give."""
    ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_ids)
    return out[0, len(ids):].tolist()


def test_chat_reuses_kept_blocks_after_a_system_switch_and_in_a_new_session(loaded):
    from lmcli.chat.session import ChatSession

    model, tokenizer = loaded("llama")
    settings = GenerationSettings.from_flags(greedy=True, max_new_tokens=5, chat=True)
    shared = PrefixCache(block=4)
    system_a = "the first system message, long enough to fill a few blocks"
    session = ChatSession(model, tokenizer, settings, context=256, system=system_a, prefix_cache=shared)

    def turn(text):
        before = [*session.messages, {"role": "user", "content": text}]
        done = session.reply(text)
        assert done.result.tokens == fresh_reply(model, tokenizer, before, 5), text
        return done, tokenizer.encode_chat(before, add_generation_prompt=True), list(session._cached_ids)

    first, ids1, kept1 = turn("hello there")
    assert first.prefill_tokens == len(ids1)
    session.set_system("another system message")
    turn("and now?")
    # Back to the first system message: its conversation is gone from the session's one cache (the
    # second system message overwrote it) but its blocks are kept, to the token.
    session.set_system(system_a)
    third, ids3, _ = turn("back again")
    assert common(ids3, kept1) > len(ids1) // 2
    assert third.prefill_tokens == len(ids3) - common(ids3, kept1)
    # A new session sharing the cache, with the same system message and first question: all but the
    # last token of its prompt comes from the blocks kept.
    other = ChatSession(model, tokenizer, settings, context=256, system=system_a, prefix_cache=shared)
    again = other.reply("hello there")
    assert again.result.tokens == first.result.tokens and again.prefill_tokens == 1


def test_a_ring_cache_is_never_stored(loaded):
    """A rolling layer keeps slot s at s % capacity: its keys are not a prefix's, so nothing is kept (and
    the cache says why, for --stats). A chat with a prefix cache keeps every slot instead (chat/session.py)."""
    model, _ = loaded("window")
    prefix = PrefixCache(block=4)
    ring = model.init_cache(1, 128)  # the sliding layers' rings of their window
    assert not all(isinstance(layer, KVCache) for layer in ring.layers)
    ids = list(range(3, 40))
    prefix.store(ids, ring, len(ids))
    assert len(prefix) == 0 and prefix.bytes == 0 and prefix.unusable


@pytest.mark.full  # about 20 s on two idle cores (each row's reference prefilled alone)
def test_real_default_model_repeated_and_overlapping_prompts(smollm2_gguf):
    """The default model as a job loads it: one question asked greedy and with two seeds (the repeats
    compute nothing), and questions that leave it after the shared system message."""
    import lmcli
    from lmcli.bench.job import SYSTEM
    from lmcli.generation.prefix_cache import prefix_cache_for

    model, tokenizer = lmcli.load(smollm2_gguf)
    prefix = prefix_cache_for(model)
    assert prefix is not None
    settings = GenerationSettings(chat=True, system=SYSTEM)
    questions = ["Name a colour.", "Name a colour.", "Name a color, please.", "Name a colour.", "Name two."]
    rows = [prepare_row(tokenizer, i, question, settings.for_row({"temperature": [0, 0.8][i % 2], "seed": 9 + i,
                                                                    "max_new_tokens": 4 + i}))
            for i, question in enumerate(questions)]
    got, stats = continuously(model, tokenizer, rows, 2, prefix)
    for row in rows:
        assert got[row.id] == alone(model, tokenizer, row), row.id
    ids = [row.prompt_ids for row in rows]
    expected = len(ids[0]) + sum(len(ids[i]) - min(len(ids[i]) - 1, max(common(ids[i], other) for other in ids[:i]))
                                 for i in (2, 4))  # rows 1 and 3 repeat row 0: nothing computed
    assert stats.prefill_computed == expected
