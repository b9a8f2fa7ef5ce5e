"""Nothing is lost: every mutating operation either completes or leaves the cache exactly as
it was (cells, counters, placement, flags, sequence ranges, every K/V byte).

- state_read of every truncation of several blobs, and of seeded random corruptions, for the
  three cache variants, whole and per sequence;
- find_slot that finds no room, find_slot that raises, and restore();
- allocation failures injected into the C core (kvcache._core._fail_alloc_after) at every
  allocation of each operation: MemoryError with the cache intact, or success.
"""
import io
import warnings

import numpy as np
import pytest

import kvcache
from kvcache import _core
from cache_state import (assert_unchanged, busy_iswa, busy_recurrent, busy_unified, check_recurrent_invariants,
                         check_unified_invariants, fill_random, snapshot)


# --- the caches a blob is read into, and the blobs ------------------------------------------------

UNIFIED = {
    "f16-vtrans": dict(type_k="f16", type_v="f16", v_trans=True),
    "q8_0-rows": dict(type_k="q8_0", type_v="q8_0", v_trans=False, widths=(32, 64)),
    "f32-meta": dict(type_k="f32", type_v="f32", v_trans=True, buffers=None),
}


def _pairs():
    """(name, make destination, blobs): blobs come from a differently filled cache of the same
    geometry, so that a read that wrongly succeeded would show."""
    out = []
    for name, kw in UNIFIED.items():
        src = busy_unified(seed=1, **kw)
        src.seq_rm(0, 0, 3)
        src.commit()
        blobs = {"whole": (src.state_write(layout="2025"), -1), "seq1": (src.state_write(1, layout="2025"), 1),
                 "seq0-into-3": (src.state_write(0, layout="2025"), 3),
                 "whole-2026": (src.state_write(), -1), "seq1-2026": (src.state_write(1), 1)}
        out.append((f"unified-{name}", lambda kw=kw: busy_unified(seed=2, **kw), blobs))
    src = busy_iswa(seed=1)
    src.seq_rm(1, 0, 4)
    out.append(("iswa", lambda: busy_iswa(seed=2),
                {"whole": (src.state_write(layout="2025"), -1), "seq0": (src.state_write(0, layout="2025"), 0),
                 "seq2-into-1": (src.state_write(2, layout="2025"), 1)}))
    src = busy_recurrent(seed=1)
    src.seq_rm(2)
    out.append(("recurrent", lambda: busy_recurrent(seed=2),
                {"whole": (src.state_write(layout="2025"), -1), "seq1": (src.state_write(1, layout="2025"), 1),
                 "seq0-into-3": (src.state_write(0, layout="2025"), 3)}))
    return out


PAIRS = _pairs()
CASES = [(name, make, blob, seq, "2026" if key.endswith("-2026") else "2025")
         for name, make, blobs in PAIRS for key, (blob, seq) in blobs.items()]
IDS = [f"{name}-{b}" for name, _, blobs in PAIRS for b in blobs]


def _check_invariants(cache, strict=True):
    if isinstance(cache, kvcache.ISWACache):
        check_unified_invariants(cache.base, strict)
        check_unified_invariants(cache.swa, strict)
    elif isinstance(cache, kvcache.RecurrentCache):
        check_recurrent_invariants(cache)
    else:
        check_unified_invariants(cache, strict)


@pytest.mark.parametrize("name,make,blob,seq_id,layout", CASES, ids=IDS)
def test_every_truncation_changes_nothing(name, make, blob, seq_id, layout):
    cache = make()
    before = snapshot(cache)
    assert len(blob) > 8
    for cut in range(len(blob)):
        with pytest.raises(kvcache.StateError):
            cache.state_read(blob[:cut], seq_id, layout=layout)
        assert_unchanged(cache, before, f"{name}: {cut} of {len(blob)} bytes")
    # one byte too many is an error only for an exact read; either way nothing changes on error
    with pytest.raises(kvcache.StateError):
        cache.state_read(blob + b"\0", seq_id, exact=True, layout=layout)
    assert_unchanged(cache, before, f"{name}: trailing byte")
    # and the whole blob reads
    assert cache.state_read(blob, seq_id, exact=True, layout=layout) == len(blob)
    _check_invariants(cache)


