"""Export and import of one sequence (UnifiedCache.seq_export / seq_import_begin): moving the
regions with plain memcpy must give exactly what state_write + state_read give (cells and every
K/V byte), and every bad header, a full cache, abort, an exception or garbage collection before
commit must leave the receiving cache exactly as it was. Each test runs for the seed's cache
(semantics "2025", compared with the state in layout "2025") and today's (semantics "2026" with
one stream and with a stream per sequence, compared with the state in layout "2026"), and
today's with the per-cell extension (x, y, token id: the header's cells carry it; the busy
caches' ubatches give token ids and 2-D positions); the iSWA pairs' tests run for the same,
each with swa_full and without."""
import gc
import io
import struct

import numpy as np
import pytest

import kvcache
from kvcache.handoff import copy_regions, pair_regions
from cache_state import assert_unchanged, busy_unified, busy_unified_2026, check_unified_invariants, snapshot
from conftest import meddled

GEOMETRIES = [
    dict(type_k="f16", type_v="f16", v_trans=True),
    dict(type_k="f16", type_v="f16", v_trans=False),
    dict(type_k="f32", type_v="f32", v_trans=True),
    dict(type_k="f32", type_v="f32", v_trans=False),
    dict(type_k="q8_0", type_v="q8_0", v_trans=False),
    dict(type_k="q8_0", type_v="f16", v_trans=True),
]
WIDTHS = (32, 64)


# the busy caches of each kind, and the state layout their era's state_read is compared in
KINDS = {
    "2025": (busy_unified, "2025"),
    "2026": (lambda **kw: busy_unified_2026(kv_unified=True, **kw), "2026"),
    "2026-streams": (lambda **kw: busy_unified_2026(kv_unified=False, **kw), "2026"),
    "2026-swa": (lambda **kw: busy_unified_2026(kv_unified=False, n_swa=3, **kw), "2026"),
    "2026-ext": (lambda **kw: busy_unified_2026(kv_unified=True, cell_ext=True, **kw), "2026"),
    "2026-streams-ext": (lambda **kw: busy_unified_2026(kv_unified=False, cell_ext=True, **kw), "2026"),
}
EXT_KINDS = [k for k in KINDS if k.endswith("-ext")]


def _cell_bytes(cache):
    """Bytes of a cell record of a header's cell section: pos, n_seq_id, the extension, the id."""
    return 24 if cache.cell_ext else 12
kinds = pytest.mark.parametrize("kind", list(KINDS))


def _pair(kw, buffers="owned", kind="2025"):
    busy = KINDS[kind][0]
    src = busy(seed=0, widths=WIDTHS, buffers=buffers, **kw)
    dst = busy(seed=1, widths=WIDTHS, buffers=buffers, **kw)
    ref = busy(seed=1, widths=WIDTHS, buffers=buffers, **kw)
    return src, dst, ref


def _state_read(ref, src, seq_id, kind, dst_id=None):
    """What ref's state_read of src's state of seq_id (into dst_id) gives, in the kind's layout."""
    layout = KINDS[kind][1]
    ref.state_read(src.state_write(seq_id, layout=layout), seq_id if dst_id is None else dst_id, layout=layout)


def _holds(c, seq_id):
    """Whether each cell of seq_id's stream holds it."""
    return c.stream_cells()[seq_id if c.n_stream > 1 else 0].holds(seq_id)


def _assert_same(a, b):
    assert snapshot(a) == snapshot(b)
    assert a.state_write(-1) == b.state_write(-1)


@kinds
@pytest.mark.parametrize("kw", GEOMETRIES, ids=lambda kw: f"{kw['type_k']}-{kw['type_v']}-vt{int(kw['v_trans'])}")
@pytest.mark.parametrize("seq_id", [0, 1, 2, 3])
def test_memcpy_of_the_regions_equals_state_read(kw, seq_id, kind):
    src, dst, ref = _pair(kw, kind=kind)
    exp = src.seq_export(seq_id)
    imp = dst.seq_import_begin(exp.header)
    assert imp.seq_id == seq_id and imp.n_bytes == exp.n_bytes and imp.n_cells == exp.n_cells
    assert copy_regions(exp.regions, imp.regions) == exp.n_bytes
    imp.commit()
    assert not imp.active
    _state_read(ref, src, seq_id, kind)
    _assert_same(dst, ref)
    assert dst.state_write(seq_id, layout=KINDS[kind][1]) == src.state_write(seq_id, layout=KINDS[kind][1])
    if kind == "2025":
        check_unified_invariants(dst)


