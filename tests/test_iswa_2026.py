"""ISWACache(semantics="2026"): today's llama.cpp iSWA pair (llama-cpp-python 0.3.36).

The sizes of its two caches, a placement in both or in neither, its state in the layouts of
each era (single-sequence blobs of "2026-06" and later leave out the SWA cells outside the
window), what today's llama.cpp aborts on (ValueError, neither half changed) and the seed's
operations it does not have. The model-based test is tests/test_stateful_iswa_2026.py; the live
files of 0.3.36's gemma2 context are tests/test_live_v10.py's."""
import numpy as np
import pytest

from kvcache import ISWACache, ISWACache2025, ISWACache2026, StateError, UBatch
from kvcache.plan import swa_size


def _cache(kv_size=64, n_seq_max=2, kv_unified=True, swa_full=True, n_swa=4, **kw):
    args = dict(n_layer=3, n_embd_k_gqa=4, n_embd_v_gqa=4, swa_layers=[0, 2], n_swa=n_swa, n_batch=16,
                swa_full=swa_full, type_k="f32", type_v="f32", n_seq_max=n_seq_max, n_pad=1, semantics="2026",
                kv_unified=kv_unified)
    args.update(kw)
    return ISWACache(kv_size, **args)


def _fill(c, seqs, n):
    """n tokens of each sequence in turn, every layer's rows written."""
    for s in seqs:
        p = c.seq_pos_max(s) + 1
        assert c.find_slot(UBatch(list(range(p, p + n)), [s] * n))
        for il in range(c.n_layer):
            rows = np.arange(4 * n, dtype=np.float32).reshape(n, 4) + 100 * s + 10 * il
            c.store(il, rows, rows + 0.5)


def _snapshot(c):
    """Everything an operation could change, in both halves."""
    out = []
    for h in (c.base, c.swa):
        out.append((h.stream_cells(), h.heads, h.pending_copies, h.has_shift,
                    [h.k(il).tobytes() for il in h.layers], [h.v(il).tobytes() for il in h.layers]))
    return out


@pytest.mark.parametrize("kv_unified", [True, False])
def test_sizes_as_todays_llama_cpp(kv_unified):
    """SWA cache: kv_size with swa_full (the default), else PAD_256(min(kv_size, n_swa *
    (n_seq_max unified, else 1) + n_ubatch)); the seed's rule stays for "2025"."""
    c = _cache(kv_size=1024, n_seq_max=3, kv_unified=kv_unified, swa_full=None, n_swa=100)
    assert (c.swa_full, c.size_base, c.size_swa, c.semantics, c.n_stream) == \
        (True, 1024, 1024, "2026", 1 if kv_unified else 3)
    c = _cache(kv_size=1024, n_seq_max=3, kv_unified=kv_unified, swa_full=False, n_swa=100)
    want = 512 if kv_unified else 256          # pad(316, 256), pad(116, 256)
    assert c.size_swa == want == swa_size(1024, 100, 3, 16, 1, False, "2026", kv_unified)
    assert (c.swa.semantics, c.swa.n_swa, c.base.n_swa, c.base.swa_type) == ("2026", 100, 0, "none")
    assert not c.can_shift
    seed = ISWACache(1024, 3, 4, 4, swa_layers=[0, 2], n_swa=100, n_batch=16, n_seq_max=3, n_pad=32)
    assert (seed.semantics, seed.swa_full, seed.size_swa) == ("2025", False, 320)   # pad(316, 32)
    # padded to 256 even past a small base cache, as llama.cpp pads it
    assert _cache(kv_size=64, swa_full=False).size_swa == 256


def test_a_placement_goes_in_both_caches_or_in_neither():
    c = _cache(kv_size=512, n_seq_max=1, swa_full=False, n_swa=240)       # SWA cache: pad(256, 256)
    assert (c.size_base, c.size_swa) == (512, 256)
    _fill(c, [0], 200)
    before = _snapshot(c)
    # 80 more tokens: room in the base cache, not in the SWA one (56 free cells, and the window
    # of 240 keeps every cell of sequence 0)
    assert c.find_slot_each(UBatch(list(range(200, 280)), [0] * 80)) == (True, False)
    assert _snapshot(c) == before and c.slot_info() == ([], [])
    with pytest.raises(RuntimeError):
        c.store(0, np.zeros((80, 4), np.float32), None)
    assert c.find_slot(UBatch(list(range(200, 250)), [0] * 50))
    base_info, swa_info = c.slot_info()
    assert [x.tolist() for _, x in base_info] == [list(range(200, 250))]
    assert [x.tolist() for _, x in swa_info] == [list(range(200, 250))]
    assert [x.tolist() for x in c.slot_indices()] == [list(range(200, 250))] * 2


