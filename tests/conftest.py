"""Fixtures shared across test modules."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models are all per-op overhead; on a busy 2-core machine threads only slow them down."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
