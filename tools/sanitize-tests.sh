#!/usr/bin/env bash
# Build kvcache with AddressSanitizer + UndefinedBehaviorSanitizer and run the whole pytest
# suite (and the C tests) under them. Any sanitizer report fails the run.
#
#   tools/sanitize-tests.sh [pytest arguments...]      e.g. tools/sanitize-tests.sh -x -q
#
# Environment:
#   CC=gcc|clang         compiler (default gcc; clang also needs clang++ for the C++ benchmark
#                        extension). Debian packages: gcc g++ (libasan/libubsan come with them),
#                        or clang (with libclang-rt-14-dev).
#   KVCACHE_SANITIZE     sanitizers (default address,undefined), read by setup.py
#   PYTHON               interpreter (default python3)
#   KVCACHE_SKIP_CTESTS=1  do not run tests/c
#
# The extension is built in place in a copy of the tree under build/sanitize-$CC, and the suite
# runs there. The interpreter is not instrumented, so the sanitizer runtime is preloaded;
# PYTHONMALLOC=malloc gives every Python object its own malloc block, so an overrun of a bytes
# object handed to kvcache is caught. Leak checking is off: the interpreter keeps its own
# allocations alive at exit.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PYTHON="${PYTHON:-python3}"
CC="${CC:-gcc}"
export KVCACHE_SANITIZE="${KVCACHE_SANITIZE:-address,undefined}"

case "$(basename "$CC")" in
    clang*)
        CXX="${CXX:-${CC/clang/clang++}}"
        # the ASan runtime as a shared library: the extensions reference it, the preload provides it
        RUNTIME="$("$CC" -print-file-name=libclang_rt.asan-x86_64.so)"
        EXTRA_LDFLAGS="-shared-libsan"
        ;;
    *)
        CXX="${CXX:-${CC/gcc/g++}}"
        RUNTIME="$("$CC" -print-file-name=libasan.so)"
        EXTRA_LDFLAGS=""
        ;;
esac
if [[ "$KVCACHE_SANITIZE" == *address* ]] && [ ! -e "$RUNTIME" ]; then
    echo "no ASan runtime for $CC (looked for $RUNTIME)" >&2
    exit 1
fi

# A copy of the source tree, built in place there: the working tree's own build is left alone,
# and the tests see the sanitized build however they import kvcache (from the import path or
# from src/).
. "$REPO/tools/sanitized-tree.sh"
WORK="$REPO/build/sanitize-$(basename "$CC")"
TREE="$WORK/tree"
echo "==> copy the source tree to $TREE"
kvc_copy_tree "$REPO" "$TREE"
kvc_find_shared "$REPO"
echo "==> build in place ($CC, -fsanitize=$KVCACHE_SANITIZE)"
kvc_build_in_place "$TREE" "$WORK/build.log" "$CC" "$CXX" "$EXTRA_LDFLAGS"
cd "$TREE"

if [ -f tests/c/Makefile ] && [ "${KVCACHE_SKIP_CTESTS:-0}" != 1 ]; then
    echo "==> C tests (make -C tests/c, sanitizers on)"
    make -s -C tests/c CC="$CC"
fi

echo "==> pytest under the sanitizers"
# benchmarks/: the sanitized build of the bench's extension (kvcache_bench), before any installed one
export PYTHONPATH="$TREE/src:$TREE/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONMALLOC=malloc
if [[ "$KVCACHE_SANITIZE" == *address* ]]; then
    # libstdc++ is loaded up front too: the runtime resolves the real __cxa_throw when it starts,
    # and a C++ extension loaded later (matplotlib's) would otherwise abort on its first throw
    CXXLIB="$(readlink -f "$("$CXX" -print-file-name=libstdc++.so)")"
    export LD_PRELOAD="$RUNTIME:$CXXLIB${LD_PRELOAD:+:$LD_PRELOAD}"
    # allocator_may_return_null: a huge request is a MemoryError for the tests to see, as
    # without the sanitizer
    export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:${ASAN_OPTIONS:-}"
fi
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
"$PYTHON" - <<'PY'
import os
import kvcache
print("kvcache from", os.path.dirname(kvcache.__file__))
PY
# The live interop tests load llama.cpp (libllama.so of llama-cpp-python 0.3.10), whose
# llama_model::build_graph deletes a graph object through a pointer to a smaller type; ASan's
# new-delete-type-mismatch check would abort there. Those tests run on their own with that one
# check off (kvcache's core is C and never uses new / delete); everything else runs with all.
# The static analysis tests (mypy, stubtest: they read the package, they do not run its C code)
# are left out: the plain suite runs them. The property tests run at the dev profile's strength
# unless KVCACHE_HYPOTHESIS_PROFILE says otherwise: here they look for memory errors on the paths
# they take, and the plain suite searches the input space at full strength.
export KVCACHE_HYPOTHESIS_PROFILE="${KVCACHE_HYPOTHESIS_PROFILE:-dev}"
"$PYTHON" -m pytest -p no:cacheprovider -k "not test_live_" -m "not static_analysis" "$@" tests
echo "==> pytest under the sanitizers: the live llama.cpp interop tests"
rc=0
ASAN_OPTIONS="new_delete_type_mismatch=0:$ASAN_OPTIONS" "$PYTHON" -m pytest -p no:cacheprovider -k test_live_ "$@" tests \
    || rc=$?
# 5: nothing collected (llama_cpp not installed: the live tests skip themselves, or none exist)
[ "$rc" = 5 ] && rc=0
exit "$rc"