@kinds
@pytest.mark.parametrize("kw", GEOMETRIES[:2], ids=["vt1", "vt0"])
def test_gather_scatter_and_another_destination_id(kw, kind):
    src, dst, ref = _pair(kw, kind=kind)
    exp = src.seq_export(1)
    data = exp.gather()
    data.flags.writeable = False            # what ray.get returns: a read-only view
    with dst.seq_import_begin(exp.header, seq_id=3) as imp:    # with streams: into another stream
        imp.scatter(data)
        imp.commit()
    _state_read(ref, src, 1, kind, dst_id=3)
    _assert_same(dst, ref)


@kinds
def test_several_sequences_one_after_the_other(kind):
    src, dst, ref = _pair(GEOMETRIES[0], kind=kind)
    for s in (2, 0, 1, 3):
        exp = src.seq_export(s)
        imp = dst.seq_import_begin(exp.header)
        copy_regions(exp.regions, imp.regions)
        imp.commit()
        _state_read(ref, src, s, kind)
        _assert_same(dst, ref)


@kinds
def test_an_absent_sequence_does_to_the_destination_what_state_read_does(kind):
    src, dst, ref = _pair(GEOMETRIES[0], kind=kind)
    src.seq_rm(2)
    exp = src.seq_export(2)
    assert exp.n_cells == 0 and len(exp.regions) == 0 and exp.n_bytes == 0
    imp = dst.seq_import_begin(exp.header)
    imp.commit()
    _state_read(ref, src, 2, kind)
    _assert_same(dst, ref)
    # the seed's reading removes the sequence (C1b); today's skips an empty stream section
    assert (dst.seq_pos_max(2) >= 0) == (kind != "2025")


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


@pytest.mark.parametrize("kind", ["2025", "2026", "2026-streams", "2026-ext", "2026-streams-ext"])
def test_metadata_only_caches_get_the_cells_on_both_sides(kind):
    src, dst, ref = _pair(GEOMETRIES[0], buffers="none", kind=kind)
    exp = src.seq_export(0)
    assert len(exp.regions) == 0 and exp.n_bytes == 0
    np.testing.assert_array_equal(exp.cells, np.flatnonzero(_holds(src, 0)))
    imp = dst.seq_import_begin(exp.header)
    assert len(imp.regions) == 0 and len(imp.cells) == len(exp.cells)
    cells = imp.cells.copy()
    imp.commit()
    _state_read(ref, src, 0, kind)
    _assert_same(dst, ref)
    # the destination cells of seq 0's stream, cell k taking the position of source cell k
    np.testing.assert_array_equal(np.sort(cells), np.flatnonzero(_holds(dst, 0)))
    np.testing.assert_array_equal(dst.stream_cells()[0].pos[cells], src.stream_cells()[0].pos[exp.cells])


def test_the_sliding_window_leaves_cells_out_as_the_state_does():
    """In today's layout a sequence's state leaves out the cells its sliding window masks: so
    does its export, and the import restores what the state read restores."""
    src, dst, ref = _pair(GEOMETRIES[0], kind="2026-swa")
    exp = src.seq_export(0)
    assert 0 < exp.n_cells < int(_holds(src, 0).sum())
    # the state's cell count: after the prefix (magic, seq id) and the stream count, stream 0's
    assert struct.unpack_from("<I", src.state_write(0), 12)[0] == exp.n_cells
    with dst.seq_import_begin(exp.header) as imp:
        copy_regions(exp.regions, imp.regions)
        imp.commit()
    _state_read(ref, src, 0, "2026-swa")
    _assert_same(dst, ref)


@kinds
def test_abort_exception_and_garbage_collection_put_every_byte_back(kind):
    src, dst, _ = _pair(GEOMETRIES[0], kind=kind)
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


@kinds
def test_changes_are_refused_while_an_import_is_pending(kind):
    src, dst, _ = _pair(GEOMETRIES[0], kind=kind)
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


