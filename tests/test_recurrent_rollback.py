"""Today's recurrent memory (``RecurrentCache(semantics="2026")``) and its rollback snapshots.

llama.cpp 0.3.36 keeps ``n_rs_seq`` snapshot planes per state: a ubatch of k tokens of a
sequence writes plane p = the state p tokens before its last one, for p < min(k, n_rs_seq + 1),
and ``seq_rm(s, p0, -1)`` with ``0 < p0 <= pos`` rolls the state back to ``p0 - 1`` by pointing
the next decode at plane ``pos - p0 + 1``. It accepts a rollback of r <= n_rs_seq positions
without checking that the last ubatch wrote plane r: after a decode of k <= r tokens the next
decode reads a plane an older decode wrote. The interop-hybrid blobs show it (``lfm2_c_rollback``:
12 tokens, then 4, a rollback of 4 leaves the state of position 7 under position 11;
``lfm2_c2_rollback_specbatch``: 11 + 5, the same rollback is exact). kvcache refuses that
rollback (rule C9, docs/semantics.md): False, nothing changed."""
import json
import struct

import numpy as np
import pytest

import kvcache


def rec(n_rs_seq=4, n_seq_max=4, buffers="owned"):
    return kvcache.RecurrentCache(n_seq_max, 1, 1, 1, semantics="2026", n_rs_seq=n_rs_seq, buffers=buffers)


def decode(c, s, p0, n):
    """Place one group of n tokens of sequence s at positions p0 .. p0 + n - 1, then write what
    the graph writes: plane p of the cell = (here) the position it stands for."""
    assert c.find_slot(kvcache.UBatch(list(range(p0, p0 + n)), [s], n_seq_tokens=n))
    c.s_copy()
    if c.buffers != "none":
        for p in range(min(n, c.n_rs_seq + 1)):
            row = np.full((1, 1), p0 + n - 1 - p, np.float32)
            c.store(0, row, row, plane=p)


def snapshot(c):
    cells = c.cells()
    return ({k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in cells.items()},
            c.head, c.n, c.used, [c.pending_rollback(s) for s in range(c.n_seq_max)], c.state_write())


