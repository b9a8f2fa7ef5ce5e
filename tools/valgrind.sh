#!/usr/bin/env bash
# Run a subset of kvcache under valgrind (memcheck) and fail on any memory error or leak in
# kvcache's own code: the C core (kvc_*) and the extension (kvcache/_core).
#
#   tools/valgrind.sh [N_OPS]        (default 3000)
#
# The subset is tests/leak_workload.py: N_OPS mixed operations on unified, iSWA, recurrent and
# metadata-only caches (error paths included), then every allocation of the C core made to
# fail in turn while caches are built and used. Python runs with PYTHONMALLOC=malloc so that
# valgrind sees every allocation. What fails the run: a memory error (invalid read or write,
# use of uninitialised memory, bad free...) or a definitely / indirectly lost block with a
# frame in kvcache. The interpreter's and numpy's own records are not ours and are ignored,
# and so are "possibly lost" blocks (live Python objects at exit are reported as such).
# Environment: PYTHON (default python3), KVCACHE_VALGRIND_LOG (where the full log goes).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OPS="${1:-3000}"
LOG="${KVCACHE_VALGRIND_LOG:-$(mktemp -t kvcache-valgrind.XXXXXX)}"

command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
# the interpreter itself, not a wrapper script (pyenv shims) that valgrind would stop at
PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')"

# the in-tree build when there is one, else the installed kvcache
export PYTHONPATH="$REPO/src:$REPO/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONMALLOC=malloc
echo "valgrind: $OPS operations + injected allocation failures (log: $LOG)"
valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite,indirect,possible \
    --num-callers=40 --log-file="$LOG" \
    "$PYTHON" "$REPO/tests/leak_workload.py" "$OPS" --inject

"$PYTHON" - "$LOG" <<'PY'
import re
import sys

log = open(sys.argv[1]).read().splitlines()
records, cur = [], []
for line in log:
    body = re.sub(r"^==\d+== ?", "", line)
    if not body.strip():
        if cur:
            records.append(cur)
        cur = []
    else:
        cur.append(body)
if cur:
    records.append(cur)

ours = re.compile(r"kvc_|_core\.c\b|_core\.cpython|__pyx_")
kinds = re.compile(r"^(Invalid |Conditional jump|Use of uninitialised|Mismatched free|Syscall param|"
                   r"Source and destination overlap|Argument .* of function)|are (definitely|indirectly) lost")
bad = [r for r in records if kinds.search(r[0]) and any(ours.search(x) for x in r)]
summary = [x for r in records for x in r if x.startswith(("ERROR SUMMARY", "   definitely lost", "   indirectly lost",
                                                           "   possibly lost"))]
print("\n".join(summary))
for r in bad:
    print("\n".join(r))
    print()
print(f"kvcache records: {len(bad)} (memory errors or leaks with a frame in kvcache)")
sys.exit(1 if bad else 0)
PY