@kinds
def test_bad_headers_raise_state_error_and_change_nothing(kind):
    src, dst, _ = _pair(GEOMETRIES[0], kind=kind)
    header = src.seq_export(0).header
    before = snapshot(dst)
    cb, flags = _cell_bytes(src), struct.unpack_from("<I", header, 12)[0]
    cases = {
        "truncated": (header[:-1], "truncated"),
        "empty": (b"", "truncated"),
        "trailing": (header + b"\0", "trailing"),
        "magic": (_bad(header, 0, "<I", 0x12345678), "not a hand-off header"),
        "version": (_bad(header, 4, "<I", 9), "version"),
        "corrupted": (_bad(header, len(header) - 9, "<B", header[-9] ^ 1), "corrupted"),
        "type": (_resum(_bad(header, 16, "<i", 0)), "types"),
        "v_trans": (_resum(_bad(header, 12, "<I", flags ^ 1)), "transposed"),
        "layers": (_resum(_bad(header, 24, "<I", 3)), "layers"),
        "width": (_resum(_bad(header, 40 + 4, "<I", 31)), "layer 0 differs"),
        "position": (_resum(_bad(header, len(header) - 8 - cb, "<i", -5)), "position"),
        "n_seq_id": (_resum(_bad(header, len(header) - 8 - cb + 4, "<I", 2)), "sequence ids"),
        "cell count": (_resum(_bad(header, len(header) - 8 - cb * src.seq_export(0).n_cells - 4, "<I", 1)),
                       "do not fill"),
        "flags": (_resum(_bad(header, 12, "<I", flags | 8)), "flags"),
        "extension flag": (_resum(_bad(header, 12, "<I", flags ^ 4)), "per-cell extension"),
    }
    # sealed (length and checksum agreeing) with less than the run count and the checksum after
    # the layers: once read the run count from the checksum's bytes and the runs past the end
    runs_at = 40 + 28 * struct.unpack_from("<I", header, 24)[0]
    for extra in range(8, 12):
        cut = header[:runs_at + extra]
        cases[f"sealed after the layers + {extra}"] = (_resum(_bad(cut, 8, "<I", len(cut))),
                                                       "truncated before its runs")
    for name, (h, msg) in cases.items():
        with pytest.raises(kvcache.StateError, match=msg):
            dst.seq_import_begin(h)
        assert_unchanged(dst, before, name)
    like = dict(semantics="2026", cell_ext=True) if src.cell_ext else {}   # refused for their layers only
    foreign = kvcache.UnifiedCache(64, 2, [32, 48], [64, 128], n_seq_max=4, **like)
    with pytest.raises(kvcache.StateError, match="layer 1 differs"):
        foreign.seq_import_begin(header)
    with pytest.raises(ValueError, match="seq_id"):
        dst.seq_import_begin(header, seq_id=4)
    with pytest.raises(TypeError):
        dst.seq_import_begin(12)
    small = kvcache.UnifiedCache(64, 2, list(WIDTHS), [2 * w for w in WIDTHS], n_seq_max=2, **like)
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


@pytest.mark.parametrize("kv_unified", [True, False], ids=["one-stream", "streams"])
def test_a_full_2026_stream_says_how_many_cells_are_missing(kv_unified):
    """Today's placement takes any free cells of the sequence's stream: what is missing is the
    cells beyond the stream's free ones (with a stream per sequence, a stream smaller than the
    sequence)."""
    def cache(size):
        return kvcache.UnifiedCache(size, 2, list(WIDTHS), [2 * w for w in WIDTHS], n_seq_max=4, n_pad=1,
                                    semantics="2026", kv_unified=kv_unified)
    src = cache(64)
    assert src.find_slot(kvcache.UBatch(pos=list(range(40)), seq_id=[0] * 40))
    dst = cache(32)
    assert dst.find_slot(kvcache.UBatch(pos=list(range(10)), seq_id=[1] * 10))
    before = snapshot(dst)
    missing = 40 - (22 if kv_unified else 32)
    with pytest.raises(kvcache.StateError, match=f"no room: {missing} cells missing"):
        dst.seq_import_begin(src.seq_export(0).header)
    assert_unchanged(dst, before, "no room")
    with pytest.raises(kvcache.StateError, match="no room|not enough cells"):
        dst.state_read(src.state_write(0), 0)   # the state read agrees
    assert_unchanged(dst, before, "state_read")


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


def test_pair_regions_refuses_lengths_that_wrap_around():
    """Lengths whose u64 sum wraps around were taken as a small total (an IndexError followed,
    or regions paired over bytes that are not there)."""
    wrap = np.array([[4096, 2**64 - 1], [8192, 2]], np.uint64)
    for src, dst in ((wrap, np.array([[16384, 1]], np.uint64)), (np.array([[16384, 1]], np.uint64), wrap)):
        with pytest.raises(ValueError, match=r"2\*\*64"):
            pair_regions(src, dst)
        with pytest.raises(ValueError, match=r"2\*\*64"):
            copy_regions(src, dst)


