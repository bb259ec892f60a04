"""lmcli.threads.recheck: the thread count follows load that comes and goes after the start, read from
fake /proc readers (simulated load); only when lmcli chose the count alone. Settings only, never timings."""

import os
import sys
import time

import pytest
import torch

from lmcli import machine, threads


class FakeMachine:
    """A clock, the CPUs' busy seconds and this process's CPU seconds, advanced by `run`: what the
    readers of /proc would report while `others` CPUs' worth of other work shares our CPUs."""

    def __init__(self, threads_now: int, running_elsewhere: int | None = 0):
        self.now, self.busy, self.own = 100.0, 5000.0, 10.0
        self.torch_threads = threads_now
        self.running = running_elsewhere
        self.set_calls: list[int] = []
        self.reads = 0

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.now += seconds
        self.busy += (others + ours) * seconds
        self.own += ours * seconds

    def cpu_busy(self) -> float:
        self.reads += 1
        return self.busy

    def set_threads(self, count: int) -> None:
        self.set_calls.append(count)
        self.torch_threads = count

    def readers(self) -> threads.LoadReaders:
        return threads.LoadReaders(cpu_busy=self.cpu_busy, running_elsewhere=lambda: self.running,
                                   get_threads=lambda: self.torch_threads, set_threads=self.set_threads,
                                   own_cpu=lambda: self.own, clock=lambda: self.now)


@pytest.mark.parametrize("cpus, threads_now, others, expected", [
    (2, 2, 0.05, 2),  # quiet: keep every core
    (2, 2, 0.67, 1),  # a busy loop beside our 2 spinning threads gets ~2/3 of a core: give it one
    (2, 1, 1.0, 1),  # ... and it then takes the whole core: stay
    (2, 1, 0.05, 2),  # it ended: both cores again
    (2, 1, 0.4, 1),  # half a core taken now and then: not clearly free, stay
    (2, 2, 0.4, 2),
    (4, 4, 0.8, 3), (4, 3, 1.0, 3), (4, 3, 2.1, 2), (4, 1, 0.1, 4),
    (2, 2, 5.0, 1),  # never fewer than one
])
def test_threads_for_window(cpus, threads_now, others, expected):
    assert threads.threads_for_window(cpus, threads_now, others) == expected


def test_threads_for_tasks_counts_our_share_of_the_host():
    assert threads.threads_for_tasks(2, 2, 0) == 2
    assert threads.threads_for_tasks(2, 2, 1) == 1
    assert threads.threads_for_tasks(2, 2, 7) == 1
    assert threads.threads_for_tasks(2, 64, 8) == 2  # 8 tasks over 64 CPUs: a quarter of one of ours
    assert threads.threads_for_tasks(8, 16, 6) == 5


def test_load_arriving_later_takes_threads_away_and_leaving_gives_them_back():
    fake = FakeMachine(threads_now=2)
    follower = threads.LoadFollower(cpus=2, host_cpus=2, threads=2, readers=fake.readers())
    follower.recheck()  # the first look: nothing running elsewhere, keeps 2
    assert fake.set_calls == [] and fake.reads == 1
    for _ in range(15):  # decode steps inside the first window: only the clock is read
        fake.run(threads.FIRST_WINDOW_S / 20, others=0.0, ours=2.0)
        follower.recheck()
    assert fake.reads == 1
    fake.run(threads.RECHECK_S, others=0.0, ours=2.0)
    follower.recheck()
    assert fake.set_calls == []  # quiet: still 2
    fake.run(threads.RECHECK_S, others=0.67, ours=1.33)  # a busy loop starts
    follower.recheck()
    assert fake.set_calls == [1] and follower.threads == 1
    for _ in range(3):
        fake.run(threads.RECHECK_S, others=1.0, ours=1.0)  # it keeps its core
        follower.recheck()
    assert fake.set_calls == [1]
    fake.run(threads.RECHECK_S, others=0.0, ours=1.0)  # it ended
    follower.recheck()
    assert fake.set_calls == [1, 2] and follower.switches == 2


def test_after_a_pause_the_first_look_counts_the_tasks_running_now():
    fake = FakeMachine(threads_now=2, running_elsewhere=0)
    follower = threads.LoadFollower(cpus=2, host_cpus=2, threads=2, readers=fake.readers())
    follower.recheck()
    # A chat waits for its user; meanwhile another program ran on both cores, and one busy task runs now.
    fake.run(30.0, others=2.0, ours=0.0)
    fake.running = 1
    follower.recheck()
    assert fake.set_calls == [1]
    fake.run(30.0, others=1.0, ours=0.0)
    fake.running = 0  # everything else sleeps now: the long average would say a core is taken, the instant not
    follower.recheck()
    assert fake.set_calls == [1, 2]


