"""Fixtures of the CUDA layer's tests."""
from __future__ import annotations

import pytest

from bridge_api import BridgeApi


@pytest.fixture(scope="module")
def api():
    """The bridge's C table (csrc/cuda/bridge_api.h), as the bridge reaches the pools."""
    return BridgeApi()