def test_the_swa_cache_reuses_the_cells_its_window_has_left():
    c = _cache(kv_size=16, n_seq_max=1, swa_full=True, n_swa=4)
    _fill(c, [0], 14)
    # the base cache is full after 2 more; the SWA cache reuses cells outside the window
    assert c.find_slot_each(UBatch([14, 15, 16], [0] * 3)) == (False, True)
    _fill(c, [0], 2)
    assert c.base.used == 16 and c.swa.used == 16
    assert c.find_slot_each(UBatch([16], [0])) == (False, True)
    c.seq_rm(0, 0, 8)                       # room in the base cache again
    _fill(c, [0], 4)
    assert c.base.used == 12 and c.swa.seq_pos_min(0) >= 20 - 16
    assert c.seq_pos_max(0) == 19


@pytest.mark.parametrize("kv_unified", [True, False])
def test_whole_and_sequence_states_round_trip(kv_unified):
    c = _cache(kv_size=64, n_seq_max=3, kv_unified=kv_unified, n_swa=4)
    _fill(c, [0, 1, 2], 10)
    c.seq_rm(1, 0, 3)
    whole = c.state_write()
    d = _cache(kv_size=64, n_seq_max=3, kv_unified=kv_unified, n_swa=4)
    assert d.state_read(whole, exact=True) == len(whole) and d.state_write() == whole
    for s in range(3):
        blob = c.state_write(s)
        e = _cache(kv_size=64, n_seq_max=3, kv_unified=kv_unified, n_swa=4)
        assert e.state_read(blob, s, exact=True) == len(blob)
        assert e.state_write(s) == blob
        # the base half holds every cell of the sequence, the SWA half its window (n_swa cells)
        assert len(e.base.seq_cells(s)[0]) == len(c.base.seq_cells(s)[0])
        assert e.swa.seq_cells(s)[1].tolist() == [6, 7, 8, 9]


def test_single_sequence_blobs_trim_the_swa_half_from_2026_06_on():
    """The SWA cells outside the window are left out of a sequence's state from layout "2026-06"
    (llama-cpp-python 0.3.26) on; earlier layouts list every cell of the sequence."""
    c = _cache(kv_size=64, n_seq_max=1, n_swa=4)
    _fill(c, [0], 12)
    sizes = {}
    for layout in ("2025", "2025-08", "2026-03", "2026-05", "2026-06", "2026"):
        blob = c.state_write(0, layout=layout)
        d = _cache(kv_size=64, n_seq_max=1, n_swa=4)
        assert d.state_read(blob, 0, layout=layout, exact=True) == len(blob)
        assert d.state_write(0, layout=layout) == blob
        kept = d.swa.seq_cells(0)[1].tolist()
        assert kept == (list(range(8, 12)) if layout in ("2026-06", "2026") else list(range(12))), layout
        assert d.base.seq_cells(0)[1].tolist() == list(range(12))
        sizes[layout] = len(blob)
    assert sizes["2026-06"] < sizes["2026-05"]
    # the whole state keeps every cell in every layout
    whole = c.state_write(layout="2026")
    d = _cache(kv_size=64, n_seq_max=1, n_swa=4)
    d.state_read(whole, layout="2026")
    assert d.swa.seq_cells(0)[1].tolist() == list(range(12))


def test_a_damaged_state_changes_neither_half():
    c = _cache(kv_size=64, n_seq_max=2, n_swa=4)
    _fill(c, [0, 1], 6)
    blob = c.state_write()
    d = _cache(kv_size=64, n_seq_max=2, n_swa=4)
    _fill(d, [1], 3)
    before = _snapshot(d)
    n_base = c.base.state_size(-1)
    # cut inside the SWA half: the base half would read, the pair refuses
    for bad in (blob[:n_base + 10], blob[:-1], blob[:n_base] + b"\x09" + blob[n_base + 1:]):
        with pytest.raises(StateError):
            d.state_read(bad)
        assert _snapshot(d) == before
    one = c.state_write(0)
    with pytest.raises(StateError):
        d.state_read(one[:-3], 1)
    assert _snapshot(d) == before
    # a blob of another stream count
    other = _cache(kv_size=64, n_seq_max=2, n_swa=4, kv_unified=False)
    with pytest.raises(StateError):
        other.state_read(blob)


