"""install(): settings, the clear errors, and the swap itself against a stand-in torch.

The real swap needs a CUDA GPU (tests/gpu/); here the CPU build of torch must be
refused clearly, and install()'s own logic is run against a stand-in for torch's
pluggable-allocator API.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import types

import pytest

import pyalloc
from pyalloc import _C, bridge
from pyalloc import cuda as api

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is None


cpu_torch = pytest.mark.skipif(not _cpu_torch(), reason="needs the CPU build of torch")


@pytest.fixture(autouse=True)
def no_env_conf(monkeypatch):
    for name in ("PYALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    try:  # each test is a fresh process as far as naming the keys once goes
        monkeypatch.setattr("pyalloc._torch_conf._announced", False)
    except ImportError:
        pass


def test_import_pyalloc_does_not_import_torch():
    code = "import sys, pyalloc; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


@cpu_torch
def test_install_on_a_cpu_build_of_torch_is_a_clear_error():
    import torch

    original = torch.cuda.memory_stats
    with pytest.raises(RuntimeError) as e:
        pyalloc.install(pool_size="1GiB")
    message = str(e.value)
    assert "needs a CUDA build of PyTorch" in message and "CPU-only" in message
    assert torch.__version__ in message
    assert not pyalloc.is_installed()
    assert torch.cuda.memory_stats is original


def test_bad_settings_are_refused_first(monkeypatch):
    monkeypatch.setenv("PYALLOC_CONF", "pool_size:2GiB,bogus:1")
    with pytest.raises(ValueError, match=r"PYALLOC_CONF='pool_size:2GiB,bogus:1': unknown config key 'bogus'; valid keys: strategy, pool_size"):
        pyalloc.install()
    monkeypatch.delenv("PYALLOC_CONF")
    with pytest.raises(ValueError, match="unknown config key 'poolsize'"):
        pyalloc.install(poolsize="1GiB")
    with pytest.raises(ValueError, match="larger than max_pool_size"):
        pyalloc.install(pool_size="2GiB", max_pool_size="1GiB")
    with pytest.raises(ValueError, match="unknown unit"):
        pyalloc.install("pool_size:2 parsecs")
    with pytest.raises(TypeError):
        pyalloc.install(pool_size=1.5)
    with pytest.raises(TypeError):
        pyalloc.install(123)


def test_settings_merge_env_then_conf_then_keywords(monkeypatch):
    monkeypatch.setenv("PYALLOC_CONF", "pool_size:1GiB,segment_size:4MiB")
    text = api.settings_text("segment_size:8MiB,max_pool_size:4GiB", {"pool_size": "2GiB"})
    config = pyalloc.parse_config(text)
    assert config["pool_size"] == 2 << 30
    assert config["segment_size"] == 8 << 20
    assert config["max_pool_size"] == 4 << 30
    assert pyalloc.parse_config(api.settings_text())["pool_size"] == 1 << 30


# -- install() against a stand-in torch --------------------------------------------------


class FakeHooks:
    """torch._C._CUDAPluggableAllocator's setters, recording what they are given."""

    def __init__(self, setters):
        self.given = {}
        for name in setters:
            setattr(self, name, lambda address, name=name: self.given.__setitem__(name, address))


def fake_torch(cuda="12.8", hip=None, available=True, initialized=False, pluggable=True,
               setters=tuple(s for s, _ in api._HOOKS), swap_error=None):
    swaps = []

    class PluggableAllocator:
        def __init__(self, path, alloc_fn, free_fn):
            self.args = (path, alloc_fn, free_fn)
            self.hooks = FakeHooks(setters)

        def allocator(self):
            return self.hooks

    def change_current_allocator(allocator):
        if swap_error:
            raise RuntimeError(swap_error)
        swaps.append(allocator)

    memory = types.SimpleNamespace(change_current_allocator=change_current_allocator)
    if pluggable:
        memory.CUDAPluggableAllocator = PluggableAllocator
    return types.SimpleNamespace(
        __version__="2.11.0+cu130",
        version=types.SimpleNamespace(cuda=cuda, hip=hip),
        cuda=types.SimpleNamespace(memory=memory, is_available=lambda: available,
                                   is_initialized=lambda: initialized),
        swaps=swaps,
    )


def no_bridge():
    raise bridge.BridgeUnavailable("no compiler here")


