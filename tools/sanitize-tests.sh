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
# The extension is built in place in a copy of the tree under build/sanitize-$CC, and the
# suite runs there. The interpreter is not
# instrumented, so the sanitizer runtime is preloaded; PYTHONMALLOC=malloc gives every Python
# object its own malloc block, so an overrun of a bytes object handed to kvcache is caught.
# Leak checking is off: the interpreter keeps its own allocations alive at exit.
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

# A copy of the source tree (tracked and new files, nothing ignored), built in place there:
# the working tree's own build is left alone, and the tests see the sanitized build however
# they import kvcache (from the import path or from src/).
WORK="$REPO/build/sanitize-$(basename "$CC")"
TREE="$WORK/tree"
echo "==> copy the source tree to $TREE"
rm -rf "$TREE"
mkdir -p "$TREE"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$REPO" ls-files -co --exclude-standard -z | (cd "$REPO" && tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$TREE"
else
    tar --exclude=./build --exclude='*.so' -cf - . | tar -xf - -C "$TREE"
fi
# the reference material beside the repository, for the tests that use it
SHARED="${KVCACHE_SHARED:-}"
for cand in "$REPO/../shared" "$REPO/../../shared"; do
    if [ -z "$SHARED" ] && [ -d "$cand" ]; then SHARED="$(cd "$cand" && pwd)"; fi
done
if [ -n "$SHARED" ]; then
    export KVCACHE_SHARED="$SHARED"
    [ -d "$SHARED/interop" ] && export KVC_INTEROP_DIR="${KVC_INTEROP_DIR:-$SHARED/interop}"
fi

echo "==> build in place ($CC, -fsanitize=$KVCACHE_SANITIZE)"
cd "$TREE"
CC="$CC" CXX="$CXX" LDSHARED="$CC -shared" LDCXXSHARED="$CXX -shared" LDFLAGS="${LDFLAGS:-} $EXTRA_LDFLAGS" \
    "$PYTHON" setup.py build_ext --inplace -j 2 >"$WORK/build.log" 2>&1 || {
    tail -40 "$WORK/build.log"
    exit 1
}
if grep -E "csrc/.*warning:" "$WORK/build.log"; then
    echo "warnings in csrc/ (see $WORK/build.log)" >&2
    exit 1
fi

if [ -f tests/c/Makefile ] && [ "${KVCACHE_SKIP_CTESTS:-0}" != 1 ]; then
    echo "==> C tests (make -C tests/c, sanitizers on)"
    make -s -C tests/c CC="$CC"
fi

echo "==> pytest under the sanitizers"
export PYTHONPATH="$TREE/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONMALLOC=malloc
if [[ "$KVCACHE_SANITIZE" == *address* ]]; then
    export LD_PRELOAD="$RUNTIME${LD_PRELOAD:+:$LD_PRELOAD}"
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
exec "$PYTHON" -m pytest -p no:cacheprovider "$@" tests
