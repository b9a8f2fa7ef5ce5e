"""The reference model of today's cache (tests/reference2026.py) on the rules the 2026 traces
exercise little: scattered placement and the SWA purge, prepare as a dry run, stream copies
and their refusals, what llama.cpp aborts on (ValueError, nothing changed), failed reads of
every kind (rule C7), the empty-blob no-op, trailing bytes, 256 sequences; and the diagnostic
info of the 2026 traces (what llama.cpp's own failure paths would have changed), reproduced
with the model. (The traces themselves replay against it in tests/test_golden.py.)"""
import copy
import struct

import numpy as np
import pytest

from conftest import GOLDEN
from kvcache import StateError
from conformance import read_trace
from conformance.ops import apply_op, compare_op, start
from conformance.unified2026 import reference_target
from reference import CellTable, RefUBatch, UnifiedReference
from reference2026 import STATUS_NO_UPDATE, STATUS_SUCCESS, UnifiedReference2026
from kvcache.statefile import _Reader

TRACES_2026 = sorted((GOLDEN / "unified2026").glob("*.jsonl"))


def make(kv_size=16, n_seq_max=4, kv_unified=True, **kw):
    kw = {"n_layer": 2, "n_embd_k_gqa": 8, "n_embd_v_gqa": 8, **kw}
    return UnifiedReference2026(kv_size, n_seq_max=n_seq_max, kv_unified=kv_unified, **kw)


def ub(pos, seq_id):
    return RefUBatch(list(pos), [[s] if isinstance(s, int) else list(s) for s in seq_id])


def place(m, pos, seq_id):
    """find_slot and store rows that tell tokens apart (K: pos + 1000 * seq, V: its negation)."""
    assert m.find_slot(ub(pos, seq_id))
    first = np.array([s if isinstance(s, int) else s[0] for s in seq_id], dtype=np.float32)
    val = np.asarray(pos, dtype=np.float32) + 1000 * first
    for il in m.layers:
        m.store(il, np.repeat(val[:, None], 8, axis=1) + np.arange(8), -np.repeat(val[:, None], 8, axis=1))
    return [(s, c.tolist()) for s, c in m.slot_info()]


def state(m):
    """Everything rules C7 / C8 keep: every cell (shift included), head, flag, queued copy, byte."""
    streams = [(list(t.pos), [sorted(s) for s in t.seq], list(t.shift), t.has_shift, t.head) for t in m.streams]
    return streams, list(m._pending), [(m.k(il).tobytes(), m.v(il).tobytes()) for il in m.layers]


def cells(m, stream=0):
    return m.cells()[stream].nonempty()


# --- geometry ---------------------------------------------------------------------------------

def test_streams_and_data_layout():
    one = make(16, n_seq_max=3)
    assert (one.n_stream, one.heads, one.k(0).shape, one.v(0).shape) == (1, (0,), (16, 8), (1, 8, 16))
    per = make(16, n_seq_max=3, kv_unified=False, v_trans=False)
    assert (per.n_stream, per.heads, per.k(1).shape, per.v(1).shape) == (3, (0, 0, 0), (48, 8), (48, 8))
    assert [per.stream_of(s) for s in range(3)] == [0, 1, 2] and one.stream_of(2) == 0
    assert one.k(0).dtype == np.float16 and one.semantics == "2026"


@pytest.mark.parametrize("kw", [
    {"n_seq_max": 0}, {"n_seq_max": 257}, {"kv_size": 30, "n_pad": 8}, {"semantics": "2025"},
    {"type_v": "q8_0", "n_embd_v_gqa": 32}, {"swa_type": "sliding"}, {"swa_type": "standard", "n_swa": 0},
    {"layers": [1, 0]}, {"layers": [2]}, {"n_embd_k_gqa": [8]},
])
def test_constructor_rejects(kw):
    args = {"kv_size": 16, **kw}
    with pytest.raises(ValueError):
        make(**args)


