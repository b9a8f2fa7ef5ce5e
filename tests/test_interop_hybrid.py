"""State interop with today's llama.cpp's hybrid memory (llama-cpp-python 0.3.36, layout "2026").

Every file 0.3.36 wrote into tests/data/interop-hybrid for its tiny LFM2 model (attention layers
1 and 3, short-convolution layers 0 and 2) restores into a HybridCache of its manifest's geometry
and writes back byte for byte: sequence blobs (with the 0xaf143cd8 prefix), the recurrent part
alone (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), whole-context states, session files (version 10) and
sequence files (version 3), in the three folders (the rollback folders with n_rs_seq 4). The
attention part ends, and the recurrent part starts, where the manifests say. A read that fails in
either part (truncated, damaged, of another geometry) raises StateError naming the part and
leaves both parts exactly as they were."""
import hashlib
import io
import struct

import numpy as np
import pytest

import kvcache
from kvcache import statefile

from conftest import need_module
from interop_data import interop_hybrid_dir, make_hybrid, manifest

FOLDERS = {
    "lfm2_a": ["seq0.bin", "seq1.bin", "seq2.bin", "seq3.bin", "seq0.partial_only.bin", "state.bin", "seq0.ggsq",
               "session.ggsn"],
    "lfm2_c_rollback": ["seq0.bin", "fresh_seq0.bin", "state.bin"],
    "lfm2_c2_rollback_specbatch": ["seq0.bin", "fresh_seq0.bin", "state.bin"],
}
CASES = [(folder, name) for folder, names in FOLDERS.items() for name in names]


def _seq_of(m):
    return m.get("seq_id", -1)


def _snapshot(h):
    """Everything of both parts a read could change: cells, counters and every K/V / R/S byte."""
    a, r = h.attn, h.recr
    ac = a.cells()
    out = [ac.pos.tobytes(), ac.shift.tobytes(), repr(list(ac.nonempty())), a.used, a.head,
           {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in r.cells().items() if k != "seq_id"},
           r.cells()["seq_id"], r.used, r.head]
    for il in h.attn_layers:
        out += [a.k(il).tobytes(), a.v(il).tobytes()]
    for il in h.recurrent_layers:
        for plane in range(1 + h.n_rs_seq):
            out += [h.r(il, plane).tobytes(), h.s(il, plane).tobytes()]
    return out


def _round_trip(path, m, h):
    """Restore the file into h and write it back as the file was written."""
    data = path.read_bytes()
    seq_id = _seq_of(m)
    out = io.BytesIO()
    if path.suffix == ".ggsq":
        f = statefile.load(path)
        assert (f.version, f.layout) == (3, "2026") and f.tokens.tolist() == m["structure"]["header"]["tokens"]
        assert f.restore(h, seq_id) == len(f.cache)
        statefile.write_sequence_file(out, h, seq_id, f.tokens)
    elif path.suffix == ".ggsn":
        f = statefile.load(path)
        assert (f.version, f.layout) == (10, "2026") and f.tokens.tolist() == m["structure"]["header"]["tokens"]
        assert f.context.arch == "lfm2" and not f.context.has_outputs
        f.restore(h)
        statefile.write_session_file(out, h, f.context.arch, f.tokens)
    elif seq_id < 0:
        ctx = statefile.parse_context_state(data)
        assert (ctx.arch, ctx.cache_offset, ctx.layout) == ("lfm2", m["structure"]["memory_at"], "2026")
        ctx.restore(h)
        statefile.write_context_state(out, h, ctx.arch)
    else:
        partial = "partial_only" in path.name
        assert struct.unpack_from("<Ii", data) == (kvcache.statefile.SEQ_MAGIC, seq_id)
        assert h.state_read(data, seq_id, exact=True, partial_only=partial) == len(data)
        out.write(h.state_write(seq_id, partial_only=partial))
        assert h.state_size(seq_id, partial_only=partial) == len(data)
        buf = bytearray(len(data))
        assert h.state_write_into(buf, seq_id, partial_only=partial) == len(data) and buf == data
        f = io.BytesIO()
        assert h.state_write_into(f, seq_id, partial_only=partial) == len(data) and f.getvalue() == data
    return data, out.getvalue(), seq_id


