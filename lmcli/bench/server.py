"""`lmcli bench --sections server`: `lmcli serve` as its clients see it.

- Start-up of `lmcli generate --server URL --greedy -n 1` as a whole process, beside `python -c pass`,
  `python -c "import typer"` and `lmcli --help`: fresh processes, the kinds interleaved round after round,
  medians reported.
- Throughput: the job bench's target rows (bench_job.target_job_rows: chat rows with a shared system
  message, greedy and sampled) sent by 8 streaming clients at once, against the same rows run as a job
  (jobs.run_job, continuous, batch 8) in this process on its own copy of the model while the server
  idles; the two interleaved. Generated tokens per second of wall time, and their ratio.
- First-token latency: C clients (1, 8, 32) each sending short streaming requests one after another, so
  new requests keep joining a busy batch; p50 and p99 of the time from sending to the first text.

The server runs in a subprocess on 127.0.0.1 (a free port), batch 8; it is stopped (SIGTERM) at the end.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"
CLIENTS = 8
LATENCY_CLIENTS = (1, 8, 32)
LATENCY_TOKENS = 16
START_SECONDS = 300


def measure(settings: Any, resolved: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    path = str(resolved.path) if resolved.path is not None else None
    model_flag = ["-c", path] if path else []
    quick = settings.repeats <= 1
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-server-") as scratch:
        log = Path(scratch) / "serve.log"
        env = dict(os.environ)
        env.pop("LMCLI_API_KEY", None)
        if settings.threads:
            env["OMP_NUM_THREADS"] = str(settings.threads)
        progress("server: starting lmcli serve")
        with log.open("w", encoding="utf-8") as err:
            server = subprocess.Popen([sys.executable, "-m", "lmcli", "serve", *model_flag, "--port", "0",
                                       "--batch-size", str(CLIENTS), "--max-queue", "256"],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            url = _wait_for(server, log)
            startup = _startup(url, model_flag, env, 3 if quick else max(5, settings.repeats), progress)
            rows = _rows(16 if quick else settings.job_rows)
            throughput = _throughput(url, rows, resolved, 1 if quick else 2, progress)
            latency = {str(c): _latency(url, c, 2 if quick else 4, progress) for c in LATENCY_CLIENTS}
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
    return {"startup": startup, "throughput": throughput, "latency": latency, "batch_size": CLIENTS}


def _wait_for(server: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and server.poll() is None:
        found = re.search(r"on (http://[^\s]+)/v1 ", log.read_text(encoding="utf-8"))
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise RuntimeError(f"bench --sections server: the server did not start: {log.read_text(encoding='utf-8')[-500:]}")


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


def _rows(count: int) -> list[dict[str, Any]]:
    from lmcli.bench.job import target_job_rows

    return target_job_rows(count)


def _body(row: dict[str, Any], stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": row["system"]},
                                         {"role": "user", "content": row["prompt"]}],
                            "max_tokens": row["max_new_tokens"], "temperature": row["temperature"]}
    for name in ("seed", "top_p"):
        if name in row:
            body[name] = row[name]
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _stream(url: str, body: dict[str, Any]) -> tuple[float | None, int, str]:
    """(seconds to the first text, completion tokens, text) of one streaming request."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    started = time.perf_counter()
    first, tokens, pieces = None, 0, []
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"bench --sections server: {response.status} {response.read()[:200]!r}")
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            for choice in payload.get("choices") or ():
                piece = choice["delta"].get("content")
                if piece:
                    pieces.append(piece)
                    if first is None:
                        first = time.perf_counter() - started
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    finally:
        connection.close()
    return first, tokens, "".join(pieces)


def _clients(url: str, bodies: list[dict[str, Any]], clients: int) -> tuple[float, list[tuple[float | None, int, str]]]:
    """Send `bodies` from `clients` threads, each taking the next body when its last one ends."""
    results: list[Any] = [None] * len(bodies)
    lock = threading.Lock()
    todo = iter(range(len(bodies)))

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = _stream(url, bodies[i])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, results