def test_n_kv_is_padded_to_at_least_256_cells():
    m = make(1024, n_seq_max=1)
    assert m.n_kv_per_stream == (256,)
    place(m, range(10), [0] * 10)
    assert m.n_kv_per_stream == (256,)
    m.seq_rm(0)
    place(m, range(300), [0] * 300)
    assert m.used_max_p1_per_stream == (300,) and m.n_kv_per_stream == (512,)
    assert make(1024, n_seq_max=1, n_pad=512).n_kv_per_stream == (512,)
    assert make(64, n_seq_max=1).n_kv_per_stream == (64,)


# --- placement --------------------------------------------------------------------------------

def test_a_fragmented_cache_takes_a_ubatch_the_seed_refuses():
    """Half the cells free, none two in a row: scattered placement uses them; the seed's
    contiguous search finds no run of 16."""
    m = make(32, n_seq_max=3)
    seed = UnifiedReference(32, n_seq_max=3, n_pad=1)
    for model in (m, seed):
        assert model.find_slot(ub(range(32), [[0], [1]] * 16))
        model.seq_rm(1)
    seed.commit()
    assert not seed.find_slot(ub(range(16), [2] * 16))
    assert place(m, range(16), [2] * 16) == [(0, list(range(1, 32, 2)))]
    assert m.heads == (32,) and m.used_per_stream == (32,)


def test_placement_wraps_around_the_ring():
    m = make(8, n_seq_max=2)
    place(m, range(8), [0] * 8)
    m.seq_rm(0, 0, 2)        # cells 0, 1 free; head lowered to 0
    m.seq_rm(0, 6, -1)       # cells 6, 7 free
    m.streams[0].head = 6
    assert place(m, [10, 11, 12, 13], [1] * 4) == [(0, [6, 7, 0, 1])]
    assert m.heads == (2,)


def test_search_restarts_at_0_when_enough_cells_lie_before_head():
    m = make(16, n_seq_max=2)
    place(m, range(12), [0] * 12)
    m.seq_rm(0, 0, 10)       # head lowered to 0 by seq_rm: put it back at 12
    m.streams[0].head = 12
    assert place(m, [20], [1]) == [(0, [0])]      # 12 > used 2 + 2*1
    m2 = make(16, n_seq_max=2)
    place(m2, range(12), [0] * 12)
    m2.seq_rm(0, 0, 2)
    m2.streams[0].head = 12
    assert place(m2, [20], [1]) == [(0, [12])]    # 12 <= used 10 + 2


def test_a_failed_find_slot_changes_nothing():
    m = make(8, n_seq_max=2)
    place(m, range(6), [0] * 6)
    before = state(m)
    assert not m.find_slot(ub([6, 7, 8], [1] * 3))
    assert state(m) == before and m.slot_info() == []
    assert not m.find_slot(ub(range(9), [1] * 9))    # more tokens than cells
    assert state(m) == before


def test_swa_reuses_cells_outside_the_window_and_purges_below_them():
    m = make(8, n_seq_max=2, n_swa=4, swa_type="standard")
    place(m, [7, 6, 5, 4, 3, 2, 1, 0], [0] * 8)     # cell i holds position 7 - i
    # position 8 sees 5, 6, 7 (and itself): cell 3 (position 4) is the first one outside the
    # window from head 8 (wrapped to 0); taking it purges positions 0..3 of sequence 0
    assert place(m, [8], [0]) == [(0, [3])]
    assert cells(m) == [[0, 7, [0], 0], [1, 6, [0], 0], [2, 5, [0], 0], [3, 8, [0], 0]]
    assert m.heads == (4,) and (m.seq_pos_min(0), m.seq_pos_max(0)) == (5, 8)


def test_swa_cells_of_several_sequences_are_not_reused():
    m = make(4, n_seq_max=2, n_swa=1, swa_type="standard")
    place(m, [0, 1, 2, 3], [[0, 1], [0, 1], [0, 1], [0, 1]])
    assert not m.find_slot(ub([4], [0]))


