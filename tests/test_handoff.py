"""Export and import of one sequence (UnifiedCache.seq_export / seq_import_begin): moving the
regions with plain memcpy must give exactly what state_write + state_read give (cells and every
K/V byte), and every bad header, a full cache, abort, an exception or garbage collection before
commit must leave the receiving cache exactly as it was."""
import gc
import struct

import numpy as np
import pytest

import kvcache
from kvcache.handoff import copy_regions, pair_regions
from cache_state import assert_unchanged, busy_unified, check_unified_invariants, snapshot

GEOMETRIES = [
    dict(type_k="f16", type_v="f16", v_trans=True),
    dict(type_k="f16", type_v="f16", v_trans=False),
    dict(type_k="f32", type_v="f32", v_trans=True),
    dict(type_k="f32", type_v="f32", v_trans=False),
    dict(type_k="q8_0", type_v="q8_0", v_trans=False),
    dict(type_k="q8_0", type_v="f16", v_trans=True),
]
WIDTHS = (32, 64)


def _pair(kw, buffers="owned"):
    src = busy_unified(seed=0, widths=WIDTHS, buffers=buffers, **kw)
    dst = busy_unified(seed=1, widths=WIDTHS, buffers=buffers, **kw)
    ref = busy_unified(seed=1, widths=WIDTHS, buffers=buffers, **kw)
    return src, dst, ref


def _assert_same(a, b):
    assert snapshot(a) == snapshot(b)
    assert a.state_write(-1) == b.state_write(-1)


@pytest.mark.parametrize("kw", GEOMETRIES, ids=lambda kw: f"{kw['type_k']}-{kw['type_v']}-vt{int(kw['v_trans'])}")
@pytest.mark.parametrize("seq_id", [0, 1, 2, 3])
def test_memcpy_of_the_regions_equals_state_read(kw, seq_id):
    src, dst, ref = _pair(kw)
    exp = src.seq_export(seq_id)
    imp = dst.seq_import_begin(exp.header)
    assert imp.seq_id == seq_id and imp.n_bytes == exp.n_bytes and imp.n_cells == exp.n_cells
    assert copy_regions(exp.regions, imp.regions) == exp.n_bytes
    imp.commit()
    assert not imp.active
    ref.state_read(src.state_write(seq_id, layout="2025"), seq_id, layout="2025")
    _assert_same(dst, ref)
    check_unified_invariants(dst)


@pytest.mark.parametrize("kw", GEOMETRIES[:2], ids=["vt1", "vt0"])
def test_gather_scatter_and_another_destination_id(kw):
    src, dst, ref = _pair(kw)
    exp = src.seq_export(1)
    data = exp.gather()
    data.flags.writeable = False            # what ray.get returns: a read-only view
    with dst.seq_import_begin(exp.header, seq_id=3) as imp:
        imp.scatter(data)
        imp.commit()
    ref.state_read(src.state_write(1), 3)
    _assert_same(dst, ref)


def test_several_sequences_one_after_the_other():
    src, dst, ref = _pair(GEOMETRIES[0])
    for s in (2, 0, 1):
        exp = src.seq_export(s)
        imp = dst.seq_import_begin(exp.header)
        copy_regions(exp.regions, imp.regions)
        imp.commit()
        ref.state_read(src.state_write(s), s)
        _assert_same(dst, ref)


def test_an_absent_sequence_removes_the_destination_like_state_read():
    src, dst, ref = _pair(GEOMETRIES[0])
    src.seq_rm(2)
    exp = src.seq_export(2)
    assert exp.n_cells == 0 and len(exp.regions) == 0 and exp.n_bytes == 0
    imp = dst.seq_import_begin(exp.header)
    imp.commit()
    ref.state_read(src.state_write(2, layout="2025"), 2, layout="2025")   # the seed's reading (C1b)
    _assert_same(dst, ref)


def test_a_pending_defrag_is_settled_by_the_export():
    src, dst, ref = _pair(GEOMETRIES[0])
    src.commit()
    src.defrag_sched(0.0)
    if src.defrag_prepare(1024):
        src.defrag_move()
    exp = src.seq_export(0)
    imp = dst.seq_import_begin(exp.header)
    copy_regions(exp.regions, imp.regions)
    imp.commit()
    ref.state_read(src.state_write(0), 0)
    _assert_same(dst, ref)


def test_metadata_only_caches_get_the_cells_on_both_sides():
    src, dst, ref = _pair(GEOMETRIES[0], buffers="none")
    exp = src.seq_export(0)
    assert len(exp.regions) == 0 and exp.n_bytes == 0
    np.testing.assert_array_equal(exp.cells, np.flatnonzero(src.cells().holds(0)))
    imp = dst.seq_import_begin(exp.header)
    assert len(imp.regions) == 0 and len(imp.cells) == len(exp.cells)
    cells = imp.cells.copy()
    imp.commit()
    ref.state_read(src.state_write(0), 0)
    _assert_same(dst, ref)
    np.testing.assert_array_equal(cells, np.flatnonzero(dst.cells().holds(0)))


