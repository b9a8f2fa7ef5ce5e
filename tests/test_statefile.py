"""State blobs from Python: state_write_into / state_read on every buffer and file kind, layout
conversion, exact reads, every kind of bad blob (a precise StateError, cells and K/V buffers left
as they were), the llama.cpp wrappers under hostile input, and `kvcache inspect`."""
import io
import json
import mmap
import re
import struct

import numpy as np
import pytest

import kvcache
from kvcache import statefile
from kvcache._core import describe_state

from interop_data import interop_dir


def _unified(v_trans=True, kv_size=64, n_seq_max=4, type_k="f16", type_v="f16", widths=(8, 16, 4), v_widths=None):
    v_widths = [w + 4 for w in widths] if v_widths is None else list(v_widths)
    return kvcache.UnifiedCache(kv_size, len(widths), list(widths), v_widths, type_k=type_k,
                                type_v=type_v, v_trans=v_trans, n_seq_max=n_seq_max, n_pad=32)


def _fill(cache, seed=0):
    """Sequences 0..2 with shared cells and holes, and random bytes in every K/V byte."""
    rng = np.random.default_rng(seed)
    for p in range(12):
        assert cache.find_slot(kvcache.UBatch(pos=[p], seq_id=[[p % 3] + ([1] if p % 4 == 0 and p % 3 != 1 else [])]))
        cache.commit()
    cache.seq_rm(2, 5, 9)
    for il in cache.layers:
        for a in (cache.k(il), cache.v(il)):
            a.view(np.uint8)[...] = rng.integers(0, 256, a.nbytes, dtype=np.uint8).reshape(a.view(np.uint8).shape)
    return cache


def _snapshot(cache):
    return cache.cells(), [(cache.k(il).copy(), cache.v(il).copy()) for il in cache.layers], cache.head, cache.used


def _assert_unchanged(cache, snap):
    cells, bufs, head, used = snap
    assert cache.cells() == cells and cache.head == head and cache.used == used
    for (k, v), il in zip(bufs, cache.layers):
        assert cache.k(il).tobytes() == k.tobytes() and cache.v(il).tobytes() == v.tobytes()


def _recurrent():
    """Three sequences, one state each, recognisable rows."""
    c = kvcache.RecurrentCache(3, 2, [6, 10], [12, 4])
    for s in range(3):
        assert c.find_slot(kvcache.UBatch(pos=[0], seq_id=[s]))
        c.commit()
        for il in range(2):
            c.store(il, np.full((1, c.n_embd_k[il]), 10 * s + il), np.full((1, c.n_embd_v[il]), -s - il))
    return c


def _iswa(v_trans=True):
    """An ISWACache with three sequences in both caches and random K/V bytes."""
    c = kvcache.ISWACache(64, 4, 8, 8, swa_layers=[0, 2], n_swa=4, n_batch=8, v_trans=v_trans, n_seq_max=3)
    for p in range(10):
        assert c.find_slot(kvcache.UBatch(pos=[p], seq_id=[p % 3]))
        c.commit()
    rng = np.random.default_rng(5)
    for part in (c.base, c.swa):
        for il in part.layers:
            for a in (part.k(il), part.v(il)):
                a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
    return c


