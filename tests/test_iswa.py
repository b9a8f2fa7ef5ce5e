"""ISWACache: construction, fan-out to the two caches, pending ranges and pruning, masks, layer
routing, K-shift rules and the all-or-nothing state codec."""
import warnings

import numpy as np
import pytest

import kvcache
from kvcache import Batch, ISWACache, StateError, SWAWarning, UBatch, UnifiedCache

# sequences that start mid-batch or branch off another one make the pruning warn, as llama.cpp
# does; only the tests about the warning look at it
pytestmark = pytest.mark.filterwarnings("ignore::kvcache.SWAWarning")


def make(**kw):
    args = dict(kv_size=128, n_layer=4, n_embd_k_gqa=[4, 2, 6, 2], n_embd_v_gqa=[2, 4, 2, 6],
                swa_layers=[0, 2], n_swa=4, n_batch=8, n_seq_max=3, type_k="f16", type_v="f16")
    args.update(kw)
    return ISWACache(**args)


def sub_snapshot(c):
    kv = [(c.k(il).tobytes(), c.v(il).tobytes()) for il in c.layers]
    return (c.head, c.n, c.used, c.has_shift, c.do_defrag, c.cells(), kv)


def snapshot(c):
    """Everything observable: both caches (counters, cells, K/V bytes) and the pending ranges."""
    return sub_snapshot(c.base), sub_snapshot(c.swa), c.pending


def rows(c, il, n, value):
    return (np.full((n, c.k(il).shape[1]), value, np.float32),
            np.full((n, c.v(il).shape[0] if c.cache_of(il).v_trans else c.v(il).shape[1]), value, np.float32))


def step(c, pos, seq_id, value=1.0):
    """One decode step as llama.cpp does it: record the batch, place, store every layer, commit."""
    c.sbatch_init(pos, seq_id)
    ub = UBatch(pos, seq_id)
    assert c.find_slot(ub)
    for il in range(c.n_layer):
        c.store(il, *rows(c, il, len(pos), value))
    c.commit()


def positions(sub, s):
    return sorted(p for _, p, seqs, _ in sub.cells().nonempty() if s in seqs)


# --- construction ----------------------------------------------------------------------------

def test_public_names():
    assert kvcache.ISWACache is ISWACache and kvcache.SWAWarning is SWAWarning
    assert issubclass(SWAWarning, UserWarning)
    assert kvcache.iswa.ISWACache is ISWACache


def test_layout_and_sizes():
    c = make()
    assert isinstance(c.base, UnifiedCache) and isinstance(c.swa, UnifiedCache)
    assert c.base_layers == (1, 3) and c.swa_layers == (0, 2) and c.n_layer == 4
    assert (c.base.swa_type, c.base.n_swa) == ("none", 0)
    assert (c.swa.swa_type, c.swa.n_swa) == ("standard", 4)
    # min(kv_size, pad(n_swa * n_seq_max + n_batch, n_pad)) = pad(4 * 3 + 8, 32)
    assert (c.size_base, c.size_swa) == (128, 32)
    assert (c.n_swa, c.swa_type, c.n_batch, c.swa_full, c.n_seq_max) == (4, "standard", 8, False, 3)
    assert c.total_size == c.base.total_size + c.swa.total_size
    assert c.size_k_bytes == c.base.size_k_bytes + c.swa.size_k_bytes
    assert "ISWACache" in repr(c)
    assert make(n_batch=200).size_swa == 128            # capped by kv_size
    assert make(n_swa=40, n_batch=1).size_swa == 128    # pad(121, 32)
    assert make(n_swa=30, n_batch=1, n_pad=16, kv_size=256).size_swa == 96   # pad(91, 16)
    full = make(swa_full=True)
    assert full.size_swa == full.size_base == 128
    ch = make(swa_type="chunked")
    assert ch.swa.swa_type == "chunked"


