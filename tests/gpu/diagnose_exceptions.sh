#!/usr/bin/env bash
# For a GPU session, from the repository root after `python3 setup.py build_ext --inplace`
# and `python3 -m pyalloc bridge build` (python -m benchmarks.gpu.session runs it so).
#
# The first GPU run (benchmarks/results/gpu-2026-11-22-h100-run1) saw oom.py and
# cuda_graph.py die with SIGSEGV and nothing on stderr, in the two checks where
# pyalloc throws a C++ exception out of its allocator into torch. The likely cause:
# pyalloc built by a compiler (/opt/gcc/bin/g++) whose C++ runtime is not torch's
# (pyalloc/_toolchain.py). This tells apart, in one run:
#   R  which C++ runtime each library uses (readelf: nm -D cannot see a private
#      runtime that exports.map hides)
#   A  C++ exceptions broken inside pyalloc._C at all, without torch: on a fake device
#      and out of the hook on the real device
#   B  broken only when crossing into torch: the hooks route and the bridge, at the size
#      oom.py asks for (twice the device), under both strategies
#   C  where the checks crash (cuda-gdb: backtrace and the libraries loaded)
#   D  the torch cases again after a rebuild with the system g++
# Each step prints its exit status: 0 is good; 139 (128 + 11) is the crash; 124 a step
# stopped at its time limit. The last line lists the steps that did not exit 0 (and the
# script then exits 1).
set -u
STEP_LIMIT=${STEP_LIMIT:-120}  # seconds per step: a hang must not eat the whole window

NONZERO=""
status() {  # status NAME RC: one line a reader can grep for; the last line lists the non-zero ones
  echo "$1 rc=$2"
  [ "$2" -eq 0 ] || NONZERO="$NONZERO $1=$2"
}

py() {  # py CODE: python3 with faulthandler, stopped after STEP_LIMIT seconds
  timeout "$STEP_LIMIT" python3 -X faulthandler -c "$1"
}

runtime_of() {  # runtime_of LABEL FILE: compiler, RUNPATH, and a private runtime or not
  local label=$1 file=$2
  echo "-- $label: $file"
  if [ ! -f "$file" ]; then
    echo "   (missing)"
    return
  fi
  readelf -p .comment "$file" | grep -F "]" | sed 's/^/   comment: /'
  readelf -d "$file" | grep -E "\((RUNPATH|RPATH|NEEDED)\)" | sed 's/^ */   /'
  # UND: the shared runtime's symbol; a section number: a private copy defined in this file.
  readelf -sW "$file" | grep -E " (__cxa_throw|__gxx_personality_v0|_Unwind_RaiseException)(@.*)?$" \
    | sed 's/^ */   /'
}

SO=$(ls pyalloc/_C*.so)
TORCH_LIB=$(python3 -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))")
BRIDGE_SO=$(python3 -m pyalloc bridge status | sed -n 's/^library: //p' | grep -v '^None$')
TOTAL=$(python3 -c "import pyalloc._C as C; print(C.cuda_describe_device(0)['total_bytes'])")
if [ -z "$TOTAL" ]; then
  echo "device 0 cannot be described (no GPU?): the steps below ask for 1 TiB instead"
  TOTAL=$((1 << 39))
fi
TWICE=$((2 * TOTAL))
echo "device 0: $TOTAL bytes; oom.py asks for twice that: $TWICE"

echo "== compilers: the one pyalloc is built with, and what built torch"
echo "CC=${CC:-unset} CXX=${CXX:-unset}; first g++ on PATH: $(command -v g++ || echo none)"
python3 -m pyalloc bridge status | grep -E "^compiler:"
[ -x /usr/bin/g++ ] && /usr/bin/g++ --version | head -1
python3 -c "import torch; print(torch.__config__.show())" | grep -iE "compiler|CXX_FLAGS" | head -3

echo "== R: the C++ runtime of each library (readelf)"
if command -v readelf >/dev/null; then
  runtime_of "pyalloc._C" "$SO"
  runtime_of "the bridge" "${BRIDGE_SO:-none}"
  for lib in libtorch_python.so libc10.so libc10_cuda.so libtorch_cuda.so; do
    runtime_of "torch" "$TORCH_LIB/$lib"
  done
else
  echo "readelf is not installed (binutils): the runtimes cannot be read"
fi
ldd "$SO"

echo "== A1: a throw inside pyalloc._C, caught by pybind11 (no torch, no driver)"
py "
import pyalloc._C as C
try:
    C.cuda_configure('bogus:1')
except ValueError as e:
    print('caught ValueError')"
status A1 $?

echo "== A2: pyalloc's out-of-memory throw on a fake device (no torch, no driver)"
py "
import pyalloc._C as C
C._testing_use_fake_devices(64 << 20)
try:
    C._testing_hook_malloc(1 << 30, 0, 0)
except RuntimeError as e:
    print('caught:', str(e)[:60])"
status A2 $?

echo "== A3: the throw out of the hook on the real device, twice its memory (no torch)"
py "
import pyalloc._C as C
try:
    C._testing_hook_malloc($TWICE, 0, 0)
except RuntimeError as e:
    print('caught:', str(e)[:60])"
status A3 $?

torch_oom() {  # torch_oom ROUTE STRATEGY: oom.py's request through torch on one route
  local route=$1 strategy=$2 bridge=0
  [ "$route" = bridge ] && bridge=1
  PYALLOC_BRIDGE=$bridge PYALLOC_CONF=strategy:$strategy py "
import torch, pyalloc
pyalloc.install()
print('route', pyalloc.is_installed())
try:
    torch.empty($TWICE, dtype=torch.uint8, device='cuda')
except RuntimeError as e:
    print('caught', type(e).__name__ + ':', str(e)[:60])"
}

echo "== B: the same throw out of pyalloc into torch, at oom.py's size"
for strategy in vmm bestfit; do
  for route in hooks bridge; do
    echo "-- B $route $strategy"
    torch_oom "$route" "$strategy"
    status "B-$route-$strategy" $?
  done
done

echo "== C: where the checks crash (cuda-gdb, the image's debugger)"
if command -v cuda-gdb >/dev/null; then
  for s in oom.py cuda_graph.py; do
    echo "-- C $s"
    timeout "$STEP_LIMIT" cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt \
      -ex "info sharedlibrary" --args python3 -X faulthandler "tests/gpu/$s" 2>&1 | tail -80
  done
else
  echo "no cuda-gdb on PATH"
fi

echo "== D: the torch cases again after a rebuild with the system g++"
if [ -z "${CC:-}${CXX:-}" ] && [ -x /usr/bin/g++ ]; then
  echo "CC and CXX are unset: the build above already used the system g++ (setup.py), so B is that case"
elif [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/g++ CXX=/usr/bin/g++
  python3 setup.py build_ext --inplace --force > /tmp/pyalloc-rebuild.log 2>&1
  status D-rebuild $?
  grep -E "^pyalloc: C\+\+ compiler" /tmp/pyalloc-rebuild.log
  timeout 300 python3 -m pyalloc bridge build > /tmp/pyalloc-bridge-rebuild.log 2>&1
  status D-bridge-build $?
  tail -1 /tmp/pyalloc-bridge-rebuild.log
  for route in hooks bridge; do
    echo "-- D $route vmm"
    torch_oom "$route" vmm
    status "D-$route" $?
  done
else
  echo "no /usr/bin/g++: no rebuild"
fi

if [ -z "$NONZERO" ]; then
  echo "== diagnosis: every step exited 0"
else
  echo "== diagnosis: steps that did not exit 0:$NONZERO"
  exit 1
fi