def test_abort_exception_and_garbage_collection_put_every_byte_back():
    src, dst, _ = _pair(GEOMETRIES[0])
    before = snapshot(dst)
    imp = dst.seq_import_begin(src.seq_export(0).header)
    copy_regions(src.seq_export(0).regions, imp.regions)
    imp.abort()
    assert not imp.active
    assert_unchanged(dst, before, "abort")
    imp.abort()                              # a second abort does nothing
    with pytest.raises(RuntimeError, match="no longer active"):
        imp.commit()

    with pytest.raises(KeyError):
        with dst.seq_import_begin(src.seq_export(1).header) as imp:
            imp.scatter(src.seq_export(1).gather())
            raise KeyError("transfer failed")
    assert_unchanged(dst, before, "exception")

    imp = dst.seq_import_begin(src.seq_export(1).header)
    imp.scatter(np.full(imp.n_bytes, 0xAB, dtype=np.uint8))
    del imp
    gc.collect()
    assert_unchanged(dst, before, "garbage collection")
    dst.seq_rm(0)                            # changes are accepted again


def test_changes_are_refused_while_an_import_is_pending():
    src, dst, _ = _pair(GEOMETRIES[0])
    imp = dst.seq_import_begin(src.seq_export(0).header)
    before = snapshot(dst)
    for name, call in [("seq_rm", lambda: dst.seq_rm(1)), ("clear", dst.clear),
                       ("find_slot", lambda: dst.find_slot(kvcache.UBatch(pos=[50], seq_id=[1]))),
                       ("update", dst.update), ("seq_import_begin", lambda: dst.seq_import_begin(src.seq_export(1).header))]:
        with pytest.raises(RuntimeError, match="import"):
            call()
    assert_unchanged(dst, before, "refused")
    dst.state_write(1)                       # reads are allowed
    imp.abort()
    dst.seq_rm(1)


def _bad(header, at, fmt, value):
    h = bytearray(header)
    struct.pack_into(fmt, h, at, value)
    return bytes(h)