def test_objects_made_without_a_cache_refuse_to_work():
    """SeqExport.__new__ gives an export of no cache: its gather() raised no error but read
    through a missing cache (a crash); now a TypeError, in a subprocess so that the old crash
    fails this test rather than the run."""
    import subprocess
    import sys

    from conftest import kvcache_env

    code = """
from kvcache.handoff import SeqExport, SeqImport
x = SeqExport.__new__(SeqExport)
try:
    x.gather()
except TypeError as e:
    print("refused:", e)
print(repr(x), repr(SeqImport.__new__(SeqImport)))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=kvcache_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert "refused: SeqExport is made by UnifiedCache.seq_export" in res.stdout
    assert "SeqExport(seq_id=0, cells=0, regions=0" in res.stdout and "SeqImport(seq_id=0, cells=0" in res.stdout


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


# the iSWA pairs of each semantics (keyword arguments of busy_iswa) and their state layout
ISWA_KINDS = {
    "2025": ({}, "2025"),
    "2026": ({"semantics": "2026"}, "2026"),
    "2026-streams": ({"semantics": "2026", "kv_unified": False}, "2026"),
    "2026-ext": ({"semantics": "2026", "cell_ext": True}, "2026"),
    "2026-streams-ext": ({"semantics": "2026", "kv_unified": False, "cell_ext": True}, "2026"),
}
iswa_kinds = pytest.mark.parametrize("iswa_kind", list(ISWA_KINDS))
swa_fulls = pytest.mark.parametrize("swa_full", [False, True], ids=["swa-sized", "swa-full"])


def _iswa(iswa_kind, seed, **kw):
    from cache_state import busy_iswa

    return busy_iswa(seed=seed, **ISWA_KINDS[iswa_kind][0], **kw)


@iswa_kinds
@swa_fulls
@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("seq_id", [0, 1, 2])
def test_iswa_caches_move_both_parts_like_state_read(v_trans, seq_id, swa_full, iswa_kind):
    layout = ISWA_KINDS[iswa_kind][1]
    src, dst, ref = (_iswa(iswa_kind, seed, v_trans=v_trans, swa_full=swa_full) for seed in (0, 1, 1))
    exp = src.seq_export(seq_id)
    # the export lists exactly what the pair's state of the sequence holds, part by part
    assert exp.n_bytes == len(exp.gather())
    with dst.seq_import_begin(exp.header) as imp:
        assert imp.n_bytes == exp.n_bytes
        assert [i.n_cells for i in imp.parts] == [e.n_cells for e in exp.parts]
        copy_regions(exp.regions, imp.regions)
        imp.commit()
    assert not imp.active
    ref.state_read(src.state_write(seq_id, layout=layout), seq_id, layout=layout)
    assert snapshot(dst) == snapshot(ref)
    assert dst.state_write(-1, layout=layout) == ref.state_write(-1, layout=layout)
    assert dst.state_write(seq_id, layout=layout) == src.state_write(seq_id, layout=layout)
    dst2 = _iswa(iswa_kind, 1, v_trans=v_trans, swa_full=swa_full)
    with dst2.seq_import_begin(exp.header, seq_id=seq_id) as imp:
        imp.scatter(exp.gather())
        imp.commit()
    assert snapshot(dst2) == snapshot(ref)


@iswa_kinds
@swa_fulls
def test_iswa_caches_move_a_sequence_into_another_id(swa_full, iswa_kind):
    layout = ISWA_KINDS[iswa_kind][1]
    src, dst, ref = (_iswa(iswa_kind, seed, swa_full=swa_full) for seed in (0, 1, 1))
    exp = src.seq_export(1)
    with dst.seq_import_begin(exp.header, seq_id=2) as imp:    # with streams: into another stream
        imp.scatter(exp.gather())
        imp.commit()
    ref.state_read(src.state_write(1, layout=layout), 2, layout=layout)
    assert snapshot(dst) == snapshot(ref)


def test_a_2026_iswa_export_leaves_out_the_swa_cells_outside_the_window():
    src, dst, ref = (_iswa("2026", seed) for seed in (0, 1, 1))
    exp = src.seq_export(0)
    # sequence 0 holds positions 0, 3, 6, 9: a window of 4 keeps 6 and 9 in the SWA part
    assert [e.n_cells for e in exp.parts] == [4, 2]
    dst.seq_rm(0)
    ref.seq_rm(0)
    with dst.seq_import_begin(exp.header) as imp:
        imp.scatter(exp.gather())
        imp.commit()
    ref.state_read(src.state_write(0, layout="2026"), 0, layout="2026")
    assert snapshot(dst) == snapshot(ref)
    assert dst.swa.seq_cells(0)[1].tolist() == [6, 9]


@swa_fulls
@pytest.mark.parametrize("src_kind, dst_kind", [("2025", "2026"), ("2026", "2025")])
def test_an_iswa_pair_of_either_semantics_imports_into_the_other(src_kind, dst_kind, swa_full):
    """The export carries the cells the source's state lists in its own era's layout (today's
    SWA half: the window only); the destination ends as its state_read of that state."""
    src = _iswa(src_kind, 0, swa_full=swa_full)
    dst, ref = (_iswa(dst_kind, 1, swa_full=swa_full) for _ in range(2))
    layout = ISWA_KINDS[src_kind][1]
    for s in (1, 0):
        exp = src.seq_export(s)
        with dst.seq_import_begin(exp.header) as imp:
            copy_regions(exp.regions, imp.regions)
            imp.commit()
        ref.state_read(src.state_write(s, layout=layout), s, layout=layout)
        assert snapshot(dst) == snapshot(ref)


@iswa_kinds
@swa_fulls
def test_iswa_imports_are_all_or_nothing(swa_full, iswa_kind):
    src, dst = _iswa(iswa_kind, 0, swa_full=swa_full), _iswa(iswa_kind, 1, swa_full=swa_full)
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
    imp = dst.seq_import_begin(exp.header)
    imp.scatter(exp.gather())
    imp.abort()
    assert_unchanged(dst, before, "abort")


@iswa_kinds
@pytest.mark.parametrize("seq_id", [None, 0])
def test_an_iswa_header_framing_parts_of_two_sequences_is_refused(iswa_kind, seq_id):
    """A pair's header whose parts are exports of two sequences (each part sound) is no one
    sequence's export: refused, nothing begun (without seq_id its parts would land in two
    sequences)."""
    from kvcache.handoff import split_parts

    src, dst = _iswa(iswa_kind, 0), _iswa(iswa_kind, 1)
    base = split_parts(src.seq_export(1).header, 2)[0]
    swa = split_parts(src.seq_export(2).header, 2)[1]
    mixed = b"KVCP" + struct.pack("<II", 1, 2) + b"".join(struct.pack("<I", len(h)) + h for h in (base, swa))
    before = snapshot(dst)
    with pytest.raises(kvcache.StateError, match="sequences 1 and 2"):
        dst.seq_import_begin(mixed, seq_id)
    assert_unchanged(dst, before, "parts of two sequences")
    dst.seq_rm(0)                                   # no import left pending


@pytest.mark.parametrize("src_kind, dst_kind", [("2025", "2026"), ("2026", "2025"), ("2026-streams", "2026-streams")])
def test_a_header_of_either_semantics_imports_into_the_other(src_kind, dst_kind):
    """The header is the same in both semantics: imported, the sequence is placed as the
    destination's own state_read of the source's state places it."""
    src = KINDS[src_kind][0](seed=0, widths=WIDTHS)
    dst, ref = (KINDS[dst_kind][0](seed=1, widths=WIDTHS) for _ in range(2))
    for s in (1, 0):
        exp = src.seq_export(s)
        with dst.seq_import_begin(exp.header, seq_id=2 if src_kind == dst_kind else None) as imp:
            copy_regions(exp.regions, imp.regions)
            imp.commit()
        layout = KINDS[dst_kind][1]
        ref.state_read(src.state_write(s, layout=layout), 2 if src_kind == dst_kind else s, layout=layout)
        _assert_same(dst, ref)


def _section(blob, seq_id, n_stream):
    """The sequence's stream section of its state in layout "2026" (prefix, stream count and
    the other streams' empty sections cut off)."""
    k = seq_id if n_stream > 1 else 0
    return blob[12 + 4 * k:len(blob) - 4 * (n_stream - 1 - k)]