@pytest.mark.parametrize("swa_layers, base, swa", [
    ([], (0, 1, 2, 3), ()),
    ([0, 1, 2, 3], (), (0, 1, 2, 3)),
    ((3, 1), (0, 2), (1, 3)),
    (lambda il: il % 2 == 1, (0, 2), (1, 3)),
    (range(2), (2, 3), (0, 1)),
])
def test_layer_split(swa_layers, base, swa):
    c = make(swa_layers=swa_layers)
    assert c.base_layers == base and c.swa_layers == swa
    step(c, [0, 1], [0, 0])
    assert c.base.used == c.swa.used == 2


BAD_ARGS = [
    (dict(swa_layers=[4]), ValueError, "swa_layers"),
    (dict(swa_layers=[-1]), ValueError, "swa_layers"),
    (dict(swa_layers=[1, 1]), ValueError, "repeated"),
    (dict(swa_layers=["0"]), TypeError, "swa_layers"),
    (dict(swa_layers="02"), TypeError, "swa_layers"),
    (dict(swa_layers=5), TypeError, "swa_layers"),
    (dict(n_swa=0), ValueError, "n_swa"),
    (dict(n_swa=2.5), TypeError, "n_swa"),
    (dict(swa_type="none"), ValueError, "swa_type"),
    (dict(swa_type="sliding"), ValueError, "swa_type"),
    (dict(n_batch=0), ValueError, "n_batch"),
    (dict(swa_full=1), TypeError, "swa_full"),
    (dict(kv_size=100), ValueError, "kv_size"),
    (dict(n_seq_max=0), ValueError, "n_seq_max"),
    (dict(n_seq_max=257), ValueError, "n_seq_max"),
    (dict(n_layer=True), TypeError, "n_layer"),
    (dict(n_embd_k_gqa=[4, 2]), ValueError, "n_embd_k_gqa"),
    (dict(type_v="q8_0"), ValueError, "v_trans"),
    (dict(bogus=1), TypeError, "bogus"),
]


@pytest.mark.parametrize("kw, exc, word", BAD_ARGS, ids=[str(a[0]) for a in BAD_ARGS])
def test_bad_constructor_args(kw, exc, word):
    with pytest.raises(exc, match=word):
        make(**kw)


# --- fan-out ---------------------------------------------------------------------------------

def test_find_slot_tries_both_caches_and_restore_undoes_both():
    c = make()
    ub = UBatch(list(range(40)), [0] * 40)          # fits the base cache (128), not the SWA cache (32)
    assert c.find_slot_each(ub) == (True, False)
    assert (c.base.used, c.swa.used) == (40, 0)
    c.restore()
    assert (c.base.used, c.swa.used) == (0, 0)
    assert not c.find_slot(ub)
    c.restore()
    small = UBatch([0, 1, 2], [0, 1, [1, 2]])
    assert c.find_slot(small)
    assert c.base.cells().nonempty() == c.swa.cells().nonempty()


def test_sequence_ops_apply_to_both_caches():
    c = make(swa_full=True)
    step(c, [0, 1, 2, 3], [0, 0, 0, 0])
    c.seq_cp(0, 1, 1, 3)
    c.seq_add(1, 0, -1, 5)
    c.seq_div(0, 0, -1, 2)
    c.seq_keep(0)
    assert c.seq_rm(0, 0, 1) is True
    assert c.base.cells().nonempty() == c.swa.cells().nonempty()
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (1, 3)
    assert c.seq_rm(-1) is True
    assert c.base.used == c.swa.used == 0
    step(c, [0], [2])
    c.clear()
    assert c.base.used == c.swa.used == 0
    c.set_full()
    assert (c.base.n, c.swa.n) == (128, 128)


def test_seq_pos_comes_from_the_swa_cache():
    c = make()
    for p in range(12):
        step(c, [p], [1])
    assert positions(c.base, 1) == list(range(12))
    assert positions(c.swa, 1) == [8, 9, 10, 11]
    assert (c.seq_pos_min(1), c.seq_pos_max(1)) == (8, 11)
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (-1, -1)