def _throughput(url: str, rows: list[dict[str, Any]], resolved: Any, rounds: int,
                progress: Callable[[str], None]) -> dict[str, Any]:
    import io

    import lmcli
    from lmcli.jobs.runner import JobOutput, run_job
    from lmcli.settings.generation_settings import GenerationSettings

    progress("server: loading the model for the job")
    model, tokenizer = lmcli.load(resolved)
    served_rates, job_rates = [], []
    same = True
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-server-job-") as scratch:
        path = Path(scratch) / "rows.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        for r in range(rounds):
            progress(f"server: {len(rows)} rows from {CLIENTS} streaming clients, round {r + 1} of {rounds}")
            seconds, results = _clients(url, [_body(row) for row in rows], CLIENTS)
            served_rates.append(sum(tokens for _, tokens, _ in results) / seconds)
            progress(f"server: the same rows as a job, round {r + 1} of {rounds}")
            out = io.StringIO()
            started = time.perf_counter()
            report = run_job(path, JobOutput(out), GenerationSettings(chat=True).with_model_defaults(resolved.defaults),
                             load=lambda: (model, tokenizer), batch_size=CLIENTS)
            job_rates.append(report.tokens / (time.perf_counter() - started))
            by_id = {json.loads(line)["id"]: json.loads(line)["completion"] for line in out.getvalue().splitlines()}
            same = same and all(by_id[row["id"]] == text for row, (_, _, text) in zip(rows, results))
    served, job = statistics.median(served_rates), statistics.median(job_rates)
    return {"rows": len(rows), "clients": CLIENTS, "served_tokens_per_s": round(served, 2),
            "job_tokens_per_s": round(job, 2), "ratio": round(served / job, 3), "same_text": same}


def _latency(url: str, clients: int, each: int, progress: Callable[[str], None]) -> dict[str, Any]:
    progress(f"server: first-token latency, {clients} clients")
    bodies = [{"messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea."}],
               "max_tokens": LATENCY_TOKENS, "temperature": 0, "stream": True} for i in range(clients * each)]
    _, results = _clients(url, bodies, clients)
    firsts = sorted(first for first, _, _ in results if first is not None)
    if not firsts:
        return {"requests": len(bodies), "p50": None, "p99": None}
    p99 = firsts[min(len(firsts) - 1, round(0.99 * (len(firsts) - 1)))]
    return {"requests": len(bodies), "p50": round(statistics.median(firsts), 3), "p99": round(p99, 3)}


def report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title="Server: whole-process start-up (median, seconds)")
    table.add_column("command")
    table.add_column("seconds", justify="right")
    for name, seconds in result["startup"].items():
        table.add_row(name, "-" if seconds is None else f"{seconds:.3f}")
    console.print(table)
    t = result["throughput"]
    table = Table(title=f"Server: {t['rows']} chat rows, {t['clients']} streaming clients against the same rows as a "
                        f"job (batch {result['batch_size']})")
    for column in ("served tok/s", "job tok/s", "served / job", "same text"):
        table.add_column(column, justify="right")
    table.add_row(f"{t['served_tokens_per_s']:.1f}", f"{t['job_tokens_per_s']:.1f}", f"{t['ratio']:.2f}",
                  "yes" if t["same_text"] else "NO")
    console.print(table)
    table = Table(title=f"Server: first-token latency, requests of {LATENCY_TOKENS} tokens joining a busy batch")
    for column in ("clients", "requests", "p50 s", "p99 s"):
        table.add_column(column, justify="right")
    for clients, figures in result["latency"].items():
        table.add_row(clients, str(figures["requests"]), *(
            "-" if figures[k] is None else f"{figures[k]:.3f}" for k in ("p50", "p99")))
    console.print(table)
