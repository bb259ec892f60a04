"""`lmcli serve` driven by the official `openai` client and httpx, in a real subprocess on 127.0.0.1: every
answer equals what `lmcli generate` makes of the same request alone (runs.generate_one's path, in this
process), which equals model.generate; 32 clients at once change nothing; the limits answer in
OpenAI's error shape; `lmcli generate --server` prints what a local run prints, without importing torch."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from typing import Any

import httpx
import jsonschema
import pytest
from cli_fixtures import run_lmcli, subprocess_env
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from serve_fixtures import API_KEY, local, serving

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.usefixtures("one_thread")

CLIENT_TIMEOUT = 120.0  # seconds: no request here may hang the suite


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf):
    with serving(tmp_path_factory.mktemp("serve"), "--batch-size", "8", "--max-queue", "64", "--context", "512",
                 "--max-body", "65536") as served:
        yield served


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """`lmcli generate`'s result for a request: (prompt or messages, **flags) -> RowResult."""
    import lmcli
    from lmcli.resolve.model_ref import resolve_model

    resolved = resolve_model(smollm2_gguf)
    model, tokenizer = lmcli.load(resolved)
    defaults = resolved.defaults

    def run(prompt, **flags):
        return local(model, tokenizer, defaults, prompt, **flags)

    run.model, run.tokenizer = model, tokenizer  # type: ignore[attr-defined]
    return run


def client(server, **more) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT, **more)


def streamed_text(stream, chat: bool) -> tuple[str, str | None, Any]:
    """(text, finish_reason, usage) of a streamed response."""
    pieces, finish, usage = [], None, None
    for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            pieces.append(piece or "")
            finish = choice.finish_reason or finish
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
    return "".join(pieces), finish, usage


MESSAGES = [{"role": "user", "content": "Name a colour."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_completions_and_chat_equal_lmcli_generate(server, reference):
    api = client(server)
    # A greedy completion, not streamed; its tokens are also model.generate's own.
    prompt = "The capital of France is"
    got = api.completions.create(model="x", prompt=prompt, max_tokens=10, temperature=0)
    want = reference(prompt, temperature=0, max_new_tokens=10)
    assert got.choices[0].text == want.text.text and got.usage.completion_tokens == len(want.tokens)
    assert got.choices[0].finish_reason == "length"
    import torch

    ids = torch.tensor([reference.tokenizer.encode(prompt)])
    generated = reference.model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:].tolist()
    assert generated == want.tokens

    # A sampled chat with a seed, streamed with usage.
    stream = api.chat.completions.create(model="x", messages=MESSAGES, max_tokens=12, temperature=0.9, seed=7,
                                         stream=True, stream_options={"include_usage": True})
    text, finish, usage = streamed_text(stream, chat=True)
    want = reference(MESSAGES, temperature=0.9, seed=7, max_new_tokens=12)
    assert text == want.text.text and usage.completion_tokens == len(want.tokens)
    assert usage.prompt_tokens == len(want.row.prompt_ids)

    # A greedy chat that ends at the model's end of turn, streamed: finish_reason "stop" (lmcli's "eos").
    want = reference(MESSAGES, temperature=0, max_new_tokens=48)
    assert want.finish_reason == "eos"
    text, finish, _ = streamed_text(api.chat.completions.create(model="x", messages=MESSAGES, max_tokens=48,
                                                                temperature=0, stream=True), chat=True)
    assert (text, finish) == (want.text.text, "stop")

    # Stop strings, streamed and not: the text ends before the stop, finish_reason "stop".
    prompt = "Count: 1, 2, 3,"
    want = reference(prompt, temperature=0, max_new_tokens=16, stop=[" 6"])
    assert want.finish_reason == "stop"
    got = api.completions.create(model="x", prompt=prompt, max_tokens=16, temperature=0, stop=[" 6"])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text.text, "stop")
    text, finish, _ = streamed_text(api.completions.create(model="x", prompt=prompt, max_tokens=16, temperature=0,
                                                           stop=[" 6"], stream=True), chat=False)
    assert (text, finish) == (want.text.text, "stop")

    # n = 2 with a seed: choice i samples with seed + i.
    got = api.completions.create(model="x", prompt="Once upon", max_tokens=6, temperature=1.0, seed=40, n=2)
    assert [c.text for c in got.choices] == [reference("Once upon", temperature=1.0, seed=40 + i,
                                                       max_new_tokens=6).text.text for i in range(2)]


