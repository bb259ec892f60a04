"""`lmcli bench`'s parent side of the measuring: the worker processes, the interleaved rounds, and the
figures made from their replies (pure functions, also used by the workers)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from lmcli.bench.background_load import BackgroundLoad, Loaded
from lmcli.bench.settings import BenchSettings
from lmcli.bench.synthetic import TEXT_PROMPTS

if TYPE_CHECKING:  # torch loads only when a benchmark runs: `lmcli --help` stays quick
    import torch

# ----------------------------------------------------------------------------- figures (pure functions)


def decode_rate(stamps: Sequence[float], batch: int) -> float:
    """Tokens/s between the first and the last token's timestamp (the prefill before the first is excluded)."""
    if len(stamps) < 2:
        return float("nan")
    return batch * (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


def greedy_agreement(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> dict[str, float]:
    """How far `candidate`'s greedy continuations follow `reference`'s: identical ones, and the mean share
    of tokens generated before the first divergence (after it, the two continue from different texts)."""
    identical, shares = 0, []
    for ref, cand in zip(reference, candidate, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=False)) if a != b), min(len(ref), len(cand)))
        identical += same == len(ref) == len(cand)
        shares.append(same / max(len(ref), 1))
    return {"identical": identical, "prompts": len(reference), "tokens_before_divergence": statistics.fmean(shares)}


def mean_kl_divergence(reference_logprobs: torch.Tensor, candidate_logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || candidate), both [T, vocab] log-probabilities."""
    p = reference_logprobs.exp()
    return float((p * (reference_logprobs - candidate_logprobs)).sum(-1).mean())


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ----------------------------------------------------------------------------- the parent side


@dataclass
class Worker:
    name: str  # the key in the results: "lmcli float", "transformers", ...
    spec: dict[str, Any]
    process: subprocess.Popen | None = None
    log: IO[str] | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None
    env: dict[str, str | None] = field(default_factory=dict)  # changes to this process's environment (None: unset)

    def start(self) -> None:
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, **{k: v for k, v in self.env.items() if v is not None}}
        for name in [k for k, v in self.env.items() if v is None]:
            env.pop(name, None)
        self.process = subprocess.Popen([sys.executable, "-m", "lmcli.bench.worker", json.dumps(self.spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        bufsize=1, env=env)

    def reply(self) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            assert self.log is not None
            self.log.seek(0)
            tail = self.log.read().strip().splitlines()[-3:]
            return {"error": f"worker exited ({self.process.returncode}): {' | '.join(tail) or 'no output'}"}
        return json.loads(line)

    def wait_ready(self) -> None:
        message = self.reply()
        if message.get("ready"):
            self.ready = message
        else:
            self.failure = message.get("unsupported") or message.get("error") or "did not start"
            self.stop()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.failure is not None:
            return {"unsupported": self.failure}
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError as exc:
            return {"error": f"worker gone: {exc}"}
        return self.reply()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.log is not None:
            self.log.close()
            self.log = None


def _first_error(replies: list[dict[str, Any]]) -> str | None:
    for reply in replies:
        if "unsupported" in reply or "error" in reply:
            return reply.get("unsupported") or reply.get("error")
    return None



def _measure_engines(settings: BenchSettings, workers: list[Worker], progress,
                     load: BackgroundLoad | None = None) -> dict[str, dict[str, Any]]:
    """Prefill and decode figures of every worker; with `load`, each piece of work is also done while the
    busy loops spin (the figures prefixed "shared_")."""
    work = [("prefill", {"op": "generate", "batch": 1, "context": settings.prefill_tokens, "new": 1})]
    for batch in settings.batch_sizes:
        work.append((f"decode_b{batch}", {"op": "generate", "batch": batch, "context": settings.prompt_tokens,
                                          "new": settings.new_tokens, "tokens": batch == 1}))
    phases = [("", None), *([("shared_", load)] if load is not None and load.count else [])]
    replies: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for round_ in range(settings.repeats):
        progress(f"round {round_ + 1}/{settings.repeats}")
        for label, request in work:
            for prefix, busy in phases:
                for worker in workers:  # interleaved: each worker does this piece of work in turn
                    with Loaded(busy):
                        replies.setdefault((worker.name, prefix + label), []).append(worker.ask(request))
    engines = {}
    for worker in workers:
        figures: dict[str, Any] = {}
        if worker.failure is not None:
            engines[worker.name] = {"unavailable": worker.failure}
            continue
        figures.update({k: v for k, v in worker.ready.items() if k != "ready"})
        for prefix, _ in phases:
            figures.update(_engine_figures(settings, replies, worker.name, prefix))
        figures["peak_rss_bytes"] = worker.ask({"op": "peak_rss"}).get("peak_rss_bytes")
        engines[worker.name] = figures
    return engines


def _engine_figures(settings: BenchSettings, replies: dict[tuple[str, str], list[dict[str, Any]]], name: str,
                    prefix: str) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    prefill = replies[(name, prefix + "prefill")]
    error = _first_error(prefill)
    if error is None:
        figures[prefix + "ttft_s"] = _median([r["ttft_s"] for r in prefill])
        figures[prefix + "prefill_tokens_per_s"] = settings.prefill_tokens / figures[prefix + "ttft_s"]
    else:
        figures[prefix + "prefill_unavailable"] = error
    for batch in settings.batch_sizes:
        decode = replies[(name, f"{prefix}decode_b{batch}")]
        error = _first_error(decode)
        if error is None:
            figures[f"{prefix}decode_b{batch}_tokens_per_s"] = _median([r["decode_tokens_per_s"] for r in decode])
            if batch == 1:  # torch's (or llama.cpp's) thread count as each run ended: lmcli's follows the load
                figures[f"{prefix}decode_b1_threads"] = [r.get("threads") for r in decode]
            if batch == 1 and not prefix:
                figures["tokens"] = decode[-1]["tokens"]
        else:
            figures[f"{prefix}decode_b{batch}_unavailable"] = error
    return figures


def _add_ratios(engines: dict[str, dict[str, Any]]) -> None:
    """Each lmcli format's speed as a multiple of transformers' and llama.cpp's (higher is faster)."""
    for name, figures in engines.items():
        if not name.startswith("lmcli"):
            continue
        keys = [k for k in figures if k.endswith("_tokens_per_s")]
        for other in ("transformers", "llama.cpp"):
            theirs = engines.get(other, {})
            ratios = {key: figures[key] / theirs[key] for key in keys if key in figures and theirs.get(key)}
            if ratios:
                figures[f"vs_{other}"] = ratios