# --- state_write_into ----------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: _fill(_unified()), lambda: _fill(_unified(False)), _recurrent, _iswa])
@pytest.mark.parametrize("seq_id", [-1, 0, 1, 2])
def test_write_into_every_target(make, seq_id):
    cache = make()
    want = cache.state_write(seq_id, layout="2025")
    n = cache.state_size(seq_id, layout="2025")
    assert n == len(want)

    ba = bytearray(n + 7)
    assert cache.state_write_into(ba, seq_id, layout="2025") == n and ba[:n] == want and ba[n:] == bytes(7)
    arr = np.zeros(n // 4 + 1, dtype=np.uint32)           # any item size: the bytes are the target
    assert cache.state_write_into(arr, seq_id, layout="2025") == n and arr.tobytes()[:n] == want
    mv = memoryview(bytearray(n + 3))[3:]
    assert cache.state_write_into(mv, seq_id, layout="2025") == n and bytes(mv) == want
    with mmap.mmap(-1, n) as mm:
        assert cache.state_write_into(mm, seq_id, layout="2025") == n and mm[:] == want
    f = io.BytesIO()
    assert cache.state_write_into(f, seq_id, layout="2025") == n and f.getvalue() == want


def test_write_into_files_in_chunks(tmp_path):
    """A state larger than the chunk goes to a file intact, also through an unbuffered raw file."""
    cache = kvcache.UnifiedCache(2048, 2, 256, 256, v_trans=True, n_seq_max=2, n_pad=32)
    for start in range(0, 2000, 500):
        assert cache.find_slot(kvcache.UBatch(pos=list(range(start, start + 500)), seq_id=[start % 2] * 500))
        cache.commit()
    for il in cache.layers:
        cache.k(il).view(np.uint8)[...] = np.arange(cache.k(il).nbytes, dtype=np.uint64).astype(np.uint8).reshape(
            cache.k(il).view(np.uint8).shape)
        cache.v(il).view(np.uint8)[...] = 7
    want = cache.state_write(-1, layout="2025")
    assert len(want) > 2 << 20
    p = tmp_path / "s.bin"
    with open(p, "wb", buffering=0) as f:
        assert cache.state_write_into(f, -1, layout="2025") == len(want)
    assert p.read_bytes() == want
    with open(p, "wb") as f:
        assert cache.state_write_into(f, 1, layout="2025") == cache.state_size(1, layout="2025")
    assert p.read_bytes() == cache.state_write(1, layout="2025")


def test_write_into_rejects():
    cache = _fill(_unified())
    n = cache.state_size(0, layout="2025")
    with pytest.raises(ValueError, match=f"buf holds {n - 1} bytes, the state needs {n}"):
        cache.state_write_into(bytearray(n - 1), 0, layout="2025")
    with pytest.raises(TypeError, match="writable"):
        cache.state_write_into(bytes(n), 0, layout="2025")
    with pytest.raises(TypeError, match="writable buffer or a binary file object"):
        cache.state_write_into(12, 0, layout="2025")
    with pytest.raises(ValueError, match="C-contiguous"):
        cache.state_write_into(np.zeros((n, 2), dtype=np.uint8)[:, 0], 0, layout="2025")
    with pytest.raises(ValueError, match="seq_id"):
        cache.state_write_into(bytearray(n), 9, layout="2025")
    with pytest.raises(TypeError):
        cache.state_write_into(io.StringIO(), 0, layout="2025")


# --- state_read: buffers, exact, convert --------------------------------------------------------

@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.uint8),
                                  lambda b: memoryview(b"xyz" + b)[3:]])
def test_read_any_buffer(wrap):
    src = _fill(_unified())
    blob = src.state_write(-1, layout="2025")
    dst = _unified()
    assert dst.state_read(wrap(blob), layout="2025") == len(blob)
    assert _listed(dst) == _listed(src) and dst.state_write(-1, layout="2025") == blob


def _listed(cache):
    """(pos, seq ids) of the non-empty cells in cell order (a whole restore compacts them)."""
    return [(c[1], c[2]) for c in cache.cells().nonempty()]


def test_read_rejects_non_buffers():
    with pytest.raises(TypeError, match="bytes-like"):
        _unified().state_read("not bytes", layout="2025")
    with pytest.raises(ValueError, match="C-contiguous"):
        _unified().state_read(np.zeros((8, 2), np.uint8)[:, 0], layout="2025")


@pytest.mark.parametrize("make", [lambda: _fill(_unified()), _recurrent, _iswa])
def test_exact(make):
    src = make()
    blob = src.state_write(1, layout="2025") + b"\0\0"
    dst = make()
    snap = (dst.base.cells(), dst.swa.cells()) if isinstance(dst, kvcache.ISWACache) else dst.cells()
    with pytest.raises(kvcache.StateError, match="2 trailing bytes after the state"):
        dst.state_read(blob, 1, exact=True, layout="2025")
    assert _eq_cells((dst.base.cells(), dst.swa.cells()) if isinstance(dst, kvcache.ISWACache) else dst.cells(), snap)
    assert dst.state_read(blob, 1, layout="2025") == len(blob) - 2


