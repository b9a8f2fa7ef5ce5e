"""State interop with today's llama.cpp (llama-cpp-python 0.3.36, layout "2026").

Every file 0.3.36 wrote into tests/data/interop-v10 is parsed, restored into a kvcache cache of
its manifest's geometry (holding the cells the manifest lists) and written back byte for byte
in layout "2026": sequence blobs (with the 0xaf143cd8 prefix), whole-context states, session
files (version 10) and sequence files (version 3). The four-stream files (kv_unified=false)
restore into a 2026 cache of four streams and write back byte for byte; a one-stream cache
refuses them with "n_stream mismatch", changing nothing. The live tests
against 0.3.36 itself are in test_live_v10.py."""
import hashlib
import io
import struct

import pytest

import kvcache
from kvcache import statefile
from kvcache.inspect import report

from interop_data import interop_dir, interop_v10_dir, make_cache, manifest

FOLDERS = ["llama_fa0", "llama_fa1", "llama_q8_fa1", "mamba"]
STREAMS = "llama_fa0_streams"
FILES = ["seq0.bin", "seq1.bin", "seq2.bin", "seq3.bin", "state.bin", "seq0.ggsq", "session.ggsn"]


def _cells(cache):
    if isinstance(cache, kvcache.RecurrentCache):
        c = cache.cells()
        return [(int(c["pos"][i]), list(c["seq_id"][i])) for i in range(len(c["pos"])) if c["seq_id"][i]]
    return [(p, ids) for _, p, ids, _ in cache.cells().nonempty()]


def _expected(m, seq_id):
    (section,) = [s for s in m["expected"]["sections"] if s["cell_count"] or len(m["expected"]["sections"]) == 1]
    want = [(c["pos"], c["seq_ids"] or [seq_id]) for c in section["cells"]]
    if seq_id >= 0:
        want = [(p, [seq_id]) for p, _ in want]
    return want