def test_a_multi_stream_ubatch_goes_to_the_streams_of_its_groups():
    m = make(8, n_seq_max=3, kv_unified=False)
    assert place(m, [0, 1, 5, 6], [2, 2, 0, 0]) == [(2, [0, 1]), (0, [0, 1])]
    assert m.heads == (2, 0, 2) and m.used_per_stream == (2, 0, 2)
    mask = m.kq_mask(ub([2, 7], [2, 0]))
    assert mask.shape == (2, 1, 8)
    assert np.flatnonzero(mask[0, 0] == 0).tolist() == [0, 1] and np.flatnonzero(mask[1, 0] == 0).tolist() == [0, 1]
    assert m.kq_mask(ub([2, 7], [2, 0]), pad=True).shape == (2, 64, 8)


def test_mask_follows_the_first_listed_id_of_a_token():
    m = make(8, n_seq_max=3)
    place(m, [0, 1], [0, 1])
    rows = m.kq_mask(ub([5, 5], [[1, 0], [0, 1]]))[0]
    assert np.flatnonzero(rows[0] == 0).tolist() == [1] and np.flatnonzero(rows[1] == 0).tolist() == [0]
    assert m.kq_mask(ub([5], [0]), alibi=True)[0, 0, 0] == -5


# --- prepare (rule C8) ---------------------------------------------------------------------------

def _sequential(m, ubatches):
    trial = copy.deepcopy(m)
    out = []
    for u in ubatches:
        if not trial.find_slot(u):
            return None
        out.append([(s, c.tolist()) for s, c in trial.slot_info()])
    return out


def test_prepare_finds_the_slots_of_the_ubatches_in_turn_and_changes_nothing():
    m = make(16, n_seq_max=3, kv_unified=False)
    place(m, range(5), [1] * 5)
    place(m, range(3), [2] * 3)
    m.seq_rm(1, 1, 3)
    before = state(m)
    ubatches = [ub([5, 6, 7], [1] * 3), ub([3, 4], [2] * 2), ub([8, 9], [1] * 2), ub([0, 1], [0, 0])]
    slots = m.prepare(ubatches)
    assert [[(s, c.tolist()) for s, c in slot] for slot in slots] == _sequential(m, ubatches)
    assert state(m) == before      # llama.cpp's own undo restores heads by slot position


def test_prepare_brings_back_the_cells_an_swa_purge_removed():
    m = make(8, n_seq_max=2, n_swa=4, swa_type="standard")
    place(m, [7, 6, 5, 4, 3, 2, 1, 0], [0] * 8)
    before = state(m)
    slots = m.prepare([ub([8], [0]), ub([9], [0])])
    assert [[(s, c.tolist()) for s, c in slot] for slot in slots] == [[(0, [3])], [(0, [4])]]
    assert state(m) == before


def test_a_failing_prepare_returns_none_and_changes_nothing():
    m = make(8, n_seq_max=2)
    place(m, range(4), [0] * 4)
    before = state(m)
    assert m.prepare([ub([4, 5, 6], [0] * 3), ub([0, 1, 2], [1] * 3)]) is None
    assert state(m) == before


# --- stream copies --------------------------------------------------------------------------------

@pytest.fixture
def streams3():
    m = make(16, n_seq_max=3, kv_unified=False)
    place(m, range(5), [0] * 5)
    place(m, [0, 1], [2, 2])
    return m


@pytest.mark.parametrize("p0,p1", [(1, -1), (-1, 5), (2, 10), (0, 14), (14, -1)])
def test_a_partial_copy_across_streams_is_refused(streams3, p0, p1):
    before = state(streams3)
    with pytest.raises(ValueError, match="whole sequences"):
        streams3.seq_cp(0, 2, p0, p1)
    assert state(streams3) == before