def test_logprobs_and_json_schema_equal_lmcli_generate(server, reference):
    api = client(server)
    got = api.chat.completions.create(model="x", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                      top_logprobs=3)
    want = reference(MESSAGES, temperature=0, max_new_tokens=6, logprobs=3)
    entries = got.choices[0].logprobs.content
    assert [e.token for e in entries] == [step["token"] for step in want.logprobs]
    # The same numbers: the row's logits are those of its single run.
    assert [e.logprob for e in entries] == [step["logprob"] for step in want.logprobs]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in entries] == \
        [[(t["token"], t["logprob"]) for t in step["top"]] for step in want.logprobs]

    stream = api.completions.create(model="x", prompt="Hello", max_tokens=5, temperature=0, logprobs=2, stream=True)
    tokens = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == [step["token"] for step in reference("Hello", temperature=0, max_new_tokens=5, logprobs=2).logprobs]

    from lmcli.generation.constraints import one_constraint

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    got = api.chat.completions.create(model="x", messages=ask, max_tokens=40, temperature=0.8, seed=3,
                                      response_format=fmt)
    text = got.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    want = reference(ask, temperature=0.8, seed=3, max_new_tokens=40, constraint=one_constraint({"json_schema": SCHEMA}))
    assert text == want.text.text


def test_32_concurrent_clients_each_get_what_they_get_alone(server, reference):
    """32 clients at once, mixing streaming, a schema and seeded sampling: each response equals the same
    request alone (lmcli generate), none is lost or duplicated, and the server's memory stays bounded."""
    from lmcli.generation.constraints import one_constraint

    constraint = one_constraint({"json_schema": SCHEMA})
    requests = []
    for i in range(32):
        prompt = f"Story {i}: the {['cat', 'dog', 'bird', 'fish'][i % 4]} went"
        kind = ["plain", "stream", "schema", "chat"][i % 4]
        sampled = i % 3 != 0
        flags = {"temperature": 0.8 if sampled else 0, "max_new_tokens": 4 + i % 5}
        if sampled:
            flags["seed"] = 1000 + i
        if kind == "schema":
            flags["max_new_tokens"] = 12
        requests.append((i, kind, prompt, flags))
    before = server.rss_bytes()
    api = client(server)

    def send(request) -> tuple[int, str]:
        i, kind, prompt, flags = request
        body = {"max_tokens": flags["max_new_tokens"], "temperature": flags["temperature"]}
        if "seed" in flags:
            body["seed"] = flags["seed"]
        if kind == "chat":
            got = api.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}], **body)
            return i, got.choices[0].message.content
        if kind == "schema":
            fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
            got = api.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}],
                                              response_format=fmt, **body)
            return i, got.choices[0].message.content
        if kind == "stream":
            return i, streamed_text(api.completions.create(model="x", prompt=prompt, stream=True, **body), False)[0]
        return i, api.completions.create(model="x", prompt=prompt, **body).choices[0].text

    logged = len(server.records())
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(send, requests, timeout=300))
    assert sorted(i for i, _ in answers) == list(range(32))
    records = server.records()[logged:]
    assert len(records) == 32 and all(r["status"] == 200 for r in records)
    for (i, kind, prompt, flags), (_, text) in zip(requests, answers):
        if kind in ("chat", "schema"):
            extra = {"constraint": constraint} if kind == "schema" else {}
            want = reference([{"role": "user", "content": prompt}], **flags, **extra)
        else:
            want = reference(prompt, **flags)
        assert text == want.text.text, (i, kind)
        if kind == "schema" and want.finish_reason != "length":
            jsonschema.validate(json.loads(text), SCHEMA)
    # The batch's cache (8 rows x 512 columns) is allocated at the first request; 32 requests may add
    # their prefix-cache blocks and Python objects, not a copy of the model.
    assert server.rss_bytes() - before < 400 * 2**20


