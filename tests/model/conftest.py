"""Tiny shapes: one intra-op thread. With two threads every one of the thousands of tiny ops pays an OpenMP
barrier, which turns into scheduler waits (10× slower) whenever the CI machine is busy with anything else."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