@pytest.mark.parametrize("folder, name", CASES)
def test_file_restores_and_writes_back(folder, name):
    path = interop_hybrid_dir() / folder / name
    m = manifest(path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == m["sha256"]
    h = make_hybrid(m)
    data, out, seq_id = _round_trip(path, m, h)
    assert out == data, f"{folder}/{name}: kvcache writes back {len(out)} bytes, the file has {len(data)}"
    # the cells the manifest lists, in both parts
    st = m["structure"]
    rec = st["recurrent_part"]
    r = h.recr.cells()
    held = sorted((int(r["pos"][i]), r["seq_id"][i]) for i in range(h.recr.size) if r["seq_id"][i])
    want = sorted((c["pos"], c["seq_ids"] or [seq_id]) for c in rec["cells"])
    assert held == want
    if "attn_part" in st:
        (stream,) = st["attn_part"]["streams"]
        cells = [(p, ids) for _, p, ids, _ in h.attn.cells().nonempty()]
        assert sorted(cells) == sorted((c["pos"], c["seq_ids"] if seq_id < 0 else [seq_id])
                                       for c in stream.get("cells", []))


@pytest.mark.parametrize("folder, name", [c for c in CASES if c[1].endswith(".bin") and "partial" not in c[1]])
def test_the_parts_end_where_llama_cpp_ends_them(folder, name):
    """The attention part written alone ends where the manifest's recurrent part starts; the
    recurrent part says all 4 layers and has records for layers 0 and 2 only."""
    path = interop_hybrid_dir() / folder / name
    m = manifest(path)
    st = m["structure"]
    h = make_hybrid(m)
    data, _, seq_id = _round_trip(path, m, h)
    split = st["attn_end_recurrent_start"] - st["memory_at"]
    mem = data[st["memory_at"]:]
    if seq_id >= 0:
        assert len(h.attn.state_write(seq_id, prefix=False)) == split
        assert h.state_write(seq_id, partial_only=True)[8:] == mem[split:]
    else:
        assert len(h.attn.state_write()) == split
        assert h.recr.state_write() == mem[split:]
    rec = st["recurrent_part"]
    assert struct.unpack_from("<I", data, rec["data_at"] + 4)[0] == m["model"]["n_layer"] == 4
    assert [x["il"] for x in rec["r"]] == [x["il"] for x in rec["s"]] == m["model"]["recurrent_layers"]


def test_partial_only_is_the_recurrent_part_of_the_sequence_blob():
    d = interop_hybrid_dir() / "lfm2_a"
    full, partial = (d / "seq0.bin").read_bytes(), (d / "seq0.partial_only.bin").read_bytes()
    at = manifest(d / "seq0.bin")["structure"]["attn_end_recurrent_start"]
    assert partial[8:] == full[at:]
    h = make_hybrid(manifest(d / "seq0.bin"))
    h.state_read(full, 0)
    assert h.state_write(0, partial_only=True) == partial
    assert h.state_write(0, partial_only=True)[8:] == h.state_write(0)[at:]
    assert h.state_size(0, partial_only=True) == len(partial)
    assert h.state_write(0, partial_only=True, prefix=False) == partial[8:]
    # read alone, the recurrent part leaves the attention part as it is
    h2 = make_hybrid(manifest(d / "seq0.bin"))
    h2.state_read((d / "seq1.bin").read_bytes(), 0)
    attn_before = h2.attn.state_write()
    assert h2.state_read(partial, 0, partial_only=True, exact=True) == len(partial)
    assert h2.attn.state_write() == attn_before
    assert h2.recr.state_write(0) == h.recr.state_write(0)


def test_geometry_from_the_model_matches_the_manifests():
    need_module("test", "gguf")
    d = interop_hybrid_dir()
    m = manifest(d / "lfm2_a" / "seq0.bin")
    ctx = m["context"]
    g = kvcache.from_gguf(d / "models" / "tiny_lfm2.gguf", ctx["n_ctx"], n_seq_max=ctx["n_seq_max"],
                          semantics="2026", kv_unified=ctx["kv_unified"], flash_attn=ctx["flash_attn"])
    data = (d / "lfm2_a" / "seq0.bin").read_bytes()
    g.state_read(data, 0, exact=True)
    assert g.state_write(0) == data


def test_other_layouts_are_refused_by_name():
    h = make_hybrid(manifest(interop_hybrid_dir() / "lfm2_a" / "seq0.bin"))
    for call in (lambda: h.state_write(layout="2025"), lambda: h.state_size(0, layout="2026-06"),
                 lambda: h.state_read(b"", layout="2025"), lambda: h.state_write_into(io.BytesIO(), layout="2025")):
        with pytest.raises(ValueError, match="'2026'"):
            call()
    with pytest.raises(ValueError, match="unknown layout"):
        h.state_write(layout="2024")
    with pytest.raises(ValueError, match="partial_only"):
        h.state_write(-1, partial_only=True)
    with pytest.raises(ValueError, match="partial_only"):
        h.state_read(b"", -1, partial_only=True)


# --- bad input: StateError naming the part, both parts unchanged -------------------------------

def _loaded():
    """A hybrid cache holding lfm2_a's whole state, and its sequence 0 blob."""
    d = interop_hybrid_dir() / "lfm2_a"
    h = make_hybrid(manifest(d / "state.bin"))
    statefile.parse_context_state((d / "state.bin").read_bytes()).restore(h)
    return h, (d / "seq0.bin").read_bytes(), manifest(d / "seq0.bin")["structure"]


def _refused(h, data, seq_id, match, **kw):
    before = _snapshot(h)
    with pytest.raises(kvcache.StateError, match=match):
        h.state_read(data, seq_id, **kw)
    assert _snapshot(h) == before, "a failed read changed the cache"


def test_truncations_change_nothing():
    h, blob, st = _loaded()
    at = st["attn_end_recurrent_start"]
    for n in (4, 8, 12, 100, st["attn_part"]["streams"][0]["data_at"] + 3, at - 1):
        _refused(h, blob[:n], 1, "attention part|truncated")
    _refused(h, blob[:at], 1, r"recurrent part \(from byte %d\): missing" % at)
    for n in (at + 3, at + 8, st["recurrent_part"]["data_at"] + 6, len(blob) - 600, len(blob) - 1):
        _refused(h, blob[:n], 1, r"recurrent part \(from byte %d\)" % at)
    _refused(h, blob + b"\0", 1, "trailing", exact=True)


def test_damaged_parts_change_nothing():
    h, blob, st = _loaded()
    at = st["attn_end_recurrent_start"]
    rec = st["recurrent_part"]

    def patch(off, fmt, value):
        b = bytearray(blob)
        struct.pack_into(fmt, b, off, value)
        return bytes(b)

    # the recurrent part says another model: another layer count, row size, type
    _refused(h, patch(rec["data_at"] + 4, "<I", 2), 1, r"recurrent part .*layer count .* has 2, the cache 4")
    _refused(h, patch(rec["r"][1]["at"] + 4, "<Q", 256), 1, r"recurrent part .*layer 2.*row size")
    _refused(h, patch(rec["r"][0]["at"], "<i", 1), 1, r"recurrent part .*layer 0.*type")
    # a sequence's recurrent part holds one state
    _refused(h, patch(at, "<I", 2), 1, "recurrent part")
    # the attention part: another layer count, a V not transposed
    (stream,) = st["attn_part"]["streams"]
    _refused(h, patch(stream["data_at"] + 4, "<I", 4), 1, r"attention part .*layer count")
    _refused(h, patch(stream["data_at"], "<I", 0), 1, r"attention part .*V layout")
    # garbage
    rng = np.random.default_rng(0)
    for n in (16, 1000, len(blob)):
        junk = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        _refused(h, junk, 1, "part|magic|state")
        _refused(h, junk, -1, "part|state")


def test_a_whole_state_of_another_memory_changes_nothing():
    h, blob, _ = _loaded()
    d = interop_hybrid_dir()
    # a sequence blob as the whole memory, a whole state into a sequence
    _refused(h, blob, -1, "sequence-blob magic")
    mem = statefile.parse_context_state((d / "lfm2_a" / "state.bin").read_bytes()).cache
    _refused(h, bytes(mem)[:-12], -1, "recurrent part")
    # a recurrent part whose sequence ids the memory does not have
    small = kvcache.HybridCache(256, 4, [0, 2], 32, 32, 128, 0, n_seq_max=2)
    before = _snapshot(small)
    with pytest.raises(kvcache.StateError, match="part"):
        small.state_read(mem, -1)
    assert _snapshot(small) == before
    # another hybrid geometry: three layers, recurrent layer 0
    other = kvcache.HybridCache(256, 3, [0], 32, 32, 128, 0, n_seq_max=4)
    before = _snapshot(other)
    with pytest.raises(kvcache.StateError, match="attention part|recurrent part"):
        other.state_read(blob, 0)
    assert _snapshot(other) == before


def test_a_failing_recurrent_part_leaves_the_attention_part_as_it_was():
    """llama.cpp clears the attention cells it has just restored; kvcache restores neither."""
    h, blob, st = _loaded()
    at = st["attn_end_recurrent_start"]
    bad = blob[:at] + b"\xff" * (len(blob) - at)
    attn = h.attn.state_write()
    _refused(h, bad, 0, "recurrent part")
    assert h.attn.state_write() == attn
    assert h.seq_pos_max(0) == 22


# --- kvcache inspect and convert -----------------------------------------------------------------

@pytest.mark.parametrize("folder, name", CASES)
def test_inspect_names_both_parts(folder, name):
    from kvcache.inspect import format_report, report

    path = interop_hybrid_dir() / folder / name
    m = manifest(path)
    st = m["structure"]
    r = report(path)
    assert r["variant"] == "hybrid" and r["variant_guessed"] and r["layouts"] == ["2026"] and r["layout"] == "2026"
    rec = st["recurrent_part"]
    parts = r["parts"]
    assert parts["recurrent"] == {"cells": rec["cell_count"], "layers": 4, "layer_records": 2}
    assert r["sections"][-1]["offset"] == rec["at"] and r["sections"][-1]["size"] == rec["end"] - rec["at"]
    assert [x["k_row_size"] for x in r["sections"][-1]["layers"]] == [x["row"] for x in rec["r"]]
    text = format_report(r)
    assert f"recurrent part: {rec['cell_count']} cell" in text and "4 layers counted, records for 2" in text
    if "attn_part" in st:
        (stream,) = st["attn_part"]["streams"]
        assert parts["attention"]["cells"] == stream["cell_count"]
        assert parts["attention"]["layers"] == (2 if stream["cell_count"] else 0)
        assert r["sections"][0]["offset"] == stream["at"]
        assert "attention part: " in text and "[attention]" in text
    else:
        assert parts["attention"] is None and "the recurrent part alone" in text
    if name.endswith(".bin") and m.get("seq_id", -1) >= 0:
        assert r["kind"] == "sequence blob" and r["framing"]["src_seq_id"] == m["seq_id"]


def test_convert_keeps_a_hybrid_state_in_2026():
    from kvcache.convert import convert

    d = interop_hybrid_dir() / "lfm2_a"
    for name in ("seq0.bin", "state.bin", "session.ggsn", "seq0.ggsq", "seq0.partial_only.bin"):
        data = (d / name).read_bytes()
        c = convert(data, "2026")
        assert c.data == data and c.layout == c.source == "2026" and "written unchanged" in c.notes[0]
        with pytest.raises(kvcache.StateError, match="exists in layout 2026 only.*layout 2026-06"):
            convert(data, "2026-06")
    # a sequence blob's prefix takes the id given (the state itself unchanged); a state without one
    # says the id is not used
    data = (d / "seq1.bin").read_bytes()
    c = convert(data, "2026", seq_id=7)
    assert c.data[8:] == data[8:] and c.data[:8] != data[:8] and "names seq 7 (was 1)" in c.notes[0]
    from kvcache.inspect import report_bytes
    assert report_bytes(c.data)["framing"]["src_seq_id"] == 7
    c = convert((d / "state.bin").read_bytes(), "2026", seq_id=7)
    assert c.data == (d / "state.bin").read_bytes() and "seq_id not used" in c.notes[1]
