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
except ImportError:  # hypothesis comes with the `test` extra; without it only its tests skip (need)
    settings = None

if settings is not None:
    # CI runs the property tests at full strength; a local run stays quick.
    settings.register_profile("ci", max_examples=300, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=60, deadline=None, print_blob=True)
    default = "ci" if os.environ.get("CI") else "dev"
    settings.load_profile(os.environ.get("KVCACHE_HYPOTHESIS_PROFILE", default))


# --- optional dependencies: skipped where absent, a failure where CI installed them ----------------

#: what each name of KVCACHE_EXPECT stands for: a stage of .ci/run, or the `test` extra
STAGES = {
    "test": "kvcache's test extra (hypothesis, ml_dtypes, gguf, matplotlib, Cython, mypy)",
    "bench": "kvcache-bench, the cases of kvcache bench and their extension (pip install ./benchmarks)",
    "llama": "llama-cpp-python 0.3.10 (the live interop tests of layout 2025)",
    "llama36": "llama-cpp-python 0.3.36 (tests/test_live_v10.py, tests/test_live_hybrid.py, "
               "tests/test_live_store_llama.py)",
    "torch": "torch",
    "transformers": "transformers 5.x",
    "handoff": "ray and nixl (the hand-off examples)",
}

#: the name of KVCACHE_EXPECT that stands for each module a block of docs/ may need
#: (``needs: module``); any other comes with the test extra
MODULE_STAGE = {"torch": "torch", "transformers": "transformers", "ray": "handoff", "nixl": "handoff"}


# .ci/run names each stage it installed; a test of such a stage that would skip fails instead, so
# that a broken install cannot pass as a missing optional dependency
EXPECTED = frozenset(n.strip() for n in os.environ.get("KVCACHE_EXPECT", "").split(",") if n.strip())


def need(stage: str, reason: str):
    """Skip the calling test (or module) because what ``stage`` installs is missing, for ``reason``;
    fail it instead when KVCACHE_EXPECT names ``stage``."""
    assert stage in STAGES, stage
    if stage in EXPECTED:
        pytest.fail(f"{reason} (KVCACHE_EXPECT names {stage}: {STAGES[stage]} should be here)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def need_module(stage: str, name: str, minversion: str | None = None):
    """pytest.importorskip through :func:`need`: the module, else a skip (or the failure of an
    expected ``stage``)."""
    try:
        return pytest.importorskip(name, minversion=minversion)
    except pytest.skip.Exception as e:
        need(stage, str(e))


def needs(stage: str, missing: bool, reason: str) -> pytest.MarkDecorator:
    """A mark: the test needs what ``stage`` installs, which is ``missing`` (see :func:`need`)."""
    return pytest.mark.needs(stage, missing=missing, reason=reason)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(stage, missing, reason): an optional dependency (conftest.needs)")
    unknown = sorted(EXPECTED - STAGES.keys())
    if unknown:
        raise pytest.UsageError(f"KVCACHE_EXPECT: expected names among {', '.join(STAGES)}, found {', '.join(unknown)}")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        if mark.kwargs["missing"]:
            need(mark.args[0], mark.kwargs["reason"])


def _has_bench() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("kvcache_bench._bench") is not None
    except (ImportError, ValueError):
        return False


# `kvcache bench` needs kvcache-bench (the package kvcache_bench and its extension), which the
# kvcache wheel leaves out (`pip install ./benchmarks` installs it, .ci/run's bench stage too; in
# the source tree, `setup.py build_ext --inplace` builds it into benchmarks/, then
# PYTHONPATH=src:benchmarks)
HAS_BENCH = _has_bench()
needs_bench = needs("bench", not HAS_BENCH, "kvcache-bench (kvcache_bench._bench) is not installed "
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
    source tree in development, the installed wheel in CI), and the same kvcache_bench where this
    process finds one."""
    import importlib.util

    import kvcache

    where = [os.path.dirname(os.path.dirname(os.path.abspath(kvcache.__file__)))]
    try:
        bench = importlib.util.find_spec("kvcache_bench")
    except (ImportError, ValueError):
        bench = None
    if bench is not None and bench.origin:
        where.append(os.path.dirname(os.path.dirname(bench.origin)))
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*where, os.environ.get("PYTHONPATH", "")) if p)
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


def meddled(call, n, meddle):
    """call() with meddle() called (a RuntimeError from it, a refusal, swallowed) at the start of
    the n-th collection of the garbage collector, which runs at every allocation: Python code
    (a finalizer, a gc callback) running at each point of an operation in turn."""
    import gc

    seen = [0]

    def callback(phase, info):
        if phase == "start":
            seen[0] += 1
            if seen[0] == n:
                try:
                    meddle()
                except RuntimeError:
                    pass    # refused in the middle of the operation

    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        return call()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(callback)