@pytest.mark.parametrize("p0,p1", [(-1, -1), (0, -1), (-1, 0), (0, 15), (0, 100), (15, 0)])
def test_a_whole_copy_across_streams_is_queued_and_done_by_update(streams3, p0, p1):
    m = streams3
    k0 = m.k(0)[0:16].copy()
    m.seq_add(0, 3, -1, 2)                    # a pending shift travels with the cells
    m.seq_cp(0, 2, p0, p1)
    assert m.pending_copies == 1
    assert cells(m, 2) == [[0, 0, [2], 0], [1, 1, [2], 0], [2, 2, [2], 0], [3, 5, [2], 2], [4, 6, [2], 2]]
    assert m.heads[2] == m.heads[0] and m.seq_pos_max(0) == 6
    assert not np.array_equal(m.k(0)[32:48], k0)          # the data comes with the update
    r = m.update()
    assert (r.status, r.had_shift, r.copies, r.has_shift) == (STATUS_SUCCESS, True, 1, False)
    assert r.shift.tolist()[0:16] == [0, 0, 0, 2, 2] + [0] * 11 and r.shift.tolist()[32:37] == [0, 0, 0, 2, 2]
    assert np.array_equal(m.k(0)[32:48], k0) and np.array_equal(m.v(1)[2], m.v(1)[0])
    assert m.pending_copies == 0 and not m.has_shift


def test_queued_copies_survive_clear(streams3):
    m = streams3
    m.seq_cp(0, 1)
    m.seq_cp(2, 0)
    m.clear()
    assert m.pending_copies == 2
    assert m.update().copies == 2
    assert not m.k(0).any()


def test_a_copy_within_a_stream_is_metadata_only():
    m = make(16, n_seq_max=3)
    place(m, range(5), [0] * 5)
    m.seq_cp(0, 2, 1, 3)
    assert m.pending_copies == 0
    assert [c[2] for c in cells(m)] == [[0], [0, 2], [0, 2], [0], [0]]
    assert m.update().status == STATUS_NO_UPDATE


# --- aborts: ValueError, nothing changed -----------------------------------------------------------

ABORTS = {
    "seq_rm -2": lambda m, n: m.seq_rm(-2),
    "seq_rm n_seq_max": lambda m, n: m.seq_rm(n, 0, 4),
    "seq_cp -1": lambda m, n: m.seq_cp(-1, 0),
    "seq_cp dst n_seq_max": lambda m, n: m.seq_cp(0, n),
    "seq_keep -1": lambda m, n: m.seq_keep(-1),
    "seq_add -1": lambda m, n: m.seq_add(-1, 0, 4, 1),
    "seq_div by 0": lambda m, n: m.seq_div(0, 0, -1, 0),
    "seq_div by -2": lambda m, n: m.seq_div(0, 0, -1, -2),
    "seq_pos_min -1": lambda m, n: m.seq_pos_min(-1),
    "seq_pos_max n_seq_max": lambda m, n: m.seq_pos_max(n),
    "state_write -2": lambda m, n: m.state_write(-2),
    "state_write n_seq_max": lambda m, n: m.state_write(n),
    "state_read n_seq_max": lambda m, n: m.state_read(m.state_write(0), n),
    "state_read -2": lambda m, n: m.state_read(m.state_write(0), -2),
    "layout 2025 write": lambda m, n: m.state_write(0, layout="2025"),
    "layout 2025 read": lambda m, n: m.state_read(m.state_write(0), 0, layout="2025"),
    "ubatch id n_seq_max": lambda m, n: m.find_slot(ub([9], [n])),
    "ubatch id -1": lambda m, n: m.find_slot(ub([9], [-1])),
    "empty ubatch": lambda m, n: m.find_slot(ub([], [])),
    "negative position": lambda m, n: m.find_slot(ub([-1], [0])),
    "mask of a bad id": lambda m, n: m.kq_mask(ub([9], [n])),
    "prepare of nothing": lambda m, n: m.prepare([]),
    "prepare of a bad ubatch last": lambda m, n: m.prepare([ub([9], [0]), ub([10], [n])]),
}

MULTI_STREAM_ABORTS = {
    "not grouped": lambda m, n: m.find_slot(ub([5, 5, 6, 6], [0, 1, 0, 1])),
    "groups of unequal size": lambda m, n: m.find_slot(ub([5, 6, 5], [0, 0, 1])),
    "two ids": lambda m, n: m.find_slot(ub([5, 6], [[0, 1], [0, 1]])),
    "mask not grouped": lambda m, n: m.kq_mask(ub([5, 5, 6], [0, 1, 0])),
    "position buckets of several streams": lambda m, n: m.pos_bucket(ub([5], [0]), 32),
    "prepare not grouped": lambda m, n: m.prepare([ub([5], [0]), ub([5, 5, 6], [0, 1, 0])]),
}


