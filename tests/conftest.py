"""Shared fixtures: one generic suite runs over every backend that needs no GPU."""
import pytest

import pyalloc

CPU_BACKENDS = ("host", "virtual")


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=["bestfit", "vmm"])
def strategy(request):
    return request.param


@pytest.fixture
def make(backend, strategy):
    """make(**config) -> Allocator on the parametrized backend and strategy."""

    def factory(conf=None, **kwargs):
        kwargs.setdefault("strategy", strategy)
        return pyalloc.Allocator(backend, conf, **kwargs)

    return factory


@pytest.fixture
def host():
    """make(**config) -> Allocator on real host memory."""

    def factory(conf=None, **kwargs):
        return pyalloc.Allocator("host", conf, **kwargs)

    return factory