def _bad_calls(n):
    bad_ub = UBatch([0, 1], [[0], [1, n]])
    return [
        ("seq_rm", (-2,)), ("seq_rm", (n,)), ("seq_rm", (0, 2**31)),
        ("seq_cp", (-1, 0)), ("seq_cp", (0, n)),
        ("seq_keep", (-1,)), ("seq_keep", (1000,)),
        ("seq_add", (n, 0, -1, 1)), ("seq_add", (0, 0, -1, 2**31)),
        ("seq_div", (-1, 0, -1, 2)), ("seq_div", (0, 0, -1, 0)),
        ("seq_pos_min", (-1,)), ("seq_pos_max", (n,)),
        ("find_slot", (bad_ub,)), ("find_slot_each", (bad_ub,)), ("find_slot", ([0, 1],)),
        ("kq_mask", (bad_ub,)), ("kq_mask", (UBatch([0], [0]),), {"out": 3}),
        ("sbatch_init", ([0, 1], [0, n])), ("sbatch_init", ([0, 1], [0, -1])), ("sbatch_init", ([0, 1],)),
        ("sbatch_init", (Batch([0], [0]), [0])), ("sbatch_init", ([0, -4], [0, 0])),
        ("store", (4, None, None)), ("store", (-1, None, None)), ("k", (4,)), ("v", ("1",)),
        ("state_size", (-2,)), ("state_write", (n,)), ("state_read", (b"\0" * 16, n)),
        ("defrag_sched", ("0.5",)), ("ubatches", (Batch([0], [n]), 4)),
        ("ubatches", (Batch([0], [0], simple_split=False), 4)), ("ubatches", (Batch([0], [0]), 0)),
        ("ubatches", ([0], 4)),
    ]


def test_bad_arguments_raise_and_change_both_caches_nothing():
    c = make()
    step(c, [0, 1, 2, 3], [0, 1, [1, 2], 0], 1.5)
    c.seq_add(1, 0, 2, 3)
    c.sbatch_init([9, 10], [[0, 2], 1])
    assert c.find_slot(UBatch([9, 10], [[0, 2], 1]))    # uncommitted, so that restore() would show damage
    before = snapshot(c)
    for call in _bad_calls(c.n_seq_max):
        name, args = call[0], call[1]
        kw = call[2] if len(call) > 2 else {}
        with pytest.raises((ValueError, TypeError, IndexError)):
            getattr(c, name)(*args, **kw)
        assert snapshot(c) == before, name
    c.restore()
    assert (c.base.used, c.swa.used) == (4, 4)


# --- pending ranges and pruning --------------------------------------------------------------

def test_sbatch_init_records_each_sequence_range():
    c = make()
    assert c.pending == []
    got = c.sbatch_init([5, 3, 9, 4, 7], [[1], [0, 1], [2], [1], [0]])
    assert got == c.pending == [[0, 3, 7], [1, 3, 5], [2, 9, 9]]
    assert c.sbatch_init(Batch([2, 1], [2, 2])) == [[2, 1, 2]]     # replaces the previous ranges
    assert c.sbatch_init([], []) == []
    full = make(swa_full=True)
    assert full.sbatch_init([5, 3], [0, 1]) == [] and full.pending == []
    with pytest.raises(ValueError, match="seq_id"):
        full.sbatch_init([0], [3])


def test_commit_prunes_the_window_and_clears_the_ranges():
    c = make()
    step(c, list(range(6)), [0] * 6)
    # the window of the batch's last position 5 is [2, 5] (n_swa 4)
    assert positions(c.swa, 0) == [2, 3, 4, 5] and positions(c.base, 0) == list(range(6))
    assert c.pending == []
    step(c, [6, 7], [[0, 1], [0, 1]])
    assert positions(c.swa, 0) == [4, 5, 6, 7] and positions(c.swa, 1) == [6, 7]
    # no sbatch_init: nothing is pruned
    assert c.find_slot(UBatch([8, 9], [0, 0]))
    c.commit()
    assert positions(c.swa, 0) == [4, 5, 6, 7, 8, 9]