def test_a_fresh_call_counts_the_tasks_running_now_even_soon_after_the_last_look():
    fake = FakeMachine(threads_now=2, running_elsewhere=0)
    follower = threads.LoadFollower(cpus=2, host_cpus=2, threads=2, readers=fake.readers())
    follower.recheck()
    fake.run(threads.RECHECK_S * 2, others=2.0, ours=0.0)  # between our calls another program used both cores
    follower.recheck(fresh=True)  # ... and has stopped now
    assert fake.set_calls == []
    fake.run(threads.RECHECK_S, others=0.0, ours=2.0)
    fake.running = 1
    follower.recheck(fresh=True)
    assert fake.set_calls == [1]
    fake.run(threads.FIRST_WINDOW_S / 2, others=1.0, ours=1.0)
    fake.running = 0
    follower.recheck(fresh=True)  # too soon after the last look: nothing read
    assert fake.set_calls == [1]
    fake.run(threads.FIRST_WINDOW_S / 2, others=1.0, ours=1.0)  # the first window after a look at the instant
    follower.recheck()  # is shorter than RECHECK_S
    assert fake.set_calls == [1] and fake.reads == 3


def test_a_gap_between_calls_is_a_pause_even_when_no_look_was_due():
    fake = FakeMachine(threads_now=2, running_elsewhere=0)
    follower = threads.LoadFollower(cpus=2, host_cpus=2, threads=2, readers=fake.readers())
    follower.recheck()
    fake.run(threads.FIRST_WINDOW_S, others=0.0, ours=2.0)
    follower.recheck()  # a window look: quiet
    fake.run(threads.PAUSE_S * 1.2, others=2.0, ours=0.0)  # a loop of some caller paused; something else ran
    fake.running = 0
    follower.recheck()  # the pause is seen: the tasks running now decide, not the window
    assert fake.set_calls == [] and fake.reads == 3
    fake.run(threads.FIRST_WINDOW_S / 2, others=0.0, ours=2.0)
    follower.recheck()
    fake.run(threads.PAUSE_S * 1.2, others=2.0, ours=0.0)  # a pause that ends before the next look is due ...
    follower.due = fake.now + 0.1
    follower.recheck()
    fake.run(0.1, others=0.0, ours=2.0)
    follower.recheck()  # ... is still a pause when the look comes
    assert fake.set_calls == [] and fake.reads == 4


def test_the_program_setting_torch_threads_stops_the_following():
    fake = FakeMachine(threads_now=2)
    follower = threads.LoadFollower(cpus=2, host_cpus=2, threads=2, readers=fake.readers())
    follower.recheck()
    fake.torch_threads = 1  # torch.set_num_threads(1) by the program itself
    fake.run(threads.RECHECK_S, others=0.0, ours=1.0)
    follower.recheck()
    assert follower.stopped and fake.set_calls == []
    fake.run(threads.RECHECK_S, others=0.0, ours=1.0)
    follower.recheck()
    assert fake.set_calls == []


def test_unreadable_cpu_times_stop_the_following():
    fake = FakeMachine(threads_now=2)
    readers = fake.readers()
    readers.cpu_busy = lambda: None  # not Linux, or no /proc
    follower = threads.LoadFollower(cpus=2, host_cpus=2, threads=2, readers=readers)
    follower.recheck()
    assert follower.stopped and fake.set_calls == []


def _fresh_choice(monkeypatch, env, requested=None, load=0.0, running=1, ranks=None):
    fake = threads.Machine(cpus=2, host_cpus=2, load=load, runnable=running, local_ranks=ranks or 1)
    monkeypatch.setattr(threads, "read_machine", lambda env: fake)
    monkeypatch.setattr(threads, "_current", None)
    monkeypatch.setattr(threads, "_follower", None)
    monkeypatch.delitem(sys.modules, "torch")  # as before torch loads (restored after the test)
    return threads.configure(requested, env)


