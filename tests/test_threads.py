"""Threads: every cache is safe to call from several threads at once.

Each cache (and Batch, SWAPending) holds its own lock for the whole of every operation; a
thread waiting for it does not hold the GIL; several caches are locked in one global order.
The stress test runs 8 threads x KVCACHE_STRESS_OPS (default 100,000) mixed operations on
caches they share, checks every snapshot it takes on the way, and ends with the reference
model's invariants holding.
"""
import io
import os
import random
import subprocess
import sys
import sysconfig
import threading

import numpy as np
import pytest

import kvcache
from kvcache import _core
from cache_state import check_recurrent_invariants, check_unified_invariants
from conftest import kvcache_env, wait_for_waiters

N_THREADS = 8
N_OPS = int(os.environ.get("KVCACHE_STRESS_OPS", "100000"))
JOIN_TIMEOUT = 600   # a deadlock fails the test instead of hanging the suite


def _run_threads(target, n, *args):
    errors = []
    start = threading.Barrier(n)

    def body(i):
        try:
            start.wait()
            target(i, *args)
        except BaseException as e:     # reported by the main thread
            errors.append((i, e))

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "threads still running: deadlock?"
    if errors:
        raise errors[0][1]


def _consistent_cells(cells):
    """A snapshot taken under the lock is consistent in itself: a cell is used iff a sequence
    holds it (a torn copy would break this)."""
    used = cells.pos != -1
    assert np.array_equal(cells.seq_mask.any(axis=1), used)


# --- the stress test ---------------------------------------------------------------------------------

class Shared:
    def __init__(self):
        self.unified = kvcache.UnifiedCache(256, 2, [16, 32], [32, 16], n_seq_max=8, n_pad=32)
        self.iswa = kvcache.ISWACache(128, 3, 16, 16, swa_layers=[1], n_swa=8, n_batch=16, n_seq_max=8)
        self.recurrent = kvcache.RecurrentCache(8, 2, 8, 16)
        self.done = [0] * N_THREADS


def _ub(rng, n_seq_max=8):
    n = rng.randint(1, 4)
    s = rng.randrange(n_seq_max)
    p0 = rng.randrange(200)
    ids = [[s] if rng.random() < 0.8 else [s, (s + 1) % n_seq_max] for _ in range(n)]
    return kvcache.UBatch(list(range(p0, p0 + n)), ids)


def _unified_op(c, rng, k):
    s = rng.randrange(8)
    if k < 30:
        ub = _ub(rng)
        if c.find_slot(ub):
            try:
                il = rng.choice(c.layers)
                c.store(il, np.ones((ub.n_tokens, (16, 32)[il]), np.float16), None)
            except (RuntimeError, ValueError):
                pass    # another thread moved the placement or placed a ubatch of another size
        (c.commit if rng.random() < 0.7 else c.restore)()
    elif k < 40:
        c.seq_rm(s if rng.random() < 0.9 else -1, rng.randrange(-1, 100), rng.randrange(-1, 200))
    elif k < 45:
        c.seq_cp(s, rng.randrange(8), -1, rng.randrange(-1, 100))
    elif k < 50:
        c.seq_add(s, rng.randrange(0, 50), -1, rng.randrange(-20, 20))
    elif k < 53:
        c.seq_div(s, 0, -1, rng.randrange(1, 4))
    elif k < 54:
        c.seq_keep(s)
    elif k < 65:
        with _core._Hold(c):          # two reads, one moment
            lo, hi = c.seq_pos_min(s), c.seq_pos_max(s)
        assert lo <= hi and (lo == -1) == (hi == -1)
    elif k < 72:
        m = c.kq_mask(_ub(rng), dtype=rng.choice(["f32", "bool"]))
        assert m.shape[0] % 64 == 0
    elif k < 76:
        _consistent_cells(c.cells())
    elif k < 80:
        assert c.k_shift().shape == (c.size,)
    elif k < 86:
        blob = c.state_write(s)
        try:
            c.state_read(blob, rng.randrange(8))
        except kvcache.StateError:
            pass        # no contiguous room for it now
    elif k < 88:
        blob = c.state_write(layout=kvcache.DEFAULT_LAYOUT)
        # the layout said: a whole state of a cache this small can parse in both layouts
        c.state_read(blob, layout=kvcache.DEFAULT_LAYOUT)
    elif k < 93:
        c.defrag_sched(rng.choice([-1.0, 0.1, 0.9]))
        c.update()
    elif k < 95:
        c.defrag_prepare(rng.randrange(0, 40))
        c.defrag_move()
    elif k < 96:
        c.clear()
    elif k < 98:
        f = io.BytesIO()
        n = c.state_write_into(f, s)
        assert n == len(f.getvalue())
    else:
        _ = c.head, c.n, c.used, c.slot, c.has_shift, repr(c)


