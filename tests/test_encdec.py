"""Encoder-decoders (T5, Flan-style T5, BART, Marian) against transformers: tiny random models saved
with save_pretrained, loaded by lmcli.load, compared logit for logit and token for token."""

from __future__ import annotations

import pytest
import torch

from lmcli.errors import ConfigError, UsageError
from lmcli.loading import load

transformers = pytest.importorskip("transformers")

VOCAB = 99
SCALE = 0.3  # large enough that rows differ; transformers' own init makes logits nearly flat


def _t5(tied: bool, **sizes):
    config = transformers.T5Config(vocab_size=VOCAB, decoder_start_token_id=0, **sizes)
    model = transformers.T5ForConditionalGeneration(config)
    if not tied:  # as T5 v1.1 and Flan-T5 store it: a head of its own, unscaled outputs
        model.lm_head.weight = torch.nn.Parameter(torch.empty(VOCAB, sizes["d_model"]))
        model.config.tie_word_embeddings = False
    return model


# family -> (builder, right padding only?) ; shapes vary on purpose
FAMILIES = {
    "t5": lambda: _t5(True, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, feed_forward_proj="relu",
                      relative_attention_num_buckets=8, relative_attention_max_distance=12),
    "flan-t5": lambda: _t5(False, d_model=32, d_kv=4, d_ff=64, num_layers=3, num_heads=3,
                           feed_forward_proj="gated-gelu", relative_attention_num_buckets=16),
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=2, encoder_ffn_dim=40, decoder_ffn_dim=56, max_position_embeddings=40,
        scale_embedding=True)),
    "marian": lambda: transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64,
        scale_embedding=True, pad_token_id=98, decoder_start_token_id=98, activation_function="swish")),
}
# transformers numbers BART's and Marian's encoder positions by column, so only right padding is
# padding-free there; T5's relative positions are padding-free on either side.
LEFT_PADDING_IN_REFERENCE = {"t5", "flan-t5"}


def _randomise(model) -> None:
    """Weights large enough that logits are far apart (transformers' init makes them nearly flat)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            is_norm = "norm" in name and parameter.dim() == 1 and "bias" not in name
            parameter.copy_(1 + 0.2 * noise if is_norm else noise * SCALE)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=generator))


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory, one_thread):
    reference = FAMILIES[request.param]()
    _randomise(reference)
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    reference = type(reference).from_pretrained(directory).eval()  # the saved files are the reference
    model, _ = load(directory, device="cpu", dtype="float32")
    return request.param, model, reference, directory


def inputs(lengths, seed, left=False):
    """A padded batch of encoder inputs (pads where the mask is 0)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 5, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        span = slice(width - n, width) if left else slice(0, n)
        ids[row, span] = torch.randint(3, 90, (n,), generator=generator)
        mask[row, span] = 1
    return ids, mask


def hf_generate(reference, ids, mask, n, eos=None, pad=None, bad_words=None):
    # The model's own generation config, changed in place: a separate one would be merged with the
    # model's defaults (forced_eos_token_id, ...) wherever it says None.
    config = reference.generation_config
    for key in ("forced_bos_token_id", "forced_eos_token_id", "no_repeat_ngram_size"):
        setattr(config, key, None)
    config.bad_words_ids = bad_words
    config.eos_token_id, config.pad_token_id = eos, pad if pad is not None else reference.config.pad_token_id
    with torch.no_grad():
        return reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=0,
                                  do_sample=False, num_beams=1, generation_config=config)