def _round_trip(path, m, cache):
    """Parse, restore, write back in "2026": the bytes of the file."""
    data = path.read_bytes()
    seq_id = m["seq_id"] if "seq_id" in m else -1
    out = io.BytesIO()
    if path.suffix == ".ggsq":
        f = statefile.load(path)
        assert (f.version, f.layout) == (3, "2026") and f.tokens.tolist() == m["expected"]["tokens"]
        assert f.restore(cache, seq_id) == len(f.cache)
        statefile.write_sequence_file(out, cache, seq_id, f.tokens)
    elif path.suffix == ".ggsn":
        f = statefile.load(path)
        assert (f.version, f.layout) == (10, "2026") and f.tokens.tolist() == m["expected"]["tokens"]
        assert f.context.arch == m["expected"]["context"]["arch"] and not f.context.has_outputs
        f.restore(cache)
        statefile.write_session_file(out, cache, f.context.arch, f.tokens)
    elif m["wrapper"] == "context":
        ctx = statefile.parse_context_state(data)
        assert ctx.cache_offset == m["expected"]["context"]["memory_at"] and ctx.layout in kvcache.LAYOUTS
        assert not ctx.has_outputs and ctx.n_outputs == 0
        ctx.restore(cache)
        statefile.write_context_state(out, cache, ctx.arch)
    else:
        assert struct.unpack_from("<Ii", data) == (kvcache.statefile.SEQ_MAGIC, seq_id)
        assert cache.state_read(data, seq_id, exact=True) == len(data)
        out.write(cache.state_write(seq_id))
        assert cache.state_size(seq_id) == len(data)
        buf = bytearray(len(data))
        assert cache.state_write_into(buf, seq_id) == len(data) and buf == data
    return data, out.getvalue(), seq_id


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("name", FILES)
def test_file_restores_and_writes_back(folder, name):
    path = interop_v10_dir() / folder / name
    m = manifest(path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == m["sha256"]
    cache = make_cache(m)
    data, back, seq_id = _round_trip(path, m, cache)
    assert back == data
    assert _cells(cache) == _expected(m, seq_id)


def _streams_cache(m):
    """The 2026 cache of the four-stream files: a stream of 256 cells per sequence."""
    (g,) = m["geometry"]
    ls = g["layers"]
    return kvcache.UnifiedCache(
        g["kv_size"], len(ls), [x["n_embd_k_gqa"] for x in ls], [x["n_embd_v_gqa"] for x in ls],
        type_k=ls[0]["type_k"], type_v=ls[0]["type_v"], v_trans=g["v_trans"], n_seq_max=m["context"]["n_seq_max"],
        n_pad=m["context"]["n_pad"], semantics="2026", kv_unified=False)


def _stream_cells(cache):
    return [[(p, ids) for _, p, ids, _ in t.nonempty()] for t in cache.stream_cells()]


@pytest.mark.parametrize("name", FILES)
def test_several_streams_restore_and_write_back(name):
    """The four-stream files restore into a 2026 cache of four streams, each section into its
    stream (a sequence's into the sequence's), and write back byte for byte."""
    path = interop_v10_dir() / STREAMS / name
    m = manifest(path)
    cache = _streams_cache(m)
    assert cache.n_stream == 4
    data, back, seq_id = _round_trip(path, m, cache)
    assert back == data
    got = _stream_cells(cache)
    for sec in m["expected"]["sections"]:
        strm = sec["stream"] if seq_id < 0 else seq_id
        want = [(c["pos"], c["seq_ids"] if seq_id < 0 else [seq_id]) for c in sec["cells"]]
        if sec["cell_count"] or seq_id < 0:
            assert got[strm] == want, (name, strm)
    if seq_id >= 0:
        assert all(not cells for s, cells in enumerate(got) if s != seq_id)


@pytest.mark.parametrize("name", FILES)
def test_several_streams_are_refused_by_one_stream(name):
    """A cache of one stream refuses the four-stream files with "n_stream mismatch", changing
    nothing."""
    path = interop_v10_dir() / STREAMS / name
    m = manifest(path)
    cache = make_cache(m)          # one stream of the same cells and rows
    assert cache.find_slot(kvcache.UBatch([0, 1], [0, 0]))
    cache.commit()
    before = (_cells(cache), cache.state_write(-1))
    f = statefile.load(path)
    seq_id = m["seq_id"] if "seq_id" in m else 0
    with pytest.raises(kvcache.StateError, match="n_stream mismatch: the state has 4 streams"):
        if isinstance(f, statefile.SequenceFile):
            f.restore(cache, seq_id)
        elif isinstance(f, (statefile.SessionFile, statefile.ContextState)):
            f.restore(cache)
        else:
            cache.state_read(path.read_bytes(), seq_id)
    assert (_cells(cache), cache.state_write(-1)) == before
    r = report(path)                # inspect describes them all the same
    assert r["framing"]["n_stream"] == [4]
    assert [s["cell_count"] for s in r["sections"]] == [s["cell_count"] for s in m["expected"]["sections"]]


@pytest.mark.parametrize("folder", FOLDERS + [STREAMS])
def test_inspect_names_the_layout(folder):
    for name in FILES:
        path = interop_v10_dir() / folder / name
        r = report(path)
        assert "2026" in r["layouts"], (name, r["layouts"])
        if name.endswith((".ggsn", ".ggsq")):
            assert r["layouts"] == ["2026"]
        if name.startswith("seq") and name.endswith(".bin"):
            assert r["framing"]["prefix"] and r["framing"]["src_seq_id"] == manifest(path)["seq_id"]


def test_an_empty_sequence_blob_keeps_the_destination():
    """llama.cpp skips a stream section without cells: the 16-byte blob of an empty sequence
    leaves the destination's cells (in "2025" an empty state removes it: rule C1b)."""
    path = interop_v10_dir() / "llama_fa0" / "seq3.bin"
    cache = make_cache(manifest(path))
    assert cache.find_slot(kvcache.UBatch([0, 1, 2], [1, 1, 1]))
    cache.commit()
    assert cache.state_read(path.read_bytes(), 1) == 16
    assert cache.seq_pos_max(1) == 2
    old = make_cache(manifest(path)).state_write(3, layout="2025")
    assert cache.state_read(old, 1, layout="2025") == len(old) and cache.seq_pos_max(1) == -1


def test_an_empty_recurrent_sequence_blob_removes_the_destination():
    """llama.cpp's recurrent memory removes the destination for an empty state in every layout."""
    path = interop_v10_dir() / "mamba" / "seq3.bin"
    cache = make_cache(manifest(path))
    assert cache.find_slot(kvcache.UBatch([0], [1]))
    cache.commit()
    assert cache.state_read(path.read_bytes(), 1) == 92 and cache.seq_pos_max(1) == -1


def test_both_eras_read_with_the_layout_found():
    """The same cells from 0.3.10 and 0.3.36: each file's layout is found from its bytes, and the
    restored caches are equal (the K/V payload did not change between them)."""
    for folder in ("llama_fa0", "llama_q8_fa1"):
        for name in ("state.bin", "session.ggsn", "seq1.bin", "seq0.ggsq"):
            old_p, new_p = interop_dir() / folder / name, interop_v10_dir() / folder / name
            old_m, new_m = manifest(old_p), manifest(new_p)
            a, b = make_cache(old_m), make_cache(new_m)
            fa, fb = statefile.load(old_p), statefile.load(new_p)
            seq_id = new_m.get("seq_id", 0)
            for f, c in ((fa, a), (fb, b)):
                if isinstance(f, memoryview):
                    c.state_read(f, seq_id)
                elif isinstance(f, statefile.SequenceFile):
                    f.restore(c, seq_id)
                else:
                    f.restore(c)
            assert a.state_write(-1) == b.state_write(-1), (folder, name)
            if not isinstance(fa, memoryview):
                assert (fa.layout, fb.layout) in (("2025", "2026"), ("2025", "2026-06")), (folder, name)


def test_the_old_whole_state_hazard():
    """Today's llama.cpp accepts a "2025" whole state and empties its cache (the old output count
    reads as one stream, the first output position as an empty one). kvcache finds the layout
    from the bytes; told "2026", its exact read refuses the bytes left over."""
    data = (interop_dir() / "llama_fa0" / "state.bin").read_bytes()
    ctx = statefile.parse_context_state(data)
    assert ctx.layout == "2025" and ctx.n_outputs == 1
    as_new = statefile.parse_context_state(data, layout="2026")
    assert bytes(as_new.cache[:8]) == b"\x01\x00\x00\x00\x00\x00\x00\x00"   # n_stream 1, an empty stream
    cache = make_cache(manifest(interop_dir() / "llama_fa0" / "state.bin"))
    with pytest.raises(kvcache.StateError, match="trailing bytes"):
        as_new.restore(cache)
    assert cache.used == 0


def test_inspect_reads_in_the_layout_it_is_told(capsys):
    from kvcache.cli import main

    path = interop_v10_dir() / "llama_fa0" / "session.ggsn"
    assert main(["inspect", "--layout", "2026", "--json", str(path)]) == 0
    assert '"layout": "2026"' in capsys.readouterr().out
    assert main(["inspect", "--layout", "2026-06", str(path)]) == 2     # version 10 is 2026's alone
    assert "version 10 (byte 4) is not layout 2026-06's 9" in capsys.readouterr().err
    old = interop_dir() / "llama_fa0" / "seq1.bin"
    assert main(["inspect", "--layout", "2026", str(old)]) == 2
    capsys.readouterr()
