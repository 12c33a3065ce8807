"""One intra-op thread for the optimizer tests: tiny matmuls on a loaded 2-core machine stall on thread wake-ups."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