@pytest.fixture
def stand_in(monkeypatch):
    """install() with a stand-in torch and driver; its state is undone afterwards."""
    calls = {"configured": [], "installed": [], "patched": 0, "told": []}
    fake_c = types.SimpleNamespace(
        cuda_check_driver=lambda: 13000,
        cuda_configure=calls["configured"].append,
        cuda_set_route=calls["installed"].append,
        cuda_set_told_of_captures=calls["told"].append,
        library_path=_C.library_path,
    )
    monkeypatch.setattr(api, "_C", fake_c)
    for name in ("conf", "config", "allocator", "hooks", "route", "no_bridge"):
        monkeypatch.setattr(api._state, name, None)
    # The bridge cannot be built here unless a test says otherwise.
    monkeypatch.setattr(bridge, "load", no_bridge)
    monkeypatch.setattr(api._state, "patched", False)

    def patch():
        calls["patched"] += 1
        api._state.patched = True

    monkeypatch.setattr(api, "_patch_torch", patch)

    def use(torch):
        monkeypatch.setattr(api, "_import_torch", lambda: torch)
        return calls

    return use


def test_install_registers_every_hook_torch_offers(stand_in):
    torch = fake_torch()
    calls = stand_in(torch)
    pyalloc.install(pool_size="1GiB", bridge=False)
    (allocator,) = torch.swaps
    assert allocator.args == (_C.library_path(), "pyalloc_malloc", "pyalloc_free")
    lib = ctypes.CDLL(_C.library_path())
    for setter, symbol in api._HOOKS:
        assert allocator.hooks.given[setter] == ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    assert calls["configured"] == ["pool_size:1073741824"]
    assert calls["installed"] == ["hooks"] and calls["patched"] == 1
    # PyTorch announces captures through the graph-pool hooks: no per-allocation query.
    assert calls["told"] == [True]

    # Again with the same settings: nothing happens. With others: a clear error.
    pyalloc.install("pool_size:1024MiB")
    assert len(torch.swaps) == 1
    with pytest.raises(RuntimeError, match="already installed with settings 'pool_size:1073741824'.*only once per process"):
        pyalloc.install(pool_size="2GiB")


def test_install_sets_only_the_hooks_the_installed_torch_has(stand_in):
    torch = fake_torch(setters=("set_reset_fn", "set_record_stream_fn"))
    calls = stand_in(torch)
    pyalloc.install(patch_torch=False, bridge=False)
    assert set(torch.swaps[0].hooks.given) == {"set_reset_fn", "set_record_stream_fn"}
    assert calls["told"] == [False], "without the graph-pool hooks, captures must be asked about"
    assert api._state.hooks == ("set_reset_fn", "set_record_stream_fn")
    assert not api._state.patched


def test_install_later_can_add_the_torch_patch(stand_in):
    calls = stand_in(fake_torch())
    pyalloc.install(patch_torch=False, bridge=False)
    pyalloc.install()
    assert calls["patched"] == 1


@pytest.mark.parametrize(
    "torch_kwargs, words",
    [
        (dict(cuda=None), "CPU-only"),
        (dict(hip="6.2"), "ROCm"),
        (dict(pluggable=False), "torch 2.3 or newer"),
        (dict(available=False), "found no usable CUDA GPU"),
        (dict(initialized=True), "CUDA is already initialized"),
        (dict(swap_error="Can't swap an already initialized allocator"), "CUDA is already initialized"),
    ],
)
def test_install_refusals_are_clear(stand_in, torch_kwargs, words):
    torch = fake_torch(**torch_kwargs)
    calls = stand_in(torch)
    with pytest.raises(RuntimeError, match=words):
        pyalloc.install(bridge=False)
    assert calls["installed"] == [] and api._state.config is None


def test_already_initialized_error_names_the_fixes(stand_in):
    stand_in(fake_torch(initialized=True))
    with pytest.raises(RuntimeError) as e:
        pyalloc.install(bridge=False)
    message = str(e.value)
    for fix in ("call pyalloc.install() first", "python -m pyalloc run script.py",
                "torchrun ... -m pyalloc run", "PYALLOC_CONF"):
        assert fix in message


# -- the bridge route ------------------------------------------------------------------


class FakeBridge:
    """A stand-in for the built bridge module: install() records what it was given."""

    def __init__(self, swap_error=None):
        self.given = []
        self.swap_error = swap_error

    def install(self, library):
        if self.swap_error:
            raise RuntimeError(self.swap_error)
        self.given.append(library)