def test_chunked_window_prunes_whole_chunks():
    c = make(swa_type="chunked", n_swa=4)
    step(c, list(range(10)), [0] * 10)
    assert positions(c.swa, 0) == [8, 9]
    assert positions(c.base, 0) == list(range(10))


def test_swa_full_never_prunes():
    c = make(swa_full=True)
    step(c, list(range(10)), [0] * 10)
    assert positions(c.swa, 0) == list(range(10))


def test_restore_keeps_the_ranges_for_the_next_commit():
    c = make()
    step(c, list(range(6)), [0] * 6)
    c.sbatch_init([6], [0])
    assert c.find_slot(UBatch([6], [0]))
    c.restore()
    assert c.pending == [[0, 6, 6]]
    assert c.find_slot(UBatch([6], [0]))
    c.commit()
    assert positions(c.swa, 0) == [3, 4, 5, 6]


def test_partial_window_warns():
    c = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for p in range(0, 8, 2):
            step(c, [p, p + 1], [0, 0])      # a full window each time: no warning
    c.seq_rm(0, 5, 7)                        # cut a hole into the window of position 8
    with pytest.warns(SWAWarning, match="sequence 0"):
        step(c, [8], [0])
    assert c.pending == []


def test_prune_swa_on_a_unified_cache():
    u = UnifiedCache(32, 1, 2, 2, n_swa=3, swa_type="standard", n_seq_max=2)
    assert u.find_slot(UBatch(list(range(6)), [0] * 6))
    u.commit()
    assert u.prune_swa(0, 5, 5) is False
    assert positions(u, 0) == [3, 4, 5]
    assert u.prune_swa(0, 9, 9) is True      # nothing of 6..8 is there
    assert positions(u, 0) == []
    with pytest.raises(ValueError, match="seq_id"):
        u.prune_swa(2, 0, 0)
    with pytest.raises(ValueError, match="sliding window"):
        UnifiedCache(32, 1, 2, 2).prune_swa(0, 0, 0)


# --- graph inputs and layers -----------------------------------------------------------------

def test_masks_of_both_caches():
    c = make()
    for p in range(10):
        step(c, [p], [0])
    ub = UBatch([10, 11], [0, 0])
    c.sbatch_init([10, 11], [0, 0])
    assert c.find_slot(ub)
    mb, ms = c.kq_mask(ub)
    assert mb.shape == (64, c.base.n) and ms.shape == (64, c.swa.n)
    assert np.array_equal(mb, c.base.kq_mask(ub)) and np.array_equal(ms, c.swa.kq_mask(ub))
    # the base mask sees the whole past, the SWA mask only the window
    assert np.count_nonzero(mb[0] == 0) == 11
    assert np.count_nonzero(ms[0] == 0) == 4
    ob = np.empty_like(mb)
    os_ = np.empty_like(ms)
    rb, rs = c.kq_mask(ub, out=(ob, os_))
    assert rb is ob and rs is os_ and np.array_equal(ob, mb)
    bb, bs = c.kq_mask(ub, dtype="bool", causal=False)
    assert bb.dtype == np.bool_ and bs.shape == ms.shape


def test_layers_route_to_their_cache():
    c = make(type_k="f32", type_v="f32", v_trans=False)
    assert c.find_slot(UBatch([0, 1], [0, 0]))
    for il in range(4):
        c.store(il, *rows(c, il, 2, float(il + 1)))
    for il in range(4):
        sub = c.swa if il in (0, 2) else c.base
        assert c.cache_of(il) is sub
        assert np.shares_memory(c.k(il), sub.k(il)) and np.shares_memory(c.v(il), sub.v(il))
        assert np.all(c.k(il)[:2] == il + 1) and np.all(c.v(il)[:2] == il + 1)
        other = c.base if sub is c.swa else c.swa
        with pytest.raises(IndexError):
            other.k(il)
    with pytest.raises(IndexError, match="il"):
        c.k(4)


