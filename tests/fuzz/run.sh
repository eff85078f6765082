#!/usr/bin/env bash
# Builds the libFuzzer target for the pickle pre-scan (pickle_scan_fuzz.cpp) with clang's
# ASan and UBSan and runs it for a bounded time (FUZZ_SECONDS, default 60), starting from a
# seed corpus of the bundled snapshots in benchmarks/traces/ (decompressed, cut to their
# first FUZZ_SEED_BYTES) and a few small pickles Python writes. clang and its fuzzer runtime
# come from the distribution's packages, installed here if missing (CI starts bare).
# Longer runs:  FUZZ_SECONDS=3600 bash tests/fuzz/run.sh   (extra libFuzzer flags after it,
# e.g. -jobs=4 -workers=4). New inputs the fuzzer finds stay in build/fuzz/corpus; a crash
# is written to build/fuzz/crash-* and this script exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${FUZZ_SECONDS:-60}
seed_bytes=${FUZZ_SEED_BYTES:-4096}
out=build/fuzz
mkdir -p "$out/corpus" "$out/seeds"

# Whether clang can link a fuzz target here (clang, and libclang_rt.fuzzer beside it).
fuzzer_builds() {
  command -v clang++ >/dev/null &&
    printf '%s\n' 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o "$out/probe" >/dev/null 2>&1
}
if ! fuzzer_builds; then
  echo "run.sh: installing clang and its fuzzer runtime" >&2
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq clang
  # libclang_rt.fuzzer: libclang-rt-NN-dev, where the distribution splits it out
  # (only recommended by clang-NN on Debian 12, so absent under --no-install-recommends).
  version=$(clang++ --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "libclang-rt-$version-dev" || true
  fuzzer_builds || { echo "run.sh: clang cannot link a libFuzzer target (-fsanitize=fuzzer)" >&2; exit 1; }
fi

clang++ -std=c++17 -g -O1 -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Icsrc tests/fuzz/pickle_scan_fuzz.cpp csrc/replay/pickle_scan.cpp -o "$out/pickle_scan_fuzz"

# Seeds: the first byte of each is the chunk size's choice, the rest a pickle.
python3 - "$out/seeds" "$seed_bytes" <<'PY'
import glob, gzip, os, pickle, sys
out, keep = sys.argv[1], int(sys.argv[2])
seeds = {"small-p%d" % p: pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1 << 40,
         "size": 512, "stream": 0}]], "x": (1.5, -7, 2**70, b"ab", "\u00e9", None, True, {1, 2})}, protocol=p)
         for p in range(6)}
for path in sorted(glob.glob("benchmarks/traces/*.pickle.gz")):
    with gzip.open(path, "rb") as f:
        seeds[os.path.basename(path)] = f.read(keep)
for name, blob in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(bytes([len(name)]) + blob)
PY

# UBSan's findings are errors here, and any one stops the run with a report.
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1
"$out/pickle_scan_fuzz" "$out/corpus" "$out/seeds" -max_total_time="$seconds" -timeout=10 \
  -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 -artifact_prefix="$out/" "$@"
