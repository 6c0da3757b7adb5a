import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 2**20


@pytest.fixture(autouse=True)
def _threads_and_seed():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """One intra-op thread. Runs after the 2-thread fixture above: on a 2-core box,
    2 threads plus any other busy process make OpenMP barriers stall (conv steps
    went from 0.2 s to 6 s); one thread is immune, and no test asserts timings."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Property tests draw the same examples on every run (a seed derived from each
# test): a clean-clone CI fails only where a change does, never on an example
# no earlier run drew (a random conv/BatchNorm chain whose conv bias gradient is
# zero in exact arithmetic failed its tolerance once that way).
settings.register_profile("magis", derandomize=True)
settings.load_profile("magis")
