#!/usr/bin/env bash
# Builds the C++ test driver over the allocator core twice and runs it:
#   - AddressSanitizer + UndefinedBehaviorSanitizer: every test;
#   - ThreadSanitizer: the multi-thread stress.
# Only the core's sources are compiled (no pybind11, no Python).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$here/bin"
mkdir -p "$out"
CXX="${CXX:-g++}"
# Every layer but the Python module (and the bridge, built against torch).
mapfile -t core < <(ls "$root"/csrc/{core,backends,cuda,replay}/*.cpp)
common=(-std=c++17 -g -O1 -fno-omit-frame-pointer -Wall -Wextra -I"$root/csrc")

echo "== building with ASan + UBSan"
"$CXX" "${common[@]}" -fsanitize=address,undefined -fno-sanitize-recover=all \
  "$here/test_core.cpp" "${core[@]}" -o "$out/test_core_asan" -ldl -pthread
echo "== running under ASan + UBSan"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$out/test_core_asan" all

echo "== building with TSan"
"$CXX" "${common[@]}" -fsanitize=thread \
  "$here/test_core.cpp" "${core[@]}" -o "$out/test_core_tsan" -ldl -pthread
echo "== running the thread stress under TSan"
TSAN_OPTIONS=halt_on_error=1 "$out/test_core_tsan" threads
echo "sanitizers: all passed"