def _corrupt(rng, blob):
    b = bytearray(blob)
    kind = rng.integers(4)
    if kind == 0:                                   # a few random bytes
        for _ in range(rng.integers(1, 5)):
            b[rng.integers(len(b))] = rng.integers(256)
    elif kind == 1:                                 # one bit
        i = rng.integers(len(b))
        b[i] ^= 1 << int(rng.integers(8))
    else:                                           # a 32-bit field set to an edge value
        i = int(rng.integers(0, len(b) - 3))
        v = [0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 64, 65, len(b), rng.integers(2**32)][rng.integers(9)]
        b[i:i + 4] = int(v).to_bytes(4, "little")
    return bytes(b)


@pytest.mark.parametrize("name,make,blob,seq_id,layout", CASES, ids=IDS)
def test_random_corruptions_change_nothing_or_read_consistently(name, make, blob, seq_id, layout):
    rng = np.random.default_rng(20250 + len(blob))
    cache = make()
    before = snapshot(cache)
    failed = 0
    for trial in range(150):
        bad = _corrupt(rng, blob)
        try:
            cache.state_read(bad, seq_id, layout=layout)
        except kvcache.StateError:
            failed += 1
            assert_unchanged(cache, before, f"{name}: corruption {trial}")
            continue
        # a corruption that still parses (e.g. in K/V data or a position) is a valid state
        _check_invariants(cache, strict=False)
        cache = make()
    assert failed > 0


# --- find_slot and restore --------------------------------------------------------------------------

def test_find_slot_without_room_leaves_the_cells():
    cache = busy_unified()
    cache.commit()
    while cache.find_slot(kvcache.UBatch([100], [1])):
        cache.commit()
    before = cache.cells()
    assert not cache.find_slot(kvcache.UBatch(list(range(5)), [0] * 5))
    assert cache.cells() == before          # head may move, as llama.cpp's search leaves it
    check_unified_invariants(cache)


@pytest.mark.parametrize("make", [busy_unified, busy_iswa])
def test_restore_undoes_every_uncommitted_slot(make):
    cache = make()
    cache.commit()
    parts = (cache.base, cache.swa) if isinstance(cache, kvcache.ISWACache) else (cache,)
    before = [(p.cells(), [(p.seq_pos_min(s), p.seq_pos_max(s)) for s in range(p.n_seq_max)], p.used)
              for p in parts]
    for ub in (kvcache.UBatch([30, 31, 32], [0, 0, 0]), kvcache.UBatch([40], [[1, 2]]),
               kvcache.UBatch([50, 51], [[2], [0, 1]])):
        cache.find_slot(ub)
    cache.restore()
    after = [(p.cells(), [(p.seq_pos_min(s), p.seq_pos_max(s)) for s in range(p.n_seq_max)], p.used)
             for p in parts]
    assert after == before
    for p in parts:
        check_unified_invariants(p)


# --- injected allocation failures -----------------------------------------------------------------

def _sweep(setup, op, *, intact=True, limit=200):
    """Run op(cache) on a fresh setup() with the C core's n-th allocation failing, n = 1, 2...
    until op makes fewer than n allocations. Each attempt either succeeds or raises MemoryError
    with the cache exactly as before (intact) . Returns the number of allocations swept."""
    for n in range(1, limit):
        cache = setup()
        before = snapshot(cache) if intact else None
        _core._fail_alloc_after(n)
        try:
            op(cache)
        except MemoryError:
            if intact:
                assert_unchanged(cache, before, f"allocation {n} failed")
            continue
        finally:
            left = _core._fail_alloc_after(0)
        if left > 0:          # the op made fewer than n allocations: every one was tried
            return n - 1
    raise AssertionError("more allocations than the sweep allows")


def _fresh(make):
    """The setup of a sweep: a cache whose recovery stack is full (the next find_slot grows it)."""
    def setup():
        cache = make()
        cache.commit()
        for p in range(4):
            assert cache.find_slot(kvcache.UBatch(list(range(200 + 16 * p, 216 + 16 * p)), [0] * 16))
        return cache
    return setup


def _big_unified():
    return busy_unified(kv_size=128, n_seq_max=4)


def _big_iswa():
    return busy_iswa(swa_full=True, kv_size=128)


UB = kvcache.UBatch([300, 301], [[0, 1], [1]])


def test_find_slot_growth():
    assert _sweep(_fresh(_big_unified), lambda c: c.find_slot(UB)) >= 2


def test_iswa_find_slot_undoes_the_base_part():
    # allocations 1..k fail in the base cache, the next ones in the SWA cache after the base
    # cache placed the ubatch: both must be as they were
    n = _sweep(_fresh(_big_iswa), lambda c: c.find_slot(UB))
    assert n >= 4


