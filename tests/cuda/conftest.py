"""Fixtures of the CUDA layer's tests."""
from __future__ import annotations

import pytest

from bridge_api import BridgeApi


@pytest.fixture(scope="module")
def api():
    """The bridge's C table (csrc/cuda/bridge_api.h), as the bridge reaches the pools."""
    return BridgeApi()


# A GPU check's failure printed as soon as it is known (crash_rerun.py).
from crash_rerun import pytest_runtest_logreport, pytest_sessionstart  # noqa: E402,F401
