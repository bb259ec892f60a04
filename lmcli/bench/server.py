"""`lmcli bench --sections server`: `lmcli serve` as its clients see it, beside llama-cpp-python's server.

- Start-up of `lmcli generate --server URL --greedy -n 1` as a whole process, beside `python -c pass`,
  `python -c "import typer"` and `lmcli --help`: fresh processes, the kinds interleaved round after round,
  medians reported.
- Throughput: the job bench's chat questions (bench_job.target_job_rows, with its shared system
  message; a third of --job-rows, at least 16), made greedy, 64 tokens each with every special token
  banned (logit_bias -100, so no row ends early and every engine makes the same number of tokens), sent
  by 8 streaming clients at once to `lmcli serve` (batch 8) and to `python -m llama_cpp.server` on the
  same GGUF with the same thread count; and the same rows run as an lmcli job (jobs.run_job,
  continuous, batch 8) in this process on its own copy of the model while the servers idle. Each
  round's questions carry the round's number, so that no engine has seen them before (a server's
  prefix cache outlives a round, a job's does not). The three take turns in each round (the order
  reversed every other round) so that the shared machine's load falls on all of them alike, after a
  warm-up batch each that is not counted; 2 or 3 rounds (--repeats; 1 with --quick), medians of
  generated tokens per second of wall time. llama_cpp.server runs with `--interrupt_requests False`:
  by default it cuts a stream short whenever another request waits, which would not be the same work.
- First-token latency: C clients (1, 8, 32) each sending short streaming requests one after another, so
  new requests keep joining a busy batch; p50 and p99 of the time from sending to the first text, for
  each server (the servers alternating within each client count).

llama_cpp.server is measured only when it imports (`make bench-deps`) and the model is a GGUF file;
otherwise the result says why it was left out. The servers run in subprocesses on free 127.0.0.1 ports
and are stopped (SIGTERM) at the end.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"
CLIENTS = 8
LATENCY_CLIENTS = (1, 8, 32)
LATENCY_TOKENS = 16
SERVE_TOKENS = 64  # each throughput row's max_tokens (and its tokens: special tokens are banned)
START_SECONDS = 300
LMCLI, LLAMA_CPP = "lmcli", "llama.cpp"


def measure(settings: Any, resolved: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    path = str(resolved.path) if resolved.path is not None else None
    model_flag = ["-c", path] if path else []
    quick = settings.repeats <= 1
    threads = settings.threads or _lmcli_threads()
    env = server_env(os.environ, settings.threads)
    why_not = llama_cpp_missing(path)
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-server-") as scratch, contextlib.ExitStack() as stack:
        progress("server: starting lmcli serve")
        lmcli_log = Path(scratch) / "serve.log"
        server = stack.enter_context(_process(
            [sys.executable, "-m", "lmcli", "serve", *model_flag, "--port", "0", "--batch-size", str(CLIENTS),
             "--max-queue", "256"], lmcli_log, env))
        urls = {LMCLI: _wait_for(server, lmcli_log)}
        if why_not is None:
            assert path is not None
            progress("server: starting llama_cpp.server")
            port = _free_port()
            llama_log = Path(scratch) / "llama_cpp.log"
            llama = stack.enter_context(_process(llama_cpp_command(path, port, threads), llama_log, env))
            urls[LLAMA_CPP] = _wait_for_llama_cpp(llama, llama_log, f"http://127.0.0.1:{port}")
        startup = _startup(urls[LMCLI], model_flag, env, 3 if quick else max(5, settings.repeats), progress)
        rounds = 1 if quick else min(3, max(2, settings.repeats))
        throughput = _throughput(urls, resolved, settings.threads, max(16, settings.job_rows // 3), SERVE_TOKENS,
                                 rounds, progress)
        latency = _latency(urls, 2 if quick else 3, progress)
    return {"startup": startup, "throughput": throughput, "latency": latency, "batch_size": CLIENTS,
            "threads": threads, "llama_cpp": why_not or f"llama_cpp.server {_llama_cpp_version()}"}


def _lmcli_threads() -> int:
    """lmcli's thread count for this machine at the start (its free CPUs: lmcli.threads), which
    llama_cpp.server gets too. lmcli's own follows the load from there; llama.cpp's is fixed, and more
    threads than free cores stall its every barrier (it then makes about 1 token a second here)."""
    from lmcli import threads

    return threads.configure().threads or len(os.sched_getaffinity(0))


def server_env(environ: Any, threads: int | None) -> dict[str, str]:
    """The servers' environment: no API key; lmcli's thread variables left for the server to choose
    afresh, or OMP_NUM_THREADS fixed at `threads` (--threads) as the user's own setting."""
    from lmcli.threads import SET_BY_LMCLI_VAR

    env = dict(environ)
    env.pop("LMCLI_API_KEY", None)
    for name in env.pop(SET_BY_LMCLI_VAR, "").split(","):
        if name:
            env.pop(name, None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def llama_cpp_missing(path: str | None) -> str | None:
    """Why llama_cpp.server is left out of the comparison, or None when it can run on this model."""
    if path is None or not path.endswith(".gguf"):
        return "not measured: the model is not a GGUF file"
    if importlib.util.find_spec("llama_cpp") is None:
        return "not measured: llama-cpp-python is not installed (make bench-deps)"
    if importlib.util.find_spec("llama_cpp.server") is None:
        return "not measured: llama-cpp-python's server extra is not installed (make bench-deps)"
    return None


def llama_cpp_command(path: str, port: int, threads: int) -> list[str]:
    # Requests one after another on its one model (its server has no batching across requests), not cut
    # short when another arrives; its default context (2048) holds every row here.
    return [sys.executable, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--interrupt_requests", "False"]


def _llama_cpp_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return "?"


@contextlib.contextmanager
def _process(command: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """A server subprocess, its stderr (and stdout) in `log`; SIGTERM, then kill, when done."""
    with log.open("w", encoding="utf-8") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(server: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and server.poll() is None:
        found = re.search(r"on (http://[^\s]+)/v1 ", log.read_text(encoding="utf-8"))
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise RuntimeError(f"bench --sections server: the server did not start: {log.read_text(encoding='utf-8')[-500:]}")


def _wait_for_llama_cpp(server: subprocess.Popen, log: Path, url: str) -> str:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and server.poll() is None:
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        with contextlib.suppress(OSError):
            connection.request("GET", "/v1/models")
            if connection.getresponse().status == 200:
                return url
        connection.close()
        time.sleep(0.3)
    raise RuntimeError("bench --sections server: llama_cpp.server did not start: "
                       f"{log.read_text(encoding='utf-8', errors='replace')[-500:]}")


def _startup(url: str, model_flag: list[str], env: dict[str, str], rounds: int,
             progress: Callable[[str], None]) -> dict[str, Any]:
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import typer'": [sys.executable, "-c", "import typer"],
        "lmcli --help": [sys.executable, "-m", "lmcli", "--help"],
        "lmcli generate --server URL -n 1": [sys.executable, "-m", "lmcli", "generate", "--server", url, "--greedy",
                                             "-n", "1", PROMPT],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for r in range(rounds):
        progress(f"server: start-up, round {r + 1} of {rounds}")
        for name, command in commands.items():
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, timeout=300)
            if done.returncode == 0:
                times[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(values), 3) if values else None for name, values in times.items()}


def throughput_rows(count: int, max_tokens: int, banned: list[int]) -> list[dict[str, Any]]:
    """The job bench's chat rows, greedy, `max_tokens` each, with no special token allowed (so that every
    row runs to its max_tokens on every engine): job rows, which `request_body` turns into requests."""
    from lmcli.bench.job import target_job_rows

    bias = {str(token): -100 for token in banned}
    return [{"id": row["id"], "system": row["system"], "prompt": row["prompt"], "max_new_tokens": max_tokens,
             "temperature": 0, "logit_bias": bias} for row in target_job_rows(count)]


def request_body(row: dict[str, Any], usage: bool = True) -> dict[str, Any]:
    """A job row as a streaming chat request (stream_options only where the server takes it)."""
    body: dict[str, Any] = {"messages": [{"role": "system", "content": row["system"]},
                                         {"role": "user", "content": row["prompt"]}],
                            "max_tokens": row["max_new_tokens"], "temperature": row["temperature"], "stream": True}
    if "logit_bias" in row:
        body["logit_bias"] = row["logit_bias"]
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streaming chat request: seconds to the first text, its text, completion tokens (the usage
    chunk's, else the content chunks counted), its finish reason."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    started = time.perf_counter()
    first, usage, chunks, finish, pieces = None, None, 0, None, []
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"bench --sections server: {url}: {response.status} {response.read()[:200]!r}")
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                raise RuntimeError(f"bench --sections server: {url}: {payload['error']}")
            for choice in payload.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    pieces.append(piece)
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - started
                finish = choice.get("finish_reason") or finish
            if payload.get("usage"):
                usage = payload["usage"]["completion_tokens"]
    finally:
        connection.close()
    return {"first": first, "tokens": usage if usage is not None else chunks, "finish": finish,
            "text": "".join(pieces)}


def _clients(url: str, bodies: list[dict[str, Any]], clients: int) -> tuple[float, list[dict[str, Any]]]:
    """Send `bodies` from `clients` threads, each taking the next body when its last one ends."""
    results: list[Any] = [None] * len(bodies)
    failures: list[BaseException] = []
    lock = threading.Lock()
    todo = iter(range(len(bodies)))

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None or failures:
                return
            try:
                results[i] = _stream(url, bodies[i])
            except (OSError, RuntimeError, ValueError) as e:
                failures.append(e)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"bench --sections server: a request to {url} failed: {failures[0]}")
    return time.perf_counter() - started, results


def _throughput(urls: dict[str, str], resolved: Any, threads: int | None, count: int, max_tokens: int, rounds: int,
                progress: Callable[[str], None]) -> dict[str, Any]:
    import io

    import lmcli
    from lmcli.jobs.runner import JobOutput, run_job
    from lmcli.settings.generation_settings import GenerationSettings

    progress("server: loading the model for the job")
    model, tokenizer = lmcli.load(resolved)
    if threads is not None:  # --threads: the job's too (else it follows the load, as the server's does)
        from lmcli import threads as lmcli_threads

        lmcli_threads.configure(threads)
    banned = sorted(set(tokenizer.special_ids or ()) | set(tokenizer.eos_token_ids or ()))
    base_rows = rows = throughput_rows(count, max_tokens, banned)
    rates: dict[str, list[float]] = {name: [] for name in (*urls, "job")}
    texts: dict[str, dict[int, str]] = {}
    counts_equal = True

    def once(name: str, path: Path, rows: list[dict[str, Any]], tokens: int) -> tuple[float, dict[int, str], bool]:
        """One engine through `rows`: (generated tok/s, each row's text, whether each made `tokens`)."""
        if name == "job":
            out = io.StringIO()
            started = time.perf_counter()
            report = run_job(path, JobOutput(out), GenerationSettings(chat=True).with_model_defaults(
                resolved.defaults), load=lambda: (model, tokenizer), batch_size=CLIENTS)
            rate = report.tokens / (time.perf_counter() - started)
            records = [json.loads(line) for line in out.getvalue().splitlines()]
            return rate, {record["id"]: record["completion"] for record in records}, report.tokens == len(rows) * tokens
        bodies = [request_body(row, usage=name == LMCLI) for row in rows]
        seconds, results = _clients(urls[name], bodies, CLIENTS)
        rate = sum(result["tokens"] for result in results) / seconds
        return (rate, {row["id"]: result["text"] for row, result in zip(rows, results)},
                all(result["finish"] == "length" for result in results))

    with tempfile.TemporaryDirectory(prefix="lmcli-bench-server-job-") as scratch:
        # Not counted: each engine's first batch (its first requests, buffers, the prefix cache's system
        # message) on other questions, so that round 1 measures what the later rounds measure.
        warm_rows = [dict(row, id=f"warm-{row['id']}", max_new_tokens=8, prompt=f"{row['prompt']} Say it briefly.")
                     for row in rows[:CLIENTS]]
        warm_path = Path(scratch) / "warm.jsonl"
        warm_path.write_text("".join(json.dumps(row) + "\n" for row in warm_rows), encoding="utf-8")
        for name in (*urls, "job"):
            progress(f"server: warming up {name}")
            once(name, warm_path, warm_rows, 8)
        for r in range(rounds):
            # Each round's questions are new to every engine: a server keeps its prefix cache between
            # rounds (a prompt seen before needs no prefill at all), a job starts each run with an empty one.
            rows = [dict(row, prompt=f"{row['prompt']} (Question {r + 1}.{row['id']}.)") for row in base_rows]
            path = Path(scratch) / f"rows-{r + 1}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
            order = [*urls, "job"]
            for name in order if r % 2 == 0 else reversed(order):
                what = f"the same rows as a job (batch {CLIENTS})" if name == "job" else \
                    f"{len(rows)} rows from {CLIENTS} streaming clients to {name}"
                progress(f"server: {what}, round {r + 1} of {rounds}")
                rate, texts[name], equal = once(name, path, rows, max_tokens)
                rates[name].append(rate)
                counts_equal = counts_equal and equal
    median = {name: statistics.median(values) for name, values in rates.items()}
    figures: dict[str, Any] = {
        "rows": len(rows), "clients": CLIENTS, "max_tokens": max_tokens, "rounds": rounds,
        "served_tokens_per_s": round(median[LMCLI], 2), "job_tokens_per_s": round(median["job"], 2),
        "ratio": round(median[LMCLI] / median["job"], 3),
        "same_text": texts[LMCLI] == texts["job"],  # greedy, batch-invariant: the served rows are the job's
        "equal_token_counts": counts_equal,  # every row of every engine ran to max_tokens
        "each_round": {name: [round(v, 2) for v in values] for name, values in rates.items()},
        # Within a round the three ran back to back: on a shared machine these move less than the rates.
        "each_round_serve_vs_job": [round(a / b, 3) for a, b in zip(rates[LMCLI], rates["job"])]}
    if LLAMA_CPP in urls:
        figures["llama_cpp_tokens_per_s"] = round(median[LLAMA_CPP], 2)
        figures["vs_llama_cpp"] = round(median[LMCLI] / median[LLAMA_CPP], 3)
        figures["each_round_serve_vs_llama_cpp"] = [round(a / b, 3) for a, b in zip(rates[LMCLI], rates[LLAMA_CPP])]
        # Different kernels and rounding: greedy texts agree for a while, then may part.
        figures["llama_cpp_same_text_rows"] = sum(texts[LLAMA_CPP][i] == text for i, text in texts[LMCLI].items())
        figures["llama_cpp_common_prefix_chars"] = statistics.median(
            _common_prefix(texts[LLAMA_CPP][i], text) for i, text in texts[LMCLI].items())
    return figures


def _common_prefix(a: str, b: str) -> int:
    """How many characters two texts share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _latency(urls: dict[str, str], each: int, progress: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, dict[str, Any]] = {name: {} for name in urls}
    for k, clients in enumerate(LATENCY_CLIENTS):
        # New questions at each client count: none found whole in lmcli's prefix cache.
        bodies = [{"messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea ({clients})."}],
                   "max_tokens": LATENCY_TOKENS, "temperature": 0, "stream": True} for i in range(clients * each)]
        names = list(urls) if k % 2 == 0 else list(reversed(urls))
        for name in names:
            progress(f"server: first-token latency, {clients} clients, {name}")
            _, results = _clients(urls[name], bodies, clients)
            out[name][str(clients)] = percentiles([r["first"] for r in results if r["first"] is not None],
                                                  len(bodies))
    return out


def percentiles(firsts: list[float], requests: int) -> dict[str, Any]:
    """p50 and p99 (nearest rank) of first-token times."""
    firsts = sorted(firsts)
    if not firsts:
        return {"requests": requests, "p50": None, "p99": None}
    p99 = firsts[min(len(firsts) - 1, round(0.99 * (len(firsts) - 1)))]
    return {"requests": requests, "p50": round(statistics.median(firsts), 3), "p99": round(p99, 3)}


def report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title="Server: whole-process start-up (median, seconds)")
    table.add_column("command")
    table.add_column("seconds", justify="right")
    for name, seconds in result["startup"].items():
        table.add_row(name, "-" if seconds is None else f"{seconds:.3f}")
    console.print(table)
    t = result["throughput"]
    llama = "llama_cpp_tokens_per_s" in t
    table = Table(title=f"Server: {t['rows']} greedy chat rows of {t['max_tokens']} tokens, {t['clients']} streaming "
                        f"clients, against the same rows as a job (batch {result['batch_size']}), "
                        f"{result['threads']} threads, median of {t['rounds']}")
    for column in ("lmcli serve tok/s", "job tok/s", "serve / job", "same text as job",
                   *(("llama_cpp.server tok/s", "serve / llama_cpp") if llama else ())):
        table.add_column(column, justify="right")
    table.add_row(f"{t['served_tokens_per_s']:.1f}", f"{t['job_tokens_per_s']:.1f}", f"{t['ratio']:.2f}",
                  "yes" if t["same_text"] else "NO",
                  *((f"{t['llama_cpp_tokens_per_s']:.1f}", f"{t['vs_llama_cpp']:.2f}") if llama else ()))
    console.print(table)
    if not llama:
        console.print(f"llama_cpp.server: {result['llama_cpp']}")
    if not t["equal_token_counts"]:
        console.print("note: some rows ended before max_tokens, so the engines did not make equal token counts")
    table = Table(title=f"Server: first-token latency (s), requests of {LATENCY_TOKENS} tokens joining a busy batch")
    table.add_column("clients", justify="right")
    table.add_column("requests", justify="right")
    for name in result["latency"]:
        label = "lmcli serve" if name == LMCLI else "llama_cpp.server"
        table.add_column(f"{label} p50", justify="right")
        table.add_column(f"{label} p99", justify="right")
    for clients in (str(c) for c in LATENCY_CLIENTS):
        cells = []
        requests = 0
        for figures in result["latency"].values():
            requests = figures[clients]["requests"]
            cells += ["-" if figures[clients][k] is None else f"{figures[clients][k]:.3f}" for k in ("p50", "p99")]
        table.add_row(clients, str(requests), *cells)
    console.print(table)
