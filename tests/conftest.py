"""Fixtures shared by every test module."""

from __future__ import annotations

import pytest

from dilated_attention._warnings import reset_warnings


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """The package warns once per cause per process; each test starts with nothing warned yet."""
    reset_warnings()
    yield