def test_errors_in_openai_shape(server):
    http = httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT, headers={"Authorization": f"Bearer {API_KEY}"})
    url = "/v1/completions"

    def error(response, status):
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["message"]
        return body

    error(http.post(url, content=b'{"prompt": "x",'), 400)
    error(http.post(url, content=b"[1, 2]"), 400)
    assert error(http.post(url, json={"prompt": "x", "temperature": "hot"}), 400)["param"] == "temperature"
    assert "max_tokenz" in error(http.post(url, json={"prompt": "x", "max_tokenz": 3}), 400)["message"]
    assert error(http.post(url, content=b'{"prompt": "' + b"x" * 70000 + b'"}'), 413)["code"] == "request_too_large"
    too_long = error(http.post(url, json={"prompt": "x", "max_tokens": 10**9}), 400)
    assert too_long["code"] == "context_length_exceeded" and "maximum context length is 512" in too_long["message"]
    nothing = {"type": "json_schema", "json_schema": {"name": "none", "schema": {"type": "string", "enum": []}}}
    error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": nothing}), 400)
    error(http.post(url, json={"prompt": "x", "n": 100}), 400)
    assert error(http.post(url, json={"prompt": "x", "prompt_lookup": True}), 400)["param"] == "prompt_lookup"
    error(http.post(url, json={"prompt": "x", "stream_options": {"include_usage": True}}), 400)
    assert error(http.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)["code"] == \
        "invalid_api_key"
    error(http.get("/v1/embeddings"), 404)
    assert http.get("/health", headers={}).json()["status"] == "ok"
    assert http.get("/v1/models").json()["data"][0]["id"] == "smollm2-135m"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()


def test_disconnect_mid_stream_frees_the_row_and_a_slow_reader_holds_no_one_up(server):
    http = httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT, headers={"Authorization": f"Bearer {API_KEY}"})
    # Never the end-of-text token (SmolLM2's is 2), so the row runs until its max_tokens or its client goes.
    body = {"prompt": "Write a long story:", "max_tokens": 400, "temperature": 0, "stream": True,
            "logit_bias": {"2": -100}}
    logged = len(server.records())
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(4)]  # a few chunks, then the client goes
    assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and http.get("/health").json()["running"] > 0:
        time.sleep(0.2)
    assert http.get("/health").json()["running"] == 0  # its place was freed long before its 400 tokens
    record = server.records()[logged]
    assert record.get("disconnected") is True and record["completion_tokens"] < 400

    # A slow reader: another request finishes while it is not reading.
    slow = http.stream("POST", "/v1/completions", json={**body, "max_tokens": 60})
    response = slow.__enter__()
    try:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        quick = client(server).completions.create(model="x", prompt="Hi", max_tokens=3, temperature=0)
        assert quick.choices[0].finish_reason == "length"
        rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        slow.__exit__(None, None, None)


def lmcli_with_key(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmcli", *args], capture_output=True, timeout=CLIENT_TIMEOUT,
                          env=subprocess_env(LMCLI_API_KEY=API_KEY), input=input.encode() if input else None)


def test_generate_with_server_prints_what_a_local_run_prints(server, smollm2_gguf):
    args = ["generate", "--greedy", "-n", "12", "The capital of France is"]
    remote = lmcli_with_key(*args, "--server", server.url)
    here = run_lmcli(*args)
    assert remote.returncode == here.returncode == 0, remote.stderr
    assert remote.stdout == here.stdout and remote.stdout.strip()
    chat = ["generate", "--chat", "--seed", "5", "--temperature", "0.7", "-n", "8", "Hi there"]
    assert lmcli_with_key(*chat, "--server", server.url).stdout == run_lmcli(*chat).stdout
    wrong = run_lmcli(*args, "--server", server.url)  # no key: the server's 401, in one line
    assert wrong.returncode == 1 and wrong.stderr.count(b"\n") == 1 and b"401" in wrong.stderr
    # The client path imports no torch (nor numpy), and an error is one line.
    env = subprocess_env(LMCLI_SERVER=server.url, LMCLI_API_KEY=API_KEY)
    timed = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmcli", "generate", "-n", "1", "Hi"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert timed.returncode == 0, timed.stderr
    imported = {line.split("|")[-1].strip() for line in timed.stderr.splitlines() if line.startswith("import time:")}
    assert "lmcli.serve.client" in imported and not {"torch", "numpy", "starlette"} & imported
    refused = run_lmcli("generate", "--server", "http://127.0.0.1:9", "-n", "1", "Hi")
    assert refused.returncode == 1 and refused.stderr.count(b"\n") == 1 and b"cannot reach" in refused.stderr