def test_update_shifts_both_caches_whatever_their_sizes():
    """Today's llama.cpp applies each cache's K-shift (can_shift only informs); the seed's pair
    refuses a shift when the SWA cache is smaller."""
    c = _cache(kv_size=512, n_seq_max=1, swa_full=False, n_swa=8)
    assert c.size_swa == 256 and not c.can_shift
    _fill(c, [0], 20)
    c.seq_add(0, 10, -1, -5)
    u = c.update()
    assert (u.base.had_shift, u.swa.had_shift, bool(u)) == (True, True, True)
    assert not c.has_shift and c.seq_pos_max(0) == 14
    seed = ISWACache(512, 3, 4, 4, swa_layers=[0, 2], n_swa=8, n_batch=16, n_pad=1)
    assert seed.find_slot(UBatch(list(range(20)), [0] * 20))
    seed.commit()
    seed.seq_add(0, 10, -1, -5)
    with pytest.raises(RuntimeError):
        seed.update()


def test_stream_copies_are_made_in_both_caches_at_update():
    c = _cache(kv_size=64, n_seq_max=2, kv_unified=False)
    _fill(c, [0], 5)
    c.seq_cp(0, 1)
    assert (c.base.pending_copies, c.swa.pending_copies) == (1, 1)
    u = c.update()
    assert (u.base.copies, u.swa.copies) == (1, 1)
    for il in range(3):
        k = c.k(il)
        assert np.array_equal(k[64:69], k[:5])


def test_prepare_is_a_dry_run_of_both():
    c = _cache(kv_size=32, n_seq_max=1, swa_full=True, n_swa=4)
    _fill(c, [0], 20)
    before = _snapshot(c)
    got = c.prepare([UBatch([20, 21], [0, 0]), UBatch([22, 23, 24], [0, 0, 0])])
    assert got is not None and _snapshot(c) == before
    base, swa = got
    assert [x.tolist() for _, x in base[1]] == [[22, 23, 24]] and len(swa) == 2
    # 14 more tokens fit the SWA cache (it reuses cells), not the base one: None, nothing changed
    assert c.prepare([UBatch(list(range(20, 34)), [0] * 14)]) is None
    assert _snapshot(c) == before


# what today's llama.cpp aborts on, and the seed's operations this pair does not have:
# (call, applies with several streams only)
_REFUSED = [
    (lambda c: c.seq_rm(-2), False),
    (lambda c: c.seq_rm(2), False),
    (lambda c: c.seq_cp(0, 2), False),
    (lambda c: c.seq_cp(-1, 0), False),
    (lambda c: c.seq_keep(-1), False),
    (lambda c: c.seq_add(2, 0, 4, 1), False),
    (lambda c: c.seq_div(0, 0, 4, 0), False),
    (lambda c: c.find_slot(UBatch([0], [2])), False),
    (lambda c: c.prepare([]), False),
    (lambda c: c.prepare([UBatch([0], [0]), UBatch([1], [5])]), False),
    (lambda c: c.kq_mask(UBatch([0], [0]), pad=True), False),
    (lambda c: c.seq_cp(0, 1, 2, -1), True),            # part of a sequence across streams
    (lambda c: c.seq_cp(0, 1, -1, 7), True),
    (lambda c: c.find_slot(UBatch([5, 5, 6], [0, 1, 0])), True),      # not grouped per sequence
    (lambda c: c.find_slot(UBatch([5, 6], [[0, 1], [0, 1]])), True),  # a token of two sequences
    (lambda c: c.kq_mask(UBatch([5, 5, 6], [0, 1, 0])), True),
]


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("k", range(len(_REFUSED)))
def test_refused_with_value_error_and_nothing_changed(k, kv_unified):
    call, multi_only = _REFUSED[k]
    if multi_only and kv_unified:
        pytest.skip("applies to a pair of several streams")
    c = _cache(kv_size=64, n_seq_max=2, kv_unified=kv_unified)
    _fill(c, [0, 1], 5)
    before = _snapshot(c), [[x.tolist() for _, x in h] for h in c.slot_info()]
    with pytest.raises(ValueError):
        call(c)
    assert (_snapshot(c), [[x.tolist() for _, x in h] for h in c.slot_info()]) == before