def _iswa_op(c, rng, k):
    s = rng.randrange(8)
    if k < 35:
        pos0 = rng.randrange(300)
        n = rng.randint(1, 6)
        batch = kvcache.Batch(list(range(pos0, pos0 + n)), [s] * n)
        ok = True
        for ub in c.ubatches(batch, 4):
            if not c.find_slot(ub):
                ok = False
                break
        (c.commit if ok and rng.random() < 0.8 else c.restore)()
    elif k < 45:
        c.seq_rm(s, rng.randrange(-1, 100), -1)
    elif k < 50:
        c.seq_cp(s, rng.randrange(8))
    elif k < 60:
        with c._hold:
            lo, hi = c.seq_pos_min(s), c.seq_pos_max(s)
        assert lo <= hi and (lo == -1) == (hi == -1)
    elif k < 70:
        base, swa = c.kq_mask(_ub(rng))
        assert base.shape[0] == swa.shape[0]
    elif k < 78:
        blob = c.state_write(s)
        try:
            c.state_read(blob, rng.randrange(8))
        except kvcache.StateError:
            pass
    elif k < 80:
        c.state_read(c.state_write(layout=kvcache.DEFAULT_LAYOUT), layout=kvcache.DEFAULT_LAYOUT)
    elif k < 86:
        c.defrag_sched(-1.0)
        c.update()
    elif k < 90:
        _consistent_cells(c.base.cells())
        _consistent_cells(c.swa.cells())
    elif k < 92:
        c.clear()
    elif k < 96:
        c.base.seq_rm(s, rng.randrange(100), -1)     # a part used directly, concurrently with the whole
    else:
        _ = c.has_shift, c.pending, c.k_shift()


def _recurrent_op(c, rng, k):
    s = rng.randrange(8)
    if k < 40:
        n = rng.randint(1, 3)
        p = c.seq_pos_max(s) + 1
        try:
            c.find_slot(kvcache.UBatch(list(range(p, p + n)), [s], n_seq_tokens=n))
        except ValueError:
            pass        # no free cell for a new sequence
        c.commit()
    elif k < 50:
        c.seq_rm(s, rng.randrange(-1, 50), -1)
    elif k < 55:
        c.seq_cp(s, rng.randrange(8))
    elif k < 60:
        c.seq_keep(s) if rng.random() < 0.2 else c.seq_add(s, 0, -1, rng.randrange(0, 5))
    elif k < 70:
        # min / max agree with the cells, all read at one moment (the other threads wait)
        with _core._Hold(c):
            lo, hi, cells = c.seq_pos_min(s), c.seq_pos_max(s), c.cells()
        held = [int(p) for p, ids in zip(cells["pos"], cells["seq_id"]) if s in ids]
        assert (lo, hi) == ((min(held), max(held)) if held else (-1, -1))
    elif k < 78:
        c.s_copy()
        c.s_mask()
    elif k < 88:
        blob = c.state_write(s)
        try:
            c.state_read(blob, rng.randrange(8))
        except kvcache.StateError:
            pass
    elif k < 92:
        c.state_read(c.state_write())
    elif k < 94:
        c.clear()
    else:
        cells = c.cells()
        assert len(cells["pos"]) == c.size


def _worker(i, shared, n_ops):
    rng = random.Random(1000 + i)
    ops = ((shared.unified, _unified_op), (shared.iswa, _iswa_op), (shared.recurrent, _recurrent_op))
    with np.errstate(all="ignore"):
        for j in range(n_ops):
            cache, op = ops[rng.randrange(3) if rng.random() < 0.5 else i % 3]
            op(cache, rng, rng.randrange(100))
            shared.done[i] = j + 1


def test_stress_8_threads_mixed_operations():
    import warnings
    shared = Shared()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # partial-window and recurrent find_slot warnings
        _run_threads(_worker, N_THREADS, shared, N_OPS)
    assert shared.done == [N_OPS] * N_THREADS
    check_unified_invariants(shared.unified)
    check_unified_invariants(shared.iswa.base)
    check_unified_invariants(shared.iswa.swa)
    check_recurrent_invariants(shared.recurrent)
    # the final state round-trips through a fresh cache
    for c, fresh in ((shared.unified, kvcache.UnifiedCache(256, 2, [16, 32], [32, 16], n_seq_max=8)),
                     (shared.recurrent, kvcache.RecurrentCache(8, 2, 8, 16))):
        blob = c.state_write()
        fresh.state_read(blob)
        assert fresh.state_write() == blob