def test_logits_equal_transformers(pair):
    name, model, reference, _ = pair
    ids, mask = inputs([9, 4, 6], seed=1, left=name in LEFT_PADDING_IN_REFERENCE)
    decoder_ids = torch.randint(3, 90, (3, 7), generator=torch.Generator().manual_seed(2))
    decoder_ids[:, 0] = reference.config.decoder_start_token_id
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        got = model(ids, mask, decoder_ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_t5_with_more_decoder_layers_equals_transformers(tmp_path, one_thread):
    reference = _t5(True, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=3, num_heads=2)
    _randomise(reference)
    reference.save_pretrained(tmp_path)
    reference = type(reference).from_pretrained(tmp_path).eval()
    model, _ = load(tmp_path, device="cpu", dtype="float32")
    ids, mask = inputs([5, 3], seed=3)
    decoder_ids = torch.tensor([[0, 7, 8, 9], [0, 10, 11, 12]])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(model(ids, mask, decoder_ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_equals_transformers_batched_and_alone(pair, use_cache):
    name, model, reference, _ = pair
    ids, mask = inputs([10, 3, 7], seed=4, left=name in LEFT_PADDING_IN_REFERENCE)
    got = model.generate(ids, 12, False, attention_mask=mask, use_cache=use_cache)
    assert got.shape == (3, 13) and bool((got[:, 0] == reference.config.decoder_start_token_id).all())
    assert got.tolist() == hf_generate(reference, ids, mask, 12).tolist()
    for row in range(3):
        alone = ids[row : row + 1, mask[row].bool()]
        expected = hf_generate(reference, alone, torch.ones_like(alone), 12)
        assert model.generate(alone, 12, False, use_cache=use_cache).tolist() == expected.tolist()


def test_padding_on_either_side_gives_the_same_tokens(pair):
    _, model, _, _ = pair
    right, right_mask = inputs([8, 2, 5], seed=5)
    left, left_mask = inputs([8, 2, 5], seed=5, left=True)
    assert model.generate(left, 9, False, attention_mask=left_mask).tolist() == \
        model.generate(right, 9, False, attention_mask=right_mask).tolist()


def test_eos_and_pad_equal_transformers(pair):
    name, model, reference, _ = pair
    ids, mask = inputs([6, 9, 4], seed=6, left=name in LEFT_PADDING_IN_REFERENCE)
    free = model.generate(ids, 10, False, attention_mask=mask)
    # A token one row produces and another does not: the first stops early, padded, while the other goes on.
    rows = [row[1:].tolist() for row in free]
    stops, eos = next((a, t) for a in range(3) for b in range(3) for t in rows[a] if t not in rows[b])
    got = model.generate(ids, 10, False, attention_mask=mask, eos_token_id=eos, pad_token_id=97)
    assert got.tolist() == hf_generate(reference, ids, mask, 10, eos=eos, pad=97).tolist()
    assert got.shape[1] == 11 and got[stops, -1] == 97


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(pair):
    _, model, _, _ = pair
    ids, mask = inputs([7, 3, 5], seed=7, left=True)
    batch = model.generate(ids, 10, True, temperature=1.3, attention_mask=mask, seed=[11, 12, 13])
    for row, seed in enumerate([11, 12, 13]):
        alone = ids[row : row + 1, mask[row].bool()]
        assert model.generate(alone, 10, True, temperature=1.3, seed=[seed]).tolist() == batch[row : row + 1].tolist()
    other = model.generate(ids, 10, True, temperature=1.3, attention_mask=mask, seed=[21, 22, 23])
    assert other.tolist() != batch.tolist()  # the seeds matter


def test_encoder_and_cross_attention_run_once_per_call(pair, monkeypatch):
    _, model, _, _ = pair
    calls = {"encode": 0, "cross": 0}
    encode, cross = model.encode, model.cross_keys_values

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(model, "encode", counted("encode", encode))
    monkeypatch.setattr(model, "cross_keys_values", counted("cross", cross))
    ids, mask = inputs([5, 3], seed=8)
    events: list = []
    model.generate(ids, 6, False, attention_mask=mask, on_token=events.append)
    assert calls == {"encode": 1, "cross": 1} and len(events) == 6


def test_on_token_and_logits_processors_apply(pair):
    _, model, _, _ = pair
    ids, mask = inputs([5, 3], seed=9)

    def only_token_42(history, logits):
        forced = torch.full_like(logits, float("-inf"))
        forced[:, 42] = 0
        return forced

    got = model.generate(ids, 4, False, attention_mask=mask, logits_processors=[only_token_42])
    assert got[:, 1:].tolist() == [[42] * 4] * 2
    stop_after_two = model.generate(ids, 8, False, attention_mask=mask,
                                    on_token=lambda event: event.length >= 2, pad_token_id=96)
    assert stop_after_two.shape[1] == 3  # start token + 2: every row was finished by on_token
    assert model.generate(ids, 3, False, attention_mask=mask, ignore_output=True) is None


def test_learned_positions_stop_at_max_position_embeddings(pair, capsys):
    name, model, _, _ = pair
    ids, mask = inputs([4], seed=10)
    got = model.generate(ids, 100, False, attention_mask=mask)
    if name == "bart":  # 40 learned positions: the start token and 39 new ones
        assert got.shape == (1, 40)
        assert "max_position_embeddings" in capsys.readouterr().err
    elif name == "marian":
        assert got.shape == (1, 64)
    else:  # T5's relative positions have no limit
        assert got.shape == (1, 101)


def test_bad_encoder_input_is_a_clear_error(pair):
    _, model, _, _ = pair
    ids, mask = inputs([4, 2], seed=11)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model.generate(ids, 2, False, attention_mask=mask[:, :3])
    mask[1] = 0
    with pytest.raises(ValueError, match="no tokens"):
        model.generate(ids, 2, False, attention_mask=mask)


def test_config_errors_name_the_field(pair, tmp_path):
    import json
    import shutil

    _, _, _, directory = pair
    config = json.loads((directory / "config.json").read_text())
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    del config["decoder_start_token_id"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json: missing field 'decoder_start_token_id'"):
        load(broken, device="cpu")
    with pytest.raises(UsageError, match="tensor parallel does not support encoder-decoder"):
        load(directory, device="cpu", tp=2)


def test_mismatched_sizes_are_one_line_errors(pair, tmp_path):
    import json
    import shutil

    name, _, _, directory = pair
    if name not in ("bart", "marian"):
        return
    config = json.loads((directory / "config.json").read_text())
    config["encoder_attention_heads"] = 5  # d_model 16 or 32: not a multiple of 5
    shutil.copytree(directory, tmp_path / "heads")
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"d_model \(\d+\) is not a multiple of encoder_attention_heads \(5\)"):
        load(tmp_path / "heads", device="cpu")
    if name == "marian":
        config = json.loads((directory / "config.json").read_text())
        config["decoder_vocab_size"] = VOCAB + 1
        shutil.copytree(directory, tmp_path / "vocab")
        (tmp_path / "vocab" / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match="decoder_vocab_size"):
            load(tmp_path / "vocab", device="cpu")


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_linear_layers_equal_transformers_on_dequantised_weights(pair, bits):
    """--quantize int4|int8: every linear layer (and the shared embedding) whose rows split into
    groups is stored quantized; the reference is transformers with those weights dequantised."""
    from lmcli.io.group_quantized import GROUP, GroupQuantized

    name, _, _, directory = pair
    model, _ = load(directory, device="cpu", dtype="float32", quantize=f"int{bits}")
    reference = type(pair[2]).from_pretrained(directory).eval()
    with torch.no_grad():
        for module in reference.modules():
            weight = getattr(module, "weight", None)
            # the linear layers and the token embedding (not the position tables or T5's relative biases)
            quantizable = isinstance(module, torch.nn.Linear) or (
                isinstance(module, torch.nn.Embedding) and weight is not None and weight.shape[0] == VOCAB)
            if quantizable and weight is not None and weight.shape[1] % GROUP == 0:
                weight.copy_(GroupQuantized.quantize(weight.detach().clone(), bits).dequantise(torch.float32))
    formats = model.weight_formats()
    quantized = sum(n for kind, n in formats.items() if kind not in ("float32", "bfloat16", "float16"))
    assert quantized > 0 or name == "marian"  # d_model 16: no whole groups of 32
    ids, mask = inputs([6, 3], seed=12)
    decoder_ids = torch.tensor([[reference.config.decoder_start_token_id, 7, 8, 9]] * 2)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(model(ids, mask, decoder_ids), expected, atol=2e-3, rtol=2e-3)
    generated = model.generate(ids, 4, False, attention_mask=mask)
    assert generated is not None and generated.shape == (2, 5)


def test_bad_words_ids_of_one_token_are_never_generated(pair, tmp_path):
    """opus-mt's config.json bans its pad token this way; transformers' generate applies it."""
    import json
    import shutil

    _, model, reference, directory = pair
    ids, mask = inputs([6, 4], seed=13)
    banned = int(model.generate(ids, 6, False, attention_mask=mask)[0, 1])  # a token it would produce
    shutil.copytree(directory, tmp_path / "banned")
    config = json.loads((directory / "config.json").read_text())
    config["bad_words_ids"] = [[banned], [banned, 3]]  # the pair is not applied (nor checked here)
    (tmp_path / "banned" / "config.json").write_text(json.dumps(config))
    banning, _ = load(tmp_path / "banned", device="cpu", dtype="float32")
    got = banning.generate(ids, 6, False, attention_mask=mask)
    assert got is not None and banned not in got[:, 1:].flatten().tolist()
    expected = hf_generate(reference, ids, mask, 6, bad_words=[[banned]])
    assert got.tolist() == expected.tolist()


def test_init_cache_and_traverse_cache_cover_self_and_cross_attention(pair):
    _, model, _, _ = pair
    ids, mask = inputs([5, 3], seed=14)
    states = model.encode(ids, mask.bool())
    cache = model.init_cache(2, 8, states, mask.bool())
    config = model.config
    assert len(cache.layers) == len(cache.cross) == config.num_hidden_layers
    assert cache.cross[0][0].shape == (2, config.num_attention_heads, ids.shape[1], config.head_dim)
    before = cache.nbytes()
    model.traverse_cache(cache, lambda t: t[:1])  # keep the first row, everywhere
    assert cache.layers[0].keys.shape[0] == cache.cross[-1][1].shape[0] == cache.encoder_mask.shape[0] == 1
    assert cache.nbytes() * 2 == before


@pytest.mark.parametrize("preset", ["flan-t5-small", "bart-base", "opus-mt-en-de"])
def test_presets_build_their_configs(preset):
    """`-m t5|bart|marian` (a lone .safetensors file) stands for these published configs."""
    from lmcli import registry
    from lmcli.models.encoder_decoder_config import EncoderDecoderConfig

    hf = registry.preset_config(preset)
    assert hf is not None
    config = registry.config_from_hf(hf)
    assert isinstance(config, EncoderDecoderConfig) and config.is_encoder_decoder and config.decoder_start_token_id == hf["decoder_start_token_id"]
    assert config.hidden_size == hf["d_model"] and config.vocab_size == hf["vocab_size"]
    if preset == "opus-mt-en-de":
        assert config.suppressed_token_ids == [58100] and config.embed_scale == 512**0.5