def _populated(kv_unified):
    m = make(16, n_seq_max=3, kv_unified=kv_unified)
    place(m, range(4), [0] * 4)
    place(m, [0, 1], [1, 1])
    m.seq_add(1, 0, -1, 3)
    if not kv_unified:
        m.seq_cp(0, 2)
    return m


ABORT_CASES = ([pytest.param(name, True, id=f"unified-{name}") for name in ABORTS]
               + [pytest.param(name, False, id=f"streams-{name}") for name in [*ABORTS, *MULTI_STREAM_ABORTS]])


@pytest.mark.parametrize("name,kv_unified", ABORT_CASES)
def test_what_llama_cpp_aborts_on_raises_valueerror_and_changes_nothing(name, kv_unified):
    m = _populated(kv_unified)
    before = state(m)
    with pytest.raises(ValueError):
        {**ABORTS, **MULTI_STREAM_ABORTS}[name](m, m.n_seq_max)
    assert state(m) == before


def test_one_stream_takes_interleaved_and_shared_tokens():
    m = make(16, n_seq_max=3)
    assert place(m, [5, 5, 6, 6], [0, 1, [0, 1], 1]) == [(0, [0, 1, 2, 3])]
    assert [c[2] for c in cells(m)] == [[0], [1], [0, 1], [1]]


def test_store_needs_a_placed_ubatch_of_the_right_shape():
    m = make(8, n_seq_max=1)
    with pytest.raises(RuntimeError):
        m.store(0, np.zeros((1, 8)), None)
    assert m.find_slot(ub([0, 1], [0, 0]))
    with pytest.raises(ValueError):
        m.store(0, np.zeros((3, 8)), None)
    with pytest.raises(ValueError):
        m.k(5)


# --- state blobs ------------------------------------------------------------------------------------

def _hex_words(b: bytes, n: int) -> list:
    return [b[4 * i:4 * i + 4].hex() for i in range(n)]


def test_a_sequence_blob_of_a_multi_stream_cache_has_its_stream_only():
    m = make(16, n_seq_max=4, kv_unified=False)
    place(m, range(3), [1] * 3)
    place(m, range(9), [2] * 9)
    blob = m.state_write(2)
    assert _hex_words(blob, 4) == ["04000000", "00000000", "00000000", "09000000"]
    assert blob.endswith(b"\0" * 4)                       # stream 3: its count alone
    whole = m.state_write(-1)
    assert struct.unpack_from("<II", whole) == (4, 0) and struct.unpack_from("<I", whole, 8)[0] == 3


def test_whole_and_sequence_state_round_trips():
    m = make(16, n_seq_max=3, kv_unified=False)
    place(m, range(5), [0] * 5)
    place(m, range(3), [2] * 3)
    m.seq_rm(0, 1, 3)
    fresh = make(16, n_seq_max=3, kv_unified=False)
    blob = m.state_write()
    assert fresh.state_read(blob) == len(blob)
    assert [c.nonempty() for c in fresh.cells()] == [
        [[0, 0, [0], 0], [1, 3, [0], 0], [2, 4, [0], 0]], [], [[0, 0, [2], 0], [1, 1, [2], 0], [2, 2, [2], 0]]]
    assert fresh.heads == (0, 0, 0) and fresh.state_write() == blob
    # a sequence into another one of one stream: placed where find_slot puts it
    one = make(16, n_seq_max=3)
    place(one, range(4), [1] * 4)
    one.seq_rm(1, 1, 3)
    src = make(16, n_seq_max=3)
    place(src, [7, 8, 9], [0] * 3)
    blob = src.state_write(0)
    assert one.state_read(blob, 2) == len(blob)
    assert cells(one) == [[0, 0, [1], 0], [1, 7, [2], 0], [2, 8, [2], 0], [3, 3, [1], 0], [4, 9, [2], 0]]
    assert np.array_equal(one.k(1)[[1, 2, 4]], src.k(1)[[0, 1, 2]])
    assert np.array_equal(one.v(1)[0][:, [1, 2, 4]], src.v(1)[0][:, [0, 1, 2]])


