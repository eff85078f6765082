"""Where the tests find ../shared, the folder beside the repository that holds the
recorded traces (traces/, traces/gpu/) and the GPU runs' logs.

It is not part of the repository, and a machine may not have it: tests that read
it are marked ``shared`` and skipped there, with the reason (conftest.py).
PYALLOC_TEST_SHARED names another folder in its place (a missing one: run as a
machine without it would).
"""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DIR = Path(os.environ.get("PYALLOC_TEST_SHARED") or REPO.parent / "shared")