def test_the_bridge_is_the_default_route_and_patches_nothing(stand_in, monkeypatch):
    torch = fake_torch()
    calls = stand_in(torch)
    module = FakeBridge()
    monkeypatch.setattr(bridge, "load", lambda: module)
    pyalloc.install(pool_size="1GiB")
    assert module.given == [_C.library_path()]
    assert torch.swaps == [], "the C hooks must not be registered too"
    assert calls["installed"] == ["bridge"] and calls["patched"] == 0
    assert api._state.route == "bridge"
    pyalloc.install(pool_size="1GiB")  # again: nothing more, and still no patch
    assert calls["patched"] == 0 and len(module.given) == 1


def test_without_a_bridge_install_falls_back_and_says_what_is_lost(stand_in):
    torch = fake_torch()
    calls = stand_in(torch)
    with pytest.warns(RuntimeWarning) as caught:
        pyalloc.install()
    (warning,) = caught
    text = str(warning.message)
    assert "no compiler here" in text and "pyalloc bridge build" in text
    for lost in ("cudnn.benchmark", "torch.cuda.OutOfMemoryError", "_record_memory_history",
                 "MemPool", "reduce-overhead"):
        assert lost in text
    assert len(torch.swaps) == 1 and calls["installed"] == ["hooks"] and calls["patched"] == 1


def test_bridge_true_fails_rather_than_fall_back(stand_in):
    torch = fake_torch()
    calls = stand_in(torch)
    with pytest.raises(RuntimeError, match=r"install\(bridge=True\): no compiler here"):
        pyalloc.install(bridge=True)
    assert torch.swaps == [] and calls["installed"] == [] and api._state.config is None


def test_bridge_after_cuda_is_in_use_says_how_to_fix_it(stand_in, monkeypatch):
    stand_in(fake_torch())
    monkeypatch.setattr(bridge, "load",
                        lambda: FakeBridge("Can't swap an already initialized allocator"))
    with pytest.raises(RuntimeError, match="pyalloc.install\\(\\) must run before PyTorch initializes CUDA"):
        pyalloc.install()
    assert api._state.config is None


@pytest.mark.parametrize("value, route", [("0", "hooks"), ("1", "bridge"), ("auto", "bridge")])
def test_pyalloc_bridge_env_chooses_the_route(stand_in, monkeypatch, value, route):
    calls = stand_in(fake_torch())
    monkeypatch.setattr(bridge, "load", lambda: FakeBridge())
    monkeypatch.setenv("PYALLOC_BRIDGE", value)
    pyalloc.install()
    assert calls["installed"] == [route]


def test_pyalloc_bridge_env_1_fails_without_a_bridge(stand_in, monkeypatch):
    stand_in(fake_torch())
    monkeypatch.setenv("PYALLOC_BRIDGE", "1")
    with pytest.raises(RuntimeError, match="bridge=True"):
        pyalloc.install()
    monkeypatch.setenv("PYALLOC_BRIDGE", "yes")
    with pytest.raises(ValueError, match="PYALLOC_BRIDGE='yes'"):
        pyalloc.install()


def test_regression_a_second_install_asking_another_route_says_why_it_cannot(stand_in, monkeypatch):
    # Regression: install(bridge=True) after the default fell back to the hooks returned
    # in silence, on the hooks route the caller had just asked not to be on.
    torch = fake_torch()
    calls = stand_in(torch)
    with pytest.warns(RuntimeWarning):
        pyalloc.install(pool_size="1GiB")
    assert calls["installed"] == ["hooks"]
    with pytest.raises(RuntimeError, match=r"install\(bridge=True\): pyalloc is already installed through "
                                           r"the C hooks \(the bridge was not available: no compiler here\), "
                                           r"and the route can be chosen only once per process"):
        pyalloc.install(pool_size="1GiB", bridge=True)
    monkeypatch.setenv("PYALLOC_BRIDGE", "1")
    with pytest.raises(RuntimeError, match="already installed through the C hooks"):
        pyalloc.install(pool_size="1GiB")
    monkeypatch.delenv("PYALLOC_BRIDGE")
    pyalloc.install(pool_size="1GiB")  # the default again, or the hooks named: nothing to say
    pyalloc.install(pool_size="1GiB", bridge=False)
    assert len(torch.swaps) == 1


def test_a_second_install_asking_the_hooks_on_the_bridge_route_says_why_it_cannot(stand_in, monkeypatch):
    calls = stand_in(fake_torch())
    monkeypatch.setattr(bridge, "load", lambda: FakeBridge())
    pyalloc.install()
    with pytest.raises(RuntimeError, match=r"install\(bridge=False\): pyalloc is already installed through "
                                           r"the bridge, and the route can be chosen only once per process"):
        pyalloc.install(bridge=False)
    pyalloc.install(bridge=True)
    assert calls["installed"] == ["bridge"]


