"""What the backend test modules share: the backends that run here, the dtypes, and fixtures
(one thread, a fresh backend selection per test); the fake GPU is in conftest.py."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import backends

RUNNABLE = ["native", "sdpa", "manual"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
LOGGER = "dilated_attention.backends.registry"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The problems here are tiny: one thread is faster, and steady on a busy machine (the fused
    CPU attention kernels otherwise pay a thread wake-up per call)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def fresh_selection():
    backends.default_selector().clear()
    yield
    backends.default_selector().clear()