def test_port_in_use_is_one_line(server):
    port = server.url.rsplit(":", 1)[1]
    taken = run_lmcli("serve", "--port", port)
    assert taken.returncode == 1 and taken.stderr.count(b"\n") == 1 and b"already in use" in taken.stderr


def test_a_request_gets_the_settings_lmcli_generate_gets(reference, smollm2_gguf):
    """The defaults a request falls back on are `lmcli generate`'s: the model's, else lmcli's, and 512 new
    tokens under a schema (CONSTRAINED_MAX_NEW_TOKENS, as --json-schema has), whatever the route."""
    from lmcli.generation.constraints import one_constraint
    from lmcli.jobs import openai_batch
    from lmcli.resolve.model_ref import resolve_model
    from lmcli.serve.requests import parse
    from lmcli.settings.generation_settings import GenerationSettings

    defaults = resolve_model(smollm2_gguf).defaults
    base = GenerationSettings().with_model_defaults(defaults)
    tokenizer, vocab = reference.tokenizer, reference.model.config.vocab_size
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    cases: list[tuple[dict, dict[str, Any]]] = [({"prompt": "x"}, {}), ({"prompt": "x", "temperature": 0}, {"greedy": True}),
             ({"prompt": "x", "response_format": fmt}, {"constraint": one_constraint({"json_schema": SCHEMA})}),
             ({"prompt": "x", "top_p": 0.5, "seed": 3}, {"top_p": 0.5, "seed": 3})]
    for body, flags in cases:
        [row] = parse(openai_batch.COMPLETIONS, body, base, tokenizer, vocab, 4096, 1).rows
        want = GenerationSettings.from_flags(**flags).with_model_defaults(defaults)
        assert row.settings.used() == want.used(), body


CHAT_INPUT = 'Hi\nName a colour.\n/set max_new_tokens 5\n/system Be brief.\nAgain?\n/undo\n"""Two\nlines"""\n'


def test_chat_with_server_prints_what_a_local_chat_prints(server, smollm2_gguf, tmp_path):
    """A chat on a pipe, with commands, against the server equals the same chat run locally (greedy and
    seeded); a transcript /saved through the server resumes there as it resumes locally."""
    for flags in (["--greedy", "-n", "10"], ["--seed", "7", "--temperature", "0.8", "-n", "8"]):
        remote = lmcli_with_key("chat", *flags, "--server", server.url, input=CHAT_INPUT)
        here = run_lmcli("chat", *flags, input=CHAT_INPUT)
        assert remote.returncode == here.returncode == 0, remote.stderr
        assert remote.stdout == here.stdout and remote.stdout.count(b"\n") == 4
    saved = tmp_path / "t.json"
    remote = lmcli_with_key("chat", "--greedy", "-n", "6", "--server", server.url, input=f"Hi\n/save {saved}\n")
    assert remote.returncode == 0, remote.stderr
    resumed = lmcli_with_key("chat", "--resume", str(saved), "--server", server.url, input="More\n")
    assert resumed.returncode == 0 and resumed.stdout == run_lmcli("chat", "--resume", str(saved), input="More\n").stdout
    # LMCLI_SERVER names the server; the path imports no torch; flags no request carries are one-line errors.
    env = subprocess_env(LMCLI_SERVER=server.url, LMCLI_API_KEY=API_KEY)
    timed = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmcli", "chat", "--greedy", "-n", "3"],
                           input="Hi\n", capture_output=True, text=True, env=env, timeout=120)
    assert timed.returncode == 0 and timed.stdout.strip(), timed.stderr
    imported = {line.split("|")[-1].strip() for line in timed.stderr.splitlines() if line.startswith("import time:")}
    assert "lmcli.serve.remote_chat" in imported and not {"torch", "numpy", "starlette"} & imported
    refused = lmcli_with_key("chat", "--min-p", "0.1", "--server", server.url, input="Hi\n")
    assert refused.returncode == 2 and refused.stderr.count(b"\n") == 1 and b"--min-p" in refused.stderr
    unset = lmcli_with_key("chat", "--server", server.url, input="Hi\n/set min_p 0.2\n")
    assert unset.returncode == 1 and b"min_p is not supported with --server" in unset.stderr