def test_prefix_reuse_from_several_threads():
    """Each thread serves requests on its own sequence id of one today's-semantics cache with
    prefix reuse: attach, place the rest with token ids, release. The prompts share prefixes
    across threads, so attaches, releases and the evictions of placement interleave on shared
    cells; the index and the cells agree at the end and no live sequence lost a cell."""
    c = kvcache.UnifiedCache(256, 1, 8, 8, n_seq_max=N_THREADS, semantics="2026", buffers=None)
    c.enable_prefix_reuse()
    n_req = max(50, min(2000, N_OPS // 100))

    def work(i):
        rng = np.random.default_rng(i)
        for _ in range(n_req):
            prompt = [1, 2, 3, 4] + rng.integers(0, 4, int(rng.integers(1, 12))).tolist()
            k = c.prefix_attach(i, prompt)
            assert c.seq_pos_max(i) == k - 1
            ub = kvcache.UBatch(list(range(k, len(prompt))), [i] * (len(prompt) - k), tokens=prompt[k:])
            if c.find_slot(ub):
                assert c.seq_pos_max(i) == len(prompt) - 1 and c.seq_pos_min(i) == 0
                c.prefix_release(i)
            else:
                c.seq_rm(i)

    _run_threads(work, N_THREADS)
    c._prefix_check()
    _consistent_cells(c.cells())
    assert c.used == 0 and c.prefix_stats["cells"] > 0


# --- what the locks promise -----------------------------------------------------------------------

class _BlockingFile(io.RawIOBase):
    """A file whose first write waits until released: a state_write_into stays in progress."""

    def __init__(self, on_write=None):
        self.entered = threading.Event()
        self.go = threading.Event()
        self.on_write = on_write
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, b):
        if self.on_write:
            self.on_write()
        self.entered.set()
        assert self.go.wait(JOIN_TIMEOUT)
        self.data += bytes(b)
        return len(b)


@pytest.mark.parametrize("make,call", [
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2), lambda c: c.clear()),
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2), lambda c: c.used),
    (lambda: kvcache.RecurrentCache(2, 1, 8, 8), lambda c: c.seq_pos_max(0)),
])
def test_an_operation_in_progress_excludes_others_without_holding_the_gil(make, call):
    cache = make()
    assert cache.find_slot(kvcache.UBatch([0], [0]))
    f = _BlockingFile()
    writer = threading.Thread(target=cache.state_write_into, args=(f,), daemon=True)
    writer.start()
    assert f.entered.wait(JOIN_TIMEOUT)
    done = threading.Event()
    other = threading.Thread(target=lambda: (call(cache), done.set()), daemon=True)
    other.start()
    # `other` is blocked on the lock, and this thread runs Python meanwhile: the waiter does not
    # hold the GIL
    wait_for_waiters(cache, 1)
    assert not done.is_set(), "an operation ran while another held the cache"
    f.go.set()
    writer.join(JOIN_TIMEOUT)
    other.join(JOIN_TIMEOUT)
    assert done.is_set() and not writer.is_alive()


def test_lock_is_reentrant_for_its_holder():
    cache = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2)
    assert cache.find_slot(kvcache.UBatch([0, 1], [0, 0]))
    seen = []
    f = _BlockingFile(on_write=lambda: seen.append(cache.seq_pos_max(0)))
    f.go.set()
    cache.state_write_into(f)
    assert seen and seen[0] == 1


def test_lock_order_of_several_caches_cannot_deadlock():
    a = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2)
    b = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2)
    for c in (a, b):
        assert c.find_slot(kvcache.UBatch([0, 1], [0, 1]))
        c.commit()
    ub = kvcache.UBatch([5], [1])

    def work(i):
        pair = (a, b) if i % 2 else (b, a)
        for _ in range(2000):
            _core._state_read_parts(pair, _core._state_write_parts(pair))
            with _core._Hold(*pair):
                pair[0].restore()
                pair[1].restore()
            _core._update_parts(pair)
    _run_threads(work, 4)
    for c in (a, b):
        check_unified_invariants(c)


