"""Shared paths, fixtures and hypothesis profiles of the test suite.

Paths are found from this file, never from the working directory, so the suite runs the
same from the source tree and from anywhere else against an installed kvcache:

- ``REPO``: the repository root (the parent of tests/);
- ``GOLDEN``: tests/golden, the golden traces shipped with the repository;
- ``SHARED``: the reference material beside the repository (``../shared``, or the directory
  named by ``KVCACHE_SHARED``). Everything the suite reads ships in tests/ (tests/golden,
  tests/data); the ``shared_dir`` fixture only adds cross-checks against the originals, skipped
  where they are absent (e.g. on hosted CI runners).
"""
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
GOLDEN = TESTS / "golden"


def _find_shared() -> Path:
    # ../shared beside the clone; one level further up for a git worktree inside a checkout
    env = os.environ.get("KVCACHE_SHARED")
    if env:
        return Path(env).resolve()
    for cand in (REPO.parent / "shared", REPO.parent.parent / "shared"):
        if cand.is_dir():
            return cand.resolve()
    return (REPO.parent / "shared").resolve()


SHARED = _find_shared()

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis comes with the `test` extra; without it only its tests skip
    settings = None

if settings is not None:
    # CI runs the property tests at full strength; a local run stays quick.
    settings.register_profile("ci", max_examples=300, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=60, deadline=None, print_blob=True)
    default = "ci" if os.environ.get("CI") else "dev"
    settings.load_profile(os.environ.get("KVCACHE_HYPOTHESIS_PROFILE", default))


def _has_bench() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("kvcache._bench") is not None
    except (ImportError, ValueError):
        return False


# `kvcache bench` needs the benchmark extension, which the kvcache wheel leaves out (benchmarks/
# builds it; .ci/run installs it and sets KVCACHE_EXPECT_BENCH=1, where its absence fails a test)
HAS_BENCH = _has_bench()
needs_bench = pytest.mark.skipif(not HAS_BENCH, reason="the benchmark extension kvcache._bench is not installed "
                                                       "(pip install ./benchmarks)")


@pytest.fixture(scope="session")
def repo_dir() -> Path:
    """The repository root."""
    return REPO


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """tests/golden (always present)."""
    if not GOLDEN.is_dir():
        pytest.fail(f"golden traces missing: {GOLDEN}")
    return GOLDEN


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The reference material beside the repository; skips the test when it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"reference material not found at {SHARED} (set KVCACHE_SHARED)")
    return SHARED


def kvcache_env(**extra) -> dict:
    """Environment for a subprocess that must import the same kvcache as this process (the
    source tree in development, the installed wheel in CI)."""
    import kvcache

    where = os.path.dirname(os.path.dirname(os.path.abspath(kvcache.__file__)))
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH", "")) if p)
    return env


def wait_for_waiters(obj, n, timeout=600.0):
    """Return once n threads are blocked waiting for the lock of obj (a cache, Batch or
    SWAPending); fails after timeout seconds. Lets a test see that a thread really waits,
    instead of assuming it has got there."""
    import time

    from kvcache import _core

    end = time.monotonic() + timeout
    while _core._lock_state(obj)["waiting"] < n:
        assert time.monotonic() < end, "no thread came to wait for the lock"
        time.sleep(0.001)
