"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests: a tiny model gains nothing from more, and OpenMP
    workers spinning on a busy 2-core machine can make training ten times slower. Restored after
    the module. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
