"""Thread choices the earlier tests did not pin (found by the planted-bug audit, docs/testing.md): torchrun
ranks that share a quiet machine still sleep when idle (lmcli.threads' documented rule: a spinning rank
stalls the others' cores), and a machine so busy that no CPU is free still gets one thread."""

from __future__ import annotations

import pytest

from lmcli import threads


@pytest.mark.parametrize("cpus, ranks", [(2, 2), (8, 2), (16, 4)])
@pytest.mark.parametrize("started", [False, True])  # the other ranks not yet running, or already counted
def test_ranks_sharing_a_quiet_machine_sleep_when_idle(cpus, ranks, started):
    load, runnable = (ranks - 1, ranks) if started else (0.0, 1)
    fake = threads.Machine(cpus=cpus, host_cpus=cpus, load=load, runnable=runnable, local_ranks=ranks)
    choice = threads.choose(fake, {})
    assert choice.env == {"OMP_NUM_THREADS": str(cpus // ranks), "OMP_WAIT_POLICY": "PASSIVE"}


def test_every_cpu_busy_still_leaves_one_thread():
    fake = threads.Machine(cpus=2, host_cpus=2, load=6.0, runnable=7)
    assert threads.choose(fake, {}).env["OMP_NUM_THREADS"] == "1"
