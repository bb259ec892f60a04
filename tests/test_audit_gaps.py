"""Gaps an outside audit found by planting bugs the suite did not catch (issue 31), each closed against
an independent reference: the registry's name of the default model, a resume that must accept or refuse,
Python's own str() of a template's values, the tokenizer's end-of-text ids, a plain greedy decode, each
job row run on its own, and torch's thread count read inside a thread started late.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from typer.testing import CliRunner

import lmcli
from lmcli.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- the default model's identity -----------------------------------------------------------------


def test_the_default_model_is_recorded_by_its_registry_name_and_resumes_under_it(smollm2_gguf, tmp_path):
    """A job on the default model records "smollm2-135m" (what `lmcli pull` and `-m` call it), not its
    file's name; its resume by that name is the same model; an OpenAI response names it so too."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "Hi"}\n{"id": 2, "prompt": "Hello"}\n')
    out = tmp_path / "out.jsonl"
    assert cli("generate", "--greedy", "-n", 2, "--input", source, "-o", out).exit_code == 0
    first = rows_of(out)
    assert {row["model"]["name"] for row in first} == {"smollm2-135m"}
    assert all(row["model"]["name"] != smollm2_gguf.name for row in first)
    out.write_text(json.dumps(first[0]) + "\n")
    result = cli("generate", "-m", "smollm2-135m", "--greedy", "-n", 2, "--input", source, "-o", out, "--resume")
    assert result.exit_code == 0 and "1 already done" in result.stderr, result.output
    assert rows_of(out)[1]["model"] == first[0]["model"]
    requests = tmp_path / "openai.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}) + "\n")
    answers = tmp_path / "answers.jsonl"
    assert cli("generate", "--input", requests, "-o", answers).exit_code == 0
    [answer] = rows_of(answers)
    assert answer["response"]["body"]["model"] == "smollm2-135m" and answer["lmcli"]["model"]["name"] == "smollm2-135m"


# --- input_hash and speculation --------------------------------------------------------------------


def test_speculation_fields_leave_a_greedy_rows_hash_alone_and_change_a_sampled_ones(tiny_checkpoint, tmp_path):
    """Speculation does not change greedy text, so a greedy job resumed with --prompt-lookup keeps its
    rows; it draws a sampled row's tokens differently, so there resume refuses the row as changed."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "hello hello"}\n{"id": 2, "prompt": "the quick"}\n')
    for mode, accepted in ((("--greedy",), True), (("--seed", 3, "--temperature", 0.9), False)):
        out = tmp_path / f"out{accepted}.jsonl"
        assert cli("generate", "-c", tiny_checkpoint, *mode, "-n", 4, "--input", source, "-o", out).exit_code == 0
        out.write_text(out.read_text().splitlines()[0] + "\n")
        result = cli("generate", "-c", tiny_checkpoint, *mode, "-n", 4, "--prompt-lookup", "--input", source,
                     "-o", out, "--resume")
        if accepted:
            assert result.exit_code == 0 and "1 already done" in result.stderr, result.output
        else:
            assert result.exit_code == 1 and "its prompt or settings changed" in result.stderr, result.output


# --- vendor keywords in a schema -------------------------------------------------------------------


def test_vendor_x_keywords_are_accepted_anywhere_and_the_output_still_validates(tiny_checkpoint):
    """"x-" keywords annotate (a validator ignores them, as jsonschema does here); a key that is neither
    a keyword nor "x-" is refused. The output under such a schema is checked by jsonschema."""
    import jsonschema

    from lmcli.generation.constraints import Constraint, ConstraintError

    schema = {"type": "object", "x-owner": {"team": ["a"]},
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9, "x-unit": "kg"},
                             "tags": {"type": "array", "items": {"enum": ["a", "b"], "x-ui": 1}, "maxItems": 2}},
              "required": ["n", "tags"], "additionalProperties": False}
    Constraint.parse("json_schema", schema)
    with pytest.raises(ConstraintError, match="unsupported schema keyword 'y-unit' at /properties/n"):
        Constraint.parse("json_schema", {"type": "object", "properties": {"n": {"type": "integer", "y-unit": "kg"}}})
    result = cli("generate", "-c", tiny_checkpoint, "--greedy", "-n", 60, "--json-schema", json.dumps(schema),
                 "--format", "jsonl", "hello")
    row = json.loads(result.stdout)
    if row["finish_reason"] == "eos":
        jsonschema.validate(json.loads(row["completion"]), schema)
    else:  # the random model's text ran out of room: said so, exit 3 (test_structured_limits)
        assert result.exit_code == 3


# --- a row whose matcher errored -------------------------------------------------------------------


def test_a_row_whose_matcher_errored_may_emit_only_end_of_text(tiny_checkpoint):
    """Once a row's matcher is in error, its mask allows the tokenizer's end-of-text ids and nothing
    else; the free row beside it is untouched."""
    from lmcli.generation.constraints import Constraint, ConstraintMask

    model, tokenizer = lmcli.load(tiny_checkpoint)
    vocab = model.config.vocab_size
    mask = ConstraintMask(tokenizer, [Constraint.parse("regex", "a+"), None], vocab)
    prompt = torch.tensor([tokenizer.encode("x")] * 2)
    logits = torch.zeros(2, vocab)
    first = mask(prompt, logits)
    allowed = torch.isfinite(first[0]).nonzero().view(-1).tolist()
    refused = next(i for i in range(vocab) if i not in allowed and i not in tokenizer.eos_token_ids)
    after = mask(torch.cat([prompt, torch.tensor([[refused], [refused]])], 1), logits)  # the row breaks its pattern
    assert mask.row_error(0) is not None
    assert torch.isfinite(after[0]).nonzero().view(-1).tolist() == sorted(tokenizer.eos_token_ids)
    assert torch.isfinite(after[1]).all()


# --- speculation at the edge of the context --------------------------------------------------------


def test_speculation_where_prompt_and_new_tokens_fill_the_context_exactly(tiny_models):
    """tests/tiny.py's model has 64 positions: a prompt of 16 and 48 new tokens fill them exactly.
    Speculation stays on there (only past the context does it switch off), and its tokens are plain
    greedy decoding's."""
    from lmcli.generation.speculative import SpeculationStats

    model = tiny_models("llama")
    context = model.config.max_position_embeddings
    prompt = torch.tensor([[5, 6, 7, 8] * 4])  # (1, 16): repeats, so the lookup finds guesses
    new = context - prompt.shape[1]
    plain = model.generate(prompt, max_new_tokens=new, do_sample=False)
    stats = SpeculationStats()
    fast = model.generate(prompt, max_new_tokens=new, do_sample=False, prompt_lookup=4, stats=stats)
    assert fast.tolist() == plain.tolist() and plain.shape[1] == context
    assert stats.enabled and stats.note is None and stats.passes > 0, stats
    over = SpeculationStats()
    model.generate(prompt, max_new_tokens=new + 1, do_sample=False, prompt_lookup=4, stats=over)
    assert not over.enabled and over.note is not None and "context" in over.note


