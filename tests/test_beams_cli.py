"""Beam search from the command line and in jobs, on a tiny T5 with a tokenizer.json whose
generation_config.json asks for beams (as opus-mt and BART-CNN do), and on a tiny Marian shaped like
opus-mt-en-de (its tokenizer files and its published generation_config.json, trained for a second on four
sentence pairs: no real opus-mt checkpoint ships on PyPI), against transformers' generate of the same
files with that same generation config."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_fixtures import run_lmcli, tiny_checkpoint  # noqa: F401 (fixture)
from test_encdec_cli import _t5_tokenizer
from typer.testing import CliRunner

from lmcli.cli import app

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["translate English to German: the house is wonderful", "summarize: a cat sat on the mat and slept",
           "the quick brown fox"]
OWN = {"num_beams": 3, "length_penalty": 1.5, "early_stopping": True, "no_repeat_ngram_size": 2}  # its generation_config.json


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("t5-beams")
    vocab = _t5_tokenizer(directory)
    config = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   feed_forward_proj="gated-gelu", decoder_start_token_id=0, eos_token_id=1,
                                   pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, **OWN)
    model.save_pretrained(directory)
    return directory


def reference(directory, prompt: str, n: int, **options) -> str:
    """transformers' text for `prompt` with the saved generation config (and `options` over it)."""
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                                     eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    model = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=n, **options)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def run(*args: str) -> str:
    result = CliRunner().invoke(app, ["generate", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_models_own_beams_give_transformers_text(t5_dir, prompt):
    want = reference(t5_dir, prompt, 12)
    row = json.loads(run("-c", str(t5_dir), "-n", "12", "--format", "jsonl", prompt))
    assert row["completion"] == want and want.strip()


def test_info_shows_the_models_beam_defaults(t5_dir):
    result = CliRunner().invoke(app, ["info", str(t5_dir)])
    assert result.exit_code == 0, result.output
    shown = {line.split(":")[0]: line for line in result.stdout.splitlines()}
    assert shown["default num_beams"].startswith("default num_beams: 3 (") and "generation_config.json" in shown[
        "default num_beams"]
    assert shown["default length_penalty"].startswith("default length_penalty: 1.5 (")
    assert shown["default early_stopping"].startswith("default early_stopping: true (")
    assert shown["default temperature"].startswith("default temperature: 0 (beam search)")


def test_flags_override_the_models_beams(t5_dir):
    prompt = PROMPTS[0]
    want = reference(t5_dir, prompt, 10, num_beams=2, length_penalty=0.5, early_stopping="never")
    got = run("-c", str(t5_dir), "-n", "10", "--num-beams", "2", "--length-penalty", "0.5",
              "--early-stopping", "never", "--format", "jsonl", prompt)
    assert json.loads(got)["completion"] == want
    # --num-beams 1 is greedy decoding, as transformers' num_beams=1
    greedy = reference(t5_dir, prompt, 10, num_beams=1, do_sample=False)
    assert json.loads(run("-c", str(t5_dir), "-n", "10", "--num-beams", "1", "--greedy", "--format", "jsonl",
                          prompt))["completion"] == greedy


def test_a_job_of_beam_and_sampled_rows_equals_each_row_alone(t5_dir, tmp_path):
    rows = [{"id": "a", "prompt": PROMPTS[0]}, {"id": "b", "prompt": PROMPTS[1], "num_beams": 2},
            {"id": "c", "prompt": PROMPTS[2], "temperature": 0.7, "seed": 3, "num_beams": 1},
            {"id": "d", "prompt": PROMPTS[2], "num_beams": 4, "length_penalty": 0.8}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", "-c", str(t5_dir), "-n", "9", "--input", str(source),
                                      "--output", str(output), "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    got = {row["id"]: row["completion"] for row in map(json.loads, output.read_text().splitlines())}
    assert got["a"] == reference(t5_dir, PROMPTS[0], 9)
    assert got["b"] == reference(t5_dir, PROMPTS[1], 9, num_beams=2)
    assert got["d"] == reference(t5_dir, PROMPTS[2], 9, num_beams=4, length_penalty=0.8)
    alone = run("-c", str(t5_dir), "-n", "9", "--temperature", "0.7", "--seed", "3", "--num-beams", "1",
                "--format", "jsonl", PROMPTS[2])
    assert got["c"] == json.loads(alone)["completion"]


@pytest.mark.parametrize("flags", [["--temperature", "0.7"], ["--prompt-lookup"], ["--regex", "[a-z]+"],
                                   ["--json-schema", '{"type": "string"}'], ["--top-k", "5"],
                                   ["--early-stopping", "maybe"]])
def test_beams_with_what_they_do_not_do_is_a_one_line_error(t5_dir, flags):
    result = CliRunner().invoke(app, ["generate", "-c", str(t5_dir), "-n", "3", "--num-beams", "3", *flags, "hi"])
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and ("num-beams" in lines[0] or "early-stopping" in lines[0]), lines


def test_job_rows_asking_for_beams_with_speculation_or_structured_output_are_error_rows(t5_dir, tmp_path):
    rows = [{"id": "lookup", "prompt": PROMPTS[0], "num_beams": 2, "prompt_lookup": True},
            {"id": "schema", "prompt": PROMPTS[0], "num_beams": 2, "json_schema": {"type": "string"}},
            {"id": "regex", "prompt": PROMPTS[0], "num_beams": 3, "regex": "[a-z]+"},
            {"id": "fine", "prompt": PROMPTS[0], "num_beams": 2}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", "-c", str(t5_dir), "-n", "6", "--input", str(source),
                                      "--output", str(output)])
    assert result.exit_code != 0  # some rows failed
    got = {row["id"]: row for row in map(json.loads, output.read_text().splitlines())}
    for name, other in (("lookup", "prompt_lookup"), ("schema", "constraint"), ("regex", "constraint")):
        assert f'"num_beams" and "{other}" cannot be combined' in got[name]["error"], got[name]
    assert got["fine"]["completion"] == reference(t5_dir, PROMPTS[0], 6, num_beams=2)


def test_a_continuous_job_of_beam_and_sampled_rows_equals_each_row_alone(tiny_checkpoint, tmp_path):
    """On a decoder-only model rows run continuously; beam rows run apart, each as it runs alone."""
    rows = [{"id": "s1", "prompt": "hello there", "temperature": 0.9, "seed": 1},
            {"id": "b1", "prompt": "the quick brown", "num_beams": 3, "temperature": 0},
            {"id": "s2", "prompt": "once upon", "seed": 2},
            {"id": "b2", "prompt": "a b c d", "num_beams": 2, "length_penalty": 0.5, "early_stopping": "never"}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["generate", "-c", str(tiny_checkpoint), "-n", "6", "--input", str(source),
                                      "--output", str(output), "--batch-size", "3"])
    assert result.exit_code == 0, result.output
    got = {row["id"]: row for row in map(json.loads, output.read_text().splitlines())}
    assert got["b1"]["settings"]["num_beams"] == 3 and got["b2"]["settings"]["early_stopping"] == "never"
    for row in rows:
        flags = [f"--{key.replace('_', '-')}={value}" for key, value in row.items() if key not in ("id", "prompt")]
        alone = json.loads(run("-c", str(tiny_checkpoint), "-n", "6", "--format", "jsonl", *flags, str(row["prompt"])))
        assert got[row["id"]]["completion"] == alone["completion"], row["id"]


# --- beams in a chat ---------------------------------------------------------------------------------


def transformers_reply(directory: Path, ids: list[int], n: int, **options: Any) -> list[int]:
    """transformers' new tokens for the prompt `ids` (the model's generation_config.json under `options`),
    up to and with the first EOS (id 1), as a chat turn records them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, eos_token_id=1, pad_token_id=2, **options)
    new = out[0, len(ids):].tolist()
    return new[:new.index(1) + 1] if 1 in new else new


def test_a_chat_turn_after_set_num_beams_is_beam_search_and_a_later_greedy_turn_a_fresh_chats(tiny_checkpoint):
    """/set num_beams 4 (with length_penalty, early_stopping and no_repeat_ngram_size): the turn is
    transformers' beam search over the whole rendered conversation, shown when the search ends; the chat's
    cache, left as it was, gives the following greedy turn what a fresh chat with that history gives
    (and transformers' greedy decoding), from the prefix it still holds."""
    from lmcli.chat.session import ChatSession
    from lmcli.loading import load
    from lmcli.settings.generation_settings import GenerationSettings

    model, tokenizer = load(tiny_checkpoint, device="cpu", dtype="float32")
    assert tokenizer is not None
    n = 8
    session = ChatSession(model, tokenizer, GenerationSettings.from_flags(max_new_tokens=n, chat=True), context=128)
    session.set_setting("greedy", "on")
    first = session.reply("hello there")
    for name, value in (("num_beams", "4"), ("length_penalty", "0.5"), ("early_stopping", "never"),
                        ("no_repeat_ngram_size", "2")):
        session.set_setting(name, value)
    pieces: list[str] = []
    second = session.reply("and the cat?", lambda result, piece: pieces.append(piece), logprobs=True)
    ids2 = tokenizer.encode_chat(session.messages[:-1], add_generation_prompt=True)
    assert second.result.tokens == transformers_reply(tiny_checkpoint, ids2, n, num_beams=4, length_penalty=0.5,
                                                      early_stopping="never", no_repeat_ngram_size=2, do_sample=False)
    assert second.result.tokens != transformers_reply(tiny_checkpoint, ids2, n, do_sample=False)  # not greedy's
    assert "".join(pieces) == second.reply and second.prefill_tokens == len(ids2)  # told whole, at the end
    assert second.result.logprobs is None and not second.interrupted  # --color-probs: unshaded

    session.set_setting("num_beams", "1")
    assert session.settings.temperature == 0  # beams set it; it stays greedy
    history = list(session.messages)
    third = session.reply("one more")
    fresh = ChatSession(model, tokenizer, GenerationSettings.from_flags(greedy=True, max_new_tokens=n, chat=True),
                        context=128, messages=history)
    again = fresh.reply("one more")
    ids3 = tokenizer.encode_chat(fresh.messages[:-1], add_generation_prompt=True)
    assert third.result.tokens == again.result.tokens == transformers_reply(tiny_checkpoint, ids3, n, do_sample=False)
    assert third.prefill_tokens < again.prefill_tokens == len(ids3)  # the first turn's keys were reused
    assert first.result.tokens  # (the first turn ran greedily, into the cache the third reused)


def test_the_models_own_beams_apply_in_chat_as_in_generate(tiny_checkpoint, tmp_path):
    """A model whose generation_config.json asks for 4 beams: `lmcli chat` searches with them, as
    `lmcli generate` does and as transformers' generate() with that file does."""
    from lmcli.loading import load

    directory = tmp_path / "own-beams"
    shutil.copytree(tiny_checkpoint, directory)
    path = directory / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "num_beams": 4, "length_penalty": 0.7}))
    _, tokenizer = load(directory, device="cpu", dtype="float32")
    assert tokenizer is not None
    message = "tell me about the house"
    ids = tokenizer.encode_chat([{"role": "user", "content": message}], add_generation_prompt=True)
    want = transformers_reply(directory, ids, 8)  # its own generation_config.json: 4 beams
    assert want != transformers_reply(directory, ids, 8, num_beams=1, do_sample=False)  # the beams matter here
    result = CliRunner().invoke(app, ["chat", "-c", str(directory), "-n", "8"], input=message + "\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == tokenizer.decode([t for t in want if t != 1]) + "\n"


def test_ctrl_c_ends_a_beam_turn_and_the_chat_goes_on(tiny_checkpoint, monkeypatch):
    """A stop asked during the search ends it before its next step: the reply is the best running beam so
    far, marked interrupted, and the next turn is still a fresh chat's."""
    from lmcli.chat.session import ChatSession
    from lmcli.generation import beams
    from lmcli.loading import load
    from lmcli.settings.generation_settings import GenerationSettings

    model, tokenizer = load(tiny_checkpoint, device="cpu", dtype="float32")
    session = ChatSession(model, tokenizer, GenerationSettings.from_flags(max_new_tokens=12, chat=True,
                                                                          num_beams=3, ignore_eos=True), context=128)
    steps = 0
    recheck = beams.threads.recheck

    def step_then_ctrl_c(*args: Any, **kwargs: Any) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:  # Ctrl-C during the third step (the REPL's SIGINT handler calls request_stop)
            session.request_stop()
        recheck(*args, **kwargs)

    monkeypatch.setattr(beams.threads, "recheck", step_then_ctrl_c)
    turn = session.reply("hello there")
    monkeypatch.setattr(beams.threads, "recheck", recheck)
    assert turn.interrupted and turn.result.finish_reason == "interrupted" and len(turn.result.tokens) == 3
    assert session.messages[-1] == {"role": "assistant", "content": turn.reply}
    history = list(session.messages)
    session.set_setting("num_beams", "1")
    later = session.reply("again")
    fresh = ChatSession(model, tokenizer, GenerationSettings.from_flags(greedy=True, max_new_tokens=12, chat=True,
                                                                        ignore_eos=True), context=128, messages=history)
    assert later.result.tokens == fresh.reply("again").result.tokens


@pytest.mark.parametrize(("settings", "name", "value", "message"), [
    ({}, "num_return_sequences", "2", r"^/set num_return_sequences: a chat turn keeps one reply"),
    ({"temperature": 0.7}, "num_beams", "4", r"^num_beams and temperature cannot be combined"),  # the user's own sampling
    ({"num_beams": 2}, "temperature", "0.7", r"^num_beams and temperature cannot be combined"),
    ({}, "early_stopping", "maybe", r"early_stopping"),
])
def test_chat_set_of_beams_with_what_they_do_not_do_is_a_one_line_error(tiny_checkpoint, settings, name, value,
                                                                        message):
    """As in `lmcli generate`: the user's own beams with the user's own sampling is an error (the model's
    beams give way instead), and a chat keeps one reply; the settings stay as they were."""
    from lmcli.chat.session import ChatError, ChatSession
    from lmcli.loading import load
    from lmcli.settings.generation_settings import GenerationSettings

    model, tokenizer = load(tiny_checkpoint, device="cpu", dtype="float32")
    session = ChatSession(model, tokenizer, GenerationSettings.from_flags(chat=True, max_new_tokens=4, **settings),
                          context=64)
    before = session.settings
    with pytest.raises(ChatError, match=message) as refused:
        session.set_setting(name, value)
    assert "\n" not in str(refused.value) and session.settings is before


# --- an opus-mt-shaped Marian -------------------------------------------------------------------------

OPUS_SOURCE = ["the house is wonderful.", "a small house by the lake, above all!", "the cat sleeps on the mat",
               "I like green tea"]
OPUS_TARGET = ["das Haus ist wunderbar.", "ein kleines Haus am See, über alles!", "die Katze schläft auf der Matte",
               "ich mag grünen Tee"]


# Not among the pairs it was trained on: where its beams chose otherwise than greedy decoding when tried
OPUS_UNSEEN = ["the small cat likes the house", "a house by the lake"]


def build_opus_like(directory: Path, steps: int = 150) -> Path:
    """A tiny Marian with opus-mt's files (source.spm, target.spm, vocab.json) and opus-mt-en-de's
    generation_config.json (4 beams, its pad token banned, forced EOS, renormalize_logits), trained for
    `steps` AdamW steps on OPUS_SOURCE -> OPUS_TARGET so that its beams choose among real alternatives."""
    import sentencepiece as spm

    work = directory.parent / f"{directory.name}-spm"
    work.mkdir(parents=True, exist_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    models = []
    for side, lines in (("source", OPUS_SOURCE), ("target", OPUS_TARGET)):
        (work / f"{side}.txt").write_text("\n".join(lines * 40), encoding="utf-8")
        spm.SentencePieceTrainer.train(input=str(work / f"{side}.txt"), model_prefix=str(work / side),
                                       vocab_size=60, hard_vocab_limit=False, model_type="unigram",
                                       character_coverage=1.0, minloglevel=2, unk_id=0, bos_id=-1, eos_id=-1,
                                       pad_id=-1)
        shutil.copy(work / f"{side}.model", directory / f"{side}.spm")
        models.append(spm.SentencePieceProcessor(model_file=str(work / f"{side}.model")))
    pieces = ["</s>", "<unk>", *(m.id_to_piece(i) for m in models for i in range(m.get_piece_size()))]
    pieces = [*dict.fromkeys(pieces), "<pad>"]  # one vocabulary for both sides, </s> 0 and <pad> last, as opus-mt
    (directory / "vocab.json").write_text(json.dumps({piece: i for i, piece in enumerate(pieces)}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MarianTokenizer: "Recommended: pip install sacremoses"
        tokenizer = transformers.MarianTokenizer(source_spm=str(directory / "source.spm"),
                                                 target_spm=str(directory / "target.spm"),
                                                 vocab=str(directory / "vocab.json"))
    tokenizer.save_pretrained(directory)
    shutil.rmtree(work)
    pad = len(pieces) - 1
    config = transformers.MarianConfig(
        vocab_size=len(pieces), decoder_vocab_size=len(pieces), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=512, pad_token_id=pad, eos_token_id=0, bos_token_id=0, decoder_start_token_id=pad,
        activation_function="swish", scale_embedding=True, share_encoder_decoder_embeddings=True)
    torch.manual_seed(7)
    model = transformers.MarianMTModel(config)
    batch = tokenizer(OPUS_SOURCE, text_target=OPUS_TARGET, padding=True, return_tensors="pt")
    batch["labels"][batch["labels"] == pad] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    # opus-mt-en-de's generation_config.json, with this vocabulary's pad id
    model.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[pad]], bos_token_id=0, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        max_length=512, num_beams=4, pad_token_id=pad, renormalize_logits=True)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def opus_dir(tmp_path_factory):
    return build_opus_like(tmp_path_factory.mktemp("opus") / "tiny-opus-mt-en-de")


def opus_reference(directory: Path, prompt: str) -> tuple[str, int]:
    """transformers' translation with the model's own generation config, and its new tokens (EOS included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MarianTokenizer: "Recommended: pip install sacremoses"
        tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    model = transformers.MarianMTModel.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model.generate(**tokenizer(prompt, return_tensors="pt"))
    return tokenizer.decode(out[0], skip_special_tokens=True), out.shape[1] - 1  # less the decoder's start token


def test_an_opus_mt_shaped_marian_translates_with_its_own_beams_as_transformers(opus_dir):
    """`lmcli generate -c DIR TEXT` with nothing else: the model's own 4 beams and rules, as transformers'
    generate() with the same files and no arguments."""
    from lmcli.settings.model_defaults import read_model_defaults

    own = read_model_defaults(opus_dir)
    assert own.values["num_beams"] == 4 and own.rules["renormalize_logits"] is True
    want, _ = opus_reference(opus_dir, OPUS_UNSEEN[0])
    result = run_lmcli("generate", "-c", str(opus_dir), OPUS_UNSEEN[0])
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode("utf-8") == want + "\n" and want.strip()


@pytest.mark.full
def test_an_opus_mt_shaped_marian_job_gives_transformers_translations(opus_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                              for i, p in enumerate(OPUS_SOURCE + OPUS_UNSEEN)))
    output = tmp_path / "out.jsonl"
    result = run_lmcli("generate", "-c", str(opus_dir), "--input", str(source), "--output", str(output))
    assert result.returncode == 0, result.stderr
    got = {row["id"]: row for row in map(json.loads, output.read_text().splitlines())}
    for i, prompt in enumerate(OPUS_SOURCE + OPUS_UNSEEN):
        want, tokens = opus_reference(opus_dir, prompt)
        assert (got[str(i)]["completion"], got[str(i)]["completion_tokens"]) == (want, tokens), prompt


def test_a_bad_renormalize_logits_is_a_one_line_error(t5_dir, tmp_path):
    shutil.copytree(t5_dir, tmp_path / "bad")
    config = json.loads((t5_dir / "generation_config.json").read_text())
    (tmp_path / "bad" / "generation_config.json").write_text(json.dumps({**config, "renormalize_logits": "yes"}))
    result = CliRunner().invoke(app, ["generate", "-c", str(tmp_path / "bad"), "-n", "3", "hi"])
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "renormalize_logits must be true or false" in lines[0], lines


def test_chat_with_a_server_refuses_beams_and_still_takes_other_settings():
    """lmcli serve does not search with beams and no request field carries them: `/set num_beams` and the
    beam flags with --server are one-line errors (before any request); `/set temperature` still goes in
    the requests (what /set records of its source is bookkeeping, not a field). No request is made here."""
    from lmcli.chat.session import ChatError
    from lmcli.serve.remote_chat import RemoteChatSession
    from lmcli.settings.generation_settings import GenerationSettings

    session = RemoteChatSession("http://127.0.0.1:1", {}, GenerationSettings.from_flags(chat=True), context=None,
                                system=None, messages=None, changed=set())
    session.set_setting("temperature", "0")
    assert session.settings.temperature == 0 and session.changed == {"temperature"}
    with pytest.raises(ChatError, match=r"^num_beams is not supported with --server") as refused:
        session.set_setting("num_beams", "4")
    assert "\n" not in str(refused.value) and session.settings.num_beams is None
    for flags in (["--num-beams", "4"], ["--length-penalty", "2"], ["--early-stopping", "never"]):
        result = CliRunner().invoke(app, ["chat", "--server", "http://127.0.0.1:1", *flags], input="hi\n")
        lines = result.stderr.strip().splitlines()
        assert result.exit_code != 0 and len(lines) == 1, result.output
        assert lines[0].startswith(f"error: {flags[0]} is not supported with --server"), lines


def test_a_resumed_transcripts_beams_and_a_temperature_flag_given_again_are_an_error_not_a_silent_choice():
    """A transcript saved after /set num_beams 3 (the user's own) resumed with --temperature 0.7 (the
    user's own again): as --num-beams 3 --temperature 0.7, a one-line error; with --num-beams 1 it samples."""
    from lmcli.chat.session import ChatError, resumed_settings
    from lmcli.settings.generation_settings import GenerationSettings

    saved = {"num_beams": 3, "temperature": 0.0, "sources": {"num_beams": "flag"}}
    flags = GenerationSettings.from_flags(chat=True, temperature=0.7)
    with pytest.raises(ChatError, match="cannot be combined"):
        resumed_settings(saved, flags, {"temperature"}, Path("t.json"))
    flags = GenerationSettings.from_flags(chat=True, temperature=0.7, num_beams=1)
    resumed = resumed_settings(saved, flags, {"temperature", "num_beams"}, Path("t.json"))
    assert (resumed.beams, resumed.temperature) == (1, 0.7)
    assert resumed_settings(saved, GenerationSettings.from_flags(chat=True), set(), Path("t.json")).beams == 3
