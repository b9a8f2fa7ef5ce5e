"""RecurrentCache: API, argument checks, state codec (round trips, truncation, rejected blobs)
and the blobs llama.cpp wrote for a Mamba model."""
import inspect
import json
import struct
import warnings

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import kvcache
from kvcache import RecurrentCache, StateError, UBatch

from interop_data import interop_dir


@pytest.mark.parametrize("semantics, cls", [("2025", kvcache.RecurrentCache2025),
                                             ("2026", kvcache.RecurrentCache2026)])
def test_a_class_per_semantics(semantics, cls):
    """RecurrentCache(semantics=...) makes the class of that semantics (RecurrentCache2025 by
    default); each class can be made directly, with its own semantics or none, and is a
    RecurrentCache."""
    made = [RecurrentCache(2, 1, 4, 4, semantics=semantics), cls(2, 1, 4, 4), cls(2, 1, 4, 4, semantics=semantics),
            RecurrentCache(2, 1, 4, 4, "f32", "f32", None, 0, 0, "owned", semantics)]
    for c in made:
        assert type(c) is cls and isinstance(c, RecurrentCache) and c.semantics == semantics
    assert type(RecurrentCache(2, 1, 4, 4)) is kvcache.RecurrentCache2025
    other = "2026" if semantics == "2025" else "2025"
    with pytest.raises(ValueError, match=f"semantics = '{other}': a {cls.__name__} is a cache of semantics"):
        cls(2, 1, 4, 4, semantics=other)
    with pytest.raises(TypeError, match="semantics must be a str"):
        cls(2, 1, 4, 4, semantics=2025)
    with pytest.raises(TypeError, match=rf"^{cls.__name__}\(\) missing"):
        cls(2)
    assert inspect.signature(RecurrentCache).parameters["semantics"].default == "2025"
    assert inspect.signature(cls).parameters["semantics"].default is None


def test_the_factory_refuses_what_is_no_semantics():
    with pytest.raises(ValueError, match="semantics = '2027': expected one of 2025, 2026"):
        RecurrentCache(2, 1, 4, 4, semantics="2027")
    with pytest.raises(TypeError, match="semantics must be a str"):
        RecurrentCache(2, 1, 4, 4, semantics=2026)
    with pytest.raises(TypeError, match=r"^RecurrentCache\(\) missing"):
        RecurrentCache(2)

    class Mine(RecurrentCache):
        __slots__ = ()
    with pytest.raises(TypeError, match="RecurrentCache2025 or a RecurrentCache2026"):
        Mine(2, 1, 4, 4)

    class Mine2026(kvcache.RecurrentCache2026):
        __slots__ = ()
    assert isinstance(Mine2026(2, 1, 4, 4), kvcache.RecurrentCache2026)


def test_each_class_has_only_its_semantics_members():
    """What only one semantics has is absent from the other's class (AttributeError), not a
    method that refuses."""
    only_2025 = {"s_mask"}
    only_2026 = {"rs_z", "pending_rollback", "rollback_ok", "enable_prefix_reuse", "disable_prefix_reuse",
                 "prefix_reuse", "prefix_stats", "prefix_checkpoints", "checkpoint", "prefix_match", "prefix_attach",
                 "prefix_release", "prefix_pin", "prefix_unpin", "prefix_evict"}
    for name in only_2025:
        assert hasattr(kvcache.RecurrentCache2025, name) and not hasattr(kvcache.RecurrentCache2026, name), name
        assert not hasattr(RecurrentCache, name), name
    for name in only_2026:
        assert hasattr(kvcache.RecurrentCache2026, name) and not hasattr(kvcache.RecurrentCache2025, name), name
        assert not hasattr(RecurrentCache, name), name
    for name in ("find_slot", "s_copy", "seq_rm", "store", "state_write", "state_read", "n_rs_seq"):
        assert hasattr(RecurrentCache, name), name


