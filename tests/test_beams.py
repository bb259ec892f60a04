"""Beam search (lmcli/generation/beams.py) against transformers' generate(num_beams=..., do_sample=False)
on tiny float32 models: the same sequences token for token, and the same sequences_scores (1e-4).

Decoder-only (llama, gpt2, mistral with its rolling cache) and encoder-decoder (t5, bart) models;
length_penalty != 1, each early_stopping value, num_return_sequences > 1, several EOS ids, and a
padded batch, whose rows must each give what transformers gives for that row alone.
"""

from __future__ import annotations

import pytest
import torch
from tiny import left_pad, prompts, save_reference

import lmcli
from lmcli.generation import beams
from lmcli.generation.sampling import NoRepeatNGram

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 3  # a pad id that is not 0: transformers fills finished beams with `pad or eos`, 0 being falsy


def hf_beams(reference, ids, mask, n, **options):
    config = reference.generation_config
    for key in ("forced_bos_token_id", "forced_eos_token_id", "no_repeat_ngram_size", "bad_words_ids"):
        setattr(config, key, None)
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=0, do_sample=False,
                                 pad_token_id=PAD, return_dict_in_generate=True, output_scores=True,
                                 generation_config=config, **options)
    return out.sequences, out.sequences_scores


def our_beams(model, ids, mask, n, num_beams, eos_token_id=None, **options):
    with torch.inference_mode():
        return beams.generate(model, ids, n, num_beams, attention_mask=mask, eos_token_id=eos_token_id,
                              pad_token_id=PAD, output_scores=True, **options)


def assert_same(ours, theirs):
    (ids, scores), (want_ids, want_scores) = ours, theirs
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(scores, want_scores.float(), atol=1e-4, rtol=0)


@pytest.fixture(scope="module", params=["llama", "gpt2", "mistral"])
def decoder(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_reference(request.param, directory)
    model, _ = lmcli.load(directory)
    return reference, model


def likely_eos(reference, prompt, n=3):
    """EOS ids that beams will meet: tokens greedy decoding chooses early on (random weights rarely end)."""
    with torch.no_grad():
        greedy = reference.generate(prompt[None], max_new_tokens=n, do_sample=False, num_beams=1,
                                    eos_token_id=None, pad_token_id=PAD)
    return greedy[0, prompt.shape[0]:].tolist()


OPTIONS = [
    dict(num_beams=4),
    dict(num_beams=3, length_penalty=2.0, early_stopping=True),
    dict(num_beams=4, length_penalty=0.5, early_stopping="never", num_return_sequences=3),
    dict(num_beams=2, length_penalty=-1.0, early_stopping=False, num_return_sequences=2),
    dict(num_beams=3, length_penalty=1.5, early_stopping="never"),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_decoder_beams_equal_transformers(decoder, options):
    reference, model = decoder
    (prompt,) = prompts([7])
    eos = likely_eos(reference, prompt)[1:3]  # two EOS ids: more continuations kept per step
    ids, mask = prompt[None], torch.ones(1, 7, dtype=torch.long)
    want = hf_beams(reference, ids, mask, 12, eos_token_id=eos, **options)
    options = dict(options)
    assert_same(our_beams(model, ids, mask, 12, options.pop("num_beams"), eos, **options), want)


def test_decoder_beams_without_eos_run_to_max_new_tokens(decoder):
    reference, model = decoder
    (prompt,) = prompts([5])
    ids, mask = prompt[None], torch.ones(1, 5, dtype=torch.long)
    want = hf_beams(reference, ids, mask, 9, num_beams=3, eos_token_id=None, num_return_sequences=3)
    got = our_beams(model, ids, mask, 9, 3, None, num_return_sequences=3)
    assert got[0].shape == (3, 14)
    assert_same(got, want)


def test_padded_batch_rows_equal_each_row_alone_in_transformers(decoder):
    reference, model = decoder
    rows = prompts([4, 9, 6], seed=3)
    eos = likely_eos(reference, rows[0])[1:2]
    ids, mask = left_pad(rows, PAD)
    got_ids, got_scores = our_beams(model, ids, mask, 10, 3, eos, num_return_sequences=2, length_penalty=1.3)
    width = ids.shape[1]
    for i, row in enumerate(rows):
        want_ids, want_scores = hf_beams(reference, row[None], torch.ones(1, len(row), dtype=torch.long), 10,
                                         num_beams=3, eos_token_id=eos, num_return_sequences=2, length_penalty=1.3)
        for j in range(2):
            ours = got_ids[2 * i + j, width - len(row):]
            want = want_ids[j]
            # The batch's output is as long as its longest row: the rest is padding.
            assert ours[:want.shape[0]].tolist() == want.tolist()
            assert (ours[want.shape[0]:] == PAD).all()
        torch.testing.assert_close(got_scores[2 * i:2 * i + 2], want_scores.float(), atol=1e-4, rtol=0)


def test_no_repeat_ngram_inside_beams_equals_transformers(decoder):
    reference, model = decoder
    (prompt,) = prompts([6], seed=4)
    ids, mask = prompt[None], torch.ones(1, 6, dtype=torch.long)
    want = hf_beams(reference, ids, mask, 14, num_beams=4, eos_token_id=None, no_repeat_ngram_size=2)
    got = our_beams(model, ids, mask, 14, 4, None, logits_processors=[NoRepeatNGram(2)])
    assert_same(got, want)


def test_model_generate_takes_num_beams(decoder):
    reference, model = decoder
    (prompt,) = prompts([5], seed=5)
    ids = prompt[None]
    want, _ = hf_beams(reference, ids, torch.ones_like(ids), 8, num_beams=3, eos_token_id=None,
                       length_penalty=0.7, num_return_sequences=2)
    got = model.generate(ids, 8, do_sample=False, num_beams=3, length_penalty=0.7, num_return_sequences=2,
                         pad_token_id=PAD)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("kwargs", [dict(do_sample=True), dict(do_sample=False, prompt_lookup=3),
                                    dict(do_sample=False, top_k=5), dict(do_sample=False, num_return_sequences=5),
                                    dict(do_sample=False, early_stopping="sometimes")])
def test_beam_search_refuses_what_it_does_not_do(decoder, kwargs):
    _, model = decoder
    with pytest.raises(ValueError):
        model.generate(prompts([4])[0][None], 4, num_beams=4, **kwargs)


# --- encoder-decoders ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["t5", "bart", "marian"])
def encdec(request, tmp_path_factory):
    from test_encdec import FAMILIES, _randomise

    reference = FAMILIES[request.param]()
    _randomise(reference)
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    reference = type(reference).from_pretrained(directory).eval()
    model, _ = lmcli.load(directory, device="cpu", dtype="float32")
    return reference, model, directory


@pytest.mark.parametrize("options", OPTIONS[:4], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_encoder_decoder_beams_equal_transformers(encdec, options):
    from test_encdec import inputs

    reference, model, _ = encdec
    ids, mask = inputs([6, 9], seed=2)  # right padding: transformers' BART numbers positions by column
    with torch.no_grad():
        greedy = reference.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=4, num_beams=1,
                                    do_sample=False, eos_token_id=None, forced_eos_token_id=None,
                                    forced_bos_token_id=None)
    eos = greedy[0, 2:4].tolist()
    want = hf_beams(reference, ids, mask, 10, eos_token_id=eos, **options)
    options = dict(options)
    num_beams = options.pop("num_beams")
    with torch.inference_mode():
        got = model.generate(ids, 10, do_sample=False, attention_mask=mask, eos_token_id=eos, pad_token_id=PAD,
                             num_beams=num_beams, output_scores=True, **options)
    assert_same(got, want)


def test_encoder_runs_once_per_input(encdec, monkeypatch):
    _, model, _ = encdec
    seen = []
    encode = model.encode
    def counting(ids, mask):
        seen.append(ids.shape[0])
        return encode(ids, mask)

    monkeypatch.setattr(model, "encode", counting)
    model.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), 5, do_sample=False, num_beams=4)
    assert seen == [2]