JOB_ROWS = [
    {"id": 1, "prompt": "The capital of France is", "max_new_tokens": 8, "temperature": 0},
    {"id": 2, "prompt": "Once upon a time", "max_new_tokens": 8, "seed": 5, "temperature": 0.8},
    {"id": "c", "prompt": "Name a colour.", "max_new_tokens": 6, "seed": 11, "top_p": 0.9},
    {"id": 4, "prompt": "Stop here: a, b", "max_new_tokens": 8, "temperature": 0, "stop": [","]},
    {"id": 5, "prompt": "Count: 1, 2,", "max_new_tokens": 6, "seed": 2, "logit_bias": {"2": -100}},
    {"id": 6, "prompt": ""},  # a bad row: an error row in both
]
OPENAI_ROWS = [
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}},
    {"custom_id": "b", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "The sky is", "max_tokens": 6, "seed": 3, "logprobs": 2}},
    {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Yo"}], "max_tokens": 5, "seed": 9, "logprobs": True,
              "top_logprobs": 1}},
]


def job_rows(path) -> dict[str, dict]:
    """A job's output rows by id (the output is in completion order); a response's `created` time apart."""
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        body = (row.get("response") or {}).get("body")
        if body:
            body.pop("created")
        rows[str(row.get("custom_id", row.get("id")))] = row
    return rows


def test_a_job_through_the_server_writes_a_local_jobs_rows(server, smollm2_gguf, tmp_path):
    """`generate --input --server` writes the rows a local job writes (greedy, seeded, stop, logit_bias, bad
    rows; lmcli rows and OpenAI batch rows with logprobs), and resumes a partial output as a local job does."""
    for name, rows in (("rows", JOB_ROWS), ("openai", OPENAI_ROWS)):
        given = tmp_path / f"{name}.jsonl"
        given.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        remote, here = tmp_path / f"{name}-remote.jsonl", tmp_path / f"{name}-local.jsonl"
        ran = lmcli_with_key("generate", "--input", str(given), "-o", str(remote), "--batch-size", "3",
                             "--server", server.url)
        local_run = run_lmcli("generate", "--input", str(given), "-o", str(here))
        assert ran.returncode == local_run.returncode, ran.stderr
        assert job_rows(remote) == job_rows(here) and len(job_rows(here)) == len(rows)
    # Resume: two finished rows and a partial line (a kill mid-write) are kept / dropped as locally.
    given = tmp_path / "rows.jsonl"
    lines = (tmp_path / "rows-local.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    finished = [line for line in lines if '"error"' not in line][:2]
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(finished) + lines[-1][:40], encoding="utf-8")
    resumed = lmcli_with_key("generate", "--input", str(given), "-o", str(partial), "--resume", "--server", server.url)
    assert resumed.returncode == 1 and b"2 already done" in resumed.stderr, resumed.stderr  # row 6 fails again
    assert job_rows(partial) == job_rows(tmp_path / "rows-local.jsonl")
    assert partial.read_text(encoding="utf-8").splitlines(keepends=True)[:2] == finished
    # A row the server cannot take is that row's error; the path imports no torch.
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"id": 1, "prompt": "x", "min_p": 0.2}\n', encoding="utf-8")
    env = subprocess_env(LMCLI_SERVER=server.url, LMCLI_API_KEY=API_KEY)
    timed = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmcli", "generate", "--input", str(odd)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert timed.returncode == 1 and "min_p is not supported with --server" in json.loads(timed.stdout)["error"]
    imported = {line.split("|")[-1].strip() for line in timed.stderr.splitlines() if line.startswith("import time:")}
    assert "lmcli.serve.remote_job" in imported and not {"torch", "numpy", "starlette"} & imported