# the operations of one semantics only
_SEED_ONLY = ("commit", "restore", "set_full", "defrag_sched", "sbatch_init")
_TODAY_ONLY = ("prepare",)


def test_each_semantics_is_a_class_with_its_own_operations():
    today = _cache(kv_size=64, n_seq_max=2)
    seed = ISWACache(64, 2, 4, 4, swa_layers=[0], n_swa=4, n_batch=16)
    assert type(today) is ISWACache2026 and type(seed) is ISWACache2025
    assert isinstance(today, ISWACache) and isinstance(seed, ISWACache)
    assert (today.semantics, seed.semantics) == ("2026", "2025")
    assert [n for n in _SEED_ONLY if hasattr(today, n)] == [] and all(hasattr(seed, n) for n in _SEED_ONLY)
    assert [n for n in _TODAY_ONLY if hasattr(seed, n)] == [] and all(hasattr(today, n) for n in _TODAY_ONLY)
    # the classes build their own semantics, and refuse the other
    assert ISWACache2026(64, 2, 4, 4, swa_layers=[0], n_swa=4, n_batch=16).semantics == "2026"
    assert ISWACache2025(64, 2, 4, 4, swa_layers=[0], n_swa=4, n_batch=16, semantics="2025").swa_full is False
    with pytest.raises(ValueError, match="semantics = '2025': an ISWACache2026 has semantics '2026'"):
        ISWACache2026(64, 2, 4, 4, swa_layers=[0], n_swa=4, semantics="2025")


def test_the_seed_semantics_is_unchanged_and_streams_need_2026():
    with pytest.raises(ValueError):
        ISWACache(64, 2, 4, 4, swa_layers=[0], n_swa=4, kv_unified=False)
    with pytest.raises(ValueError):
        _cache(semantics="2027")
    seed = ISWACache(64, 2, 4, 4, swa_layers=[0], n_swa=4, n_batch=16)
    assert (seed.semantics, seed.kv_unified, seed.n_stream, seed.swa_full) == ("2025", True, 1, False)
    assert "semantics" not in repr(seed) and "semantics='2026'" in repr(_cache())


@pytest.mark.parametrize("swa_full", [True, False])
def test_a_handed_off_sequence_carries_the_swa_half_as_its_state_does(swa_full):
    """seq_export moves what the sequence's state of layout "2026" holds: every base cell, the
    SWA cells of the window; the receiver ends as state_read of that state leaves it."""
    from kvcache.handoff import copy_regions

    c = _cache(kv_size=64, n_seq_max=1, n_swa=4, swa_full=swa_full)
    _fill(c, [0], 12)
    exp = c.seq_export(0)
    assert [e.n_cells for e in exp.parts] == [12, 4]
    d, ref = _cache(kv_size=64, n_seq_max=1, n_swa=4, swa_full=swa_full), _cache(kv_size=64, n_seq_max=1, n_swa=4,
                                                                                swa_full=swa_full)
    with d.seq_import_begin(exp.header) as imp:
        copy_regions(exp.regions, imp.regions)
        imp.commit()
    ref.state_read(c.state_write(0, layout="2026"), 0, layout="2026")
    assert _snapshot(d) == _snapshot(ref)
    assert d.swa.seq_cells(0)[1].tolist() == list(range(8, 12))
    assert d.state_write(0, layout="2026") == c.state_write(0, layout="2026")


def test_batches_split_as_the_unified_caches_of_the_semantics_do():
    from kvcache import Batch
    one = _cache(kv_size=64, n_seq_max=2)
    placed = 0
    for ub in one.ubatches(Batch(list(range(10)), [0] * 10), 4):      # in order, nothing recorded
        assert one.find_slot(ub)
        placed += len(one.slot_indices()[1])
    assert placed == 10 and one.base.used == one.swa.used == 10
    streams = _cache(kv_size=64, n_seq_max=2, kv_unified=False)
    b = Batch([0, 1, 2, 0, 1], [0, 0, 0, 1, 1], simple_split=False)
    for ub in streams.ubatches(b, 4):                                 # equal splits per sequence
        assert streams.find_slot(ub)
    assert streams.base.used_per_stream == streams.swa.used_per_stream == (3, 2)
    with pytest.raises(ValueError):
        list(streams.ubatches(Batch([0], [0]), 4))
