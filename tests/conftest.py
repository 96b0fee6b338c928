"""Fixtures shared by every test module."""

from __future__ import annotations

import pytest

from dilated_attention import hardware
from dilated_attention._warnings import reset_warnings


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """The package warns once per cause per process; each test starts with nothing warned yet."""
    reset_warnings()
    yield


@pytest.fixture
def fake_gpu(monkeypatch):
    """Make the hardware module report one CUDA GPU of a chosen compute capability."""
    state = {"cap": (8, 0)}
    monkeypatch.setattr(hardware, "compute_capability", lambda device=None: state["cap"])
    monkeypatch.setattr(
        hardware, "device_name", lambda device=None: f"FAKE sm_{state['cap'][0]}{state['cap'][1]}"
    )
    monkeypatch.setattr(hardware, "device_unavailable", lambda device=None: None)
    return state
