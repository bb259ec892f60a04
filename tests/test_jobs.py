"""Unit tests for lmcli.jobs.runner and lmcli.generation.streaming that need no model: stop strings, settings,
JSONL input/output, resume bookkeeping, batching, and the job runner against a fake model."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from lmcli.errors import LmcliError, UsageError
from lmcli.generation import streaming
from lmcli.generation.rows import PreparedRow, plan_batches
from lmcli.generation.streaming import RowText, StopMatcher
from lmcli.jobs.runner import JobOutput, read_finished, read_rows, run_job, unescape_line
from lmcli.settings.generation_settings import GenerationSettings, ModelDefaults, RowError, input_hash

# ----------------------------------------------------------------------------- stop strings


def matched(stops, pieces):
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in pieces)
    return out + matcher.flush(), matcher.stopped


def reference_cut(stops, text):
    starts = [text.find(s) for s in stops if s in text]
    return (text[: min(starts)], True) if starts else (text, False)


def test_stop_string_split_across_pieces_is_cut_and_never_emitted():
    matcher = StopMatcher(["END"])
    assert matcher.push("abc E") == "abc "  # "E" might start END: held back
    assert matcher.push("N") == ""
    assert matcher.push("Dxyz") == ""
    assert matcher.stopped and matcher.flush() == ""


def test_held_back_text_is_released_when_it_is_not_a_stop():
    matcher = StopMatcher(["END"])
    assert matcher.push("ab E") == "ab "
    assert matcher.push("Nx") == "ENx"
    assert matcher.push("E") == ""
    assert matcher.flush() == "E"  # the stream ended: nothing to wait for
    assert not matcher.stopped


def test_earliest_stop_wins_and_overlapping_prefixes():
    assert matched(["world", "lo"], ["hello world"]) == ("hel", True)
    assert matched(["aab"], list("aaab")) == ("a", True)
    assert matched(["\n\n"], ["one\n", "\ntwo"]) == ("one", True)


def test_stop_matcher_agrees_with_a_plain_search_for_any_split():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abcd", k=rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert matched(stops, pieces) == reference_cut(stops, text), (stops, pieces)


class ByteDecoder:
    """Incremental UTF-8 decoding of byte tokens (id = byte value + 3), like a byte-level BPE."""

    def __init__(self, tokenizer):
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id):
        return self._decoder.decode(bytes([token_id - 3])) if token_id >= 3 else ""

    def flush(self):
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """Ids 0/1/2 are BOS/EOS/pad; every other id is a byte."""

    eos_token_ids: ClassVar[list[int]] = [1]
    pad_token_id = 2
    bos_token_id = 0
    chat_template = "{{ messages }}"

    def encode(self, text):
        return [0] + [b + 3 for b in text.encode("utf-8")]

    def encode_chat(self, messages, add_generation_prompt=True):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")


@pytest.fixture
def byte_decoder(monkeypatch):
    monkeypatch.setattr(streaming, "StreamDecoder", ByteDecoder)


def test_row_text_joins_multibyte_characters_and_cuts_at_stops(byte_decoder):
    text = "Привет 🙂 STOP мир"
    row = RowText(ByteTokenizer(), stops=["STOP"])
    pieces = []
    for token in ByteTokenizer().encode(text)[1:]:
        pieces.append(row.push(token))
        if row.stopped:
            break
    pieces.append(row.finish())
    assert "".join(pieces) == row.text == "Привет 🙂 "
    assert all("\ufffd" not in p for p in pieces)  # never half a character


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(top_k=5, top_p=0.9), "--top-k and --top-p cannot be used together"),
        (dict(top_p=1.5), "--top-p must be in (0, 1], got 1.5"),
        (dict(top_p=0.0), "--top-p must be in (0, 1]"),
        (dict(temperature=-0.5), "--temperature must be >= 0"),
        (dict(max_new_tokens=0), "--max-new-tokens must be at least 1"),
        (dict(top_k=0), "--top-k must be at least 1"),
        (dict(greedy=True, temperature=0.7), "--greedy and --temperature 0.7 contradict"),
        (dict(greedy=True, top_k=3), "--top-k only applies to sampling"),
        (dict(repetition_penalty=0.0), "--repetition-penalty must be > 0"),
        (dict(seed=-1), "--seed must be between 0 and 2**64-1"),
        (dict(stop=[""]), "--stop must not be an empty string"),
        (dict(system="be brief"), "--system only applies with --chat"),
        (dict(logprobs=-1), "--logprobs must be >= 0"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_flag(flags, message):
    with pytest.raises(UsageError) as info:
        GenerationSettings.from_flags(**flags)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_flag_defaults_and_greedy_spellings():
    assert not GenerationSettings.from_flags().greedy
    assert GenerationSettings.from_flags(greedy=True).greedy
    assert GenerationSettings.from_flags(temperature=0).greedy
    assert GenerationSettings.from_flags(greedy=True, temperature=0).greedy


def test_flags_win_over_row_fields():
    base = GenerationSettings.from_flags(top_k=40, max_new_tokens=10)
    assert base.for_row({"top_p": 0.5}) == base  # the flags' truncation stands whole
    assert base.for_row({"max_new_tokens": 3}).max_new_tokens == 10  # a flag beats the row
    assert base.for_row({"temperature": 0}).greedy  # no temperature flag: the row is greedy, the top-k moot
    assert base.for_row({"stop": "x"}).stop == ("x",)  # no --stop flag: the row's
    assert GenerationSettings.from_flags(stop=["y"]).for_row({"stop": "x"}).stop == ("y",)
    assert base.for_row({"seed": 7}).seed == 7
    assert base.for_row({"seed": 7}).source("seed") == "row"
    greedy = GenerationSettings.from_flags(greedy=True)
    assert greedy.for_row({"temperature": 0.7, "top_p": 0.5}) == greedy  # a greedy flag makes every row greedy
    # the row's values are still checked, even those a flag overrides
    with pytest.raises(RowError, match='"top_p" must be in'):
        base.for_row({"top_p": 2})
    with pytest.raises(RowError, match='"max_new_tokens" must be an integer'):
        base.for_row({"max_new_tokens": "5"})
    with pytest.raises(RowError, match='"system" only applies with --chat'):
        base.for_row({"system": "hi"})


# ----------------------------------------------------------------------------- input and output files


def test_read_jsonl_rows_with_defaults_and_bad_rows(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"prompt": "a"}',
                '{"id": "x", "prompt": "b", "seed": 3}',
                "{not json",
                '{"id": 9}',
                '{"prompt": "c", "top_p": 7}',
                "",
                '{"prompt": "d", "max_tokens": 5}',
                '["prompt"]',
            ]
        )
    )
    settings = GenerationSettings.from_flags()
    rows = read_rows(path, settings)
    assert [r.id for r in rows] == [1, "x", 3, 9, 5, 7, 8]
    assert [r.error is None for r in rows] == [True, True, False, False, False, False, False]
    assert rows[1].settings is not None and rows[1].settings.seed == 3
    errors = [r.error or "" for r in rows]
    assert "line 3: not valid JSON" in errors[2]
    assert errors[3] == 'line 4: "prompt" is missing'
    assert '"top_p" must be in (0, 1]' in errors[4] and rows[4].prompt == "c"
    assert 'unknown field "max_tokens"' in errors[5]
    assert "must be a JSON object" in errors[6]


def test_read_text_rows_unescapes_newlines(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffone\\ntwo\n\nback\\\\slash\\n\nплохо 🙂\r\n".encode())
    rows = read_rows(path, GenerationSettings.from_flags())
    assert [(r.id, r.prompt) for r in rows] == [(1, "one\ntwo"), (3, "back\\slash\n"), (4, "плохо 🙂")]
    assert unescape_line(r"a\tb\\n") == r"a\tb\n"


def test_duplicate_ids_are_refused(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    with pytest.raises(UsageError, match="input lines 1 and 2 have the same id 1"):
        read_rows(path, GenerationSettings.from_flags())


def test_input_hash_depends_on_prompt_and_settings():
    s = GenerationSettings.from_flags()
    assert input_hash("a", s) == input_hash("a", GenerationSettings.from_flags())
    assert input_hash("a", s) != input_hash("b", s)
    assert input_hash("a", s) != input_hash("a", GenerationSettings.from_flags(max_new_tokens=5))


def test_read_finished_drops_partial_last_line_and_failed_rows(tmp_path):
    path = tmp_path / "out.jsonl"
    rows = [{"id": 1, "completion": "x", "input_hash": "h1"}, {"id": 2, "error": "bad", "input_hash": "h2"},
            {"id": "3", "completion": "y", "input_hash": "h3"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": 4, "compl')
    finished = read_finished(path)
    assert set(finished) == {"1", '"3"'}
    assert path.read_text() == json.dumps(rows[0]) + "\n" + json.dumps(rows[2]) + "\n"
    assert set(read_finished(path)) == {"1", '"3"'}  # idempotent, no rewrite needed now


def test_read_finished_refuses_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": 1, "input_hash": "h"}\ngarbage\n{"id": 2, "input_hash": "h"}\n')
    with pytest.raises(LmcliError, match="line 2: not a row written by lmcli"):
        read_finished(path)


def test_batches_share_settings_and_sort_by_length():
    greedy = GenerationSettings.from_flags(greedy=True)
    hot = GenerationSettings.from_flags(temperature=1.2)
    rows = [
        PreparedRow(i, "p", settings, [0] * length, None, "h")
        for i, (settings, length) in enumerate([(greedy, 5), (hot, 2), (greedy, 1), (greedy, 3), (hot, 9)])
    ]
    batches = [[r.id for r in batch] for batch in plan_batches(rows, batch_size=2)]
    assert batches == [[2, 3], [0], [1, 4]]
    assert sorted(i for batch in batches for i in batch) == list(range(5))


# ----------------------------------------------------------------------------- the job runner (fake model)


class FakeModel(torch.nn.Module):
    """Follows the generate() contract: each row's tokens depend only on its own prompt and seed."""

    device = torch.device("cpu")  # as BaseModel.device

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=4096)  # the context prompts are fitted to
        self.calls = []

    def generate(self, x, max_new_tokens, do_sample, temperature=1.0, top_k=None, top_p=None, use_cache=True,
                 attention_mask=None, eos_token_id=None, pad_token_id=None, *, seed=None, logits_processors=None,
                 on_token=None, ignore_output=False):
        batch = x.shape[0]
        mask = torch.ones_like(x, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self.calls.append(batch)
        state = [int(x[i][mask[i]].sum()) + (seed[i] if seed is not None else 0) for i in range(batch)]
        finished = torch.zeros(batch, dtype=torch.bool)
        lengths = torch.zeros(batch, dtype=torch.long)
        for step in range(max_new_tokens):
            tokens = torch.tensor([3 + ord("a") + (s + step) % 26 for s in state])
            tokens = torch.where(finished, torch.full_like(tokens, pad_token_id), tokens)
            lengths += (~finished).long()
            logits = torch.nn.functional.one_hot(tokens, 300).float()
            event = SimpleNamespace(step=step, token_id=tokens, finished=finished.clone(), length=lengths.clone(),
                                    logits=logits)
            result = on_token(event)
            finished |= torch.as_tensor(result, dtype=torch.bool)
            if finished.all():
                break


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def job(tmp_path, input_path, output, **kwargs):
    # max_new_tokens=4 as the model's default (not a flag), so a row's own max_new_tokens still applies
    settings = kwargs.pop("settings", None) or GenerationSettings.from_flags().with_model_defaults(
        ModelDefaults({"max_new_tokens": 4}, "generation_config.json"))
    return run_job(input_path, output, settings, load=lambda: (FakeModel(), ByteTokenizer()), batch_size=2,
                   **kwargs)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_job_writes_every_row_once_with_errors_and_seeds(tmp_path, byte_decoder):
    source = tmp_path / "in.jsonl"
    write_jsonl(source, [{"prompt": "a"}, {"prompt": "bb", "seed": 5, "max_new_tokens": 2}, "{oops",
                         {"prompt": "ccc", "stop": "f"}])
    out = tmp_path / "out.jsonl"
    report = job(tmp_path, source, out)
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert sorted(rows) == [1, 2, 3, 4] and report.failed == 1 and report.written == 4
    assert "not valid JSON" in rows[3]["error"]
    assert rows[2]["seed"] == 5 and rows[2]["completion_tokens"] == 2 and rows[2]["finish_reason"] == "length"
    assert isinstance(rows[1]["seed"], int)  # drawn and recorded
    assert all(r.get("finish_reason") in ("length", "stop") for r in rows.values() if "error" not in r)
    assert rows[1]["input_hash"] == input_hash("a", GenerationSettings.from_flags(max_new_tokens=4))


def test_job_refuses_to_clobber_and_resumes_after_a_partial_line(tmp_path, byte_decoder):
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\nthree\nfour\n")
    out = tmp_path / "out.jsonl"
    job(tmp_path, source, out, settings=GenerationSettings.from_flags(greedy=True, max_new_tokens=3))
    full = read_jsonl(out)
    with pytest.raises(UsageError, match="already exists; use --resume"):
        job(tmp_path, source, out)
    # Simulate a kill: two rows done, the third half-written.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1] + lines[2][:10])
    report = job(tmp_path, source, out, resume=True,
                 settings=GenerationSettings.from_flags(greedy=True, max_new_tokens=3))
    assert report.skipped == 2 and report.written == 2
    resumed = read_jsonl(out)
    assert sorted(r["id"] for r in resumed) == [1, 2, 3, 4]
    assert sorted(resumed, key=lambda r: r["id"]) == sorted(full, key=lambda r: r["id"])


def test_resume_refuses_changed_input_under_the_same_id(tmp_path, byte_decoder):
    source = tmp_path / "in.txt"
    source.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    job(tmp_path, source, out)
    source.write_text("one\nTWO\n")
    with pytest.raises(LmcliError, match=r"row 2 \(input line 2\) is not the row that produced it"):
        job(tmp_path, source, out, resume=True)
    with pytest.raises(LmcliError, match="is not the row"):  # other settings count as a change too
        job(tmp_path, source, out, resume=True,
            settings=GenerationSettings.from_flags(max_new_tokens=5))


def test_resume_retries_failed_rows(tmp_path, byte_decoder):
    source = tmp_path / "in.jsonl"
    write_jsonl(source, [{"prompt": "a"}, {"prompt": "b", "top_p": 3}])
    out = tmp_path / "out.jsonl"
    assert job(tmp_path, source, out).failed == 1
    write_jsonl(source, [{"prompt": "a"}, {"prompt": "b", "top_p": 0.3}])  # fixed
    report = job(tmp_path, source, out, resume=True)
    assert (report.skipped, report.written, report.failed) == (1, 1, 0)
    assert sorted(r["id"] for r in read_jsonl(out)) == [1, 2]
    assert all("error" not in r for r in read_jsonl(out))


def test_job_with_nothing_to_do_does_not_load_the_model(tmp_path, byte_decoder):
    source = tmp_path / "in.jsonl"
    write_jsonl(source, ["{bad"])

    def load():
        raise AssertionError("loaded the model for a job with no valid rows")

    out = tmp_path / "out.jsonl"
    report = run_job(source, out, GenerationSettings.from_flags(), load=load, batch_size=2)
    assert report.failed == 1


def test_job_to_stdout_and_logprobs(tmp_path, byte_decoder):
    import io

    source = tmp_path / "in.txt"
    source.write_text("hi\n")
    stream = io.StringIO()
    settings = GenerationSettings.from_flags(max_new_tokens=2, logprobs=2, greedy=True)
    run_job(source, JobOutput(stream), settings, load=lambda: (FakeModel(), ByteTokenizer()), batch_size=4)
    [row] = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(row["logprobs"]) == 2
    first = row["logprobs"][0]
    assert first["top"][0]["id"] == first["id"] and first["logprob"] == first["top"][0]["logprob"]
    assert len(first["top"]) == 2 and row["seed"] is None


class PickyModel(FakeModel):
    """Refuses any batch holding the byte "!" (like generate() refusing a prompt that is too long)."""

    def generate(self, x, *args, **kwargs):
        if (x == 3 + ord("!")).any():
            raise ValueError("prompt too long for this model")
        return super().generate(x, *args, **kwargs)


def test_a_row_that_fails_in_generate_fails_alone(tmp_path, byte_decoder):
    source = tmp_path / "in.txt"
    source.write_text("fine\nbad!\nalso fine\nok\n")
    out = tmp_path / "out.jsonl"
    report = run_job(source, out, GenerationSettings.from_flags(max_new_tokens=3), load=lambda: (PickyModel(), ByteTokenizer()),
                     batch_size=4)
    rows = {r["id"]: r for r in read_jsonl(out)}
    assert sorted(rows) == [1, 2, 3, 4] and report.failed == 1
    assert rows[2]["error"] == "ValueError: prompt too long for this model" and rows[2]["prompt"] == "bad!"
    assert all(rows[i]["completion_tokens"] == 3 for i in (1, 3, 4))
