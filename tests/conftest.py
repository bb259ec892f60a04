"""Fixtures and session settings shared across test modules.

- The suite writes its caches into a directory of its own, never the user's ~/.cache/lmcli:
  LMCLI_CACHE_DIR points at a fresh per-session directory (subprocesses inherit it). The transformers
  references, which take minutes to compute, are kept across runs under TEST_CACHE_DIR instead.
- Under CI=true a skip is a failure: a missing real model, reference library or test dependency must
  not turn a run green. (Tests never install anything; `make install-test` does.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Computed once and reused by later runs (transformers references of the real models).
TEST_CACHE_DIR = Path(os.environ.get("LMCLI_TEST_CACHE_DIR") or Path.home() / ".cache" / "lmcli-tests").expanduser()

_session_cache: str | None = None


def pytest_configure(config):
    global _session_cache
    _session_cache = tempfile.mkdtemp(prefix="lmcli-test-cache-")
    os.environ["LMCLI_CACHE_DIR"] = _session_cache
    # Loads read the checkpoint itself (a test that patches loading code must see it run); the packed
    # cache's own tests (test_startup_packed.py) turn it on.
    os.environ.setdefault("LMCLI_PACKED_CACHE", "0")
    os.environ.setdefault("LMCLI_COMPILE", "0")  # no compiled program runs unless a test asks (test_compile*.py)
    # Prompt blocks are not kept between tests' runs (a test's prefill counts are its own); the prompt
    # cache's tests (test_prompt_cache*.py) give each case its own directory.
    os.environ.setdefault("LMCLI_PROMPT_CACHE", "off")
    # Nothing is downloaded unless a test asks (test_hub.py, against its own local server).
    os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_unconfigure(config):
    if _session_cache is not None:
        shutil.rmtree(_session_cache, ignore_errors=True)


def _skip_is_failure(report) -> None:
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which must not happen: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _skip_is_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _skip_is_failure(outcome.get_result())  # a module-level importorskip


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_worker(request):
    """Under pytest-xdist (`make test` runs two workers on two cores) each worker computes on one thread:
    two workers of two threads each on two cores spin against each other (a real-model test took 12x as
    long). Tests of thread counts set their own; the CLI's subprocesses choose theirs as a user's would."""
    if hasattr(request.config, "workerinput"):
        import torch  # here, not at the top: see one_thread

        torch.set_num_threads(1)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models are all per-op overhead; on a busy 2-core machine threads only slow them down."""
    import torch  # here, not at the top: the suite's own rule tests run pytest without torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """tiny_models(case): tests/tiny.py's random model of `case` (64 positions, vocabulary 97), saved
    and loaded with lmcli once per module."""
    # Imported here, not at the top (they import torch), as in one_thread.
    from tiny import save_reference

    import lmcli

    models = {}

    def get(case: str):
        if case not in models:
            directory = tmp_path_factory.mktemp(case)
            save_reference(case, directory)
            models[case] = lmcli.load(directory)[0]
        return models[case]

    return get
