"""Fixtures shared by every test module."""

from __future__ import annotations

import os

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


SLOW = os.environ.get("DILATED_ATTENTION_SLOW") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (long sweeps, slow compile cases) are skipped unless
    DILATED_ATTENTION_SLOW=1 (``make test-slow``); a fast case of each capability stays."""
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow: set DILATED_ATTENTION_SLOW=1 (make test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
