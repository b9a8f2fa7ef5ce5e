#!/usr/bin/env bash
# Fuzz kvcache's Python-facing decoders with atheris (tests/fuzz/atheris_state.py), the C core
# instrumented for coverage and checked by AddressSanitizer + UndefinedBehaviorSanitizer.
#
#   tools/fuzz-python.sh [SECONDS] [TARGET...]   default: 60 seconds for each of
#                                                unified recurrent statefile inspect
#
# Needs clang with compiler-rt (Debian: clang libclang-rt-14-dev) and atheris (pip install
# atheris). What it does:
#   1. copies the source tree to build/fuzz-python/tree and builds the extension in place with
#      clang and -fsanitize=address,undefined,fuzzer-no-link;
#   2. links clang's ASan runtime and its libFuzzer into one preloadable library (the runtime's
#      weak coverage hooks would otherwise shadow libFuzzer's, and atheris would see no
#      coverage of the C code); atheris finds that libFuzzer and uses it;
#   3. runs each target for SECONDS on its seeds (new inputs go to build/fuzz-python/corpus,
#      crashes to build/fuzz-python/artifacts). Any finding fails the run.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_EACH="${1:-60}"
shift || true
TARGETS=("$@")
[ "${#TARGETS[@]}" -gt 0 ] || TARGETS=(unified recurrent statefile inspect)
PYTHON="${PYTHON:-python3}"
CC="${CC:-clang}"
CXX="${CXX:-${CC/clang/clang++}}"
WORK="$REPO/build/fuzz-python"
TREE="$WORK/tree"
mkdir -p "$WORK/corpus" "$WORK/artifacts"

"$PYTHON" -c "import atheris" 2>/dev/null || { echo "atheris is not installed (pip install atheris)" >&2; exit 1; }

. "$REPO/tools/sanitized-tree.sh"
echo "==> copy the source tree to $TREE and build it ($CC, address,undefined,fuzzer-no-link)"
kvc_copy_tree "$REPO" "$TREE"
kvc_find_shared "$REPO"
KVCACHE_SANITIZE=address,undefined,fuzzer-no-link kvc_build_in_place "$TREE" "$WORK/build.log" "$CC" "$CXX" ""

echo "==> ASan runtime with libFuzzer"
RT_DIR="$(dirname "$("$CC" -print-file-name=libclang_rt.asan-x86_64.a)")"
for lib in libclang_rt.asan-x86_64.a libclang_rt.fuzzer_no_main-x86_64.a; do
    [ -f "$RT_DIR/$lib" ] || { echo "missing $RT_DIR/$lib (install libclang-rt-dev)" >&2; exit 1; }
done
PRELOAD="$WORK/asan_with_fuzzer.so"
cp "$RT_DIR/libclang_rt.asan-x86_64.a" "$WORK/asan.a"
# the preinit object registers ASan's initialiser for executables; a shared library has none
ar d "$WORK/asan.a" asan_preinit.cpp.o 2>/dev/null || true
"$CXX" -shared -o "$PRELOAD" -Wl,--whole-archive "$RT_DIR/libclang_rt.fuzzer_no_main-x86_64.a" "$WORK/asan.a" \
    -Wl,--no-whole-archive -lpthread -ldl -lrt

# loaded up front so that the runtime finds the real __cxa_throw (see sanitize-tests.sh)
CXXLIB="$(readlink -f "$("$CXX" -print-file-name=libstdc++.so)")"

seeds_of() {
    case "$1" in
        unified) echo "$TREE/tests/fuzz/corpus/fuzz_unified_state" ;;
        recurrent) echo "$TREE/tests/fuzz/corpus/fuzz_recurrent_state" ;;
        *) echo "$TREE/tests/fuzz/corpus/atheris_files" ;;
    esac
}

export PYTHONPATH="$TREE/src"
export PYTHONMALLOC=malloc
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:quarantine_size_mb=16:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
cd "$TREE"
for t in "${TARGETS[@]}"; do
    echo "==> atheris: $t ($SECONDS_EACH s)"
    mkdir -p "$WORK/corpus/$t"
    LD_PRELOAD="$PRELOAD:$CXXLIB" "$PYTHON" tests/fuzz/atheris_state.py "$t" -max_total_time="$SECONDS_EACH" \
        -rss_limit_mb=3072 -max_len=131072 -print_final_stats=1 -artifact_prefix="$WORK/artifacts/$t-" \
        "$WORK/corpus/$t" "$(seeds_of "$t")" >"$WORK/$t.log" 2>&1 || {
        grep -v -E "^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse)" "$WORK/$t.log" | tail -40
        echo "atheris $t: finding (log: $WORK/$t.log)" >&2
        exit 1
    }
    grep -E "^(#[0-9]+[[:space:]]+DONE|stat::number_of_executed_units|stat::average_exec_per_sec)" "$WORK/$t.log" || true
done
echo "atheris fuzzing passed"
