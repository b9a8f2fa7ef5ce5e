"""Leaks: a million mixed cheap operations leave memory flat.

Two measures: tracemalloc (every Python object and numpy buffer kvcache creates) and the
resident set size of the process (also the C core's own allocations, which tracemalloc does
not see). A leak of a few bytes per operation grows either by megabytes over a million
operations; the bounds leave room for allocator noise only. KVCACHE_LEAK_OPS scales the run.
tools/valgrind.sh checks a subset under valgrind.
"""
import gc
import os
import sys
import tracemalloc

import pytest

from leak_workload import Workload, inject_failures

# AddressSanitizer keeps freed memory in quarantine: the resident size grows by design there,
# and every operation is slower
SANITIZED = "libasan" in os.environ.get("LD_PRELOAD", "") or bool(os.environ.get("KVCACHE_SANITIZE"))
N_OPS = int(os.environ.get("KVCACHE_LEAK_OPS", "200000" if SANITIZED else "1000000"))
WARMUP = 50000


def _rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def test_a_million_operations_keep_memory_flat():
    w = Workload(seed=7)
    w.run(WARMUP)                 # caches, free lists and allocator arenas reach their size
    gc.collect()
    tracemalloc.start()
    try:
        w.run(WARMUP // 5)
        gc.collect()
        traced0, _ = tracemalloc.get_traced_memory()
        rss0 = _rss_bytes()
        w.run(N_OPS)
        gc.collect()
        traced1, _ = tracemalloc.get_traced_memory()
        rss1 = _rss_bytes()
    finally:
        tracemalloc.stop()
    grew_traced = traced1 - traced0
    grew_rss = rss1 - rss0
    print(f"{N_OPS} operations: traced {traced0} -> {traced1} bytes ({grew_traced:+}), "
          f"rss {rss0} -> {rss1} bytes ({grew_rss:+})")
    assert grew_traced < 256 * 1024, f"Python-side memory grew by {grew_traced} bytes"
    if not SANITIZED:
        assert grew_rss < 8 * 1024 * 1024, f"the process grew by {grew_rss} bytes"


@pytest.mark.skipif(not sys.platform.startswith("linux") or SANITIZED,
                    reason="reads /proc for the resident size (which AddressSanitizer's quarantine grows)")
def test_failed_allocations_free_what_they_took():
    inject_failures(rounds=1)     # warm-up: the same objects and arenas
    gc.collect()
    rss0 = _rss_bytes()
    inject_failures(rounds=20)
    gc.collect()
    grew = _rss_bytes() - rss0
    assert grew < 8 * 1024 * 1024, f"the process grew by {grew} bytes over 20 rounds of failures"