@pytest.mark.parametrize("src_kind, dst_kind", [("2025", "2026-streams"), ("2026", "2026-streams"),
                                                ("2026-streams", "2026"), ("2026-streams", "2025"),
                                                ("2026-ext", "2026-streams-ext"), ("2026-streams-ext", "2026-ext")])
def test_a_sequence_moves_between_caches_of_other_stream_counts(src_kind, dst_kind):
    """The header names no stream count: a sequence moves between a cache of one stream and one
    of a stream per sequence (whose states refuse each other: n_stream mismatch), into the
    destination sequence's stream, and the destination's state of it holds the source's."""
    src = KINDS[src_kind][0](seed=0, widths=WIDTHS)
    for s in (0, 1, 3):
        dst = KINDS[dst_kind][0](seed=1, widths=WIDTHS)
        dst.clear()                       # a fresh cache: cells placed in order from cell 0
        exp = src.seq_export(s)
        with dst.seq_import_begin(exp.header) as imp:
            copy_regions(exp.regions, imp.regions)
            imp.commit()
        with pytest.raises(kvcache.StateError, match="n_stream mismatch"):
            dst.state_read(src.state_write(s), s)
        assert _section(dst.state_write(s), s, dst.n_stream) == _section(src.state_write(s), s, src.n_stream)


