"""Decode speed under OpenMP thread settings, quiet and beside busy loops: the figures behind lmcli.threads.

    python tools/thread_settings.py [--busy N] [--rounds R] [--new-tokens T] [SETTINGS ...]

Each SETTINGS is `default` (lmcli's own choice, made by the worker, whose count then follows the load)
or environment changes joined by '+' (the user's settings: a fixed count), e.g.
`OMP_NUM_THREADS=1` or `OMP_NUM_THREADS=2+GOMP_SPINCOUNT=10000` (`VAR=` unsets VAR). Each runs in its
own `lmcli bench` worker process (OpenMP reads its settings when torch loads) on the default model,
loaded once. Every round asks each worker in turn for one batch-1 greedy decode with the busy loops
paused, then the same with them spinning, so load from the rest of the machine falls on all alike;
the table shows the medians of decode tokens/s and torch's thread count as each run ended.
"""

from __future__ import annotations

import argparse
import os
import statistics

from lmcli import threads
from lmcli.bench.background_load import BackgroundLoad, Loaded
from lmcli.bench.measure import Worker

SETTINGS = ["default", "GOMP_SPINCOUNT=300000+OMP_WAIT_POLICY=+OMP_NUM_THREADS=2", "OMP_NUM_THREADS=1",
            "OMP_NUM_THREADS=2", "OMP_NUM_THREADS=2+OMP_WAIT_POLICY=PASSIVE",
            "OMP_NUM_THREADS=2+OMP_WAIT_POLICY=+GOMP_SPINCOUNT=10000"]


def _env(settings: str) -> dict[str, str | None]:
    """The worker's environment changes: what lmcli chose in this process is dropped (so a worker's
    variables are all the user's, or, for `default`, lmcli chooses afresh in the worker)."""
    ours = [name for name in os.environ.get(threads.SET_BY_LMCLI_VAR, "").split(",") if name]
    env: dict[str, str | None] = dict.fromkeys([*ours, threads.SET_BY_LMCLI_VAR])
    if settings != "default":
        changes = dict(part.split("=", 1) for part in settings.split("+"))
        env.update({name: value or None for name, value in changes.items()})
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("settings", nargs="*", default=SETTINGS)
    parser.add_argument("--busy", type=int, default=1, help="busy loops in the loaded runs (default 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()

    choice = threads.configure()  # what `default` gets (before any torch import, as in the CLI)
    print(f"lmcli's choice now: {choice.describe()}", flush=True)
    if args.checkpoint is None:
        from lmcli.resolve.default_model import default_checkpoint_path

        args.checkpoint = str(default_checkpoint_path())
    spec = {"engine": "lmcli", "format": "native", "checkpoint": args.checkpoint, "model": None, "device": "cpu",
            "dtype": "auto", "threads": None, "context": 32 + args.new_tokens}
    workers = [Worker(settings, spec, env=_env(settings)) for settings in args.settings]
    rates: dict[tuple[str, bool], list[float]] = {}
    counts: dict[tuple[str, bool], list[int]] = {}  # torch's thread count at the end of each run
    with BackgroundLoad(args.busy) as load:
        try:
            for worker in workers:
                worker.start()
                worker.wait_ready()
            print(f"workers ready · load average {os.getloadavg()[0]:.2f}", flush=True)
            request = {"op": "generate", "batch": 1, "context": 32, "new": args.new_tokens}
            for round_ in range(args.rounds):
                for busy in (False, True):
                    for worker in workers:
                        with Loaded(load if busy else None):
                            reply = worker.ask(request)
                        rates.setdefault((worker.name, busy), []).append(reply.get("decode_tokens_per_s", float("nan")))
                        counts.setdefault((worker.name, busy), []).append(reply.get("threads", 0))
                print(f"round {round_ + 1}/{args.rounds} done · load average {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            for worker in workers:
                worker.stop()
    print(f"\n| settings | quiet decode tok/s | {args.busy} busy loop(s) decode tok/s | threads at the end of each run, "
          f"quiet / busy |\n|---|---|---|---|")
    for worker in workers:
        if worker.failure:
            print(f"| {worker.name} | {worker.failure} | |")
            continue
        quiet, shared = (statistics.median(rates[(worker.name, b)]) for b in (False, True))
        ends = " / ".join(",".join(map(str, counts[(worker.name, b)])) for b in (False, True))
        print(f"| {worker.name} | {quiet:.1f} | {shared:.1f} | {ends} |")


if __name__ == "__main__":
    main()
