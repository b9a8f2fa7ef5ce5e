"""The release build keeps the prefetches of the loops over scattered cells.

A helper that only prefetches looks to GCC like a function without effects: a call to it that is
not inlined early enough is deleted, and the loop loses its prefetches without a word (each such
loop ran 10-20% slower). The helpers are declared KVC_PREFETCH_FN (always inlined); this test
compiles the sources the way a release build does and counts the prefetch instructions left in
each loop's function."""
from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# setup.py's release flags that change code generation
FLAGS = ["-std=c11", "-O3", "-fno-strict-aliasing", "-fvisibility=hidden", "-fPIC"]
PREFETCH = {"x86_64": re.compile(r"^\s+prefetch\w*\s"), "aarch64": re.compile(r"^\s+prfm\s")}

# (source, function, prefetches at least): each loop's lines (a removal: the position, and the
# shift an emptied cell loses; kvc_cells_prefetch_seq: position and owner; placement: those, the
# end of the sequence's entries, the index's record)
LOOPS = [
    ("kvc_cells.c", "kvc_cells_seq_rm_range", 2),
    ("kvc_retain.c", "attach_run", 2),
    ("kvc_retain.c", "collect", 1),
    ("kvc_slot.c", "kvc_apply_2026", 4),
]


def _compiler() -> list[str]:
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    if not shutil.which(cc[0]):
        pytest.skip(f"no C compiler ({cc[0]})")
    return cc


def _assembly(cc: list[str], source: str) -> str:
    out = subprocess.run([*cc, *FLAGS, f"-I{CSRC}", "-S", "-o", "-", str(CSRC / source)], capture_output=True,
                         text=True, check=True)
    return out.stdout


def _prefetches(asm: str, function: str, pattern: re.Pattern) -> int | None:
    """Prefetch instructions in function's body and its clones (function.constprop.0, ...), or None
    when the compiler emitted no body of that name (inlined everywhere)."""
    n, inside, found = 0, False, False
    for line in asm.splitlines():
        label = re.match(r"^([\w.$]+):", line)
        if label and not label.group(1).startswith(".L"):   # a function's, not a local label
            name = label.group(1)
            inside = name == function or name.startswith(function + ".")
            found |= inside
        elif inside and pattern.match(line):
            n += 1
    return n if found else None


@pytest.mark.parametrize(("source", "function", "least"), LOOPS)
def test_the_loops_over_scattered_cells_keep_their_prefetches(source: str, function: str, least: int) -> None:
    pattern = PREFETCH.get(platform.machine())
    if pattern is None:
        pytest.skip(f"prefetch instructions of {platform.machine()} not known here")
    cc = _compiler()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout.lower()
    if "gcc" not in version and "clang" not in version:
        pytest.skip("neither GCC nor clang")
    n = _prefetches(_assembly(cc, source), function, pattern)
    if n is None:
        pytest.skip(f"{function} has no body of its own with this compiler")
    assert n >= least, f"{source}: {function} keeps {n} prefetch instructions, at least {least} expected"
