"""pyalloc as PyTorch's CUDA allocator: ``install()`` and the API over its pools.

``install()`` swaps PyTorch's CUDA caching allocator for pyalloc's, once, before
the process's first CUDA allocation. From then on every CUDA tensor comes from
pyalloc's pool on its device, and ``torch.cuda.empty_cache()``,
``Tensor.record_stream``, ``torch.cuda.set_per_process_memory_fraction`` and the
``torch.cuda`` memory statistics keep working.

Every function taking ``device`` accepts ``None`` (the current device), an index,
``"cuda:N"`` or a ``torch.device``. Sizes are in bytes. Nothing here imports torch
until it is needed, so ``import pyalloc`` stays cheap and works without torch.

The functions that read figures (``memory_stats()`` and the functions built on it,
``fragmentation()``, ``memory_summary()``, ``graph_memory()``, ``snapshot()``,
``dump_snapshot()``) raise NotOnCudaError where pyalloc holds no memory on the
device and is not PyTorch's allocator, so none can come (no CUDA device, or
``install()`` has not run): figures there would be zeros that mean nothing. The
functions that act on the pools (``empty_cache()``, the resets,
``release_graph_memory()``) then have nothing to do and do nothing, as
``torch.cuda.empty_cache()`` does before CUDA is in use.
"""
from __future__ import annotations

import collections
import ctypes
import operator
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _C, _torch_conf
from ._config import Size, as_size, conf_string, parse_config
from ._summary import format_summary

#: The environment variable install() reads its settings from.
CONF_ENV = "PYALLOC_CONF"
#: The environment variable that chooses the route when install() is not told:
#: "1" the bridge or an error, "0" the C hooks (unset: the bridge where it builds).
BRIDGE_ENV = "PYALLOC_BRIDGE"