@pytest.mark.parametrize("env, requested, load, follows, passive", [
    ({}, None, 0.0, True, False),  # quiet: follows the load, libgomp's own wait
    ({}, None, 1.2, True, False),  # busy at the start: 1 thread, and 2 again once the core is free
    ({"OMP_WAIT_POLICY": "PASSIVE"}, None, 1.2, True, True),  # the user's wait, lmcli's (moving) count
    ({"OMP_NUM_THREADS": "2"}, None, 1.2, False, True),  # the user's count is fixed: it sleeps beside a busy CPU
    ({}, 2, 1.2, False, True),  # --threads 2
    ({}, 2, 0.0, False, False),
])
def test_configure_follows_the_load_only_with_lmclis_own_count(monkeypatch, env, requested, load, follows, passive):
    choice = _fresh_choice(monkeypatch, dict(env), requested, load=load, running=1 + int(load))
    assert choice.follows_load == follows and (threads.follower() is not None) == follows
    assert ("re-checked" in choice.describe()) == follows
    wait = env.get("OMP_WAIT_POLICY") or choice.env.get("OMP_WAIT_POLICY")
    assert (wait == "PASSIVE") == passive
    follower = threads.follower()
    if follower is not None:
        assert follower.threads == choice.threads == (1 if load else 2)


def test_torchrun_ranks_keep_a_fixed_count(monkeypatch):
    choice = _fresh_choice(monkeypatch, {"WORLD_SIZE": "2"}, ranks=2, load=1.0, running=2)
    assert choice.threads == 1 and not choice.follows_load and threads.follower() is None
    assert choice.env["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.fixture
def restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_system_readers_reach_torch(monkeypatch, restore_torch_threads):
    """The real readers, over faked /proc functions: torch's own thread count is what changes."""
    torch.set_num_threads(2)
    state = {"busy": 1000.0, "running": 0}
    monkeypatch.setattr(machine, "cpu_busy_seconds", lambda cpus: state["busy"])
    monkeypatch.setattr(machine, "running_tasks", lambda: state["running"] + 1)
    monkeypatch.setattr(machine, "own_running_threads", lambda: 1)
    follower = threads.LoadFollower(cpus=2, host_cpus=2, threads=2, readers=threads._system_readers())
    state["running"] = 1  # a task of another process runs now
    follower.recheck()
    assert torch.get_num_threads() == 1


def test_the_generation_loop_rechecks_every_step(monkeypatch, tiny_models, restore_torch_threads):
    """A fake follower that alternates 1 and 2 threads at each look, through generate(): the tokens are
    those of a run at a fixed count (the default kernels split work, not sums, between threads)."""
    model = tiny_models("llama")
    prompt = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(1)
    monkeypatch.setattr(threads, "_follower", None)
    with torch.inference_mode():
        fixed = model.generate(prompt, 10, False)
    seen: list[int] = []
    fresh_calls: list[bool] = []

    class Alternating:
        def recheck(self, fresh):
            fresh_calls.append(fresh)
            torch.set_num_threads(1 + len(seen) % 2)
            seen.append(torch.get_num_threads())

    monkeypatch.setattr(threads, "_follower", Alternating())
    with torch.inference_mode():
        moving = model.generate(prompt, 10, False)
    assert seen[:4] == [1, 2, 1, 2] and len(seen) == 10 and fresh_calls == [True] + [False] * 9
    assert torch.equal(moving, fixed)


def test_proc_readers_see_this_process_work():
    cpus = os.sched_getaffinity(0)
    busy, own = machine.cpu_busy_seconds(cpus), time.process_time()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # CPU work of ours must show in the CPUs' busy time
        pass
    after, running = machine.cpu_busy_seconds(cpus), machine.running_tasks()
    assert busy is not None and after is not None and running is not None
    assert after - busy >= 0.5 * (time.process_time() - own)
    assert running >= machine.own_running_threads() >= 1


def test_kernel_plans_are_keyed_by_the_thread_settings_they_were_made_under(tmp_path):
    """Each fresh process (OpenMP reads its settings when torch loads) files its kernel plan under the
    thread count torch reports and the wait its environment set, so a plan made under other settings
    is never reused."""
    import json
    import subprocess

    code = ("import json, torch, lmcli; lmcli.load; from lmcli.kernels import plan as kernel_plan; "
            "kernel_plan.fixed_choice('int4', torch.bfloat16, torch.device('cpu')); "
            "print(json.dumps(torch.get_num_threads()))")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                             threads.SET_BY_LMCLI_VAR)}
    keys: list[str] = []
    for settings in ({"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_NUM_THREADS": "2"}):
        env = {**base, **settings, "LMCLI_CACHE_DIR": str(tmp_path)}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-500:]
        assert json.loads(result.stdout.strip().splitlines()[-1]) == int(settings["OMP_NUM_THREADS"])
        new = set(json.loads((tmp_path / "kernels.json").read_text())) - set(keys)
        assert len(new) == 1
        keys.append(new.pop())
    assert keys[0].endswith("|threads=1, OMP_WAIT_POLICY=PASSIVE")
    assert keys[1].endswith("|threads=2, libgomp's default wait (spins, then sleeps)")