# --- K-shift and maintenance -----------------------------------------------------------------

def test_can_shift_only_with_equal_sizes():
    c = make()
    assert not c.can_shift
    step(c, [0, 1, 2], [0, 0, 0])
    c.seq_add(0, 0, -1, 2)
    assert c.has_shift
    before = snapshot(c)
    with pytest.raises(RuntimeError, match="K-shift"):
        c.update()
    assert snapshot(c) == before
    shifts = c.k_shift()
    assert [s[:4].tolist() for s in shifts] == [[2, 2, 2, 0], [2, 2, 2, 0]]
    c.reset_shift()
    assert not c.has_shift
    assert not c.update()

    full = make(swa_full=True)
    assert full.can_shift
    step(full, [0, 1, 2], [0, 0, 0])
    full.seq_add(0, 0, -1, 2)
    full.update()
    assert not full.has_shift and not full.base.has_shift and not full.swa.has_shift
    assert make(kv_size=32).can_shift        # both caches have 32 cells


def test_defrag_sched_and_update_in_both_caches():
    c = make(swa_full=True)
    step(c, list(range(8)), [0] * 8)
    c.seq_rm(0, 2, 4)
    c.defrag_sched(-1.0)                     # a negative threshold forces it
    assert c.base.do_defrag and c.swa.do_defrag
    c.update()
    assert not c.base.do_defrag and not c.swa.do_defrag
    assert [cell[0] for cell in c.base.cells().nonempty()] == list(range(6))
    assert c.base.cells().nonempty() == c.swa.cells().nonempty()


# --- state -----------------------------------------------------------------------------------

def filled(**kw):
    c = make(**kw)
    rng = np.random.default_rng(7)
    for pos, seq in (([0, 1, 2], [0, 0, [0, 1]]), ([0, 1], [2, 2]), ([3], [1]), ([3, 4], [0, 0])):
        c.sbatch_init(pos, seq)
        assert c.find_slot(UBatch(pos, seq))
        for il in range(c.n_layer):
            k, v = rows(c, il, len(pos), 0.0)
            c.store(il, rng.standard_normal(k.shape).astype(np.float32),
                    rng.standard_normal(v.shape).astype(np.float32))
        c.commit()
    return c


def test_state_is_the_base_part_then_the_swa_part():
    a = filled()
    for s in (-1, 0, 1, 2):
        blob = a.state_write(s, layout="2025")
        assert blob == a.base.state_write(s, layout="2025") + a.swa.state_write(s, layout="2025")
        assert len(blob) == a.state_size(s, layout="2025") == a.base.state_size(s, layout="2025") + a.swa.state_size(s, layout="2025")


def test_state_round_trips():
    a = filled()
    blob = a.state_write(layout="2025")
    b = make()
    assert b.state_read(blob + b"\x07" * 16, layout="2025") == len(blob)
    assert b.state_write(layout="2025") == blob                            # cells and K/V of both caches
    assert b.base.cells() == a.base.cells()                   # no hole in the base cache: same cells
    assert [cell[1:] for cell in b.swa.cells().nonempty()] == [cell[1:] for cell in a.swa.cells().nonempty()]
    one = a.state_write(0, layout="2025")
    d = make()
    assert d.state_read(memoryview(one), 1, layout="2025") == len(one)
    assert positions(d.base, 1) == positions(a.base, 0) and positions(d.swa, 1) == positions(a.swa, 0)


