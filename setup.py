"""Builds pyalloc._C from csrc/ with only a C++17 compiler and pybind11.

No CUDA toolkit and no torch are needed: the CUDA backend loads the driver at
run time. The extension is one shared library that is both the Python module
and the library torch.cuda.memory.CUDAPluggableAllocator loads.
"""
import glob
import importlib.util
import os
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

VERSION = "0.1.0"

# Compile the sources in parallel (NPY_NUM_BUILD_JOBS overrides the count).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

here = os.path.dirname(os.path.abspath(__file__))


def _toolchain():
    # pyalloc/_toolchain.py imports nothing from pyalloc, which is not built yet.
    spec = importlib.util.spec_from_file_location("_pyalloc_toolchain",
                                                  os.path.join(here, "pyalloc", "_toolchain.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# The compiler must use the C++ runtime torch uses (the system g++'s), or an exception
# unwound from pyalloc through torch's frames crashes: pyalloc/_toolchain.py says why.
# CC and CXX set in the environment win unless they link a private copy of it; the
# library built is checked too (PYALLOC_ALLOW_PRIVATE_RUNTIME=1 turns both off).
toolchain = _toolchain()
CHOICE = toolchain.use_for_setup(os.environ)
if CHOICE.notice:
    print(CHOICE.notice, file=sys.stderr)
print(f"pyalloc: C++ compiler: {toolchain.identity(CHOICE.cxx) if CHOICE.cxx else 'none'} ({CHOICE.why})",
      file=sys.stderr)
# csrc/ holds one folder per layer (csrc/README.md). Everything but the bridge,
# which is built later against the installed torch, goes into pyalloc._C.
LAYERS = ("core", "backends", "cuda", "replay", "python")


def _files(pattern):
    return sorted(
        os.path.relpath(p, here)
        for layer in LAYERS
        for p in glob.glob(os.path.join(here, "csrc", layer, pattern))
    )


sources = _files("*.cpp")
# Relative, as every path setuptools is given: an absolute one is left out of the sdist.
EXPORTS = os.path.join("csrc", "python", "exports.map")
headers = _files("*.h")

ext = Pybind11Extension(
    "pyalloc._C",
    sources,
    depends=headers + [EXPORTS],  # rebuild when a header changes, not only a .cpp
    cxx_std=17,
    include_dirs=["csrc"],  # includes name their layer: "core/allocator.h"
    define_macros=[("PYALLOC_VERSION", f'"{VERSION}"')],
    extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall", "-Wextra"],
    libraries=["dl"],
    # Exports only the module's entry point and the pyalloc_* C functions.
    extra_link_args=[f"-Wl,--version-script={EXPORTS}"],
)

# The bridge is compiled later, against the torch the user has (pyalloc/bridge.py):
# its sources travel inside the package, where an installed pyalloc finds them.
BRIDGE_SOURCES = ("torch_bridge/bridge.cpp", "torch_bridge/allocate.h", "torch_bridge/segment_fields.h",
                  "cuda/bridge_api.h")


class BuildPyWithBridgeSources(build_py):
    def run(self):
        super().run()
        for rel in BRIDGE_SOURCES:
            target = os.path.join(self.build_lib, "pyalloc", "csrc", rel)
            self.mkpath(os.path.dirname(target))
            self.copy_file(os.path.join(here, "csrc", rel), target)


setup(version=VERSION, ext_modules=[ext],
      cmdclass={"build_py": BuildPyWithBridgeSources, "build_ext": toolchain.checked_build_ext(build_ext, CHOICE.refused)})