# --- per-row speculation counts in a batched job ---------------------------------------------------


def test_each_rows_speculation_counts_are_its_own_in_a_batched_job_with_early_stops(tiny_checkpoint, tmp_path):
    """Quantized weights (batch-invariant), prompt lookup and one length: the rows of a batch of 4 share
    their passes (speculative_batch.py). A bias towards end-of-text makes some stop early beside rows
    that run to the limit. Each row's recorded counts, and its text, equal the same row's in a job of
    batch 1, where no row shares anything."""
    prompts = ["one two one two one two", "the quick the quick the", "a b a b a b a", "hello hello hello",
               "the the the the", "fox fox fox", "over the lazy dog over", "hi there hi there"]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    results = {}
    for batch in (4, 1):
        out = tmp_path / f"out{batch}.jsonl"
        result = cli("generate", "-c", tiny_checkpoint, "-q", "int8", "--greedy", "--prompt-lookup", "-n", 24,
                     "--logit-bias", "1=2.5", "--batch-size", batch, "--input", source, "-o", out)
        assert result.exit_code == 0, result.output
        results[batch] = {row["id"]: (row["completion"], row["finish_reason"], row["completion_tokens"],
                                      row["speculation"]) for row in rows_of(out)}
    assert results[4] == results[1]
    first_four = [results[1][i] for i in range(4)]  # one batch of the batched job
    assert {reason for _, reason, _, _ in first_four} == {"eos", "length"}  # early stops beside full rows
    assert any(counts["drafted"] for *_, counts in results[1].values())  # the lookup did guess
    for _, _, tokens, counts in results[1].values():
        assert counts["accepted"] <= counts["drafted"] and counts["passes"] + counts["accepted"] == tokens


# --- torch's thread count in threads started later -------------------------------------------------


def test_a_thread_started_after_the_rows_workers_sees_the_callers_thread_count():
    """Row workers run torch on one thread each, and torch.set_num_threads(1) in a worker also writes
    torch's process-wide count, which threads started later begin with: after the workers start, a new
    thread (the mask worker, a later row worker) must read the caller's count, as the caller does."""
    from lmcli.generation.row_choice import RowChooser

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    chooser = RowChooser()
    try:
        on_workers = chooser.run([torch.get_num_threads] * 2, [True, True])  # starts two workers
        assert on_workers == [1, 1]
        seen: list[int] = []
        late = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        late.start()
        late.join()
        assert seen == [2] and torch.get_num_threads() == 2
    finally:
        chooser.close()
        torch.set_num_threads(before)


# --- template size limits: escaped strings in lists ------------------------------------------------

_ESCAPED = st.text(alphabet=st.sampled_from(["a", "\\", "'", '"', "\n", "\x00", "é", "\u2028", "🙂"]), max_size=30)
_VALUES = st.recursive(_ESCAPED, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_ESCAPED, inner, max_size=3),
                       max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(_VALUES)
def test_text_size_is_never_less_than_the_text_of_a_list_of_escaped_strings(value):
    """The limit counts at least what str() writes: inside a list a string gets quotes, and a backslash,
    a quote or an unprintable character its escape. Python's own str() is the judge."""
    from lmcli.io.tokenizer.template_limits import text_size

    assert text_size(value, 10**9) >= len(str(value))


def test_a_template_that_prints_a_list_of_backslashes_past_the_limit_is_refused(tmp_path):
    """20,000 strings of 40 backslashes: 800,000 characters as strings, but str() of the list doubles
    each backslash (1.7 million characters), past the 1,000,000 a template may build."""
    from lmcli.io.tokenizer import load_tokenizer
    from lmcli.io.tokenizer.template_limits import MAX_ITEMS

    items = ["\\" * 40] * 20_000
    assert sum(map(len, items)) < MAX_ITEMS < len(str(items))
    shutil.copytree(tiny_checkpoint_tokenizer(tmp_path), tmp_path / "t")
    config = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% set s = '\\\\' * 40 %}{% set xs = [s] * 20000 %}{{ xs }}"
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path / "t")
    assert tokenizer is not None
    with pytest.raises(Exception, match="1,000,000") as caught:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "Traceback" not in str(caught.value)


def tiny_checkpoint_tokenizer(tmp_path):
    from cli_fixtures import build_tokenizer

    directory = tmp_path / "tokenizer"
    directory.mkdir()
    build_tokenizer(directory)
    return directory