# PyTorch's setter on its pluggable-allocator object -> the function it is given.
_HOOKS = (
    ("set_init_fn", "pyalloc_init"),
    ("set_reset_fn", "pyalloc_empty_cache"),
    ("set_memory_fraction_fn", "pyalloc_set_memory_fraction"),
    ("set_base_alloc_fn", "pyalloc_base_alloc"),
    ("set_record_stream_fn", "pyalloc_record_stream"),
    # CUDA graphs' private pools (C++ signatures: csrc/cuda/torch_hooks.cpp).
    # Without them pyalloc asks the driver about captures on every allocation.
    ("set_begin_allocate_to_pool", "pyalloc_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "pyalloc_end_allocate_to_pool"),
    ("set_release_pool", "pyalloc_release_pool"),
)

_ALREADY_INITIALIZED = (
    "pyalloc.install() must run before PyTorch initializes CUDA, and CUDA is already "
    "initialized in this process (a CUDA tensor was created, or something like "
    "torch.cuda.current_device() was called), so PyTorch's allocator can no longer be "
    "swapped. Fix: call pyalloc.install() first, before any CUDA work (right after the "
    "imports); or start the program with `python -m pyalloc run script.py ...` (also "
    "`pyalloc run`, and `torchrun ... -m pyalloc run script.py`), which installs pyalloc "
    "before the script runs, with settings from PYALLOC_CONF."
)


class _State:
    """What install() set up in this process (it runs at most once)."""

    conf: Optional[str] = None  # the effective settings string
    config: Optional[Dict[str, int]] = None
    patched: bool = False
    allocator: Any = None  # torch's CUDAPluggableAllocator, or the bridge module, kept alive
    hooks: Tuple[str, ...] = ()
    route: Optional[str] = None  # "bridge" or "hooks"
    no_bridge: Optional[str] = None  # why the default fell back to the hooks
    # A multiprocessing child of a process that installed pyalloc (pyalloc._children):
    # install() leaves the CUDA driver alone there, and its parent already named the
    # PYTORCH_ALLOC_CONF keys not applied.
    child: bool = False


_state = _State()


class NotOnCudaError(RuntimeError):
    """pyalloc has no figures for a CUDA device: it holds no memory there and is not
    PyTorch's CUDA allocator in this process (no CUDA device, or ``install()`` has not
    run). The message says which, and where figures can be had without a GPU."""


# -- installing ---------------------------------------------------------------------------


def torch_settings() -> Tuple[Optional[str], List[_torch_conf.Taken]]:
    """The PyTorch variable in force (PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF)
    and how each of its keys is taken; (None, []) where neither is set."""
    found = _torch_conf.torch_conf()
    if found is None:
        return None, []
    return found[0], _torch_conf.translate(*found)


def settings_text(conf: Optional[str] = None, config: Optional[Dict[str, Size]] = None) -> str:
    """The settings install() would use: the keys of PyTorch's own variable that
    pyalloc applies (``pyalloc._torch_conf``), then PYALLOC_CONF, then ``conf``,
    then keywords.

    Later sources override earlier ones key by key. ValueError names the bad
    source, key or value.
    """
    if conf is not None and not isinstance(conf, str):
        raise TypeError(f"conf must be a 'key:value,...' string, got {type(conf).__name__}")
    torch_base = _torch_conf.settings(torch_settings()[1])
    env = os.environ.get(CONF_ENV, "")
    if env:
        try:
            parse_config(env)
        except ValueError as e:
            raise ValueError(f"{CONF_ENV}={env!r}: {e}") from None
    base = ",".join(p for p in (torch_base, env, conf or "") if p)
    return conf_string(base, config)


def install(conf: Optional[str] = None, *, bridge: Optional[bool] = None,
            patch_torch: bool = True, **config: Size) -> None:
    """Makes pyalloc PyTorch's CUDA allocator for the rest of the process.

    Call it before any CUDA work, e.g. right after ``import torch``. Every rank
    of a distributed job calls it for itself; each device gets its own pool
    when first used.

    Args:
        conf: settings as ``"key:value,..."``, e.g. ``"pool_size:40GiB"``.
        bridge: how PyTorch reaches pyalloc. ``None`` (the default): through the
            bridge (``pyalloc.bridge``), built against the installed torch the
            first time (a minute; cached), so that every PyTorch memory tool
            keeps working; where it cannot be built, through the C hooks of
            ``CUDAPluggableAllocator``, with one warning naming what is lost.
            ``True``: the bridge or an error. ``False``: the C hooks. Left
            ``None``, ``PYALLOC_BRIDGE=1`` or ``=0`` in the environment decides.
        patch_torch: on the hooks route, also make ``torch.cuda.memory_stats``,
            ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
            ``max_memory_reserved``, ``reset_peak_memory_stats`` and
            ``memory_summary`` answer from pyalloc (they raise under any pluggable
            allocator otherwise). The bridge needs no patch: torch's own
            functions answer from pyalloc.
        **config: the same settings as keywords (``pool_size="40GiB"``,
            ``max_pool_size=2**34``); see ``pyalloc.CONFIG_KEYS``.

    Settings merge key by key, later winning: the keys of ``PYTORCH_ALLOC_CONF``
    (or ``PYTORCH_CUDA_ALLOC_CONF``) that pyalloc applies, ``PYALLOC_CONF`` from
    the environment, then ``conf``, then the keywords. Each key of PyTorch's
    variable that is not applied is named once on stderr, with why.

    Calling it again with the same settings does nothing; with other settings,
    or with ``bridge`` naming the route not taken, it raises RuntimeError, as does a CPU-only PyTorch, a machine without a GPU,
    or a process that already initialized CUDA. ValueError for bad settings.
    """
    text = settings_text(conf, config)
    wanted = parse_config(text)
    if bridge is None:
        bridge = _bridge_from_env()
    if _state.config is not None:
        if wanted != _state.config:
            raise RuntimeError(
                f"pyalloc is already installed with settings '{_state.conf}' and cannot be "
                f"reinstalled with '{text}': the allocator can be chosen only once per process. "
                f"Give install() the same settings everywhere, or set them once in {CONF_ENV}."
            )
        _check_same_route(bridge)
        if patch_torch and _state.route == "hooks" and not _state.patched:
            _patch_torch()
        return

    name, taken = torch_settings()
    if name is not None and not _state.child:
        _torch_conf.announce(name, taken)
    torch = _import_torch()
    _check_torch_can_swap(torch)
    if not _state.child:
        _check_driver(torch)
    _C.cuda_configure(text)

    route = "bridge" if bridge is not False and _install_bridge(required=bool(bridge)) else "hooks"
    if route == "hooks":
        _install_hooks(torch)
    _C.cuda_set_route(route)
    _state.conf, _state.config, _state.route = text, wanted, route
    if patch_torch and route == "hooks":
        _patch_torch()


def _check_same_route(bridge: Optional[bool]) -> None:
    """A second install() that names the route other than the one taken raises: saying
    nothing would leave the caller on a route it asked not to be on."""
    if bridge is None or bridge == (_state.route == "bridge"):
        return
    if _state.route == "hooks":
        why = f" (the bridge was not available: {_state.no_bridge})" if _state.no_bridge else ""
        taken = f"the C hooks{why}"
    else:
        taken = "the bridge"
    raise RuntimeError(
        f"pyalloc.install(bridge={bridge}): pyalloc is already installed through {taken}, and "
        "the route can be chosen only once per process. Ask for the route in the first "
        f"install() (or {BRIDGE_ENV}=1 / 0), before any CUDA work."
    )


def _bridge_from_env() -> Optional[bool]:
    value = os.environ.get(BRIDGE_ENV, "").strip()
    if value in ("", "auto"):
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{BRIDGE_ENV}={value!r}: expected 1 (the bridge), 0 (the C hooks) or auto")


def _swap(change) -> None:
    """Runs torch's allocator swap, with install()'s message when CUDA is in use."""
    try:
        change()
    except RuntimeError as e:
        if "already initialized" in str(e):
            raise RuntimeError(_ALREADY_INITIALIZED) from e
        raise


def _install_bridge(required: bool) -> bool:
    """Installs the bridge; False (after one warning) where it cannot be had, unless required."""
    from . import bridge

    try:
        module = bridge.load()
    except bridge.BridgeUnavailable as e:
        if required:
            raise RuntimeError(f"pyalloc.install(bridge=True): {e}") from e
        _state.no_bridge = str(e)
        lost = "".join(f"\n  - {item}" for item in bridge.LOST_WITHOUT_BRIDGE)
        warnings.warn(
            f"pyalloc: the bridge to PyTorch's allocator interface is not available ({e}); "
            f"pyalloc is installed through CUDAPluggableAllocator's C hooks instead, where "
            f"these do not work:{lost}\nTo get the bridge: a C++ compiler, ninja and the CUDA "
            f"runtime headers, then `pyalloc bridge build` (see `pyalloc doctor`); "
            f"install(bridge=False) uses the hooks without this warning.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    _swap(lambda: module.install(_C.library_path()))
    _state.allocator = module
    return True


def _install_hooks(torch) -> None:
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        _C.library_path(), "pyalloc_malloc", "pyalloc_free"
    )
    hooks = allocator.allocator()
    lib = ctypes.CDLL(_C.library_path())
    installed_hooks = []
    for setter, symbol in _HOOKS:
        set_fn = getattr(hooks, setter, None)  # each where the installed torch has it
        if set_fn is not None:
            set_fn(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
            installed_hooks.append(setter)
    _swap(lambda: torch.cuda.memory.change_current_allocator(allocator))
    _state.allocator, _state.hooks = allocator, tuple(installed_hooks)
    # With the graph-pool hooks PyTorch announces every capture, so allocations
    # need not ask the driver about their stream each time.
    _C.cuda_set_told_of_captures("set_begin_allocate_to_pool" in installed_hooks)


def is_installed() -> Optional[str]:
    """How PyTorch reaches pyalloc in this process: ``"bridge"`` (every PyTorch memory
    tool works), ``"hooks"`` (CUDAPluggableAllocator's C hooks), or None when pyalloc
    is not PyTorch's allocator."""
    route = _C.cuda_route()
    return None if route == "none" else route


def _import_torch():
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(
            "pyalloc.install() needs PyTorch with CUDA support; torch cannot be imported: "
            f"{e}. Install a CUDA build of PyTorch (https://pytorch.org/get-started/)."
        ) from e
    return torch


def _check_torch_can_swap(torch) -> None:
    if getattr(torch.version, "hip", None):
        raise RuntimeError(
            f"pyalloc supports CUDA builds of PyTorch; this one (torch {torch.__version__}) is "
            "built for ROCm."
        )
    if torch.version.cuda is None:
        raise RuntimeError(
            f"pyalloc.install() needs a CUDA build of PyTorch, and this one (torch "
            f"{torch.__version__}) is CPU-only: it has no CUDA allocator to replace. Install "
            "a CUDA build (https://pytorch.org/get-started/), or use pyalloc.Allocator "
            "(host or virtual memory) on this machine."
        )
    if not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.cuda.memory.CUDAPluggableAllocator; "
            "pyalloc needs torch 2.3 or newer."
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(_ALREADY_INITIALIZED)


def _check_driver(torch) -> None:
    """A GPU that torch sees, and the driver pyalloc's pools load. Both start the CUDA
    driver (cuInit), which reads CUDA_VISIBLE_DEVICES once and for the process's life:
    a multiprocessing child skips them, so that its target can still choose its devices
    (``os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)``), and a child that does no CUDA
    work never starts the driver. There a missing GPU or driver is said at the first
    CUDA use, by torch's lazy init or by pyalloc's pools, which load the driver then."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "pyalloc.install() found no usable CUDA GPU (torch.cuda.is_available() is False): "
            "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES."
        )
    _C.cuda_check_driver()


def _patch_torch() -> None:
    from . import _torch_patch

    _torch_patch.apply(TORCH_REPLACEMENTS)
    _state.patched = True


# -- devices ------------------------------------------------------------------------------


def _device_index(device: Any = None) -> int:
    """A CUDA device index from None (current), an int, 'cuda[:N]' or a torch.device."""
    if device is None:
        try:
            import torch
        except ImportError:
            return 0  # without torch nothing can have changed the current device

        # Before PyTorch initializes CUDA the current device is 0; asking
        # torch.cuda.current_device() then would initialize it.
        if not torch.cuda.is_initialized():
            return 0
        return torch.cuda.current_device()
    if isinstance(device, bool):
        raise TypeError("device must be an index, 'cuda:N' or a torch.device, not a bool")
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            raise ValueError(f"expected a CUDA device like 'cuda' or 'cuda:1', got {device!r}")
        return int(index) if index else _device_index(None)
    if hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        if device.type != "cuda":
            raise ValueError(f"expected a CUDA device, got {device}")
        return _device_index(None) if device.index is None else int(device.index)
    if hasattr(device, "__index__"):
        index = operator.index(device)
        if index < 0:
            raise ValueError(f"device index must not be negative, got {index}")
        return index
    raise TypeError(f"device must be an index, 'cuda:N' or a torch.device, got {type(device).__name__}")


# -- statistics ---------------------------------------------------------------------------

_WITHOUT_A_GPU = (
    "Without a GPU, the same figures come from pyalloc.Allocator over host or virtual "
    "memory (its stats(), fragmentation() and snapshot()), or from a replay "
    "of a recorded snapshot (pyalloc.replay.replay(path), `pyalloc replay`)"
)


def _read(device: Any, what: str) -> int:
    """The device index, where pyalloc has figures for the device: its pools exist,
    or may yet (pyalloc is PyTorch's allocator; fake devices in tests). Otherwise
    NotOnCudaError, saying why there are none."""
    d = _device_index(device)
    if _C.cuda_is_installed() or d in _C.cuda_devices() or _C._testing_fake_devices():
        return d
    raise NotOnCudaError(f"pyalloc.{what}(): {_why_no_pools(d)}")


def _why_no_pools(d: int) -> str:
    try:
        count = _C.cuda_device_count()  # loads the driver: only here, on the way to an error
    except RuntimeError as e:
        return (f"there is no CUDA device in this process, so pyalloc holds no memory on "
                f"cuda:{d} and has no figures for it ({e}). {_WITHOUT_A_GPU}.")
    if d >= count:
        return (f"there is no cuda:{d} (the CUDA driver sees {count} device(s)), so pyalloc has "
                f"no figures for it. {_WITHOUT_A_GPU}.")
    return (f"pyalloc is not PyTorch's CUDA allocator in this process and holds no memory on "
            f"cuda:{d}, so it has no figures for it: call pyalloc.install() before any CUDA "
            f"work, or start the program with `pyalloc run script.py` (torch.cuda.memory_stats() "
            f"reports PyTorch's own allocator meanwhile).")


def memory_stats(device: Any = None) -> Dict[str, int]:
    """Every key of ``torch.cuda.memory_stats()``, for pyalloc's pools on the device.

    As PyTorch counts a device: every pool together (the general pool, the
    buffer pool of ``reserve_buffer``, and the private pools of CUDA graphs and
    ``torch.cuda.MemPool``), each peak the highest the device's count reached
    (not a sum of the pools' peaks), plus
    ``reserved_bytes_by_private_pools.<id>.*`` for each graph pool, its id
    ``(a, b)`` written ``a_b``, and pyalloc's own ``num_driver_calls`` (the
    CUDA driver calls behind ``num_device_alloc`` and ``num_device_free``).
    Keys are sorted, as torch's are. NotOnCudaError where pyalloc has no figures
    for the device (see the module's docstring).
    """
    return _stats(device, "memory_stats")


def _stats(device: Any, what: str) -> Dict[str, int]:
    stats = _C.cuda_device_stats(_read(device, what))
    return collections.OrderedDict(sorted(stats.items()))


def memory_allocated(device: Any = None) -> int:
    """Bytes in blocks handed out to tensors on the device (rounded up to 512 B)."""
    return _stats(device, "memory_allocated")["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    """The peak of memory_allocated() since the start or reset_peak_memory_stats()."""
    return _stats(device, "max_memory_allocated")["allocated_bytes.all.peak"]


def memory_reserved(device: Any = None) -> int:
    """Bytes pyalloc holds from the driver on the device, allocated or cached."""
    return _stats(device, "memory_reserved")["reserved_bytes.all.current"]


def max_memory_reserved(device: Any = None) -> int:
    """The peak of memory_reserved() since the start or reset_peak_memory_stats()."""
    return _stats(device, "max_memory_reserved")["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    """Sets every peak statistic of the device to its current value."""
    _C.cuda_reset_peak_stats(_device_index(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Sets every ``allocated`` / ``freed`` sum and counter (``num_ooms``,
    ``num_device_alloc``, ...) of the device to 0, as ``torch.cuda`` does."""
    _C.cuda_reset_accumulated_stats(_device_index(device))


def fragmentation(device: Any = None) -> Dict[str, Any]:
    """The device's general pool: free bytes, largest free block, external
    fragmentation (1 - largest free block / free bytes), free blocks by size.
    NotOnCudaError where pyalloc has no figures for the device."""
    return _C.cuda_fragmentation(_read(device, "fragmentation"), "general")


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A readable table of the device's statistics, like ``torch.cuda.memory_summary()``,
    followed by a section on fragmentation. NotOnCudaError where pyalloc has no
    figures for the device."""
    d = _read(device, "memory_summary")
    blocks, held = _C.cuda_graph_memory(d)
    return format_summary(
        memory_stats(d), fragmentation(d), device=d, abbreviated=abbreviated,
        graph_blocks=blocks, graph_bytes=held,
    )


# What install() puts in place of torch.cuda's functions of the same names
# (_torch_patch.py), which raise under any pluggable allocator.
TORCH_REPLACEMENTS = (
    memory_stats,
    memory_allocated,
    max_memory_allocated,
    memory_reserved,
    max_memory_reserved,
    reset_peak_memory_stats,
    reset_accumulated_memory_stats,
    memory_summary,
)


# -- pool control -------------------------------------------------------------------------


def empty_cache(device: Any = None) -> int:
    """Returns the device's cached (free) segments to the driver, keeping ``pool_size``
    reserved; the bytes released. ``torch.cuda.empty_cache()`` does this for every device."""
    return _C.cuda_empty_cache(_device_index(device))


def reserve(nbytes: Size, device: Any = None) -> int:
    """Grows the device's pool so that ``nbytes`` are free in one range now; the bytes
    newly reserved (0 if such a range existed). empty_cache() may release them again."""
    return _C.cuda_reserve(_device_index(device), as_size(nbytes, "nbytes"))


def reserve_buffer(nbytes: Size, device: Any = None):
    """A CUDA tensor of ``nbytes`` uint8 carved from the device's buffer pool.

    The buffer pool is kept apart from the general pool, so long-lived buffers
    (KV caches, workspaces, pinned activations) never split the general pool's
    free ranges. View the tensor as you need (``t.view(torch.float16)``); when
    the last tensor using it dies, the region goes back to the buffer pool.
    The buffer is ordered on the current stream.
    """
    import torch
    import torch.utils.dlpack

    d = _device_index(device)
    size = as_size(nbytes, "nbytes")
    stream = torch.cuda.current_stream(d).cuda_stream if torch.cuda.is_available() else 0
    return torch.utils.dlpack.from_dlpack(_C.cuda_buffer(d, size, stream))


def graph_memory(device: Any = None) -> Tuple[int, int]:
    """(blocks, bytes) allocated during CUDA graph captures on the device, which pyalloc
    holds for the graphs' replays even after PyTorch frees them.

    Only under a torch without the graph-pool hooks: where install() set them
    (``set_begin_allocate_to_pool``), each graph gets a private pool instead,
    returned to the device when the graph and its tensors are gone, and this
    stays (0, 0). NotOnCudaError where pyalloc has no figures for the device."""
    return tuple(_C.cuda_graph_memory(_read(device, "graph_memory")))


def release_graph_memory(device: Any = None) -> int:
    """Returns the memory held for CUDA graphs on the device to its pool; the bytes.
    Needed only under a torch without the graph-pool hooks (see graph_memory()).

    Call it only once no graph captured so far will be replayed again. It waits
    for the device's queued work first.
    """
    d = _device_index(device)
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(d)
    return _C.cuda_release_graph_memory(d)


# -- snapshots ----------------------------------------------------------------------------

#: segment_pool_id of the buffer pool's segments in snapshot(). PyTorch gives its
#: private pools (0, n) (torch.cuda.MemPool) and (n, 0) (CUDA graphs), counting n
#: from 1, and (0, 0) is its default pool: an id with both halves set is never one
#: of PyTorch's, so buffers are never mistaken for a graph's or a MemPool's memory.
BUFFER_POOL_ID = (1, 1)


def attach_oom_observer(fn: Callable[[int, int, int, int], Any]) -> None:
    """Calls ``fn(device, requested_bytes, device_total, device_free)`` at each
    out-of-memory error of pyalloc's CUDA pools, on every route (install()'s bridge
    or C hooks, and reserve_buffer()), as PyTorch's allocator calls the observers
    of ``torch._C._cuda_attach_out_of_memory_observer``: once per error, on the
    allocating thread, with the GIL, after pyalloc's locks are released and before
    the error reaches the caller. So fn may take a snapshot() (its history holds the
    error's ``oom`` event) or allocate; an error of its own allocations calls no
    observer. What fn raises is printed on stderr (``sys.unraisablehook``) and
    swallowed: the caller gets its out-of-memory error all the same.

    ``requested_bytes`` is what the caller asked for; ``device_total`` and
    ``device_free`` are the driver's figures for the device (0 when pyalloc could
    not read them), read once the error was final. Unlike PyTorch's allocator, which
    passes the segment size it tried to get from the driver and, under a memory
    fraction, the fraction's cap as the total, pyalloc passes the request and the
    device's own total. Through the bridge, PyTorch's own observers hear the same
    figures, after pyalloc's.

    Attaching fn twice calls it twice. TypeError if fn is not callable."""
    _C.cuda_attach_oom_observer(fn)


def detach_oom_observer(fn: Callable[[int, int, int, int], Any]) -> None:
    """Stops calling ``fn`` (one attachment of it: the oldest of a callable equal to
    it, so ``obj.method`` detaches what ``attach_oom_observer(obj.method)`` attached).
    ValueError if fn is not attached; TypeError if it is not callable."""
    _C.cuda_detach_oom_observer(fn)


def record_history(enabled: bool = True, max_entries: int = 100_000) -> None:
    """Keeps the last ``max_entries`` alloc / free / segment events of every device's
    pools, for snapshot() and dump_snapshot(); ``enabled=False`` stops and forgets them."""
    n = operator.index(max_entries)
    if enabled and n <= 0:
        raise ValueError(f"max_entries must be positive, got {n}")
    _C.cuda_record_history(bool(enabled), n if enabled else 0)


def snapshot() -> Dict[str, Any]:
    """Every device's pools in PyTorch's memory-snapshot format
    (``torch.cuda.memory._snapshot()``), with the recorded history as device_traces.
    The buffer pool's segments carry segment_pool_id BUFFER_POOL_ID, (1, 1); a
    graph pool's, its pool id. Segment counts and bytes add up to memory_stats()' figures.
    NotOnCudaError where pyalloc holds memory on no device and is not PyTorch's allocator."""
    return _snapshot("snapshot")


def _snapshot(what: str) -> Dict[str, Any]:
    devices = _C.cuda_devices()
    if not devices:
        _read(None, what)
    count = max([d + 1 for d in devices] + [max(_C.cuda_hook_device_count(), 0)])
    segments: List[Dict[str, Any]] = []
    traces: List[List[Dict[str, Any]]] = [[] for _ in range(count)]
    for d in devices:
        segments.extend(_C.cuda_snapshot_segments(d, "general"))
        for seg in _C.cuda_snapshot_segments(d, "buffers"):
            seg["segment_pool_id"] = BUFFER_POOL_ID
            segments.append(seg)
        segments.extend(_C.cuda_snapshot_segments(d, "graph"))
        events = sum((_C.cuda_history(d, pool) for pool in ("general", "buffers", "graph")), [])
        traces[d] = sorted(events, key=lambda e: e["time_us"])
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {"backend": "pyalloc", **_C.cuda_config()},
    }


def dump_snapshot(path: str = "dump_snapshot.pickle") -> None:
    """Writes snapshot() as a plain pickle, like ``torch.cuda.memory._dump_snapshot()``:
    open it at pytorch.org/memory_viz or with ``python -m torch.cuda._memory_viz``.
    Only a name ending in ``.gz`` gets a gzip-compressed pickle, which those two
    cannot read (``pyalloc replay`` reads both). NotOnCudaError as snapshot()."""
    from .replay.snapshot_io import write_snapshot

    write_snapshot(_snapshot("dump_snapshot"), path)