def _resum(h):
    """The header with its checksum recomputed (a consistent header that lies)."""
    body = bytes(h[:-8])
    x = 0xcbf29ce484222325
    for b in body:
        x = ((x ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return body + struct.pack("<Q", x)


def test_bad_headers_raise_state_error_and_change_nothing():
    src, dst, _ = _pair(GEOMETRIES[0])
    header = src.seq_export(0).header
    before = snapshot(dst)
    cases = {
        "truncated": (header[:-1], "truncated"),
        "empty": (b"", "truncated"),
        "trailing": (header + b"\0", "trailing"),
        "magic": (_bad(header, 0, "<I", 0x12345678), "not a hand-off header"),
        "version": (_bad(header, 4, "<I", 9), "version"),
        "corrupted": (_bad(header, len(header) - 9, "<B", header[-9] ^ 1), "corrupted"),
        "type": (_resum(_bad(header, 16, "<i", 0)), "types"),
        "v_trans": (_resum(_bad(header, 12, "<I", 2)), "transposed"),
        "layers": (_resum(_bad(header, 24, "<I", 3)), "layers"),
        "width": (_resum(_bad(header, 40 + 4, "<I", 31)), "layer 0 differs"),
        "position": (_resum(_bad(header, len(header) - 8 - 12, "<i", -5)), "position"),
        "n_seq_id": (_resum(_bad(header, len(header) - 8 - 8, "<I", 2)), "sequence ids"),
        "cell count": (_resum(_bad(header, len(header) - 8 - 12 * src.seq_export(0).n_cells - 4, "<I", 1)),
                       "do not fill"),
    }
    for name, (h, msg) in cases.items():
        with pytest.raises(kvcache.StateError, match=msg):
            dst.seq_import_begin(h)
        assert_unchanged(dst, before, name)
    foreign = kvcache.UnifiedCache(64, 2, [32, 48], [64, 128], n_seq_max=4)
    with pytest.raises(kvcache.StateError, match="layer 1 differs"):
        foreign.seq_import_begin(header)
    with pytest.raises(ValueError, match="seq_id"):
        dst.seq_import_begin(header, seq_id=4)
    with pytest.raises(TypeError):
        dst.seq_import_begin(12)
    small = kvcache.UnifiedCache(64, 2, list(WIDTHS), [2 * w for w in WIDTHS], n_seq_max=2)
    with pytest.raises(kvcache.StateError, match="sequence 3 is outside"):
        small.seq_import_begin(src.seq_export(3).header)
    assert_unchanged(dst, before, "arguments")


def test_a_full_cache_says_how_many_cells_are_missing():
    src = busy_unified(seed=0, widths=WIDTHS)
    exp = src.seq_export(0)
    assert exp.n_cells == 7
    dst = kvcache.UnifiedCache(32, 2, list(WIDTHS), [2 * w for w in WIDTHS], n_seq_max=4)
    assert dst.find_slot(kvcache.UBatch(pos=list(range(29)), seq_id=[1] * 29))
    dst.commit()
    before = snapshot(dst)
    with pytest.raises(kvcache.StateError, match="no room: 4 cells missing"):
        dst.seq_import_begin(exp.header)
    assert_unchanged(dst, before, "no room")
    with pytest.raises(kvcache.StateError, match="no room"):
        dst.state_read(src.state_write(0), 0)   # the state read agrees


def test_pair_regions_splits_both_sides_at_the_same_places():
    a = np.array([[100, 4], [200, 6]], dtype=np.uint64)
    b = np.array([[1000, 3], [2000, 0], [3000, 7]], dtype=np.uint64)
    pa, pb = pair_regions(a, b)
    assert pa.tolist() == [[100, 3], [103, 1], [200, 6]]
    assert pb.tolist() == [[1000, 3], [3000, 1], [3001, 6]]
    with pytest.raises(ValueError, match="not the same sequence"):
        pair_regions(a, b[:1])
    with pytest.raises(ValueError, match=r"\(N, 2\) uint64"):
        pair_regions(a.astype(np.int64), b)
    e = np.empty((0, 2), dtype=np.uint64)
    assert [x.shape for x in pair_regions(e, e)] == [(0, 2), (0, 2)]


def test_export_and_import_objects():
    src, dst, _ = _pair(GEOMETRIES[0])
    exp = src.seq_export(0)
    assert "SeqExport(seq_id=0" in repr(exp)
    assert not exp.regions.flags.writeable and not exp.cells.flags.writeable
    with pytest.raises(TypeError):
        kvcache.handoff.SeqExport()
    with pytest.raises(TypeError):
        kvcache.handoff.SeqImport()
    with pytest.raises(ValueError, match="bytes"):
        exp.gather(np.empty(3, dtype=np.uint8))
    with pytest.raises(TypeError, match="writable"):
        exp.gather(bytes(exp.n_bytes))
    imp = dst.seq_import_begin(exp.header)
    assert "active" in repr(imp)
    with pytest.raises(ValueError, match="bytes"):
        imp.scatter(b"12")
    imp.abort()
    with pytest.raises(RuntimeError, match="no longer active"):
        imp.scatter(exp.gather())


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("seq_id", [0, 1, 2])
def test_iswa_caches_move_both_parts_like_state_read(v_trans, seq_id):
    from cache_state import busy_iswa

    src, dst, ref = busy_iswa(v_trans, seed=0), busy_iswa(v_trans, seed=1), busy_iswa(v_trans, seed=1)
    exp = src.seq_export(seq_id)
    with dst.seq_import_begin(exp.header) as imp:
        assert imp.n_bytes == exp.n_bytes
        copy_regions(exp.regions, imp.regions)
        imp.commit()
    assert not imp.active
    ref.state_read(src.state_write(seq_id, layout="2025"), seq_id, layout="2025")
    assert snapshot(dst) == snapshot(ref)
    dst2 = busy_iswa(v_trans, seed=1)
    with dst2.seq_import_begin(exp.header, seq_id=seq_id) as imp:
        imp.scatter(exp.gather())
        imp.commit()
    assert snapshot(dst2) == snapshot(ref)


def test_iswa_imports_are_all_or_nothing():
    from cache_state import busy_iswa

    src, dst = busy_iswa(seed=0), busy_iswa(seed=1)
    exp = src.seq_export(0)
    before = snapshot(dst)
    # the SWA part's header corrupted: the base part's import, begun, is aborted
    h = bytearray(exp.header)
    h[-9] ^= 1
    with pytest.raises(kvcache.StateError, match="corrupted"):
        dst.seq_import_begin(bytes(h))
    assert_unchanged(dst, before, "a bad second part")
    for bad, msg in [(exp.header[:-1], "truncated|trailing"), (b"KVCH" + exp.header[4:], "several parts"),
                     (exp.header + b"\0", "trailing")]:
        with pytest.raises(kvcache.StateError, match=msg):
            dst.seq_import_begin(bad)
        assert_unchanged(dst, before, msg)
    with pytest.raises(KeyError):
        with dst.seq_import_begin(exp.header) as imp:
            copy_regions(exp.regions, imp.regions)
            raise KeyError("transfer failed")
    assert_unchanged(dst, before, "exception")