def test_sequence_blobs_leave_out_cells_the_window_has_left():
    m = make(16, n_seq_max=2, n_swa=3, swa_type="standard")
    place(m, range(8), [0] * 8)
    blob = m.state_write(0)
    # against the largest position 7 (not 8): positions 5, 6, 7 stay
    assert struct.unpack_from("<II", blob) == (1, 3) and struct.unpack_from("<i", blob, 8)[0] == 5
    assert struct.unpack_from("<II", m.state_write(-1)) == (1, 8)


def test_an_all_empty_blob_is_a_no_op_that_keeps_the_destination():
    for kv_unified in (True, False):
        m = _populated(kv_unified)
        m.update()
        empty = make(16, n_seq_max=3, kv_unified=kv_unified).state_write(1)
        assert empty == struct.pack("<I", m.n_stream) + b"\0" * 4 * m.n_stream
        before = state(m)
        assert m.state_read(empty, 0) == len(empty)
        assert state(m) == before and m.seq_pos_max(0) == 3
        m.state_read(empty, -1)                        # a whole-cache read of it clears the cache
        assert m.used_per_stream == (0,) * m.n_stream and not m.k(0).any()


def test_bytes_after_the_state_are_not_read():
    m = make(16, n_seq_max=2)
    place(m, range(4), [0] * 4)
    blob = m.state_write(0)
    a, b = make(16, n_seq_max=2), make(16, n_seq_max=2)
    assert a.state_read(blob + bytes(range(16)), 1) == len(blob)
    b.state_read(blob, 1)
    assert state(a) == state(b)


def _changed(blob: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _failed_reads(m):
    """(name, blob, seq_id) of reads that must fail on model m (a 2-layer f16 cache with
    transposed V, sequence 0 holding 3 cells)."""
    seq = m.state_write(0)
    whole = m.state_write(-1)
    ns = m.n_stream
    # offsets in a single-sequence blob: after the stream counts, 3 cells of 12 bytes
    s = m.stream_of(0)
    cells_at = 4 + 4 * (s + 1)
    data_at = cells_at + 3 * 12
    k_at = data_at + 8
    yield "n_stream + 1", _changed(seq, 0, "<I", ns + 1), 0
    yield "n_stream + 1, whole", _changed(whole, 0, "<I", ns + 1), -1
    yield "two ids in a sequence cell", _changed(seq, cells_at + 4, "<I", 2), 1
    yield "negative position", _changed(seq, cells_at, "<i", -3), 1
    yield "V transposition", _changed(seq, data_at, "<I", 0), 1
    yield "layer count", _changed(seq, data_at + 4, "<I", 3), 1
    yield "K type", _changed(seq, k_at, "<i", 0), 1
    yield "K row size", _changed(seq, k_at + 4, "<Q", 17), 1
    v_at = k_at + 2 * (12 + 3 * 16)
    yield "V type", _changed(seq, v_at, "<i", 0), 1
    yield "V element size", _changed(seq, v_at + 4, "<I", 4), 1
    yield "V width", _changed(seq, v_at + 8, "<I", 16), 1
    yield "more cells than a stream has", _changed(seq, 4 + 4 * s, "<I", 17), 1
    yield "whole: id out of range", _changed(whole, 16, "<i", m.n_seq_max), -1
    for cut in range(1, len(seq)):
        yield f"single cut to {cut}", seq[:cut], 1
    for cut in range(1, len(whole), 7):
        yield f"whole cut to {cut}", whole[:cut], -1


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "streams"])
def test_every_failed_read_changes_nothing(kv_unified):
    m = make(16, n_seq_max=3, kv_unified=kv_unified)
    place(m, range(3), [0] * 3)
    place(m, range(5), [1] * 5)
    m.seq_cp(1, 2) if not kv_unified else m.seq_cp(1, 2, 0, 2)
    before = state(m)
    n = 0
    for name, blob, seq_id in _failed_reads(copy.deepcopy(m)):
        with pytest.raises(StateError):
            m.state_read(blob, seq_id)
        assert state(m) == before, name
        n += 1
    assert n > 300