@pytest.mark.parametrize("seq_id", [0, 3])
def test_regions_of_a_stream_lie_in_that_stream_of_the_buffers(seq_id):
    """With a stream per sequence, a sequence's regions lie in its stream's slab of each layer's
    K and V (rows seq_id * kv_size .. of K; the stream's n_embd_v rows of a transposed V)."""
    src = busy_unified_2026(kv_unified=False, widths=WIDTHS)
    exp = src.seq_export(seq_id)
    slabs = []
    for il in src.layers:
        for a in (src.k(il), src.v(il)):
            per = a.nbytes // src.n_stream
            slabs.append((a.ctypes.data + seq_id * per, per))
    for addr, length in exp.regions.tolist():
        assert any(lo <= addr and addr + length <= lo + n for lo, n in slabs), (addr, length)
    assert sum(n for _, n in exp.regions.tolist()) == exp.n_bytes > 0


def test_a_sequence_with_cells_outside_its_stream_is_refused():
    """A whole-cache state read puts the cells a state lists in its streams, even cells of a
    sequence in another sequence's stream (as llama.cpp does with such a state); that sequence's
    state then has two non-empty sections, which one header cannot carry: the export refuses it,
    naming the stream, and the other sequences still move."""
    src = kvcache.UnifiedCache(32, 1, 8, 8, n_seq_max=2, n_pad=1, semantics="2026", kv_unified=False)
    assert src.find_slot(kvcache.UBatch(pos=[0, 1], seq_id=[0, 0]))
    assert src.find_slot(kvcache.UBatch(pos=[0, 1, 2], seq_id=[1, 1, 1]))
    blob = bytearray(src.state_write(-1))
    # u32 n_stream, stream 0 (u32 count 2, two cells of 12 bytes, then its V layout, layers and
    # K/V), stream 1: the first cell of stream 1 said to be sequence 0's
    n0 = len(src.state_write(0)) - 8 - 4 - 4      # the bytes of stream 0's section
    at = 4 + n0 + 4 + 8
    assert struct.unpack_from("<iIi", blob, at - 8) == (0, 1, 1)
    struct.pack_into("<i", blob, at, 0)
    cache = kvcache.UnifiedCache(32, 1, 8, 8, n_seq_max=2, n_pad=1, semantics="2026", kv_unified=False)
    cache.state_read(bytes(blob))
    assert cache.stream_cells()[1].holds(0).any()
    with pytest.raises(ValueError, match=r"sequence 0 holds cells in stream 1, not its own \(0\)"):
        cache.seq_export(0)
    dst = kvcache.UnifiedCache(32, 1, 8, 8, n_seq_max=2, n_pad=1, semantics="2026", kv_unified=False)
    with dst.seq_import_begin(cache.seq_export(1).header) as imp:
        imp.commit()
    assert dst.state_write(1) == cache.state_write(1)


# --- the per-cell extension ------------------------------------------------------------------

def _ext_at(cache, seq_id, cells):
    """The extensions (x, y, token id) of cells of seq_id's stream."""
    return cache.stream_cells()[seq_id if cache.n_stream > 1 else 0].ext[cells]


@pytest.mark.parametrize("kind", EXT_KINDS)
@pytest.mark.parametrize("kw", GEOMETRIES[:2], ids=["vt1", "vt0"])
@pytest.mark.parametrize("buffers", ["owned", "none"])
def test_the_cells_take_the_saved_extension_as_state_read_gives_it(kind, kw, buffers):
    """Token ids and 2-D positions go with the cells: destination cell k gets the x, y and token
    id of source cell k, and the destination writes the source's state of the sequence."""
    src, dst, ref = _pair(kw, buffers=buffers, kind=kind)
    for s in (1, 0, 3, 2):
        exp = src.seq_export(s)
        src_ext = _ext_at(src, s, exp.cells)
        with dst.seq_import_begin(exp.header) as imp:
            copy_regions(exp.regions, imp.regions)
            cells = imp.cells.copy()
            imp.commit()
        _state_read(ref, src, s, kind)
        _assert_same(dst, ref)
        assert dst.state_write(s) == src.state_write(s)
        np.testing.assert_array_equal(_ext_at(dst, s, cells), src_ext)
        if s != 2:                               # sequence 2's cells were removed by seq_rm
            assert (src_ext != [0, 0, -1]).any(axis=1).all(), (s, src_ext)


