#!/usr/bin/env bash
# For a GPU session, from the repository root after `python3 setup.py build_ext --inplace`.
#
# The first GPU run (benchmarks/results/gpu-2026-11-22-h100-run1) saw oom.py and
# cuda_graph.py die with SIGSEGV and nothing on stderr, in the two checks where
# pyalloc throws a C++ exception. This tells apart:
#   A  C++ exceptions broken in this build of pyalloc._C at all (compiler/runtime mix)
#   B  broken only when crossing into torch
#   C  a crash elsewhere in those scripts
# Each step prints its exit status; 0 is good, -11 / 139 is the crash.
set -u
SO=$(ls pyalloc/_C*.so)
echo "== compilers: ${CXX:-c++} and what built torch"
"${CXX:-c++}" --version | head -1
python3 -c "import torch; print(torch.__config__.show())" | grep -iE "compiler|CXX_FLAGS" | head -3
echo "== the C++ runtime pyalloc._C uses (U: shared; T: a private copy)"
ldd "$SO"
nm -D "$SO" | grep -E " (__cxa_throw|__gxx_personality_v0|_Unwind_RaiseException)$"
echo "== A1: a throw inside pyalloc._C, caught by pybind11 (no torch, no driver)"
python3 -X faulthandler -c "
import pyalloc._C as C
try:
    C.cuda_configure('bogus:1')
except ValueError as e:
    print('caught ValueError')"
echo "A1 rc=$?"
echo "== A2: pyalloc's out-of-memory throw on a fake device (no torch, no driver)"
python3 -X faulthandler -c "
import pyalloc._C as C
C._testing_use_fake_devices(64 << 20)
try:
    C._testing_hook_malloc(1 << 30, 0, 0)
except RuntimeError as e:
    print('caught:', str(e)[:60])"
echo "A2 rc=$?"
echo "== B: the same throw out of pyalloc_malloc into torch (hooks route)"
PYALLOC_BRIDGE=0 python3 -X faulthandler -c "
import torch, pyalloc
pyalloc.install(bridge=False)
try:
    torch.empty(1 << 46, dtype=torch.uint8, device='cuda')
except RuntimeError as e:
    print('caught:', str(e)[:60])"
echo "B rc=$?"
echo "== C: where the checks crash (cuda-gdb, the image's debugger)"
if command -v cuda-gdb >/dev/null; then
  for s in oom.py cuda_graph.py; do
    cuda-gdb -q -batch -ex run -ex bt --args python3 -X faulthandler "tests/gpu/$s" 2>&1 | tail -40
  done
fi
