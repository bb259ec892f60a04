"""Beam search where a request has no room for it: `lmcli serve` (one continuous batch, no beams), OpenAI
batch bodies (OpenAI's API has no beam field) and `lmcli generate --input --server`. Nothing asked for is
dropped silently: a request's beam fields are a 400 (seen through the official openai client), a batch
body's an error row, a job row's beams an error row; a model whose generation config asks for beams is
served as `lmcli generate --num-beams 1` serves it, with a note, and /v1/models lists no beams."""

from __future__ import annotations

from typing import Any

import pytest
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)

from lmcli.jobs import openai_batch
from lmcli.settings.generation_settings import GenerationSettings, RowError
from lmcli.settings.model_defaults import ModelDefaults

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

OWN = ModelDefaults(values={"num_beams": 4, "length_penalty": 2.0, "early_stopping": True, "temperature": 0.6,
                            "top_p": 0.9}, source="generation_config.json")
BEAM_FIELDS = [("num_beams", 4), ("length_penalty", 2.0), ("early_stopping", True)]


@pytest.fixture(scope="module")
def served(tiny_checkpoint) -> Any:
    """build_app on the tiny model, with the base `lmcli serve` builds for a model that asks for beams, in
    this process (starlette's TestClient); the requests here never reach the scheduler."""
    from lmcli.loading import load
    from lmcli.serve.app import ServerState, build_app
    from lmcli.serve.server import served_defaults

    model, tokenizer = load(tiny_checkpoint, device="cpu", dtype="float32")
    base = GenerationSettings().with_model_defaults(served_defaults(OWN))
    state = ServerState(None, tokenizer, model.config.vocab_size, base, "tiny", "sha256:0", 64)  # type: ignore[arg-type]
    return build_app(state), base, tokenizer


def test_a_model_asking_for_beams_is_served_as_num_beams_1_with_a_note(capsys):
    from lmcli.serve.server import served_defaults

    base = GenerationSettings().with_model_defaults(served_defaults(OWN))
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "num_beams 4" in note[0] and "--num-beams 1" in note[0]
    # what `lmcli generate --num-beams 1` runs with on the same model: its own sampling settings, no beams
    local = GenerationSettings.from_flags(num_beams=1).with_model_defaults(OWN)
    assert base.beams == 1 == local.beams
    assert (base.temperature, base.top_p) == (local.temperature, local.top_p) == (0.6, 0.9)
    plain = ModelDefaults(values={"temperature": 0.6}, source="generation_config.json")
    assert served_defaults(plain) is plain and capsys.readouterr().err == ""  # nothing to drop, nothing said


@pytest.mark.parametrize(("field", "value"), BEAM_FIELDS)
def test_a_request_asking_for_beams_is_a_400_naming_the_field(served, field, value):
    from starlette.testclient import TestClient

    app, _, _ = served
    http = TestClient(app)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="a b", max_tokens=2, extra_body={field: value})
    assert refused.value.status_code == 400 and f'"{field}"' in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert refused.value.body["param"] == field
    listed = http.get("/v1/models").json()["data"][0]["lmcli"]["defaults"]["values"]
    assert listed == {"temperature": 0.6, "top_p": 0.9}  # what the server uses: no beams


@pytest.mark.parametrize(("field", "value"), BEAM_FIELDS)
def test_a_batch_body_asking_for_beams_is_an_error_row(field, value):
    """OpenAI's API has no beam search; as with the other fields it has no name for (min_p, ...), a body
    that asks for it is refused rather than run without it (lmcli's own JSONL rows take num_beams)."""
    request = {"custom_id": "a", "method": "POST", "url": openai_batch.COMPLETIONS,
               "body": {"prompt": "x", "max_tokens": 3, field: value}}
    with pytest.raises(RowError, match=f'body field "{field}" is not supported'):
        openai_batch.parse_request(request)


def test_a_job_row_with_beams_sent_to_a_server_is_refused_not_decoded_without_them(served):
    from lmcli.errors import LmcliError
    from lmcli.generation.rows import prepare_row
    from lmcli.serve.remote_job import request_for
    from lmcli.settings.generation_settings import ROW

    _, base, tokenizer = served
    beams = base.for_row({"num_beams": 3})
    assert beams.source("num_beams") == ROW and beams.beams == 3
    with pytest.raises(LmcliError, match="num_beams is not supported with --server"):
        request_for(prepare_row(tokenizer, 1, "a b", beams), base)
    _, body, _ = request_for(prepare_row(tokenizer, 2, "a b", base.for_row({"num_beams": 1})), base)
    assert not set(body) & {"num_beams", "length_penalty", "early_stopping"}