def test_a_read_that_finds_no_room_changes_nothing():
    m = make(8, n_seq_max=2)
    place(m, range(3), [0] * 3)
    place(m, range(5), [1] * 5)
    big = make(8, n_seq_max=2)
    place(big, range(6), [0] * 6)
    before = state(m)
    # removing sequence 0 frees 3 cells: 6 do not fit, and the removal is undone
    with pytest.raises(StateError, match="failed to find 6 available cells"):
        m.state_read(big.state_write(0), 0)
    assert state(m) == before


# --- 256 sequences ---------------------------------------------------------------------------------

def test_256_sequences_in_one_stream():
    m = make(512, n_seq_max=256)
    for s in range(256):
        place(m, [s, s + 1], [s, s])
    assert m.seq_pos_min(255) == 255 and m.seq_pos_max(255) == 256 and m.used_per_stream == (512,)
    m.seq_rm(200)
    m.seq_cp(255, 200)
    assert [c[:3] for c in cells(m)[-2:]] == [[510, 255, [200, 255]], [511, 256, [200, 255]]]
    blob = m.state_write(255)
    assert struct.unpack_from("<IIiIi", blob) == (1, 2, 255, 1, 255)
    m.seq_rm(254)
    assert m.state_read(blob, 254) == len(blob)
    # placed from the head, which the removal of sequence 200 lowered to its first cell
    assert (m.seq_pos_min(254), m.seq_pos_max(254)) == (255, 256)
    rows = m.kq_mask(ub([300], [254]))[0, 0]
    assert np.flatnonzero(rows == 0).tolist() == [400, 401]
    fresh = make(512, n_seq_max=256)
    whole = m.state_write()
    fresh.state_read(whole)
    assert fresh.state_write() == whole
    # the whole-cache read puts the k-th listed cell into cell k
    assert [c[1:] for c in cells(fresh)] == [c[1:] for c in cells(m)] and fresh.used_max_p1_per_stream == (510,)


def test_256_streams():
    m = make(4, n_seq_max=256, kv_unified=False)
    assert m.n_stream == 256
    assert place(m, [0, 1, 7, 8], [255, 255, 3, 3]) == [(255, [0, 1]), (3, [0, 1])]
    m.seq_cp(255, 254)
    assert m.update().copies == 1
    assert np.array_equal(m.k(0)[254 * 4:255 * 4], m.k(0)[255 * 4:256 * 4])
    blob = m.state_write(254)
    assert len(blob) > 4 * 257 and struct.unpack_from("<I", blob, 4 + 4 * 254)[0] == 2


# --- the rule both eras share ------------------------------------------------------------------------

def test_emptied_cells_keep_their_shift_in_the_seed_and_lose_it_today():
    for keeps in (True, False):
        t = CellTable(4, empty_keeps_shift=keeps)
        t.pos[0], t.seq[0] = 3, {0}
        t.add(0, 0, -1, 2)
        t.remove(0, -1, -1)
        assert t.is_empty(0) and t.shift[0] == (2 if keeps else 0) and t.k_shift().tolist() == [0] * 4


def test_update_with_nothing_to_do():
    m = make(8, n_seq_max=2)
    place(m, range(3), [0] * 3)
    r = m.update()
    assert (r.status, r.had_shift, r.copies, r.has_shift, r.shift.tolist()) == (STATUS_NO_UPDATE, False, 0, False, [0] * 8)
    m.seq_div(0, 1, -1, 2)
    r = m.update()
    assert (r.status, r.had_shift) == (STATUS_SUCCESS, True) and r.shift.tolist()[:3] == [0, 1, 1]
    assert cells(m) == [[0, 0, [0], 0], [1, 0, [0], 0], [2, 1, [0], 0]]