def test_iswa_find_slot_undo_keeps_earlier_slots():
    setup = _fresh(_big_iswa)
    cache, control = setup(), setup()
    before = snapshot(cache)
    _core._fail_alloc_after(4)          # the base part grows (3 allocations), the SWA part fails
    try:
        with pytest.raises(MemoryError):
            cache.find_slot(UB)
    finally:
        _core._fail_alloc_after(0)
    assert_unchanged(cache, before)
    # the earlier uncommitted slots are still there for restore to undo
    cache.restore()
    control.restore()
    assert snapshot(cache) == snapshot(control)


@pytest.mark.parametrize("layout", ["2025", "2026"])
@pytest.mark.parametrize("make", [_big_unified, _big_iswa, busy_recurrent])
@pytest.mark.parametrize("seq_id", [-1, 1])
def test_state_write(make, seq_id, layout):
    want = make().state_write(seq_id, layout=layout)

    def op(c):
        assert c.state_write(seq_id, layout=layout) == want
        buf = bytearray(len(want))
        assert c.state_write_into(buf, seq_id, layout=layout) == len(want) and bytes(buf) == want
        f = io.BytesIO()
        c.state_write_into(f, seq_id, layout=layout)
        assert f.getvalue() == want
    assert _sweep(make, op) >= 1


@pytest.mark.parametrize("make,src", [(_big_unified, lambda: busy_unified(kv_size=128, seed=7)),
                                      (_big_iswa, lambda: busy_iswa(swa_full=True, kv_size=128, seed=7)),
                                      (busy_recurrent, lambda: busy_recurrent(seed=7))])
@pytest.mark.parametrize("seq_id", [-1, 1])
@pytest.mark.parametrize("layout", ["2025", "2026", None])
def test_state_read(make, src, seq_id, layout):
    # None: the layout found from the bytes (a "2026" blob)
    blob = src().state_write(seq_id, layout=layout or "2026")
    done = make()
    done.state_read(blob, seq_id, layout=layout)
    want = snapshot(done)

    def op(c):
        c.state_read(blob, seq_id, layout=layout)
        assert snapshot(c) == want
    _sweep(make, op)


def test_kq_mask():
    ub = kvcache.UBatch([14, 15], [0, 1])
    want = _big_unified().kq_mask(ub)
    assert _sweep(_big_unified, lambda c: np.testing.assert_array_equal(c.kq_mask(ub), want)) >= 1


def test_iswa_kq_mask():
    assert _sweep(_big_iswa, lambda c: c.kq_mask(UB)) >= 2


def _fragmented(make):
    def setup():
        cache = make()
        cache.commit()
        parts = (cache.base, cache.swa) if isinstance(cache, kvcache.ISWACache) else (cache,)
        for p in parts:
            for s in range(3):
                p.seq_rm(s, 0, 6)
        cache.seq_add(0, 0, -1, 3)
        for p in parts:
            p.defrag_sched(-1.0)
        return cache
    return setup


def _update_result(cache):
    parts = (cache.base, cache.swa) if isinstance(cache, kvcache.ISWACache) else (cache,)
    return snapshot(cache), [(p.defrag_runs().tobytes(), p.defrag_ids.tobytes()) for p in parts]


@pytest.mark.parametrize("make", [lambda: busy_unified(kv_size=128, widths=(64, 64), v_trans=False),
                                  lambda: busy_unified(kv_size=128, widths=(64, 64), v_trans=True),
                                  lambda: busy_iswa(swa_full=True)])
def test_update_shift_and_defrag(make):
    # caches without a RoPE: the pending shift is dropped and the scheduled defrag runs
    setup = _fragmented(make)
    want_cache = setup()
    want_cache.update()
    want = _update_result(want_cache)

    def op(c):
        c.update()
        assert _update_result(c) == want
    _sweep(setup, op)


def _rope_unified():
    c = kvcache.UnifiedCache(64, 2, 32, 32, type_k="q8_0", type_v="f16", n_seq_max=3, n_embd_head_k=32,
                             rope=kvcache.RopeParams(16))
    for p in range(12):
        assert c.find_slot(kvcache.UBatch([p], [p % 3]))
        c.commit()
    c.seq_add(1, 0, -1, 5)
    return fill_random(c, 3)


def _rope_iswa():
    c = kvcache.ISWACache(64, 4, 16, 16, swa_layers=[1, 3], n_swa=4, swa_full=True, n_seq_max=3,
                          n_embd_head_k=8, rope=kvcache.RopeParams(8, freq_base=500.0))
    for p in range(12):
        assert c.find_slot(kvcache.UBatch([p], [p % 3]))
        c.commit()
    c.seq_add(2, 3, -1, -2)
    c.defrag_sched(-1.0)
    return fill_random(c, 4)