def recurrent_rows(blob: bytes, m: dict) -> list:
    """The R rows of the recurrent part of a sequence blob, per recurrent layer (a manifest's
    structure gives the offsets)."""
    part = m["structure"]["recurrent_part"]
    n = part["cell_count"]
    return [np.frombuffer(blob, np.float32, n * r["row"] // 4, r["rows_at"]) for r in part["r"]]


@pytest.mark.parametrize("first, second, accepted", [(12, 4, False), (11, 5, True)])
def test_rollback_after_decodes(first, second, accepted):
    c = rec()
    decode(c, 0, 0, first)
    decode(c, 0, first, second)
    assert c.seq_pos_max(0) == 15
    assert c.rollback_ok(0, 4) is accepted
    before = snapshot(c)
    assert c.seq_rm(0, 12, -1) is accepted
    if not accepted:
        # C9: the planes of a 4-token decode reach 3 back; llama.cpp would read plane 4 of the
        # 12-token decode (the state of position 7)
        assert snapshot(c) == before
        return
    assert c.seq_pos_max(0) == 11 and c.pending_rollback(0) == 4
    assert not c.seq_rm(0, 11, -1), "a second rollback waits for the next decode"
    # the state written now is plane 4's: position 11's (snapshots are not serialised)
    blob = c.state_write(0)
    assert struct.unpack_from("<f", blob, len(blob) - 4)[0] == 11.0
    assert c.s_copy().tolist() == [4 * c.size + 0]
    assert c.pending_rollback(0) == 0 and c.s_copy().tolist() == [0]


def test_llama_cpp_accepts_the_wrong_rollback(shared_dir):
    """The blobs 0.3.36 wrote: the 12 + 4 rollback returned true and left an older state; the
    11 + 5 one is exact. kvcache refuses the first (test_rollback_after_decodes)."""
    base = shared_dir / "interop-hybrid"
    if not base.is_dir():
        pytest.skip(f"{base} not found")
    wrong, right = base / "lfm2_c_rollback", base / "lfm2_c2_rollback_specbatch"
    mw = json.loads((wrong / "seq0.bin.json").read_text())
    assert mw["rollback"]["returned"] is True and mw["rollback"]["pending_plane_at_dump"] == 4
    assert [d["op"] for d in mw["script"]] == ["decode", "decode", "seq_rm"]
    assert [len(d["tokens"]) for d in mw["script"][:2]] == [12, 4]
    w = (wrong / "seq0.bin").read_bytes()
    fw = (wrong / "fresh_seq0.bin").read_bytes()
    rows, fresh = recurrent_rows(w, mw), recurrent_rows(fw, mw)
    assert max(float(np.abs(a - b).max()) for a, b in zip(rows, fresh)) > 1.0, "llama.cpp's state is not right"
    start = mw["structure"]["attn_end_recurrent_start"]
    assert w[:start] == fw[:start], "the attention part is right"
    mr = json.loads((right / "seq0.bin.json").read_text())
    assert [len(d["tokens"]) for d in mr["script"][:2]] == [11, 5]
    assert (right / "seq0.bin").read_bytes() == (right / "fresh_seq0.bin").read_bytes()


def test_rules():
    c = rec(buffers="none")
    decode(c, 0, 0, 8)
    before = snapshot(c)
    assert not c.seq_rm(0, 0, 3), "a cut inside the state from 0 (llama.cpp: true, nothing removed)"
    assert not c.seq_rm(0, 2, 5), "a cut inside the state"
    assert not c.seq_rm(0, 2, -1), "6 back > n_rs_seq"
    assert snapshot(c) == before
    assert c.seq_rm(0, 20, -1) and snapshot(c) == before, "past the state: nothing to do"
    c.seq_cp(0, 1)
    assert not c.rollback_ok(1, 2) and not c.seq_rm(1, 6, -1), "a shared state cannot roll back"
    c.seq_rm(1)
    assert c.seq_rm(0, 6, -1) and c.pending_rollback(0) == 2
    c.seq_cp(0, 2)
    assert c.pending_rollback(2) == 2, "the copy shares the rolled-back state"
    c.seq_keep(0)
    assert [c.pending_rollback(s) for s in range(4)] == [2, 0, 0, 0]
    c.seq_rm(0)
    assert c.pending_rollback(0) == 0 and c.seq_pos_max(0) == -1
    decode(c, 0, 0, 1)
    decode(c, 0, 1, 1)
    assert not c.rollback_ok(0, 1), "a one-token ubatch writes no snapshot"
    assert not hasattr(c, "s_mask"), "today's graph zeroes row rs_z instead"
    c.clear()
    assert [c.pending_rollback(s) for s in range(4)] == [0] * 4


def test_staged_sources():
    c = rec(n_rs_seq=0, buffers="none")
    assert c.find_slot(kvcache.UBatch([0, 0], [0, 1]))
    assert c.rs_z == 0 and c.s_copy().tolist() == [0, 0], "new states read the zero row"
    assert c.s_copy().tolist() == [0, 0], "s_copy moves nothing"
    assert c.find_slot(kvcache.UBatch([1, 1], [0, 1]))
    assert c.s_copy().tolist() == [0, 1]
    assert not c.seq_rm(0, 1, -1), "n_rs_seq 0: no rollback"


def test_arguments():
    with pytest.raises(ValueError, match="n_rs_seq = 1: expected 0"):
        kvcache.RecurrentCache(2, 1, 1, 1, n_rs_seq=1)
    with pytest.raises(ValueError, match="at most 64"):
        rec(n_rs_seq=65)
    with pytest.raises(ValueError, match="semantics = '2027'"):
        kvcache.RecurrentCache(2, 1, 1, 1, semantics="2027")
    c = rec(n_rs_seq=2)
    assert (c.semantics, c.n_rs_seq) == ("2026", 2)
    assert c.size_k_bytes == 3 * 4 * 4 and c.k(0, 2).shape == (4, 1)
    with pytest.raises(ValueError, match=r"plane = 3 is outside \[0, n_rs_seq = 2\]"):
        c.k(0, 3)
    assert "n_rs_seq=2" in repr(c)
    assert kvcache.RecurrentCache(2, 1, 1, 1).semantics == "2025"