# --- the diagnostic info of the 2026 traces -------------------------------------------------------
# Whether llama.cpp's own failure path (``restored``) or its own undo of ``prepare``
# (``undo_restored``) would have changed the cache where rules C7 / C8 keep it as it was, and the
# error of every failed read (the bytes a read consumed: tests/test_golden.py, strictly).

def _state(model) -> tuple:
    """Everything of a reference model that rules C7 / C8 keep."""
    streams = [(list(t.pos), [sorted(s) for s in t.seq], list(t.shift), t.has_shift, t.head) for t in model.streams]
    data = [(model.k(il).tobytes(), model.v(il).tobytes()) for il in model.layers]
    return streams, model.pending_copies, data


def _llama_undo_changes(model, target, ubatches) -> bool:
    """Whether llama.cpp's own undo of prepare would leave the cache changed: it puts back only
    the cells each slot listed, and the head of the stream of group g from the saved head of
    stream g."""
    m = copy.deepcopy(model)
    before = _state(m)
    undo = []
    for u in ubatches:
        pos, ids, groups = m._ubatch(target.make_ubatch(u["pos"], u["seq_id"]))
        slot = m._find_slot(groups)
        if slot is None:
            break
        saved = [[(m.streams[s].pos[i], set(m.streams[s].seq[i])) for i in idxs.tolist()] for s, idxs in slot]
        undo.append((slot, list(m.heads), saved))
        m._apply(slot, groups, pos, ids)
    for slot, heads, saved in reversed(undo):
        for g, ((strm, idxs), cells) in enumerate(zip(slot, saved)):
            t = m.streams[strm]
            for i, (p, ss) in zip(idxs.tolist(), cells):
                t.pos[i], t.seq[i] = p, ss
            t.head = heads[g]
    return _state(m) != before


def _llama_failed_read_changes(model, op) -> bool:
    """Whether llama.cpp's failure path would leave the cache changed by a failed read: nothing
    before the stream count is taken; after it, ``state_clear`` — the whole cache cleared, or
    the destination sequence removed and the K/V of the cells it had been given zeroed. (The
    traces fail only on the stream count and inside K/V sections.)"""
    assert op.get("note") == "n_stream+1" or op.get("note", "").startswith("truncated"), op.get("note")
    m = copy.deepcopy(model)
    before = _state(m)
    seq_id = op["seq_id"]
    with pytest.raises(StateError):
        m._read(_Reader(memoryview(bytes.fromhex(op["hex"])), "cache state"), seq_id)
    if op["note"] == "n_stream+1":
        assert _state(m) == before
    elif seq_id == -1:
        m.clear()
    else:
        t = m.streams[m.stream_of(seq_id)]
        given = [i for i in range(t.size) if seq_id in t.seq[i]]
        t.remove(seq_id, -1, -1)
        for il in m.layers:
            rows = [m.stream_of(seq_id) * t.size + i for i in given]
            m._k[il][rows] = 0
            if m.v_trans:
                m._v[il][m.stream_of(seq_id)][:, given] = 0
            else:
                m._v[il][rows] = 0
    return _state(m) != before


@pytest.mark.parametrize("path", TRACES_2026, ids=lambda p: p.stem)
def test_the_diagnostic_info_is_reproduced(path):
    header, ops = read_trace(str(path))
    config = header["config"]
    target = reference_target()
    r = start(target, config)
    model = r.cache
    n_read = n_prepare = 0
    for index, op in enumerate(ops, start=1):
        info = op.get("info", {})
        if op["op"] == "state_read":
            n_read += 1
            blob = bytes.fromhex(op["hex"])
            if op["expect"]["ok"]:
                trial = copy.deepcopy(model)
                assert trial.state_read(blob, op["seq_id"]) == info["consumed"], index
            else:
                assert info["restored"] == _llama_failed_read_changes(model, op), index
                with pytest.raises(StateError, match=f"^{info['error']}"):
                    copy.deepcopy(model).state_read(blob, op["seq_id"])
        elif op["op"] == "prepare":
            n_prepare += 1
            assert info.get("undo_restored", False) == _llama_undo_changes(model, target, op["ubatches"]), index
        compare_op(r, index, op, apply_op(r, index, op))
    assert n_read and n_prepare