# -- PyTorch's own settings: PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF ------------------

#: Every key issue 47 names, in the forms users set them.
USERS_TORCH_CONF = ("expandable_segments:False, max_split_size_mb:64,garbage_collection_threshold:0.6,"
                    "roundup_power2_divisions:[256:1,512:2,>:4],per_process_memory_fraction:0.8,"
                    "backend:cudaMallocAsync,large_segment_size_mb:32,throw_on_cudamalloc_oom:True,"
                    "expandable_segments_reserve:0.5,pinned_use_background_threads:True")
NOT_APPLIED_KEYS = ("garbage_collection_threshold:0.6", "roundup_power2_divisions:[256:1,512:2,>:4]",
                    "per_process_memory_fraction:0.8", "backend:cudaMallocAsync",
                    "expandable_segments_reserve:0.5")


def test_pytorch_alloc_conf_keys_take_effect_or_are_named_once(stand_in, monkeypatch, capfd):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", USERS_TORCH_CONF)
    calls = stand_in(fake_torch())
    pyalloc.install(bridge=False)
    config = pyalloc.parse_config(calls["configured"][0])
    assert config["strategy"] == "bestfit"  # expandable_segments:False
    assert config["max_split_size"] == 64 << 20
    assert config["segment_size"] == 32 << 20  # large_segment_size_mb
    named = [line for line in capfd.readouterr().err.splitlines() if line.startswith("pyalloc: PYTORCH_ALLOC_CONF")]
    for item in NOT_APPLIED_KEYS:
        assert sum(f" {item} is not applied: " in line for line in named) == 1, (item, named)
    # Applied keys, and those PyTorch's own host allocator still applies, are not named.
    assert len(named) == len(NOT_APPLIED_KEYS), named
    assert "torch.cuda.set_per_process_memory_fraction(0.8)" in "\n".join(named)
    pyalloc.install()  # the same settings again: nothing new is said
    assert "PYTORCH_ALLOC_CONF" not in capfd.readouterr().err


def test_roundup_power2_divisions_as_a_number_and_the_old_variable(stand_in, monkeypatch, capfd):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF",
                       "roundup_power2_divisions:4,expandable_segments:True,max_split_size_mb:128,no_such_key:1")
    calls = stand_in(fake_torch())
    pyalloc.install(bridge=False)
    config = pyalloc.parse_config(calls["configured"][0])
    assert config["strategy"] == "vmm" and config["max_split_size"] == 128 << 20
    err = capfd.readouterr().err
    assert "pyalloc: PYTORCH_CUDA_ALLOC_CONF: roundup_power2_divisions:4 is not applied: " in err, err
    assert "no_such_key:1 is not applied: not a key PyTorch's allocator knows" in err, err


def test_the_older_variable_beside_the_new_one_is_named_as_not_read(stand_in, monkeypatch, capfd):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.5")
    stand_in(fake_torch())
    pyalloc.install(bridge=False)
    err = capfd.readouterr().err
    assert "pyalloc: PYTORCH_CUDA_ALLOC_CONF is not read: PYTORCH_ALLOC_CONF is set too" in err, err


def test_the_new_variable_wins_and_pyalloc_conf_wins_over_both(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert pyalloc.parse_config(api.settings_text())["strategy"] == "bestfit"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")  # PyTorch reads it first, alone
    config = pyalloc.parse_config(api.settings_text())
    assert config["strategy"] == "vmm" and config["max_split_size"] == 64 << 20
    monkeypatch.setenv("PYALLOC_CONF", "max_split_size:32MiB")
    assert pyalloc.parse_config(api.settings_text())["max_split_size"] == 32 << 20


@pytest.mark.parametrize("conf, words", [
    ("max_split_size_mb:10", "max_split_size_mb expects a whole number of MiB of at least 20"),
    ("expandable_segments:yes", "expandable_segments expects True or False"),
    ("backend:turbo", "backend expects native or cudaMallocAsync"),
    ("per_process_memory_fraction:1.5", "expects a fraction in [0, 1]"),
    ("roundup_power2_divisions:[256:1", "is never closed"),
    ("expandable_segments", "is not of the form key:value"),
])
def test_bad_pytorch_alloc_conf_is_refused_naming_it(stand_in, monkeypatch, conf, words):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", conf)
    stand_in(fake_torch())
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF") as e:
        pyalloc.install(bridge=False)
    assert words in str(e.value)