def test_config_bad_words_are_banned_in_the_beam_scores_as_transformers_does(encdec, tmp_path):
    """opus-mt's config.json bans its pad token: transformers bans it in the log-softmax scores, so the
    other tokens' scores are not renormalised without it."""
    import json
    import shutil

    from test_encdec import inputs

    reference, model, directory = encdec
    ids, mask = inputs([7, 5], seed=6)
    with torch.inference_mode():
        banned = int(model.generate(ids, 3, do_sample=False, attention_mask=mask, num_beams=3)[0, 1])
    shutil.copytree(directory, tmp_path / "banned")
    config = json.loads((directory / "config.json").read_text())
    config["bad_words_ids"] = [[banned]]
    (tmp_path / "banned" / "config.json").write_text(json.dumps(config))
    banning, _ = lmcli.load(tmp_path / "banned", device="cpu", dtype="float32")
    want = hf_beams(reference, ids, mask, 8, num_beams=3, eos_token_id=None, bad_words_ids=[[banned]])
    with torch.inference_mode():
        got = banning.generate(ids, 8, do_sample=False, attention_mask=mask, pad_token_id=PAD, num_beams=3,
                               output_scores=True)
    assert banned not in got[0][:, 1:].flatten().tolist()
    assert_same(got, want)


def test_renormalize_logits_shares_a_banned_tokens_mass_as_transformers_does(encdec):
    """opus-mt's generation_config.json has renormalize_logits: true (transformers' LogitNormalization,
    its last processor): the scores are log-softmaxed again after a ban, which changes the beams' sums."""
    from test_encdec import inputs

    from lmcli.generation.sampling import BadWords

    reference, model, _ = encdec
    ids, mask = inputs([7, 5], seed=6)
    with torch.inference_mode():
        banned = int(model.generate(ids, 3, do_sample=False, attention_mask=mask, num_beams=3)[0, 1])
    want = hf_beams(reference, ids, mask, 8, num_beams=3, eos_token_id=None, bad_words_ids=[[banned]],
                    renormalize_logits=True)
    ban = [BadWords([[banned]])]
    with torch.inference_mode():
        got = model.generate(ids, 8, do_sample=False, attention_mask=mask, pad_token_id=PAD, num_beams=3,
                             logits_processors=ban, output_scores=True, renormalize_logits=True)
        plain = model.generate(ids, 8, do_sample=False, attention_mask=mask, pad_token_id=PAD, num_beams=3,
                               logits_processors=ban, output_scores=True)
    assert_same(got, want)
    assert not torch.allclose(plain[1], want[1].float(), atol=1e-4, rtol=0)  # the renormalisation matters here