@pytest.mark.parametrize("kv_unified", [True, False], ids=["one-stream", "streams"])
def test_a_per_layer_embedding_cache_keeps_the_saved_tokens(kv_unified):
    """A cache with ple_token sets the token id of every cell a placement takes (the import's
    too): the commit puts the saved ones back, as state_read does."""
    src = busy_unified_2026(kv_unified=kv_unified, cell_ext=True, widths=WIDTHS)
    dst, ref = (kvcache.UnifiedCache(64, 2, list(WIDTHS), [2 * w for w in WIDTHS], type_k="f16", type_v="f16",
                                     n_seq_max=4, n_pad=1, semantics="2026", kv_unified=kv_unified, cell_ext=True,
                                     ple_token=7) for _ in range(2))
    for s in (0, 1):
        exp = src.seq_export(s)
        with dst.seq_import_begin(exp.header) as imp:
            copy_regions(exp.regions, imp.regions)
            cells = imp.cells.copy()
            imp.commit()
        ref.state_read(src.state_write(s), s)
        _assert_same(dst, ref)
        np.testing.assert_array_equal(_ext_at(dst, s, cells), _ext_at(src, s, exp.cells))
        assert 7 not in _ext_at(dst, s, cells)[:, 2]


@pytest.mark.parametrize("kind", EXT_KINDS)
def test_the_extension_is_read_from_the_header(kind):
    """A header whose extension bytes were changed (and resealed) gives the cells those values;
    changed without resealing, it is refused as corrupted."""
    src, dst, _ = _pair(GEOMETRIES[0], kind=kind)
    exp = src.seq_export(0)
    n = exp.n_cells
    first = len(exp.header) - 8 - 24 * n          # the first cell record: pos, n_seq_id, x, y, tok, id
    changed = _resum(_bad(_bad(_bad(exp.header, first + 8, "<i", -3), first + 12, "<i", 1 << 20),
                          first + 16, "<i", 424242))
    before = snapshot(dst)
    with pytest.raises(kvcache.StateError, match="corrupted"):
        dst.seq_import_begin(changed[:first + 16] + bytes([changed[first + 16] ^ 1]) + changed[first + 17:])
    assert_unchanged(dst, before, "corrupted extension")
    with dst.seq_import_begin(changed) as imp:
        copy_regions(exp.regions, imp.regions)
        cells = imp.cells.copy()
        imp.commit()
    want = _ext_at(src, 0, exp.cells).copy()
    want[0] = [-3, 1 << 20, 424242]
    np.testing.assert_array_equal(_ext_at(dst, 0, cells), want)


@pytest.mark.parametrize("ext_kind, plain_kind", [("2026-ext", "2026"), ("2026-streams-ext", "2026-streams"),
                                                  ("2026-ext", "2025")])
def test_a_cache_with_the_extension_and_one_without_refuse_each_others_headers(ext_kind, plain_kind):
    ext, plain = KINDS[ext_kind][0](seed=0, widths=WIDTHS), KINDS[plain_kind][0](seed=1, widths=WIDTHS)
    for src, dst, msg in [(ext, plain, "the sequence's cells carry the per-cell extension, the cache's do not"),
                          (plain, ext, "the sequence's cells do not carry the per-cell extension, the cache's do")]:
        before = snapshot(dst)
        with pytest.raises(kvcache.StateError, match=msg):
            dst.seq_import_begin(src.seq_export(0).header)
        assert_unchanged(dst, before, msg)


@pytest.mark.parametrize("kind", EXT_KINDS)
def test_an_aborted_import_leaves_every_extension(kind):
    """Abort, an exception and a refused commit (the cache changed) leave the destination's
    extensions (and everything else) as they were."""
    src, dst, _ = _pair(GEOMETRIES[1], kind=kind)
    exts = [t.ext.copy() for t in dst.stream_cells()]
    before = snapshot(dst)
    for s in (0, 1):
        imp = dst.seq_import_begin(src.seq_export(s).header)
        copy_regions(src.seq_export(s).regions, imp.regions)
        imp.abort()
        assert_unchanged(dst, before, "abort")
    with pytest.raises(KeyError):
        with dst.seq_import_begin(src.seq_export(3).header) as imp:
            imp.scatter(src.seq_export(3).gather())
            raise KeyError("transfer failed")
    assert_unchanged(dst, before, "exception")
    for t, e in zip(dst.stream_cells(), exts):
        np.testing.assert_array_equal(t.ext, e)


# --- commit from a callback of an operation on the cache --------------------------------------------

class _CommittingFile(io.RawIOBase):
    """A file whose write() commits an import into the cache being written (its error kept)."""

    def __init__(self, imp):
        self.imp, self.errors, self.data = imp, [], bytearray()

    def writable(self):
        return True

    def write(self, b):
        try:
            self.imp.commit()
        except RuntimeError as e:
            self.errors.append(e)
        self.data += bytes(b)
        return len(b)