def snapshot(c):
    """Everything observable about a cache, for 'nothing changed' assertions."""
    cells = c.cells()
    return (
        c.head, c.n, c.used,
        cells["pos"].tolist(), cells["src"].tolist(), cells["tail"].tolist(), cells["seq_id"],
        [c.k(il).tobytes() for il in range(c.n_layer)],
        [c.v(il).tobytes() for il in range(c.n_layer)],
    )


def place(c, pos, seq_id, n_seq_tokens=1, fill=True):
    """find_slot + commit, then write recognisable K/V rows for the placed groups."""
    ub = UBatch(pos, seq_id, n_seq_tokens=n_seq_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert c.find_slot(ub)
    c.commit()
    if fill:
        rows = ub.n_seqs
        for il in range(c.n_layer):
            base = 1000 * il + 10 * c.head
            k = base + np.arange(rows * c.n_embd_k[il]).reshape(rows, -1) % 97
            v = -(base + np.arange(rows * c.n_embd_v[il]).reshape(rows, -1) % 89)
            c.store(il, k, v)
    return ub


def busy_cache(**kw):
    """A cache with three sequences, one state shared by two of them, data in every used row."""
    args = dict(n_seq_max=4, n_layer=2, n_embd_k_gqa=[3, 4], n_embd_v_gqa=[5, 2], type_k="f16",
                type_v="f32", n_embd_k_s=2, n_embd_v_s=[1, 3])
    args.update(kw)
    c = RecurrentCache(**args)
    place(c, [0, 1, 0, 1, 0, 1], [[0], [1], [2]], n_seq_tokens=2)
    c.seq_cp(1, 3)
    place(c, [2, 3], [[0]], n_seq_tokens=2)
    return c


# --- construction --------------------------------------------------------------------------

def test_defaults_and_geometry():
    c = RecurrentCache(n_seq_max=3, n_layer=2, n_embd_k_gqa=[4, 6], n_embd_v_gqa=8, n_embd_k_s=2,
                       n_embd_v_s=[0, 4])
    assert c.size == 3 and c.n_seq_max == 3 and c.n_layer == 2
    assert (c.head, c.n, c.used) == (0, 0, 0)
    assert c.n_embd_k == [6, 8] and c.n_embd_v == [8, 12]
    assert c.k(1).shape == (3, 8) and c.k(1).dtype == np.float32
    assert c.v(1).shape == (3, 12)
    assert not c.can_shift
    assert c.size_k_bytes == 3 * 4 * (6 + 8) and c.size_v_bytes == 3 * 4 * (8 + 12)
    assert c.total_size == c.size_k_bytes + c.size_v_bytes
    assert all(not c.k(il).any() and not c.v(il).any() for il in range(2))
    assert c.cells()["tail"].tolist() == [-1, -1, -1]
    assert kvcache.RecurrentCache is RecurrentCache
    assert "RecurrentCache(size=3" in repr(c)


def test_size_at_least_one_and_types():
    c = RecurrentCache(1, 1, 4, 4)
    assert c.size == 1
    c = RecurrentCache(2, 1, 32, 64, type_k="q8_0", type_v="bf16", kv_size=5)
    assert c.size == 5 and c.type_k == "q8_0" and c.type_v == "bf16"
    assert c.k(0).shape == (5, 34) and c.k(0).dtype == np.uint8
    assert c.v(0).shape == (5, 64) and c.v(0).dtype == kvcache.view_dtype("bf16")
    c = RecurrentCache(2, 1, 4, 4, type_k=1, type_v=0)  # ggml ids
    assert (c.type_k, c.type_v) == ("f16", "f32")
    assert c.k(0).dtype == np.float16


@pytest.mark.parametrize("kw, exc", [
    (dict(n_seq_max=257), ValueError),
    (dict(n_seq_max=0), ValueError),
    (dict(n_seq_max=-1), ValueError),
    (dict(n_seq_max=2.0), TypeError),
    (dict(n_layer=0), ValueError),
    (dict(kv_size=1), ValueError),          # below n_seq_max
    (dict(kv_size="4"), TypeError),
    (dict(type_k="q3_k"), ValueError),
    (dict(type_v=99), ValueError),
    (dict(type_k=1.5), TypeError),
    (dict(n_embd_k_gqa=[4]), ValueError),    # one width for two layers
    (dict(n_embd_v_gqa=-1), ValueError),
    (dict(n_embd_v_s=["x", 1]), TypeError),
    (dict(type_k="q8_0"), ValueError),       # 4 + 0 is not a multiple of 32
    (dict(buffers="external"), ValueError),
])
def test_bad_constructor_arguments(kw, exc):
    args = dict(n_seq_max=2, n_layer=2, n_embd_k_gqa=4, n_embd_v_gqa=4)
    args.update(kw)
    with pytest.raises(exc):
        RecurrentCache(**args)


# --- placement -----------------------------------------------------------------------------

def test_byte_counts_that_do_not_fit_are_refused():
    # 2**20 cells x 2**16 layers x two 8 GB rows
    with pytest.raises(ValueError, match="more bytes of K/V memory or state than a size_t can count"):
        RecurrentCache(1, 2**16, 2**31 - 1, 2**31 - 1, kv_size=2**20, buffers=None)
    c = RecurrentCache(1, 2**16, 2**31 - 1, 1, kv_size=2**10, buffers=None)
    assert c.state_size(layout="2025") == 4 + 8 + 2**16 * 24


def test_a_sequence_in_two_groups_is_refused():
    c = RecurrentCache(4, 1, 2, 2)
    before = c.cells()
    with pytest.raises(ValueError, match="sequence 1 is in two token groups"):
        c.find_slot(UBatch([0, 0], [[1], [2, 1]]))
    assert c.cells()["seq_id"] == before["seq_id"] and c.used == 0


def test_find_slot_places_groups_in_order():
    c = RecurrentCache(4, 1, 2, 2)
    ub = UBatch([0, 1, 0, 1], [[2], [0, 3]], n_seq_tokens=2)
    assert c.find_slot(ub)
    assert (c.head, c.n, c.used) == (0, 2, 2)
    cells = c.cells()
    assert cells["seq_id"][:2] == [[2], [0, 3]]
    assert cells["pos"].tolist()[:2] == [1, 1]
    assert cells["tail"].tolist() == [1, -1, 0, 1]
    assert c.s_mask().tolist() == [0.0, 0.0]   # fresh states start from zero...
    assert c.s_mask().tolist() == [1.0, 1.0]   # ...once
    assert c.s_copy().tolist() == [0, 1]
    assert c.cell_max() == 2
    assert c.seq_pos_min(3) == 1 and c.seq_pos_max(1) == -1


def test_copy_on_share_and_s_copy():
    c = RecurrentCache(3, 1, 2, 2)
    place(c, [5], [[0]])
    c.s_copy(), c.s_mask()
    c.seq_cp(0, 1)
    assert c.cells()["seq_id"][0] == [0, 1]
    assert c.used == 1
    place(c, [6], [[1]], fill=False)
    # seq 1 got its own cell, a copy of the shared state (pos and source)
    cells = c.cells()
    assert cells["seq_id"][:2] == [[0], [1]]
    assert cells["pos"].tolist()[:2] == [5, 6]
    assert c.head == 1 and c.n == 1 and c.used == 2
    assert c.s_copy().tolist() == [0]     # copy the state of cell 0 in...
    assert c.s_copy().tolist() == [1]     # ...once


def test_non_consecutive_position_warns():
    c = RecurrentCache(2, 1, 2, 2)
    c.find_slot(UBatch([0, 1], [[0]], n_seq_tokens=2))
    with pytest.warns(RuntimeWarning, match="non-consecutive token position 7 after 1 for sequence 0"):
        assert c.find_slot(UBatch([7], [[0]]))
    assert c.warnings == ["find_slot: non-consecutive token position 7 after 1 for sequence 0 with 1 new tokens"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.find_slot(UBatch([8], [[0]]))
    assert c.warnings == []


def test_invalid_sequence_ids_change_nothing():
    c = busy_cache()
    before = snapshot(c)
    calls = [
        lambda: c.find_slot(UBatch([9], [[4]])),
        lambda: c.find_slot(UBatch([9, 9], [[0], [1, 63]])),
        lambda: c.find_slot(UBatch([], [])),
        lambda: c.seq_rm(-2),
        lambda: c.seq_rm(4, 0, -1),
        lambda: c.seq_cp(-1, 0),
        lambda: c.seq_cp(0, 4),
        lambda: c.seq_keep(-1),
        lambda: c.seq_add(64, 0, -1, 1),
        lambda: c.seq_div(-1, 0, -1, 2),
        lambda: c.seq_div(0, 0, -1, 0),
        lambda: c.seq_pos_min(4),
        lambda: c.seq_pos_max(-1),
        lambda: c.state_write(4, layout="2025"),
        lambda: c.state_size(-2, layout="2025"),
        lambda: c.state_read(c.state_write(0, layout="2025"), 7, layout="2025"),
    ]
    for call in calls:
        with pytest.raises(ValueError):
            call()
        assert snapshot(c) == before
    for call in [lambda: c.seq_rm("0"), lambda: c.seq_add(0, 0.5, 1, 1), lambda: c.seq_keep(True),
                 lambda: c.find_slot([0]), lambda: c.k(0.0), lambda: c.state_read(12, layout="2025")]:
        with pytest.raises(TypeError):
            call()
        assert snapshot(c) == before
    with pytest.raises(IndexError):
        c.v(2)


def test_seq_rm_semantics():
    c = busy_cache()
    before = snapshot(c)
    assert c.seq_rm(0, 2, -1) is False       # would cut the state of seq 0 (pos 3)
    assert c.seq_rm(-1, 0, 5) is False       # every sequence: only nothing or everything
    assert c.seq_rm(-1, 3, 3) is True        # empty range
    assert snapshot(c) == before
    assert c.seq_rm(2) is True
    assert c.seq_pos_max(2) == -1
    assert c.used == 2


def test_seq_rm_all_then_find_slot_needs_clear():
    c = busy_cache()
    assert c.seq_rm(-1, 0, -1) is True
    assert c.used == 0 and all(not ids for ids in c.cells()["seq_id"])
    assert c.cells()["tail"].tolist() != [-1] * 4    # the records are left as the reference leaves them
    before = snapshot(c)
    with pytest.raises(RuntimeError, match="clear"):
        c.find_slot(UBatch([0], [[0]]))
    assert snapshot(c) == before
    c.clear()
    assert c.find_slot(UBatch([0], [[0]]))
    assert not any(c.k(il).any() for il in range(c.n_layer))


def test_add_div_keep_and_full():
    c = busy_cache()
    c.seq_add(0, 0, -1, 10)
    assert c.seq_pos_max(0) == 13
    c.seq_div(0, 0, -1, 2)
    assert c.seq_pos_max(0) == 6
    c.seq_add(0, 0, 5, 10)      # outside the range: unchanged
    assert c.seq_pos_max(0) == 6
    c.seq_keep(1)
    assert [ids for ids in c.cells()["seq_id"] if ids] == [[1]]
    c.set_full()
    assert (c.head, c.n) == (0, c.size)
    c.restore()
    c.defrag_sched(0.1)
    assert c.update() is False


@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_seq_add_past_the_largest_position_saturates(semantics):
    # as an attention cell's position: the state stays at the largest position, never wraps to
    # a negative one (which no state read would take back)
    c = RecurrentCache(2, 1, 4, 4, semantics=semantics)
    assert c.find_slot(UBatch(list(range(10)), [0], n_seq_tokens=10))
    c.seq_add(0, 0, -1, 2**31 - 1)
    assert (c.seq_pos_min(0), c.seq_pos_max(0), c.used) == (2**31 - 1, 2**31 - 1, 1)
    blob = c.state_write(0)
    d = RecurrentCache(2, 1, 4, 4, semantics=semantics)
    assert d.state_read(blob, 1) == len(blob)
    assert d.seq_pos_max(1) == 2**31 - 1


def test_store_checks_rows():
    c = RecurrentCache(2, 1, 3, 2)
    c.find_slot(UBatch([0, 0], [[0], [1]]))
    c.store(0, np.ones((2, 3)), np.full((2, 2), 2.0))
    assert c.k(0).tolist() == [[1, 1, 1], [1, 1, 1]] and c.v(0)[1].tolist() == [2, 2]
    with pytest.raises(ValueError):
        c.store(0, np.ones((2, 4)))
    with pytest.raises(ValueError):
        c.store(0, np.ones((3, 3)))           # past the last cell
    with pytest.raises(ValueError):
        c.store(0, np.ones((2, 3)), np.ones((1, 2)))


# --- state codec ---------------------------------------------------------------------------

def test_state_round_trip_whole_cache():
    c = busy_cache()
    blob = c.state_write(layout="2025")
    assert len(blob) == c.state_size(layout="2025")
    d = busy_cache()
    d.clear()
    assert d.state_read(blob, layout="2025") == len(blob)
    assert d.state_write(layout="2025") == blob
    cs, ds = c.cells(), d.cells()
    listed = [i for i in range(c.size) if cs["seq_id"][i]]
    assert [ds["seq_id"][k] for k in range(len(listed))] == [cs["seq_id"][i] for i in listed]
    assert ds["src"].tolist()[:len(listed)] == list(range(len(listed)))
    assert d.used == len(listed) and d.head == 0
    for s in range(4):
        assert d.state_write(s, layout="2025") == c.state_write(s, layout="2025")
        assert d.seq_pos_max(s) == c.seq_pos_max(s)


def test_state_round_trip_one_sequence_into_another():
    c = busy_cache()
    blob = c.state_write(0, layout="2025")
    assert struct.unpack_from("<IiI", blob) == (1, 3, 0)   # one cell, pos 3, no ids
    d = RecurrentCache(4, 2, [3, 4], [5, 2], type_k="f16", type_v="f32", n_embd_k_s=2, n_embd_v_s=[1, 3])
    assert d.state_read(blob + b"\x01" * 16, 2, layout="2025") == len(blob)
    assert d.seq_pos_max(2) == 3 and d.seq_pos_max(0) == -1
    assert d.state_write(2, layout="2025") == blob
    assert d.s_copy().tolist() == [d.head]                  # the restored state is kept
    # an empty sequence's blob removes the destination sequence
    empty = RecurrentCache(4, 2, [3, 4], [5, 2], type_k="f16", type_v="f32", n_embd_k_s=2,
                           n_embd_v_s=[1, 3]).state_write(1, layout="2025")
    assert len(empty) == 4 + 8 + 2 * 2 * 12
    assert d.state_read(empty, 2, layout="2025") == len(empty)
    assert d.seq_pos_max(2) == -1 and d.used == 0


def blobs_for_truncation():
    c = busy_cache()
    return {"whole": c.state_write(layout="2025"), "seq0": c.state_write(0, layout="2025"), "shared": c.state_write(3, layout="2025"),
            "empty": RecurrentCache(4, 2, [3, 4], [5, 2], type_k="f16", type_v="f32", n_embd_k_s=2,
                                    n_embd_v_s=[1, 3]).state_write(0, layout="2025")}


@pytest.mark.parametrize("name", ["whole", "seq0", "shared", "empty"])
def test_every_truncation_fails_and_changes_nothing(name):
    blob = blobs_for_truncation()[name]
    seq_id = -1 if name == "whole" else 1
    c = busy_cache()
    before = snapshot(c)
    for cut in range(len(blob)):
        with pytest.raises(StateError):
            c.state_read(blob[:cut], seq_id, layout="2025")
        assert snapshot(c) == before, f"cut at {cut}"
    assert c.state_read(blob, seq_id, layout="2025") == len(blob)


def _patch(blob, off, fmt, value):
    b = bytearray(blob)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


def test_rejected_blobs_change_nothing():
    src = busy_cache()
    whole = src.state_write(layout="2025")
    one = src.state_write(0, layout="2025")
    n_cells = struct.unpack_from("<I", whole)[0]
    # offset of the data section of `one`: count + (pos, n_seq_id)
    one_data = 4 + 8
    # whole-cache layout: count, then per cell pos, n, ids
    offs, o = [], 4
    for _ in range(n_cells):
        offs.append(o)
        n = struct.unpack_from("<I", whole, o + 4)[0]
        o += 8 + 4 * n
    whole_data = o

    two_cells = bytearray(struct.pack("<I", 2) + one[4:12] + one[4:12] + one[12:])
    bad = {
        "seq id >= n_seq_max": (_patch(whole, offs[0] + 8, "<i", 4), -1),
        "negative seq id": (_patch(whole, offs[0] + 8, "<i", -3), -1),
        "negative pos (whole)": (_patch(whole, offs[0], "<i", -1), -1),
        "negative pos (one)": (_patch(one, 4, "<i", -5), 1),
        "duplicate seq": (_patch(whole, offs[1] + 8, "<i", struct.unpack_from("<i", whole, offs[0] + 8)[0]), -1),
        "too many cells": (_patch(whole, 0, "<I", 5), -1),
        "two cells for one sequence": (bytes(two_cells), 1),
        "ids in a single-sequence cell": (_patch(one, 8, "<I", 1), 1),
        "v_trans": (_patch(one, one_data, "<I", 1), 1),
        "layer count": (_patch(whole, whole_data + 4, "<I", 3), -1),
        "K type": (_patch(one, one_data + 8, "<i", 0), 1),
        "K row size": (_patch(one, one_data + 12, "<Q", 11), 1),
    }
    c = busy_cache()
    before = snapshot(c)
    for what, (blob, seq_id) in bad.items():
        with pytest.raises(StateError):
            c.state_read(blob, seq_id, layout="2025")
        assert snapshot(c) == before, what
    with pytest.raises(StateError, match="one cell"):
        c.state_read(bytes(two_cells), 1, layout="2025")


def test_state_read_accepts_buffers():
    c = busy_cache()
    blob = c.state_write(layout="2025")
    d = busy_cache()
    d.clear()
    assert d.state_read(bytearray(blob), layout="2025") == len(blob)
    assert d.state_read(np.frombuffer(blob, dtype=np.uint8), layout="2025") == len(blob)
    assert d.state_read(memoryview(blob), layout="2025") == len(blob)
    assert d.state_write(layout="2025") == blob


# --- random workloads ----------------------------------------------------------------------

op_strategy = st.one_of(
    st.tuples(st.just("place"), st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
              st.integers(1, 3), st.integers(0, 50)),
    st.tuples(st.just("share"), st.lists(st.integers(0, 3), min_size=2, max_size=3, unique=True),
              st.integers(1, 2), st.integers(0, 50)),
    st.tuples(st.just("cp"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("rm"), st.integers(0, 3), st.integers(-1, 40), st.integers(-1, 40)),
    st.tuples(st.just("keep"), st.integers(0, 3)),
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(-1, 40), st.integers(-1, 40), st.integers(-5, 5)),
)


def stale_records(c, groups):
    """The groups' first sequences whose record points at a cell that does not hold them."""
    cells = c.cells()
    tail, seqs = cells["tail"].tolist(), cells["seq_id"]
    return [ids[0] for ids in groups if tail[ids[0]] >= 0 and ids[0] not in seqs[tail[ids[0]]]]


@settings(max_examples=60, deadline=None)
@given(st.lists(op_strategy, max_size=25), st.integers(4, 6))
# seq 2 finishes, seq 0 continues and seq 1 starts in one ubatch: the reference's gathering
# loses seq 3's state and keeps its record (test_stateful_recurrent.py traces it)
@example([("place", [2, 3, 0], 1, 0), ("rm", 2, -1, -1), ("place", [0, 1], 1, 1), ("place", [3], 1, 1)], 4)
def test_random_workload_invariants(ops, kv_size):
    c = RecurrentCache(4, 2, [2, 3], [4, 1], type_k="f16", kv_size=kv_size)
    for op in ops:
        if op[0] in ("place", "share"):
            if op[0] == "place":
                groups = [[s] for s in op[1]]
            else:
                groups = [op[1]]
            k = op[2]
            pos = [op[3] + t for _ in groups for t in range(k)]
            if stale_records(c, groups):
                # where the reference stops on an assertion: refused, nothing changes
                before = snapshot(c)
                with pytest.raises(RuntimeError, match="which does not hold it"):
                    c.find_slot(UBatch(pos, groups, n_seq_tokens=k))
                assert snapshot(c) == before
                continue
            ub = place(c, pos, groups, n_seq_tokens=k)
            cells = c.cells()
            for g, ids in enumerate(ub.seq_id):
                assert cells["seq_id"][c.head + g] == sorted(ids)
                assert cells["pos"][c.head + g] == pos[k * g + k - 1]
        elif op[0] == "cp":
            c.seq_cp(op[1], op[2])
        elif op[0] == "rm":
            c.seq_rm(op[1], op[2], op[3])
        elif op[0] == "keep":
            c.seq_keep(op[1])
        else:
            c.seq_add(op[1], op[2], op[3], op[4])
        cells = c.cells()
        # every sequence lives in at most one cell, and its record points there
        for s in range(4):
            holders = [i for i in range(c.size) if s in cells["seq_id"][i]]
            assert len(holders) <= 1
            if holders:
                assert cells["tail"][s] == holders[0]
    # the codec reproduces the cache: whole and per sequence. A negative seq_add can leave a
    # cell holding sequences at a negative position; such blobs are rejected by contract.
    blob = c.state_write(layout="2025")
    d = RecurrentCache(4, 2, [2, 3], [4, 1], type_k="f16", kv_size=kv_size)
    final = c.cells()
    negative = any(p < 0 and ids for p, ids in zip(final["pos"], final["seq_id"]))
    if negative:
        before = d.state_write(layout="2025")
        with pytest.raises(StateError, match="negative position"):
            d.state_read(blob, layout="2025")
        assert d.state_write(layout="2025") == before
        return
    assert d.state_read(blob, layout="2025") == len(blob)
    assert d.state_write(layout="2025") == blob
    for s in range(4):
        one = c.state_write(s, layout="2025")
        e = RecurrentCache(4, 2, [2, 3], [4, 1], type_k="f16", kv_size=kv_size)
        assert e.state_read(one, s, layout="2025") == len(one)
        assert e.state_write(s, layout="2025") == one
        assert (e.seq_pos_min(s), e.seq_pos_max(s)) == (c.seq_pos_min(s), c.seq_pos_max(s))


# --- blobs written by llama.cpp ------------------------------------------------------------

MAMBA = interop_dir() / "mamba"


def manifest(name):
    return json.loads((MAMBA / (name + ".json")).read_text())


def cache_for(man):
    geo = man["geometry"][0]
    layers = geo["layers"]
    return RecurrentCache(
        n_seq_max=man["context"]["n_seq_max"], n_layer=len(layers),
        n_embd_k_gqa=[L["n_embd_r"] for L in layers], n_embd_v_gqa=[L["n_embd_s"] for L in layers],
        type_k=layers[0]["r_type"], type_v=layers[0]["s_type"], kv_size=geo["mem_size"])


def strip_context(data, off):
    """Skip llama.cpp's whole-context header (arch, outputs, logits, embeddings)."""
    (n,) = struct.unpack_from("<I", data, off)
    off += 4 + n
    (n_out,) = struct.unpack_from("<I", data, off)
    off += 4 + 4 * n_out
    (n_logits,) = struct.unpack_from("<Q", data, off)
    off += 8 + 4 * n_logits
    (n_embd,) = struct.unpack_from("<Q", data, off)
    return off + 8 + 4 * n_embd


def strip_file_header(data, magic):
    m, _version, n_tok = struct.unpack_from("<III", data, 0)
    assert m == magic
    return 12 + 4 * n_tok


def cache_part(name):
    data = (MAMBA / name).read_bytes()
    if name.endswith(".ggsq"):
        return data[strip_file_header(data, 0x67677371):]
    if name.endswith(".ggsn"):
        return data[strip_context(data, strip_file_header(data, 0x6767736E)):]
    if name == "state.bin":
        return data[strip_context(data, 0):]
    return data


def check_expected_cells(c, man, seq_id):
    sec = man["expected"]["sections"][0]
    cells = c.cells()
    got = [(int(cells["pos"][i]), cells["seq_id"][i]) for i in range(c.size) if cells["seq_id"][i]]
    want = [(e["pos"], e["seq_ids"] if seq_id == -1 else [seq_id]) for e in sec["cells"]]
    assert len(got) == sec["cell_count"]
    assert sorted(got) == sorted(want)


@pytest.mark.parametrize("name", ["seq0.bin", "seq1.bin", "seq2.bin", "seq3.bin", "seq0.ggsq"])
def test_interop_sequence_blobs(name):
    man = manifest(name)
    blob = cache_part(name)
    seq_id = man["seq_id"]
    c = cache_for(man)
    assert c.state_read(blob, seq_id, layout="2025") == len(blob)
    check_expected_cells(c, man, seq_id)
    assert c.state_write(seq_id, layout="2025") == blob
    # the state carries no sequence id: it restores under any id and writes back the same
    other = (seq_id + 1) % c.n_seq_max
    d = cache_for(man)
    assert d.state_read(blob, other, layout="2025") == len(blob)
    assert d.state_write(other, layout="2025") == blob


@pytest.mark.parametrize("name", ["state.bin", "session.ggsn"])
def test_interop_whole_state(name):
    man = manifest(name)
    blob = cache_part(name)
    c = cache_for(man)
    assert c.state_read(blob, layout="2025") == len(blob)
    check_expected_cells(c, man, -1)
    assert c.state_write(layout="2025") == blob
    for s, (lo, hi) in man["seq_pos_min_max"].items():
        assert (c.seq_pos_min(int(s)), c.seq_pos_max(int(s))) == (lo, hi)
    # the per-sequence blobs dumped at the same moment hold the same states
    for s in range(c.n_seq_max):
        path = MAMBA / f"seq{s}.bin"
        if path.exists():
            assert c.state_write(s, layout="2025") == path.read_bytes()


def test_interop_truncated_blob_changes_nothing():
    man = manifest("seq1.bin")
    blob = cache_part("seq1.bin")
    c = cache_for(man)
    c.state_read(cache_part("state.bin"), layout="2025")
    before = snapshot(c)
    for cut in (0, 3, 11, 12, 20, 24, 1000, len(blob) - 1):
        with pytest.raises(StateError):
            c.state_read(blob[:cut], 3, layout="2025")
        assert snapshot(c) == before
