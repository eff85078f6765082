"""Shared pytest setup: tests marked ``gpu`` run only where PyTorch sees a CUDA GPU."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """Whether torch is importable and sees a CUDA GPU (asked once, and only if needed)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
