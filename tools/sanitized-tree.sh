# Helpers shared by tools/sanitize-tests.sh and tools/fuzz-python.sh (sourced, not run): a copy
# of the source tree with the extension built in place with sanitizers, leaving the working
# tree's own build alone.

# kvc_copy_tree REPO DEST: the tracked and new (not ignored) files of REPO into DEST (emptied).
kvc_copy_tree() {
    local repo="$1" dest="$2"
    rm -rf "$dest"
    mkdir -p "$dest"
    if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
        git -C "$repo" ls-files -co --exclude-standard -z |
            (cd "$repo" && tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$dest"
    else
        (cd "$repo" && tar --exclude=./build --exclude='*.so' -cf - .) | tar -xf - -C "$dest"
    fi
}

# kvc_find_shared REPO: export KVCACHE_SHARED (and KVC_INTEROP_DIR for the C tests) when the
# reference material lies beside the repository, as the tests look for it.
kvc_find_shared() {
    local repo="$1" shared="${KVCACHE_SHARED:-}" cand
    for cand in "$repo/../shared" "$repo/../../shared"; do
        if [ -z "$shared" ] && [ -d "$cand" ]; then shared="$(cd "$cand" && pwd)"; fi
    done
    if [ -n "$shared" ]; then
        export KVCACHE_SHARED="$shared"
        if [ -d "$shared/interop" ]; then export KVC_INTEROP_DIR="${KVC_INTEROP_DIR:-$shared/interop}"; fi
    fi
}

# kvc_build_in_place TREE LOG CC CXX EXTRA_LDFLAGS: build_ext --inplace in TREE with
# $KVCACHE_SANITIZE (read by setup.py); the log goes to LOG. Fails on a build error or on a
# warning from csrc/.
kvc_build_in_place() {
    local tree="$1" log="$2" cc="$3" cxx="$4" extra="$5"
    (cd "$tree" && CC="$cc" CXX="$cxx" LDSHARED="$cc -shared" LDCXXSHARED="$cxx -shared" \
        LDFLAGS="${LDFLAGS:-} $extra" "${PYTHON:-python3}" setup.py build_ext --inplace -j 2) >"$log" 2>&1 || {
        tail -40 "$log"
        return 1
    }
    if grep -E "csrc/.*warning:" "$log"; then
        echo "warnings in csrc/ (see $log)" >&2
        return 1
    fi
}