def _moved(make, semantics_2025):
    src, dst = make(), make()
    assert src.find_slot(kvcache.UBatch(list(range(10)), [0] * 10))
    assert dst.find_slot(kvcache.UBatch(list(range(5)), [1] * 5))
    if semantics_2025:
        src.commit()
        dst.commit()
    exp = src.seq_export(0)
    imp = dst.seq_import_begin(exp.header, 0)
    imp.scatter(exp.gather())
    return dst, imp


@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_commit_from_a_callback_of_an_operation_is_refused(semantics):
    """A commit places the sequence's cells: from a callback of an operation on the cache (a
    file's write() during state_write_into; a finalizer during kq_mask, which then wrote a mask
    wider than its array) it is refused, the import still active."""
    dst, imp = _moved(lambda: kvcache.UnifiedCache(256, 1, 8, 8, n_seq_max=2, semantics=semantics),
                      semantics == "2025")
    before = dst.state_write()
    f = _CommittingFile(imp)
    assert dst.state_write_into(f) == len(before)
    assert bytes(f.data) == before and f.errors and "middle of" in str(f.errors[0])
    assert imp.active and dst.state_write() == before
    imp.commit()
    assert dst.seq_pos_max(0) == 9 and dst.seq_pos_max(1) == 4


def test_iswa_commit_from_a_callback_of_one_part_commits_neither():
    """An iSWA import checks both parts before committing either: a commit from a callback of
    one part's operation changes neither part."""
    dst, imp = _moved(lambda: kvcache.ISWACache(256, 2, 8, 8, swa_layers=[1], n_swa=8, n_seq_max=2,
                                                semantics="2026"), False)
    before = dst.state_write()
    f = _CommittingFile(imp)
    dst.base.state_write_into(f)
    assert f.errors and "middle of" in str(f.errors[0])
    assert imp.active and dst.state_write() == before
    imp.commit()
    assert dst.seq_pos_max(0) == 9


@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_iswa_export_is_of_one_moment(semantics):
    """An iSWA export's two parts are of one moment: a change between them (from another thread,
    or from a finalizer the garbage collector runs in between, as here at each collection in
    turn) is not in one part only."""
    for n in range(1, 40):
        c = kvcache.ISWACache(256, 2, 8, 8, swa_layers=[1], n_swa=8, n_seq_max=2, swa_full=True,
                              buffers=None, semantics=semantics)
        assert c.find_slot(kvcache.UBatch(list(range(20)), [0] * 20))
        if semantics == "2025":
            c.commit()
        before = tuple(p.header for p in c.seq_export(0).parts)
        exp = meddled(lambda: c.seq_export(0), n, lambda: c.seq_rm(0, 10, -1))
        after = tuple(p.header for p in c.seq_export(0).parts)
        assert tuple(p.header for p in exp.parts) in (before, after), n


def test_hybrid_export_is_of_one_moment():
    """A hybrid export's attention part and recurrent state are of one moment: a placement from
    a finalizer the garbage collector runs between them (here at each collection in turn) is
    refused."""
    for n in range(1, 40):
        c = kvcache.HybridCache(64, 2, [0], 8, 8, 8, 4, n_seq_max=2)
        assert c.find_slot(kvcache.UBatch(list(range(20)), [0], n_seq_tokens=20))
        before = c.seq_export(0).header
        exp = meddled(lambda: c.seq_export(0), n,
                      lambda: c.find_slot(kvcache.UBatch(list(range(20, 25)), [0], n_seq_tokens=5)))
        assert exp.header in (before, c.seq_export(0).header), n


@pytest.mark.parametrize("make", ["iswa", "hybrid"])
def test_a_composite_import_refuses_data_that_is_not_c_contiguous(make):
    """An iSWA pair's or a hybrid memory's scatter takes data as SeqImport.scatter does: a buffer
    that is not C-contiguous is refused (it was copied in its logical order, not its memory's),
    nothing written; a C-contiguous one of any shape moves the sequence."""
    def cache(seed):
        if make == "iswa":
            return _iswa("2026", seed)
        c = kvcache.HybridCache(64, 2, [0], 8, 8, 8, 4, n_seq_max=2)
        assert c.find_slot(kvcache.UBatch(list(range(6 + seed)), [seed], n_seq_tokens=6 + seed))
        return c
    src, dst = cache(0), cache(1)
    exp = src.seq_export(0)
    data = exp.gather()
    before = dst.state_write()
    for bad in (np.asfortranarray(data.reshape(2, -1)), np.repeat(data, 2)[::2]):
        with dst.seq_import_begin(exp.header) as imp:
            with pytest.raises(ValueError, match="C-contiguous"):
                imp.scatter(bad)
    assert dst.state_write() == before
    with dst.seq_import_begin(exp.header) as imp:
        imp.scatter(data.reshape(2, -1))
        imp.commit()
    assert dst.state_write(0) == src.state_write(0)