def _eq_cells(a, b):
    if isinstance(a, tuple):
        return all(_eq_cells(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return all(np.array_equal(np.asarray(a[k], dtype=object), np.asarray(b[k], dtype=object)) for k in a)
    return a == b


@pytest.mark.parametrize("type_v", ["f16", "f32", "bf16"])
@pytest.mark.parametrize("seq_id", [-1, 0, 1])
def test_convert_v_layout_both_ways(type_v, seq_id):
    t = _fill(_unified(True, type_v=type_v))
    blob = t.state_write(seq_id, layout="2025")
    rows = _unified(False, type_v=type_v)
    with pytest.raises(kvcache.StateError, match=r"V layout \(byte \d+\): the state has V transposed"):
        rows.state_read(blob, seq_id, layout="2025")
    assert rows.state_read(blob, seq_id, convert=True, layout="2025") == len(blob)
    # the values follow: V element j of each restored cell, compared through the cells' order
    src_cells = [c for c in t.cells().nonempty() if seq_id < 0 or seq_id in c[2]]
    dst_cells = rows.cells().nonempty()
    assert [c[1] for c in src_cells] == [c[1] for c in dst_cells]
    for il in t.layers:
        tv, rv = t.v(il), rows.v(il)          # transposed: [width, size]; rows: [size, width]
        for (si, *_), (di, *_) in zip(src_cells, dst_cells):
            assert tv[:, si].tobytes() == rv[di].tobytes()
            assert t.k(il)[si].tobytes() == rows.k(il)[di].tobytes()
    back = _unified(True, type_v=type_v)
    assert back.state_read(rows.state_write(seq_id, layout="2025"), seq_id, convert=True, layout="2025")
    assert back.state_write(seq_id, layout="2025") == blob


@pytest.mark.parametrize("seq_id", [-1, 1])
def test_iswa_convert_both_parts(seq_id):
    t = _iswa(True)
    blob = t.state_write(seq_id, layout="2025")
    rows = kvcache.ISWACache(64, 4, 8, 8, swa_layers=[0, 2], n_swa=4, n_batch=8, v_trans=False, n_seq_max=3)
    with pytest.raises(kvcache.StateError, match="part 0 of 2 .*V layout"):
        rows.state_read(blob, seq_id, layout="2025")
    assert rows.state_read(blob, seq_id, convert=True, exact=True, layout="2025") == len(blob)
    back = _iswa(True)
    back.state_read(rows.state_write(seq_id, layout="2025"), seq_id, convert=True, layout="2025")
    assert back.state_write(seq_id, layout="2025") == blob


def test_convert_refuses_quantized_transposed():
    blob = bytearray(_fill(_unified(True, type_k="q8_0", widths=(32, 64), v_widths=(32, 64))).state_write(-1, layout="2025"))
    q = _unified(False, type_k="q8_0", type_v="q8_0", widths=(32, 64), v_widths=(32, 64))
    d = describe_state(blob)
    struct.pack_into("<i", blob, d["layers"][0]["v_offset"], 8)  # claim q8_0 values, transposed
    with pytest.raises(kvcache.StateError, match="q8_0 has blocks of 32 elements and cannot be transposed"):
        q.state_read(blob, convert=True, layout="2025")


# --- every kind of bad blob: a precise message, nothing changed ---------------------------------

def _offsets(blob):
    d = describe_state(blob)
    return d, d["layers"]


def _patch(blob, at, fmt, value):
    b = bytearray(blob)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def _failure_cases():
    src = _fill(_unified())
    seq = src.state_write(0, layout="2025")
    whole = src.state_write(-1, layout="2025")
    ds, ls = _offsets(seq)
    dw, lw = _offsets(whole)
    return [
        ("truncated", seq[:-1], 0, r"state truncated at byte \d+ of %d while reading the values of layer 2" % (len(seq) - 1)),
        ("layer count", _patch(seq, ds["data_offset"] + 4, "<I", 2), 0,
         r"layer count \(byte \d+\): the state has 2, the cache 3"),
        ("key type", _patch(seq, ls[1]["k_offset"], "<i", 0), 0, r"layer 1 \(byte \d+\): key type 0 \(f32\) != cache's 1 \(f16\)"),
        ("value type", _patch(seq, ls[2]["v_offset"], "<i", 30), 0, r"layer 2 \(byte \d+\): value type 30 \(bf16\)"),
        ("key row size", _patch(seq, ls[0]["k_offset"] + 4, "<Q", 18), 0, r"key row size 18 != cache's 16"),
        ("element size", _patch(seq, ls[0]["v_offset"] + 4, "<I", 4), 0, r"value element size 4 != cache's 2"),
        ("GQA width", _patch(seq, ls[1]["v_offset"] + 8, "<I", 21), 0,
         r"value width \(n_embd_v_gqa\) 21 != cache's 20"),
        ("v_trans", _patch(seq, ds["data_offset"], "<I", 0), 0, r"V layout .*conversion not requested"),
        ("v_trans value", _patch(seq, ds["data_offset"], "<I", 7), 0, r"flag 7 is neither 0 nor 1"),
        # a count the bytes can hold (its cells' records fit after it) that the cache cannot
        ("not enough cells", _patch(seq, 0, "<I", 65) + bytes(12 * 65), 0,
         r"not enough cells: the state holds 65 cells \(byte 0\), the cache has 64"),
        ("cell count beyond the bytes", _patch(seq, 0, "<I", 65), 0,
         r"state truncated at byte 4 of %d: the cell count \(byte 0\) says 65 cells, which need at least 780 "
         r"bytes, %d remain" % (len(seq), len(seq) - 4)),
        ("invalid seq id", _patch(whole, 12, "<i", 4), -1, r"sequence id 4 out of range \[0, 4\)"),
        ("n_seq_id", _patch(seq, 8, "<I", 2), 0, r"2 sequence ids in a single-sequence state \(must be 1\)"),
        ("negative position", _patch(seq, 4 + 12, "<i", -3), 0, r"cell 1 \(byte 16\): negative position -3"),
        ("trailing bytes", seq + b"\x01", 0, r"1 trailing bytes after the state"),
    ]


@pytest.mark.parametrize("case", _failure_cases(), ids=lambda c: c[0])
def test_every_failure_kind_is_precise_and_changes_nothing(case):
    name, blob, seq_id, pattern = case
    dst = _fill(_unified(), seed=1)
    snap = _snapshot(dst)
    with pytest.raises(kvcache.StateError, match=pattern):
        dst.state_read(blob, seq_id, exact=True, layout="2025")
    _assert_unchanged(dst, snap)


def test_no_contiguous_run_is_precise_and_changes_nothing():
    src = _unified(kv_size=32)
    assert src.find_slot(kvcache.UBatch(pos=list(range(10)), seq_id=[0] * 10))
    src.commit()
    blob = src.state_write(0, layout="2025")
    dst = _unified(kv_size=32)
    assert dst.find_slot(kvcache.UBatch(pos=list(range(32)), seq_id=[1] * 32))
    dst.commit()
    for p0 in (0, 10, 20):      # free runs of 9 cells: 27 free, none 10 long
        assert dst.seq_rm(1, p0, p0 + 9)
    snap = _snapshot(dst)
    with pytest.raises(kvcache.StateError, match="no room: sequence 3 needs 10 contiguous free cells"):
        dst.state_read(blob, 3, layout="2025")
    _assert_unchanged(dst, snap)


def test_truncation_at_every_offset_changes_nothing():
    blob = (interop_dir() / "llama_fa0" / "seq1.bin").read_bytes()
    dst = kvcache.UnifiedCache(256, 3, 32, 32, v_trans=True, n_seq_max=4)
    dst.state_read((interop_dir() / "llama_fa0" / "state.bin").read_bytes()[1233:], layout="2025")
    snap = _snapshot(dst)
    for n in range(len(blob)):
        with pytest.raises(kvcache.StateError, match="truncated at byte"):
            dst.state_read(memoryview(blob)[:n], 1, layout="2025")
    _assert_unchanged(dst, snap)


def test_empty_sequence_blob_restores_as_empty():
    src = _unified()
    blob = src.state_write(3, layout="2025")
    assert len(blob) == 4 + 8 + 24 * 3
    dst = _fill(_unified())
    assert dst.seq_pos_max(1) >= 0
    assert dst.state_read(blob, 1, exact=True, layout="2025") == len(blob)
    assert dst.seq_pos_max(1) == -1


def test_recurrent_failures_change_nothing():
    src = _recurrent()
    blob = src.state_write(1, layout="2025")
    dst = _recurrent()
    before = dst.state_write(-1, layout="2025")
    for n in range(len(blob)):
        with pytest.raises(kvcache.StateError, match="truncated at byte"):
            dst.state_read(blob[:n], 1, layout="2025")
    k_off = describe_state(blob)["layers"][0]["k_offset"]
    with pytest.raises(kvcache.StateError, match=re.escape(f"layer 0 (byte {k_off}): key type 1 (f16) != cache's 0 (f32)")):
        dst.state_read(_patch(blob, k_off, "<i", 1), 1, layout="2025")
    assert dst.state_write(-1, layout="2025") == before


# --- describe_state and the wrappers under hostile input ----------------------------------------

def test_describe_state_reports_layout():
    cache = _fill(_unified())
    d = describe_state(cache.state_write(-1, layout="2025"))
    nonempty = cache.cells().nonempty()
    assert d["cell_count"] == len(nonempty) and d["v_trans"] == 1 and d["n_layer"] == 3
    assert d["pos"].tolist() == [c[1] for c in nonempty]
    assert d["seq"].shape == (len(nonempty), 4)          # 4 words: ids up to 255
    assert [[64 * w + b for w, m in enumerate(row) for b in range(64) if int(m) >> b & 1]
            for row in d["seq"]] == [c[2] for c in nonempty]
    assert [l["v_width"] for l in d["layers"]] == [12, 20, 8]
    with pytest.raises(kvcache.StateError,
                       match=r"the cell count \(byte 0\) says 4294967295 cells, which need at least"):
        describe_state(b"\xff\xff\xff\xff" + bytes(20))


def _seq_file_bytes():
    cache = _fill(_unified())
    f = io.BytesIO()
    statefile.write_sequence_file(f, cache, 0, [5, 6, 7], layout="2025")
    return cache, f.getvalue()


def test_sequence_file_round_trip(tmp_path):
    cache, data = _seq_file_bytes()
    s = statefile.parse(data)
    assert isinstance(s, statefile.SequenceFile)
    assert (s.magic, s.version, s.tokens.tolist(), s.cache_offset) == (statefile.SEQUENCE_MAGIC, 2, [5, 6, 7], 24)
    assert bytes(s.cache) == cache.state_write(0, layout="2025")
    dst = _unified()
    s.restore(dst, 2)
    assert [c[1] for c in dst.cells().nonempty()] == [c[1] for c in cache.cells().nonempty() if 0 in c[2]]
    p = tmp_path / "x.ggsq"
    statefile.write_sequence_file(p, cache, 0, np.array([5, 6, 7]), layout="2025")
    assert p.read_bytes() == data
    assert statefile.load(p).tokens.tolist() == [5, 6, 7]


def test_session_file_round_trip(tmp_path):
    cache = _fill(_unified())
    logits = np.arange(10, dtype=np.float32)
    p = tmp_path / "x.ggsn"
    n = statefile.write_session_file(p, cache, "llama", [1, 2, 3], output_pos=[0, 4], logits=logits, layout="2025")
    s = statefile.load(p)
    assert isinstance(s, statefile.SessionFile) and n == p.stat().st_size
    c = s.context
    assert (c.arch, c.output_pos.tolist(), c.n_vocab, len(c.embeddings)) == ("llama", [0, 4], 5, 0)
    assert np.array_equal(c.logits, logits)
    dst = _unified()
    s.restore(dst)
    assert _listed(dst) == _listed(cache)
    ctx = statefile.load(io.BytesIO(p.read_bytes()[12 + 12:]))
    assert isinstance(ctx, statefile.ContextState) and bytes(ctx.cache) == cache.state_write(-1, layout="2025")


def test_wrappers_truncated_anywhere_raise_state_error():
    _, seqf = _seq_file_bytes()
    cache = _fill(_unified())
    f = io.BytesIO()
    statefile.write_session_file(f, cache, "gemma2", [9] * 5, output_pos=[1], logits=np.ones(3), layout="2025")
    sess = f.getvalue()
    for data, parse, header in ((seqf, statefile.parse_sequence_file, 24),
                                (sess, statefile.parse_session_file, 12 + 20 + 10 + 4 + 4 + 8 + 12 + 8)):
        for n in range(header):
            with pytest.raises(kvcache.StateError, match="truncated at byte"):
                parse(data[:n])
        # past the header the cache part is cut short: a version-9/2 file's layout is then in
        # no shape that parses to the end; named, the cache refuses it, unchanged
        with pytest.raises(kvcache.StateError, match="stream counts|any layout"):
            parse(data[:-3])
        obj = parse(data[:-3], layout="2025")
        dst = _unified()
        with pytest.raises(kvcache.StateError, match="truncated"):
            obj.restore(dst, 0) if isinstance(obj, statefile.SequenceFile) else obj.restore(dst)
        assert dst.used == 0


@pytest.mark.parametrize("patch,pattern", [
    (lambda b: _patch(b, 0, "<I", 0x6767736F), "magic 0x6767736f is not a sequence file's 0x67677371"),
    (lambda b: _patch(b, 4, "<I", 4), r"a sequence file of version 4 \(written by a newer llama.cpp\?\): kvcache reads "
                                      "versions 2 and 3"),
    (lambda b: _patch(b, 4, "<I", 1), "a sequence file of version 1: kvcache reads versions 2 and 3"),
    (lambda b: _patch(b, 8, "<I", 0xFFFFFFFF), "the tokens holds 4294967295 items of 4 bytes"),
])
def test_sequence_file_bad_header(patch, pattern):
    _, data = _seq_file_bytes()
    with pytest.raises(kvcache.StateError, match=pattern):
        statefile.parse_sequence_file(patch(data))


@pytest.mark.parametrize("patch,pattern", [
    (lambda b: _patch(b, 0, "<I", 300), "architecture name of 300 bytes"),
    (lambda b: b[:4] + b"LL" + b[6:], "is not a model architecture name"),
    (lambda b: _patch(b, 9, "<i", -1), "negative output count -1"),
    (lambda b: _patch(b, 13, "<i", -5), "output 0 .* negative batch position -5"),
    (lambda b: _patch(b, 17, "<Q", 2**62), "the logits holds 4611686018427387904 items"),
])
def test_context_state_bad_header(patch, pattern):
    cache = _fill(_unified())
    f = io.BytesIO()
    statefile.write_context_state(f, cache, "llama", output_pos=[3], logits=np.ones(4), layout="2025")
    with pytest.raises(kvcache.StateError, match=pattern):
        statefile.parse_context_state(patch(f.getvalue()))


def test_write_arguments_checked():
    cache = _fill(_unified())
    with pytest.raises(ValueError, match="architecture name"):
        statefile.write_context_state(io.BytesIO(), cache, "Llama 3")
    with pytest.raises(ValueError, match="output_pos must not be negative"):
        statefile.write_context_state(io.BytesIO(), cache, "llama", output_pos=[-1], layout="2025")
    with pytest.raises(ValueError, match="seq_id"):
        statefile.write_sequence_file(io.BytesIO(), cache, 9, [])
    with pytest.raises(TypeError, match="tokens"):
        statefile.write_sequence_file(io.BytesIO(), cache, 0, ["a"])


# --- kvcache inspect -----------------------------------------------------------------------------

def test_inspect_cli_text_and_json(capsys):
    from kvcache.cli import main

    path = interop_dir() / "llama_fa0" / "seq0.ggsq"
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sequence file" in out and "tokens: 40" in out and "seq 0: positions 0-39" in out
    assert "layer 0: K f16 rows of 64 bytes" in out
    assert main(["inspect", "--json", str(path)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kind"] == "sequence file" and r["tokens"]["count"] == 40 and r["cell_count"] == 40
    assert r["sections"][0]["sequences"] == {"0": [[0, 39]]}
    assert r["sections"][0]["layers"][0]["v_width"] == 32


def test_inspect_corrupt_file_one_line(tmp_path, capsys):
    from kvcache.cli import main

    data = (interop_dir() / "llama_fa0" / "session.ggsn").read_bytes()
    for i, bad in enumerate((data[:700], data + b"\0", b"\x01\x02", _patch(data, 4, "<I", 8))):
        p = tmp_path / f"bad{i}"
        p.write_bytes(bad)
        assert main(["inspect", str(p)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvcache inspect: error: ") and "Traceback" not in err
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_inspect_main_and_report(tmp_path):
    from kvcache import inspect

    cache = _fill(_unified())
    p = tmp_path / "w.bin"
    p.write_bytes(cache.state_write(-1, layout="2025"))
    r = inspect.report(p)
    assert r["kind"] == "whole-cache blob" and r["variant"] == "unified" and r["variant_guessed"]
    assert r["sections"][0]["sequences"]["1"] == inspect._ranges(
        np.array([c[1] for c in cache.cells().nonempty() if 1 in c[2]]))
    assert inspect.main([str(p), "--variant", "unified"]) == 0