def test_the_fast_path_takes_generates_flags_as_the_typer_command_declares_them():
    """lmcli.serve.fast's table is the `generate` command's own: every flag of those parameters, with its
    kind (switch, repeatable, number); and what it parses is what Typer hands the command."""
    import typer.main
    from typer.testing import CliRunner

    from lmcli import cli
    from lmcli.serve import client, fast

    command = typer.main.get_command(cli.app).commands["generate"]  # type: ignore[attr-defined]
    declared = {}
    for param in command.params:
        if param.name in {name for name, _ in fast.FLAGS.values()}:
            for flag in (*param.opts, *param.secondary_opts):
                declared[flag] = (param.name, None if param.is_flag else list if param.multiple
                                  else param.type_descriptor.annotation if param.type_descriptor.annotation in (int, float)
                                      else str)
    assert declared == fast.FLAGS
    argv = ["generate", "--greedy", "-n", "7", "--stop", "\\n", "--stop=x", "--logit-bias", "5=-1", "--chat",
            "--system", "S", "--seed", "-3", "--max-tokens=9", "--server", "http://h:1", "Hi", "--stats"]
    got: dict[str, Any] = {}
    original = client.generate
    try:
        client.generate = lambda url, prompt, decoding, **more: got.update(url=url, prompt=prompt, **decoding, **more)
        assert CliRunner().invoke(cli.app, argv).exit_code == 0
    finally:
        client.generate = original
    values = fast.parse(argv[1:])
    assert values is not None
    assert {name: values[name] for name in fast.DECODING} == {name: got[name] for name in fast.DECODING}
    assert (values["server"], values["prompt"], values["chat"], values["system"], values["stats"]) == \
        (got["url"], got["prompt"], got["chat"], got["system"], got["stats"])
    for other in (["--help"], ["-n5", "x"], ["--input", "f"], ["-n", "x", "y"], ["a", "b"], ["--greedy=1", "x"]):
        assert fast.parse(other) is None, other  # the full command line's own handling (and messages)


def test_the_fast_path_prints_what_the_full_path_prints(server):
    env = subprocess_env(LMCLI_SERVER=server.url, LMCLI_API_KEY=API_KEY)
    full = [sys.executable, "-c", "from lmcli.cli import main; main()"]
    fast = [sys.executable, "-X", "importtime", "-m", "lmcli"]
    for args in (["generate", "--greedy", "-n", "9", "The sky is"], ["generate", "--chat", "--seed", "4", "-n", "6", "Hi"],
                 ["generate", "--min-p", "0.1", "Hi"], ["generate", "--greedy", "--temperature", "2", "Hi"]):
        one, other = (subprocess.run([*how, *args], capture_output=True, text=True, env=env, timeout=120)
                      for how in (fast, full))
        assert (one.returncode, one.stdout) == (other.returncode, other.stdout), args
        assert [line for line in one.stderr.splitlines() if not line.startswith("import time:")] == \
            other.stderr.splitlines()
        imported = {line.split("|")[-1].strip() for line in one.stderr.splitlines() if line.startswith("import time:")}
        assert "lmcli.serve.fast" in imported and not {"typer", "lmcli.cli", "pydantic"} & imported


def test_the_server_keeps_prompt_blocks_on_disk_and_a_new_server_gives_the_same_text(tmp_path, reference):
    """`lmcli serve --prompt-cache DIR` (the default turns it on; the suite's conftest turns it off): a
    request's blocks are written to disk, and a new server reading them answers as `lmcli generate` does."""
    blocks = tmp_path / "prompts"
    prompt = "A long shared header for every question: " + "the river runs to the sea, " * 6 + "Question: name a fish."
    want = reference(prompt, temperature=0, max_new_tokens=8)
    for _ in range(2):  # the first server writes the blocks, the second reads them
        with serving(tmp_path, "--prompt-cache", str(blocks), "--context", "512") as served:
            got = client(served).completions.create(model="x", prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == want.text.text
        assert any(blocks.rglob("*.lmpb"))
