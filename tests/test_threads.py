"""lmcli.threads: the thread count and OpenMP wait chosen for the machine, the user's settings winning,
torchrun ranks sharing the CPUs; and bench's busy loops (started, paused, always stopped). Settings only,
never timings."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmcli import threads
from lmcli.bench import main as bench
from lmcli.bench.background_load import BackgroundLoad, Loaded
from lmcli.cli import app
from lmcli.errors import UsageError


def machine(cpus=4, load=0.0, runnable=1, host_cpus=None, ranks=1):
    return threads.Machine(cpus=cpus, host_cpus=host_cpus or cpus, load=load, runnable=runnable, local_ranks=ranks)


@pytest.mark.parametrize("fake, expected, busy", [
    (machine(cpus=4), 4, False),  # quiet: every CPU
    (machine(cpus=4, load=1.0, runnable=2), 3, True),  # one busy loop elsewhere
    (machine(cpus=2, load=1.1, runnable=2), 1, True),
    (machine(cpus=4, load=3.0, runnable=1), 4, False),  # the average still remembers a load that has ended
    (machine(cpus=4, load=9.0, runnable=12), 1, True),  # crowded: never fewer than one
    (machine(cpus=2, host_cpus=64, load=32.0, runnable=40), 1, True),  # our share of a busy host's load
    (machine(cpus=2, host_cpus=64, load=8.0, runnable=9), 2, False),
    (machine(cpus=4, load=2.0, runnable=None), 2, True),  # no runnable count: the load average alone
])
def test_threads_are_the_free_cpus_and_a_fixed_count_sleeps_beside_busy_ones(fake, expected, busy):
    choice = threads.choose(fake, {})
    # lmcli's own count: no more threads than free cores, moved with the load later (test_threads_recheck),
    # so libgomp's faster spin-then-sleep is kept.
    assert choice.threads == expected and choice.follows_load
    assert choice.env == {"OMP_NUM_THREADS": str(expected)}
    fixed = threads.choose(fake, {}, requested=2)  # --threads 2 cannot give way: its idle threads sleep at once
    assert fixed.env == {"OMP_NUM_THREADS": "2", **({"OMP_WAIT_POLICY": "PASSIVE"} if busy else {})}
    assert ("PASSIVE" in fixed.describe()) == busy and not fixed.follows_load


def test_read_machine_reads_affinity_load_and_torchrun(monkeypatch):
    fake = threads.read_machine({"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6"})
    assert fake.cpus == len(os.sched_getaffinity(0)) and fake.local_ranks == 3
    assert fake.load == pytest.approx(float(Path("/proc/loadavg").read_text().split()[0]), abs=5)
    assert threads.read_machine({"WORLD_SIZE": "2"}).local_ranks == 2  # plain torchrun: all ranks here
    assert threads.read_machine({"WORLD_SIZE": "x"}).local_ranks == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7})
    assert threads.read_machine({}).cpus == 3


def test_the_users_settings_win():
    quiet = machine(cpus=4)
    by_flag = threads.choose(quiet, {"OMP_NUM_THREADS": "3"}, requested=2)
    assert by_flag.threads == 2 and by_flag.env["OMP_NUM_THREADS"] == "2" and "--threads" in by_flag.why
    by_env = threads.choose(quiet, {"OMP_NUM_THREADS": "3"})
    assert by_env.threads == 3 and "OMP_NUM_THREADS" not in by_env.env and "OMP_WAIT_POLICY" not in by_env.env
    busy = threads.choose(machine(cpus=4, load=1.0, runnable=2), {"OMP_NUM_THREADS": "3"})
    assert busy.threads == 3 and busy.env == {"OMP_WAIT_POLICY": "PASSIVE"}  # their count, lmcli's wait
    for wait in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5000"}):
        choice = threads.choose(quiet, wait)
        assert choice.env == {"OMP_NUM_THREADS": "4"}  # the user's wait, and no second wait variable beside it
        assert f"{next(iter(wait))}={next(iter(wait.values()))} from the environment" in choice.wait
    # What lmcli itself set earlier (this process, or a parent's environment) is not the user's.
    ours = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "LMCLI_THREADS_SET": "OMP_NUM_THREADS,OMP_WAIT_POLICY"}
    assert threads.choose(quiet, ours).threads == 4


def test_torch_loaded_first_keeps_the_programs_settings():
    choice = threads.choose(machine(cpus=4), {}, torch_threads=3)
    assert choice.threads == 3 and choice.env == {} and "before lmcli" in choice.why
    assert threads.choose(machine(cpus=4), {}, requested=1, torch_threads=3).threads == 1


@pytest.mark.parametrize("cpus, ranks", [(2, 2), (16, 2), (16, 3), (8, 8), (64, 4)])
@pytest.mark.parametrize("load", [0.0, 1.0, 6.0])
def test_torchrun_ranks_do_not_oversubscribe(cpus, ranks, load):
    fake = machine(cpus=cpus, load=load + ranks - 1, runnable=int(load) + ranks, ranks=ranks)
    choice = threads.choose(fake, {})
    assert choice.threads is not None and choice.threads >= 1 and ranks * choice.threads <= cpus
    if load == 0.0:  # the other ranks are the load: not counted as busy elsewhere
        assert choice.threads == cpus // ranks


def _child(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter (OpenMP reads its environment when torch loads); its last line is JSON."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LMCLI_THREADS_SET",
                         "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK")}
    result = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                            timeout=300, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


PROBE = ("import json, os, lmcli; lmcli.load; import torch; print(json.dumps({'torch': torch.get_num_threads(), "
         "'wait': os.environ.get('OMP_WAIT_POLICY'), 'spin': os.environ.get('GOMP_SPINCOUNT'), "
         "'why': __import__('lmcli.threads').threads.describe()}))")


def test_settings_reach_torch_through_the_api_path():
    # torch's own reading of the environment (not lmcli's description) shows what took effect.
    torchrun = _child(PROBE, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK="0")
    assert torchrun["torch"] * 2 <= max(len(os.sched_getaffinity(0)), 2) and torchrun["wait"] == "PASSIVE"
    user = _child(PROBE, OMP_NUM_THREADS="1", GOMP_SPINCOUNT="777")
    assert user == {"torch": 1, "wait": None, "spin": "777", "why": user["why"]}
    assert "from the environment" in user["why"]


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_threads_flag_is_applied_before_loading(monkeypatch, command):
    asked = []

    def configure(requested=None):
        asked.append(requested)
        raise UsageError("stop here")  # before any model loads

    monkeypatch.setattr(threads, "configure", configure)
    result = CliRunner().invoke(app, [*command, "--threads", "3"])
    assert result.exit_code == 2 and asked == [3]
    assert CliRunner().invoke(app, [*command, "--threads", "0"]).exit_code == 2


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_background_load_spins_only_when_asked_and_always_stops():
    with BackgroundLoad(2) as load:
        pids = load.pids()
        assert len(pids) == 2 and all(_state(pid) == "T" for pid in pids)  # paused between loaded runs
        with Loaded(load):
            time.sleep(0.2)
            assert all(_state(pid) in "RS" for pid in pids)
        assert all(_state(pid) == "T" for pid in pids)
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(KeyboardInterrupt), BackgroundLoad(1) as load:  # Ctrl-C in the middle of a run
        pids = load.pids()
        load.resume()
        raise KeyboardInterrupt
    assert not any(_alive(pid) for pid in pids)


def test_background_load_ends_with_its_parent():
    code = ("import json, os, signal; from lmcli.bench.background_load import BackgroundLoad; load = BackgroundLoad(2); "
            "load.start(); print(json.dumps(load.pids()), flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGKILL
    pids = json.loads(result.stdout)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _busy_loops_of(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == parent and b"os.getppid() == parent" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_bench_background_load_measures_shared_figures_and_leaves_no_loop(tmp_path, capsys):
    from rich.console import Console
    from tiny import save_reference

    save_reference("llama", tmp_path)
    results = bench.run(bench.settings_from_options(
        str(tmp_path), engines="lmcli", formats="float", max_new_tokens=3, prompt_tokens=4, prefill_tokens=4,
        repeats=1, contexts="", scaling_batches="", skip_quality=True, threads=1, background_load=1))
    figures = results["engines"]["lmcli float"]
    assert figures["shared_decode_b1_tokens_per_s"] > 0 and figures["shared_ttft_s"] > 0
    assert figures["decode_b1_tokens_per_s"] > 0  # the quiet figures as well
    assert _busy_loops_of(os.getpid()) == []
    bench.print_report(results, Console(file=sys.stdout, width=300))
    assert "decode b1 tok/s, 1 busy" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--background-load 999"):
        bench.settings_from_options(None, background_load=999)


def test_info_says_what_was_chosen_and_why():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "LMCLI_THREADS_SET")}
    result = subprocess.run([sys.executable, "-m", "lmcli", "info"], capture_output=True, text=True, timeout=300,
                            env={**env, "OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "5"}, check=True)
    line = next(line for line in result.stdout.splitlines() if line.startswith("threads: "))
    assert line.startswith("threads: 1 thread, GOMP_SPINCOUNT=5 from the environment — OMP_NUM_THREADS=1 from")