def _lmcli_worker(workers: list[Worker], preferred: Sequence[str]) -> Worker | None:
    by_name = {w.name: w for w in workers if w.failure is None}
    return next((by_name[f"lmcli {fmt}"] for fmt in preferred if f"lmcli {fmt}" in by_name), None)


def _measure_scaling(settings: BenchSettings, workers: list[Worker], progress) -> dict[str, Any]:
    """How decode speed falls with context and rises with batch, for lmcli's native (else float) weights."""
    worker = _lmcli_worker(workers, ("native", "float", "int4", "int8"))
    if worker is None or not (settings.scaling_contexts or settings.scaling_batches):
        return {}
    base_context = min(settings.scaling_contexts, default=settings.prompt_tokens)
    runs = [("context", c, 1, c) for c in settings.scaling_contexts]
    runs += [("batch", b, b, base_context) for b in settings.scaling_batches]
    results: dict[str, Any] = {"engine": worker.name, "new_tokens": settings.scaling_tokens,
                               "batch_context": base_context, "context": {}, "batch": {}}
    for round_ in range(settings.repeats):
        progress(f"scaling round {round_ + 1}/{settings.repeats} ({worker.name})")
        for kind, value, batch, context in runs:
            reply = worker.ask({"op": "generate", "batch": batch, "context": context, "new": settings.scaling_tokens})
            results[kind].setdefault(str(value), []).append(reply.get("decode_tokens_per_s", float("nan")))
    for kind in ("context", "batch"):
        results[kind] = {value: _median(rates) for value, rates in results[kind].items()}
    return results


def _measure_quality(settings: BenchSettings, workers: list[Worker], progress) -> dict[str, Any]:
    """Each quantized lmcli format against lmcli float32 (greedy agreement, KL divergence)."""
    reference = _lmcli_worker(workers, ("float",))
    candidates = [w for w in workers if w.name.startswith("lmcli") and w is not reference and w.failure is None]
    if not settings.quality or reference is None or not candidates:
        return {}
    progress("quality: greedy continuations and KL divergence against float32")
    texts = list(TEXT_PROMPTS[: settings.quality_prompts])
    greedy = {"op": "greedy", "texts": texts, "new": settings.quality_tokens}
    expected = reference.ask(greedy)
    if "continuations" not in expected:
        return {"unavailable": _first_error([expected])}
    results: dict[str, Any] = {"reference": reference.name, "prompts": len(texts), "new_tokens": settings.quality_tokens,
                               "kl_tokens": settings.kl_tokens, "formats": {}}
    with tempfile.TemporaryDirectory(prefix="lmcli-bench-") as scratch:
        reference_path = str(Path(scratch) / "float32-logprobs.safetensors")
        saved = reference.ask({"op": "logprobs", "tokens": settings.kl_tokens, "path": reference_path})
        for worker in candidates:
            figures: dict[str, Any] = {}
            got = worker.ask(greedy)
            if "continuations" in got:
                figures.update(greedy_agreement(expected["continuations"], got["continuations"]))
            else:
                figures["greedy_unavailable"] = _first_error([got])
            kl = worker.ask({"op": "kl", "tokens": settings.kl_tokens, "path": reference_path}) if "tokens" in saved \
                else saved
            if "mean_kl" in kl:
                figures["mean_kl"] = kl["mean_kl"]
            else:
                figures["kl_unavailable"] = _first_error([kl])
            results["formats"][worker.name] = figures
    return results

