"""Measure the prompt cache on disk (io/prompt_blocks.py) on the default model: a resumed chat's time to
its first token against recomputing it, a job sharing a long system message run twice, and reading a
prefix from disk against computing it, by length. Timings alternate the two sides in each round (this
machine is shared and noisy); the median of the rounds is reported.

    PYTHONPATH=. python tools/bench_prompt_cache.py [--rounds 3] [--rows 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import lmcli
from lmcli.chat.session import ChatSession
from lmcli.generation.continuous import ContinuousRun
from lmcli.generation.prefix_cache import PrefixCache, disk_store_for
from lmcli.generation.rows import prepare_row
from lmcli.generation.step import Step
from lmcli.settings.generation_settings import GenerationSettings

WORDS = ("the library keeps a careful record of every book that is lent, returned, repaired or lost, and "
         "each record names the reader, the date and the state of the book ")


def fresh_cache(model, directory: Path) -> PrefixCache:
    os.environ["LMCLI_PROMPT_CACHE"] = str(directory)
    return PrefixCache(disk=disk_store_for(model), vocab=model.config.vocab_size)


def conversation(tokenizer, target: int) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "You are a helpful librarian."}]
    i = 0
    while len(tokenizer.encode_chat(messages)) < target:
        messages.append({"role": "user", "content": f"Question {i}: " + WORDS * 2})
        messages.append({"role": "assistant", "content": f"Answer {i}: " + WORDS * 2})
        i += 1
    return messages


def chat_resume(model, tokenizer, directory: Path, rounds: int, target: int) -> None:
    settings = GenerationSettings.from_flags(greedy=True, max_new_tokens=1, chat=True)
    messages = conversation(tokenizer, target)
    seed = ChatSession(model, tokenizer, settings, context=4096, messages=messages,
                       prefix_cache=fresh_cache(model, directory))
    kept = seed.keep_blocks()  # what /save does
    times: dict[str, list[float]] = {"recompute": [], "from disk": []}
    for _ in range(rounds):
        for name in times:
            prefix = fresh_cache(model, directory) if name == "from disk" else None
            session = ChatSession(model, tokenizer, settings, context=4096, messages=messages, prefix_cache=prefix)
            turn = session.reply("And one more question?")
            assert turn.result.first_token_at is not None  # one new token was asked for
            times[name].append(turn.result.first_token_at - turn.result.started)
            if prefix is not None:
                print(f"  round: {turn.prefill_tokens} of {turn.prompt_tokens} computed, {turn.from_disk} from disk,"
                      f" {turn.from_memory} from memory; skipped {prefix.disk.skipped if prefix.disk else '-'}")
    rec, disk = statistics.median(times["recompute"]), statistics.median(times["from disk"])
    print(f"chat resume, {kept} tokens of history: first token {rec * 1000:.0f} ms recomputed, "
          f"{disk * 1000:.0f} ms from disk ({disk / rec:.3f}x)")


def job_twice(model, tokenizer, directory: Path, rows: int) -> None:
    system = "You are the help desk of a small library. " + WORDS * 17
    settings = GenerationSettings(chat=True, system=system)
    prepared = [prepare_row(tokenizer, i, f"Question number {i}: where is the book on topic {i}?",
                            settings.for_row({"temperature": 0, "max_new_tokens": 2})) for i in range(rows)]
    print(f"job: {rows} rows, system message of {len(tokenizer.encode(system))} tokens, "
          f"prompts of {len(prepared[0].prompt_ids)} tokens")
    for run_number in (1, 2):
        prefix = fresh_cache(model, directory)
        run = ContinuousRun(model, tokenizer, 8, on_done=lambda r: None, alone=lambda r: None, prefix_cache=prefix)
        started = time.perf_counter()
        run.run(prepared, lambda rows: None)
        s = run.stats
        print(f"  run {run_number}: prefill {s.prefill_computed} of {s.prefill_requested} tokens computed "
              f"({s.prefill_computed / s.prefill_requested:.1%}; {prefix.stats.from_disk} from disk, "
              f"{prefix.stats.from_memory} from memory), {time.perf_counter() - started:.1f} s")


def load_vs_compute(model, tokenizer, directory: Path, rounds: int, lengths: list[int]) -> None:
    step = Step.of(model)
    ids = tokenizer.encode(WORDS * 200)
    print("prefix length | compute (ms) | read from disk (ms) | disk/compute")
    for n in lengths:
        prompt = ids[:n + 1]
        writer = fresh_cache(model, directory)
        one = model.init_cache(1, n + 1, rollback=n + 1)
        x = torch.tensor([prompt])
        slots = torch.arange(n + 1)
        with torch.inference_mode():
            step.prefill(x, slots[None], slots, torch.ones(1, n + 1, dtype=torch.bool), one)
        writer.store(prompt, one, n + 1)
        times: dict[str, list[float]] = {"compute": [], "disk": []}
        for _ in range(rounds):
            with torch.inference_mode():
                one = model.init_cache(1, n + 1, rollback=n + 1)
                started = time.perf_counter()
                step.prefill(x[:, :n], slots[None, :n], slots[:n], torch.ones(1, n + 1, dtype=torch.bool), one)
                times["compute"].append(time.perf_counter() - started)
                reader = fresh_cache(model, directory)
                one = model.init_cache(1, n + 1, rollback=n + 1)
                started = time.perf_counter()
                got = reader.restore(prompt, one)
                times["disk"].append(time.perf_counter() - started)
                assert got == n // 16 * 16, (got, n)
        c, d = statistics.median(times["compute"]), statistics.median(times["disk"])
        print(f"{n:>13} | {c * 1000:>12.1f} | {d * 1000:>19.1f} | {d / c:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--lengths", default="16,32,64,128,512,2048")
    parser.add_argument("--only", default="chat,job,disk")
    args = parser.parse_args()
    model, tokenizer = lmcli.load()
    print(f"model {model.resolved.path.name}, {torch.get_num_threads()} threads, batch-invariant {model.batch_invariant}")
    with tempfile.TemporaryDirectory() as tmp:
        if "chat" in args.only:
            chat_resume(model, tokenizer, Path(tmp) / "chat", args.rounds, args.history)
        if "job" in args.only:
            job_twice(model, tokenizer, Path(tmp) / "job", args.rows)
        if "disk" in args.only:
            load_vs_compute(model, tokenizer, Path(tmp) / "disk", args.rounds, [int(n) for n in args.lengths.split(",")])


if __name__ == "__main__":
    main()