_REUSE_OFF_WHILE_WAITING = """
import sys, threading, time
import kvcache
from kvcache import _core

kind, call = sys.argv[1], sys.argv[2]
if kind == "unified":
    c = kvcache.UnifiedCache(64, 1, 8, 8, semantics="2026")
    parts = (c,)
elif kind == "recurrent":
    c = kvcache.RecurrentCache(2, 1, 8, 8, semantics="2026")
    parts = (c,)
elif kind == "iswa":
    c = kvcache.ISWACache(64, 2, 8, 8, swa_layers=[1], n_swa=8, semantics="2026")
    parts = (c.base, c.swa)
else:
    c = kvcache.HybridCache(64, 2, [0], 8, 8, 8, 4)
    parts = (c.attn, c.recr)
c.enable_prefix_reuse()
calls = {
    "prefix_evict": lambda: c.prefix_evict(1),
    "prefix_match": lambda: c.prefix_match([1, 2, 3]),
    "prefix_attach": lambda: c.prefix_attach(0, [1, 2, 3]),
    "prefix_release": lambda: c.prefix_release(0, [1, 2, 3]),
    "prefix_pin": lambda: c.prefix_pin([1, 2, 3]),
    "prefix_unpin": lambda: c.prefix_unpin(1 if kind in ("unified", "recurrent") else (1, 1)),
    "checkpoint": lambda: c.checkpoint(0, [1, 2, 3]),
    "write_back": lambda: c._spill_set(lambda cache, records: None),
}
got = []

def body():
    try:
        got.append(repr(calls[call]()))
    except Exception as e:
        got.append(f"{type(e).__name__}: {e}")

hold = c._hold if kind in ("iswa", "hybrid") else _core._Hold(c)
with hold:
    t = threading.Thread(target=body)
    t.start()
    end = time.monotonic() + 60
    while sum(_core._lock_state(p)["waiting"] for p in parts) < 1:
        assert time.monotonic() < end, "the call did not wait for the lock"
        time.sleep(0.001)
    c.disable_prefix_reuse()       # while the call waits for the lock
t.join(60)
print(got[0])
"""


@pytest.mark.parametrize("kind,call", [
    ("unified", "prefix_evict"), ("unified", "prefix_attach"), ("unified", "prefix_release"),
    ("unified", "prefix_pin"), ("unified", "prefix_unpin"), ("unified", "write_back"),
    ("recurrent", "prefix_evict"), ("recurrent", "prefix_attach"), ("recurrent", "prefix_release"),
    ("recurrent", "prefix_pin"), ("recurrent", "prefix_unpin"), ("recurrent", "checkpoint"),
    ("recurrent", "write_back"), ("recurrent", "prefix_match"),
    ("iswa", "prefix_evict"), ("iswa", "prefix_attach"), ("iswa", "prefix_release"), ("iswa", "prefix_pin"),
    ("iswa", "prefix_unpin"),
    ("hybrid", "prefix_match"), ("hybrid", "prefix_attach"), ("hybrid", "prefix_release"),
])
def test_prefix_call_waiting_while_another_thread_turns_reuse_off(kind, call):
    """A prefix-reuse call that waits for the lock while the holder turns reuse off finds it off
    (RuntimeError; prefix_match: no hit): it never uses the index or checkpoint pool the holder
    freed meanwhile (that crashed the interpreter). In a subprocess, so that a crash fails the
    test instead of the suite."""
    r = subprocess.run([sys.executable, "-c", _REUSE_OFF_WHILE_WAITING, kind, call], env=kvcache_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    out = r.stdout.strip()
    if call == "prefix_match":
        assert out == "0"
    else:
        assert out.startswith("RuntimeError") and "prefix reuse is off" in out, out


def test_batch_splits_from_several_threads_hand_out_each_token_once():
    n = 20000
    batch = kvcache.Batch(list(range(n)), [0] * n)
    taken = [[] for _ in range(4)]

    def work(i):
        while True:
            ub = batch.split_simple(7)
            if ub is None:
                return
            taken[i].extend(int(t) for t in ub.ids)
    _run_threads(work, 4)
    got = sorted(t for part in taken for t in part)
    assert got == list(range(n))
    assert batch.n_tokens_left == 0


# --- free-threaded CPython -------------------------------------------------------------------------

@pytest.mark.skipif(not sysconfig.get_config_var("Py_GIL_DISABLED"),
                    reason="needs a free-threaded CPython (3.13t / 3.14t)")
def test_import_does_not_reenable_the_gil():
    code = ("import sys, kvcache, kvcache._core, kvcache.statefile, kvcache.inspect; "
            "kvcache.UnifiedCache(64, 1, 8, 8); "
            "sys.exit(1 if sys._is_gil_enabled() else 0)")
    env = kvcache_env()
    env.pop("PYTHON_GIL", None)
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"importing kvcache re-enabled the GIL: {r.stderr}"

