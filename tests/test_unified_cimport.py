"""The cimport contract: a separate Cython extension drives UnifiedCore through _core.pxd."""
import importlib
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import kvcache
from conftest import need_module, wait_for_waiters

HERE = os.path.dirname(os.path.abspath(__file__))

EXT_SOURCE = textwrap.dedent("""
    # cython: language_level=3
    from libc.stdint cimport int32_t
    from kvcache._core cimport UnifiedCore, UBatch

    def fill(UnifiedCore c, UBatch ub, int rounds):
        '''Place ub `rounds` times at consecutive positions without the GIL.'''
        cdef int i, r, locked, placed = 0
        cdef int32_t pmax = -1
        with nogil:                 # the lock is waited for without the GIL
            locked = c.lock_c()     # the *_c methods do not lock: the caller serializes
            if locked == 0:
                for i in range(rounds):
                    r = c.find_slot_c(&ub.c)
                    if r != 1:
                        break
                    c.commit_c()
                    placed += 1
                pmax = c.seq_pos_max_c(0)
                c.unlock_c()
        if locked != 0:
            return None             # refused: called back from inside an operation on c
        return placed, pmax, c.head_c(), c.n_c(), c.used_c()

    def lock(UnifiedCore c):
        cdef int r
        with nogil:
            r = c.lock_c()
        return r

    def unlock(UnifiedCore c):
        cdef int r
        with nogil:
            r = c.unlock_c()
        return r
""")

SETUP = textwrap.dedent("""
    import sys
    from setuptools import Extension, setup
    from Cython.Build import cythonize
    inc, pxd_root = sys.argv.pop(1), sys.argv.pop(1)
    setup(ext_modules=cythonize([Extension("kvc_ext_user", ["kvc_ext_user.pyx"], include_dirs=inc.split(";"))],
                                include_path=[pxd_root], quiet=True))
""")


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    """The example extension, built against the installed package's headers and .pxd files."""
    need_module("test", "Cython")
    tmp_path = tmp_path_factory.mktemp("ext")
    pkg = kvcache.get_include()
    headers = [os.path.join(pkg, "include"), os.path.join(HERE, os.pardir, "csrc")]
    (tmp_path / "kvc_ext_user.pyx").write_text(EXT_SOURCE)
    (tmp_path / "setup.py").write_text(SETUP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(pkg), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "setup.py", ";".join(headers), os.path.dirname(pkg),
                          "build_ext", "--inplace"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("kvc_ext_user")
    finally:
        sys.path.remove(str(tmp_path))


def test_extension_cimports_unified_core(ext):
    c = kvcache.UnifiedCache(64, 1, 4, 4, n_seq_max=2)
    placed, pmax, head, n, used = ext.fill(c, kvcache.UBatch([0, 1, 2, 3, 4], [0, 0, 0, 0, 1]), 20)
    # the same tokens again and again: 12 ubatches of 5 fill 60 of the 64 cells
    assert (placed, pmax, used) == (12, 3, 60)
    assert (c.used, c.head, c.n) == (used, head, n) == (60, 55, 64)


@pytest.mark.parametrize("kv_unified", [True, False])
def test_todays_cache_places_through_the_contract_as_find_slot_does(ext, kv_unified):
    """find_slot_c of a UnifiedCache2026 is its find_slot: the same scattered, final placement."""
    def today():
        c = kvcache.UnifiedCache2026(64, 1, 4, 4, n_seq_max=2, n_pad=1, kv_unified=kv_unified)
        for p in range(6):
            assert c.find_slot(kvcache.UBatch([p], [p % 2]))
        c.seq_rm(0, 1, 3)                       # holes the next placement reuses, not contiguous
        return c
    ub = kvcache.UBatch([9, 10, 11], [1, 1, 1])
    a, b = today(), today()
    assert ext.fill(a, ub, 1)[0] == 1
    assert b.find_slot(ub)
    assert a.stream_cells() == b.stream_cells() and a.heads == b.heads
    assert [(s, x.tolist()) for s, x in a.slot_info()] == [(s, x.tolist()) for s, x in b.slot_info()]


def test_the_lock_of_the_contract_excludes_python_callers(ext):
    c = kvcache.UnifiedCache(64, 1, 4, 4, n_seq_max=2)
    assert ext.lock(c) == 0
    got = []
    t = threading.Thread(target=lambda: got.append(c.used))
    t.start()
    wait_for_waiters(c, 1)          # a Python call from another thread waits for the extension
    assert not got
    assert ext.unlock(c) == 0
    t.join(60)
    assert got == [0]
    assert ext.unlock(c) == -1      # not held: nothing is released


def test_the_lock_is_refused_inside_an_operation_on_the_cache(ext):
    c = kvcache.UnifiedCache(64, 1, 4, 4, n_seq_max=2)
    seen = []

    class File:
        def write(self, b):
            seen.append(ext.fill(c, kvcache.UBatch([0], [0]), 1))
            return len(b)

    c.state_write_into(File())
    assert seen and all(r is None for r in seen)
    assert c.used == 0


def test_the_contract_classes_cannot_be_made_directly():
    from kvcache import _core
    with pytest.raises(TypeError, match="UnifiedCache"):
        _core.UnifiedCore()
    with pytest.raises(TypeError, match="RecurrentCache"):
        _core.RecurrentCore()
    with pytest.raises(TypeError, match="create a kvcache.UnifiedCache"):
        _core._Unified(64, 1, 4, 4)