def test_empty_parts_remove_the_destination_per_cache():
    a = filled()
    a.swa.seq_rm(0)                          # sequence 0 only in the base cache
    blob = a.state_write(0, layout="2025")
    b = filled()
    assert b.state_read(blob, 2, layout="2025") == len(blob)
    assert positions(b.base, 2) == positions(a.base, 0)
    assert positions(b.swa, 2) == []
    # an empty base part followed by the SWA part of another sequence
    composed = make().base.state_write(0, layout="2025") + a.swa.state_write(1, layout="2025")
    c = filled()
    assert c.state_read(composed, 1, layout="2025") == len(composed)
    assert positions(c.base, 1) == [] and positions(c.swa, 1) == positions(a.swa, 1)


def _busy_target():
    """A cache with an uncommitted find_slot, shifted cells and pending ranges."""
    c = filled()
    c.seq_add(2, 0, -1, 1)
    c.sbatch_init([7, 8], [1, 1])
    assert c.find_slot(UBatch([7, 8], [1, 1]))
    return c


def _restored_cells(c):
    c.restore()
    return c.base.cells(), c.swa.cells()


def test_failed_read_of_the_swa_part_leaves_everything_as_it_was():
    src = filled()
    base_part, swa_part = src.base.state_write(layout="2025"), src.swa.state_write(layout="2025")
    wrong_layers = make(swa_layers=[0]).swa.state_write(layout="2025")       # one SWA layer instead of two
    twin = _busy_target()
    expected_after_restore = _restored_cells(twin)
    for bad in (base_part + swa_part[:-1],                      # truncated in the SWA part
                base_part + swa_part[:4],
                base_part,                                      # SWA part missing
                base_part + wrong_layers):
        c = _busy_target()
        before = snapshot(c)
        with pytest.raises(StateError, match="part 1"):
            c.state_read(bad, layout="2025")
        assert snapshot(c) == before
        assert _restored_cells(c) == expected_after_restore   # the uncommitted slot survived


def test_failed_single_sequence_read_leaves_everything_as_it_was():
    src = filled()
    blob = src.state_write(0, layout="2025")
    nb = len(src.base.state_write(0, layout="2025"))
    corrupt = bytearray(blob)
    corrupt[nb + 4 + 4:nb + 4 + 8] = (5).to_bytes(4, "little")   # first SWA cell: 5 sequence ids
    for bad in (bytes(corrupt), blob[:-3], blob[:nb]):
        c = _busy_target()
        before = snapshot(c)
        with pytest.raises(StateError, match="part 1"):
            c.state_read(bad, 2, layout="2025")
        assert snapshot(c) == before


def test_no_room_in_the_swa_cache_fails_the_whole_read():
    src = make()
    step(src, list(range(6)), [0] * 6)
    blob = src.state_write(0, layout="2025")                 # 6 cells in base, 4 in the SWA cache
    c = make()
    # fill the 32-cell SWA cache with 30 cells of sequence 1 and 2 (its window is never pruned
    # because no range is recorded), leaving the base cache room to spare
    assert c.find_slot(UBatch(list(range(30)), [1] * 15 + [2] * 15))
    c.commit()
    before = snapshot(c)
    with pytest.raises(StateError, match="part 1.*no room"):
        c.state_read(blob, 0, layout="2025")
    assert snapshot(c) == before
    part = src.base.state_write(0, layout="2025")
    assert c.base.state_read(part, 0, layout="2025") == len(part)            # the base part alone would fit
    # an import of the sequence names the cache that has no room too, and begins in neither
    before = snapshot(c)
    with pytest.raises(StateError, match="part 1 of 2: no room"):
        c.seq_import_begin(src.seq_export(0).header, 0)
    assert snapshot(c) == before


def test_state_read_rejects_before_reading():
    c = filled()
    before = snapshot(c)
    with pytest.raises(ValueError, match="seq_id"):
        c.state_read(c.state_write(layout="2025"), 3, layout="2025")
    with pytest.raises(TypeError):
        c.state_read(123, layout="2025")
    with pytest.raises(StateError, match="part 0"):
        c.state_read(b"", layout="2025")
    assert snapshot(c) == before