@pytest.mark.parametrize("make", [_rope_unified, _rope_iswa])
def test_update_rotates_all_or_nothing(make):
    want_cache = make()
    want_cache.update()
    want = _update_result(want_cache)

    def op(c):
        c.update()
        assert _update_result(c) == want
    # the SWA part's rotation failing after the base part's was prepared must change neither
    assert _sweep(make, op) >= (4 if make is _rope_iswa else 2)


def test_defrag_move_without_memory_for_the_run_list_moves_the_same():
    setup = _fragmented(lambda: busy_unified(kv_size=128, widths=(64, 64)))
    want_cache = setup()
    want_cache.update()
    want = _update_result(want_cache)
    for n in (1, 2):
        cache = setup()
        _core._fail_alloc_after(n)
        try:
            cache.update()           # the run list falls back to moving run by run
        finally:
            _core._fail_alloc_after(0)
        assert _update_result(cache) == want


def test_rope_shift_function():
    k = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float16)
    shift = np.arange(16, dtype=np.int32)
    before = k.copy()

    def op(_):
        kvcache.rope_shift(k, "f16", 4, 8, shift, kvcache.RopeParams(8))
    n = 0
    for n in range(1, 10):
        _core._fail_alloc_after(n)
        try:
            op(None)
        except MemoryError:
            assert k.tobytes() == before.tobytes()
            continue
        finally:
            left = _core._fail_alloc_after(0)
        if left:
            break
    assert n >= 2


@pytest.mark.parametrize("build", [
    lambda: kvcache.UnifiedCache(64, 3, 16, 16, n_seq_max=5),
    lambda: kvcache.UnifiedCache(64, 2, 32, 32, type_k="q8_0", type_v="q8_0", v_trans=False, buffers=None),
    lambda: kvcache.ISWACache(64, 4, 8, 8, swa_layers=[0, 2], n_swa=4, n_seq_max=3),
    lambda: kvcache.RecurrentCache(4, 2, 8, 8),
    lambda: kvcache.Batch([0, 1, 2, 0], [0, 0, [0, 1], 2], simple_split=False),
    lambda: kvcache.Batch(list(range(40)), [i % 3 for i in range(40)]),
])
def test_construction(build):
    n = 0
    for n in range(1, 100):
        _core._fail_alloc_after(n)
        try:
            obj = build()
        except MemoryError:
            continue
        finally:
            left = _core._fail_alloc_after(0)
        if left:
            break
    assert n >= 2
    # a failed construction leaves nothing half-made behind: the next one works
    assert build() is not None
    del obj


def test_batch_splits_after_failures():
    want = [list(u.pos) for u in kvcache.Batch([0, 1, 2, 0], [0, 0, [0, 1], 2], simple_split=False).ubatches(2)]
    for n in range(1, 10):
        _core._fail_alloc_after(n)
        try:
            b = kvcache.Batch([0, 1, 2, 0], [0, 0, [0, 1], 2], simple_split=False)
        except MemoryError:
            continue
        finally:
            _core._fail_alloc_after(0)
        assert [list(u.pos) for u in b.ubatches(2)] == want


def test_fail_alloc_hook_arguments():
    assert _core._fail_alloc_after() == 0
    with pytest.raises(TypeError):
        _core._fail_alloc_after(1.5)
    with pytest.raises(ValueError):
        _core._fail_alloc_after(-1)
    assert _core._fail_alloc_after(0) == 0


# --- a warning turned into an error interrupts nothing ------------------------------------------

def test_iswa_commit_prunes_every_sequence_when_warnings_are_errors():
    def run(as_error):
        c = kvcache.ISWACache(64, 2, 8, 8, swa_layers=[1], n_swa=2, n_batch=4, n_seq_max=3)
        for p in range(6):
            assert c.find_slot(kvcache.UBatch([p], [p % 3]))
            c.commit()
        for s in range(3):
            c.swa.seq_rm(s, 0, 3)          # holes: the window is partial on the next commit
        batch = kvcache.Batch([6, 7, 8], [0, 1, 2])
        for ub in c.ubatches(batch, 3):
            assert c.find_slot(ub)
        with warnings.catch_warnings():
            warnings.simplefilter("error" if as_error else "ignore", kvcache.SWAWarning)
            try:
                c.commit()
            except kvcache.SWAWarning:
                assert as_error
        return snapshot(c)
    assert run(True) == run(False)
