"""What the GPU check scripts share (each runs in a fresh process: tests/cuda/test_gpu.py).

pyalloc reaches PyTorch by one of two routes, chosen by install() and, when
install() is not told, by PYALLOC_BRIDGE: the bridge (1, or unset where it
builds) or CUDAPluggableAllocator's C hooks (0). Most checks run on whichever
route that selects; a check of something only the bridge gives starts with
bridge_only(), which skips the script (a SKIP line, exit status 0) under
PYALLOC_BRIDGE=0 and otherwise installs pyalloc through the bridge or fails
saying why it could not.
"""
import os
import sys

import pyalloc


def hooks_route_selected() -> bool:
    return os.environ.get("PYALLOC_BRIDGE", "").strip() == "0"


def bridge_only(feature: str, **install_kwargs) -> None:
    """Installs pyalloc through the bridge, or ends the script with a SKIP line
    where PYALLOC_BRIDGE=0 selects the hooks route (on which `feature` raises)."""
    if hooks_route_selected():
        print(f"SKIP: {feature} needs the bridge; PYALLOC_BRIDGE=0 selects the C hooks route")
        sys.exit(0)
    pyalloc.install(bridge=True, **install_kwargs)
    assert pyalloc.is_installed() == "bridge", pyalloc.is_installed()


def graph_pools_reach_pyalloc() -> bool:
    """Whether PyTorch's private-pool calls (CUDA graphs, MemPool) reach pyalloc: always
    through the bridge; on the hooks route only where torch offers the graph-pool setters."""
    return (pyalloc.is_installed() == "bridge"
            or "set_begin_allocate_to_pool" in pyalloc.cuda._state.hooks)
