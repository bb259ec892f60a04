"""`lmcli serve` in a subprocess on a free 127.0.0.1 port, and what a request gets from `lmcli generate`'s
own path in this process (the reference the server's answers are checked against)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli_fixtures import subprocess_env

START_SECONDS = 180  # a cold start on the busy 2-core machine: torch, the model, the first request's kernels
API_KEY = "test-key-4f1c"


@dataclass
class Served:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path  # its stderr: the start line, then one JSON line per request

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def records(self) -> list[dict]:
        """The request log so far (--log-format json)."""
        out = []
        for line in self.log.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and "path" in record:
                    out.append(record)
        return out

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@contextlib.contextmanager
def serving(tmp: Path, *args: str, api_key: str | None = API_KEY) -> Iterator[Served]:
    """`lmcli serve --port 0 ARGS` (the default model), once it says where it listens; stopped after."""
    log = tmp / f"serve-{time.time_ns()}.log"
    env = subprocess_env()
    env.pop("LMCLI_API_KEY", None)
    if api_key is not None:
        env["LMCLI_API_KEY"] = api_key
    with log.open("w", encoding="utf-8") as err:
        process = subprocess.Popen([sys.executable, "-m", "lmcli", "serve", "--port", "0", "--log-format", "json",
                                    *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
    served = None
    try:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline and process.poll() is None:
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text(encoding="utf-8"))
            if found:
                served = Served(process, found.group(1), log)
                break
            time.sleep(0.2)
        assert served is not None, f"the server did not start: {log.read_text(encoding='utf-8')[-2000:]}"
        yield served
    finally:
        if served is not None:
            served.stop()
        elif process.poll() is None:
            process.kill()
            process.wait(10)


def local(model: Any, tokenizer: Any, defaults: Any, prompt: str | list[dict], *, chat: bool = False,
          **flags: Any) -> Any:
    """What `lmcli generate` makes of `prompt` with these flags (runs.generate_one's path: settings from
    the flags over the model's defaults, then generate_batch on the row alone): its RowResult."""
    from lmcli.generation.rows import generate_batch, prepare_row
    from lmcli.settings.generation_settings import GenerationSettings

    logprobs = flags.pop("logprobs", None)
    settings = GenerationSettings.from_flags(chat=chat, **flags).with_model_defaults(defaults)
    if isinstance(prompt, list):  # an OpenAI chat's messages: the row encodes them with the template
        settings = dataclasses.replace(settings, chat=True)
    settings = dataclasses.replace(settings, logprobs=logprobs)
    row = prepare_row(tokenizer, 1, prompt, settings)
    [result] = generate_batch(model, tokenizer, [row])
    return result


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env_without_key() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LMCLI_API_KEY", None)
    return env
