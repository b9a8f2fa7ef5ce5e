"""HybridCache state: random operations on both parts (decodes with K/V and recurrent rows,
the sequence operations, rollbacks), then the whole state and each sequence's written, read into
a fresh cache and written again: the same bytes, with and without the sequence-blob prefix,
through a buffer and a file, and the recurrent part alone (partial_only); with and without a
sliding window (llama_memory_hybrid_iswa: the attention part an iSWA pair)."""
import io

import numpy as np
import pytest

from conftest import need_module

hypothesis = need_module("test", "hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvcache  # noqa: E402
from kvcache.handoff import split_hybrid  # noqa: E402

N_SEQ = 3
WIDTH = [4, 8, 4, 8]    # K and V widths by model layer


def make(kv_unified=True, n_rs_seq=0, n_swa=0):
    # Falcon-H1-like layer 1 in both parts; layer 3 attention only, layers 0 and 2 recurrent only;
    # with a window, layer 3 in the SWA cache (of 256 cells: today's padding) and layer 1 in the base
    window = dict(n_swa=n_swa, swa_layers=[3], n_batch=4, swa_full=False) if n_swa else {}
    return kvcache.HybridCache(16, 4, [0, 1, 2], WIDTH, WIDTH, [6, 6, 6, 6], [2, 2, 2, 2],
                               n_seq_max=N_SEQ, attn_layers=[1, 3], kv_unified=kv_unified, n_rs_seq=n_rs_seq,
                               type_k="f32", type_v="f32", **window)


def base_used(h):
    """Cells in use in the attention cache without a window."""
    return h.attn.used if h.n_swa == 0 else h.attn.base.used


def decode(h, rng, s, n):
    p0 = h.seq_pos_max(s) + 1
    for ub in list(h.ubatches(list(range(p0, p0 + n)), [s] * n, 4)):
        if not h.find_slot(ub):
            return
        for il in h.attn_layers:
            w = WIDTH[il]
            h.store(il, rng.standard_normal((ub.n_tokens, w)).astype(np.float32),
                    rng.standard_normal((ub.n_tokens, w)).astype(np.float32))
        for il in h.recurrent_layers:
            h.store_state(il, rng.standard_normal((1, 6)).astype(np.float32),
                          rng.standard_normal((1, 2)).astype(np.float32))


OPS = st.lists(st.tuples(st.sampled_from(["decode", "decode", "decode", "rm", "rollback", "cp", "keep", "add",
                                          "div"]),
                         st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1), st.integers(1, 7)),
               max_size=14)


def apply(h, ops, seed):
    rng = np.random.default_rng(seed)
    for op, s, t, n in ops:
        if op == "decode":
            decode(h, rng, s, n)
        elif op == "rm":
            h.seq_rm(s, n if n % 2 else -1, -1 if n % 2 else n)
        elif op == "rollback":
            pm = h.seq_pos_max(s)
            if pm >= 0 and h.rollback_ok(s, min(n, 2)):
                h.seq_rm(s, pm - min(n, 2) + 1, -1)
        elif op == "cp" and s != t:
            try:
                h.seq_cp(s, t)
            except ValueError:
                pass    # across streams
        elif op == "keep" and n == 1:
            h.seq_keep(s)
        elif op == "add":
            h.seq_add(s, 0, -1, n)
        elif op == "div" and n > 1:
            h.seq_div(s, 0, -1, n)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**16), kv_unified=st.booleans(), n_rs_seq=st.sampled_from([0, 2]),
       n_swa=st.sampled_from([0, 3]))
# a seq_add of sequence 0 moves the cells it shares with sequence 1 (whose recurrent position
# stays): the SWA cell sequence 1's window left, as the SWA cache sees it, may be taken
@example(ops=[("add", 0, 0, 1), ("decode", 0, 0, 1), ("cp", 0, 1, 1), ("decode", 0, 0, 3)], seed=0, kv_unified=True,
         n_rs_seq=0, n_swa=3)
def test_state_round_trips(ops, seed, kv_unified, n_rs_seq, n_swa):
    h = make(kv_unified, n_rs_seq, n_swa)
    apply(h, ops, seed)
    whole = h.state_write()
    assert len(whole) == h.state_size()
    fresh = make(kv_unified, n_rs_seq, n_swa)
    assert fresh.state_read(whole, exact=True) == len(whole)
    assert fresh.state_write() == whole
    for s in range(N_SEQ):
        assert (fresh.seq_pos_min(s), fresh.seq_pos_max(s)) == (h.seq_pos_min(s), h.seq_pos_max(s))
        blob = h.state_write(s)
        one = make(kv_unified, n_rs_seq, n_swa)
        assert one.state_read(blob, s, exact=True) == len(blob)
        assert one.state_write(s) == blob
        bare = h.state_write(s, prefix=False)
        assert bare == blob[8:] and one.state_read(bare, s) == len(bare)
        buf = bytearray(len(blob))
        f = io.BytesIO()
        assert h.state_write_into(buf, s) == len(blob) == h.state_write_into(f, s)
        assert bytes(buf) == blob == f.getvalue()
        partial = h.state_write(s, partial_only=True)
        assert partial[8:] == blob[len(blob) - len(partial) + 8:]
        other = make(kv_unified, n_rs_seq, n_swa)
        other.state_read(partial, s, partial_only=True, exact=True)
        assert other.state_write(s, partial_only=True) == partial and base_used(other) == 0
    # into a cache that holds other sequences: the read replaces the destination only
    if h.seq_pos_max(0) >= 0:
        blob = h.state_write(0)
        mixed = make(kv_unified, n_rs_seq, n_swa)
        apply(mixed, ops[::-1], seed + 1)
        # one stream: llama.cpp's find_slot may take another sequence's SWA cells it no longer sees
        shared = bool(n_swa and kv_unified)
        keep = {s: held(mixed, s) if shared else mixed.state_write(s) for s in range(1, N_SEQ)}
        try:
            mixed.state_read(blob, 0)
        except kvcache.StateError as e:
            assert "no" in str(e) and "cell" in str(e) or "room" in str(e)     # full: nothing changed
            assert {s: held(mixed, s) if shared else mixed.state_write(s) for s in range(1, N_SEQ)} == keep
        else:
            assert mixed.state_write(0) == blob
            for s in range(1, N_SEQ):
                if shared:
                    assert_kept_but_out_of_window(keep[s], held(mixed, s), n_swa)
                else:
                    assert mixed.state_write(s) == keep[s]


def held(h, s):
    """What sequence s holds in a one-stream windowed memory: its cells and their positions in
    each attention cache, and its recurrent state."""
    out = {"recr": h.recr.state_write(s), "pos_max": h.seq_pos_max(s), "swa_pos_max": h.attn.swa.seq_pos_max(s)}
    for name, c in (("base", h.attn.base), ("swa", h.attn.swa)):
        cells, pos = c.seq_cells(s)
        out[name] = {int(i): int(p) for i, p in zip(cells, pos)}
    return out


def assert_kept_but_out_of_window(before, after, n_swa):
    """A state read for another sequence leaves this one as it was, except that (as llama.cpp's
    find_slot does) it may take a SWA cell this sequence's window has left behind: one whose
    position is n_swa or more before the sequence's next position in the SWA cache. (That is the
    SWA cache's own: a seq_add of a sequence moves the cells it shares with this one in the
    attention caches, not this one's recurrent position, so the memory's seq_pos_max can be less.)"""
    assert {k: v for k, v in after.items() if k != "swa"} == {k: v for k, v in before.items() if k != "swa"}
    lost = set(before["swa"]) - set(after["swa"])
    assert all(after["swa"][i] == before["swa"][i] for i in after["swa"])
    assert all(before["swa_pos_max"] + 1 - before["swa"][i] >= n_swa for i in lost)


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("n_swa", [0, 3])
def test_failed_reads_change_nothing(kv_unified, n_swa):
    h = make(kv_unified, 2, n_swa)
    apply(h, [("decode", 0, 0, 7), ("decode", 1, 0, 5), ("cp", 0, 2, 1)], 3)
    blob = h.state_write(0)
    whole = h.state_write()
    for cut in range(0, len(blob), 7):
        before = h.state_write()
        with pytest.raises(kvcache.StateError):
            h.state_read(blob[:cut], 1)
        assert h.state_write() == before
    for cut in range(0, len(whole), 11):
        with pytest.raises(kvcache.StateError):
            h.state_read(whole[:cut])
        assert h.state_write() == whole


# --- the hand-off: both parts, or neither -------------------------------------------------------

def test_handoff_carries_both_parts():
    from kvcache.handoff import copy_regions

    src = make(n_rs_seq=2)
    apply(src, [("decode", 0, 0, 7), ("decode", 1, 0, 5), ("decode", 0, 0, 3)], 5)
    dst = make(n_rs_seq=2)
    apply(dst, [("decode", 2, 0, 4)], 6)
    other = dst.state_write(2)
    x = src.seq_export(0)
    with dst.seq_import_begin(x.header, 1) as imp:
        assert imp.seq_id == 1 and imp.n_bytes == x.n_bytes
        with pytest.raises(RuntimeError):
            dst.seq_rm(2)                       # the memory refuses changes while importing
        copy_regions(x.regions, imp.regions)
        imp.commit()
    assert not imp.active
    want = make(n_rs_seq=2)
    want.state_read(src.state_write(0), 1)
    assert dst.state_write(1) == want.state_write(1)
    assert dst.state_write(2) == other
    # gather / scatter, into the exporter's own id
    third = make(n_rs_seq=2)
    imp = third.seq_import_begin(x.header)
    imp.scatter(x.gather())
    imp.commit()
    assert third.state_write(0) == src.state_write(0)


def test_handoff_refusals_change_nothing():
    src = make()
    apply(src, [("decode", 0, 0, 6)], 7)
    x = src.seq_export(0)
    dst = make()
    apply(dst, [("decode", 1, 0, 3)], 8)
    before = dst.state_write()
    bad = bytearray(x.header)
    # the recurrent state's layer count: after the attention part's header, the state's length,
    # its cell section (count, position, ids) and V layout flag
    bad[12 + len(split_hybrid(x.header).attn) + 4 + 16] ^= 0xFF
    for h in (bytes(bad), x.header[:-1], b"KVCH" + x.header[4:8], b"nope" + x.header[4:]):
        with pytest.raises(kvcache.StateError):
            dst.seq_import_begin(h, 0)
        assert dst.state_write() == before
    other = kvcache.HybridCache(16, 4, [0, 1, 2], WIDTH, WIDTH, [8, 8, 8, 8], [2, 2, 2, 2], n_seq_max=N_SEQ,
                                attn_layers=[1, 3], type_k="f32", type_v="f32")
    with pytest.raises(kvcache.StateError, match="recurrent state"):
        other.seq_import_begin(x.header, 0)
    # aborted: as it was
    with pytest.raises(ZeroDivisionError):
        with dst.seq_import_begin(x.header, 2) as imp:
            imp.scatter(np.zeros(imp.n_bytes, np.uint8))
            1 / 0
    assert not imp.active and dst.state_write() == before
    dst.recr.seq_rm(1)                              # the recurrent part takes changes again


def test_handoff_moves_recurrent_rows_as_regions():
    """The recurrent rows travel as regions of the recurrent part's memory (the plane a pending
    rollback reads), the rest of its state in the header; the parts refuse changes during an
    import, and take them again after it, whichever way it ends."""
    from kvcache.handoff import copy_regions

    src = make(n_rs_seq=2)
    apply(src, [("decode", 0, 0, 7), ("decode", 0, 0, 3), ("decode", 1, 0, 4)], 9)
    assert src.rollback_ok(0, 2) and src.seq_rm(0, src.seq_pos_max(0) - 1, -1)    # a pending rollback
    for s in (0, 1):
        x = src.seq_export(s)
        rec = src.recr.state_write(s, prefix=False)
        fields = split_hybrid(x.header)
        rows = len(src.recurrent_layers) * (6 + 2) * 4                   # R and S rows, f32
        assert x.n_bytes == x.attn.n_bytes + rows and len(x.regions) == len(x.attn.regions) + 6
        assert len(fields.skeleton) == len(rec) - rows
        assert fields.state(x.gather()[x.attn.n_bytes:].tobytes()) == rec
        r0 = src.recr.k(0, 0)
        lo, hi = r0.ctypes.data, r0.ctypes.data + r0.nbytes * 3     # the planes of layer 0's R rows
        assert any(lo <= a < hi for a, _ in x.regions[len(x.attn.regions):].tolist())
        dst = make(n_rs_seq=2)
        imp = dst.seq_import_begin(x.header, 2)
        assert imp.n_bytes == x.n_bytes
        for call in (lambda: dst.recr.seq_rm(0), lambda: dst.recr.clear(), lambda: dst.attn.seq_rm(0),
                     lambda: dst.seq_keep(0), lambda: dst.recr.state_read(rec, 0)):
            with pytest.raises(RuntimeError, match="import"):
                call()
        copy_regions(x.regions, imp.regions)
        imp.commit()
        want = make(n_rs_seq=2)
        want.state_read(src.state_write(s), 2)
        assert dst.state_write(2) == want.state_write(2)
        dst.recr.seq_rm(2)                          # taken again after the commit
    # a metadata-only source: no regions for the rows, which arrive as zeros
    none = make()
    apply(none, [("decode", 0, 0, 5)], 1)
    meta = kvcache.HybridCache(16, 4, [0, 1, 2], WIDTH, WIDTH, [6, 6, 6, 6], [2, 2, 2, 2], n_seq_max=N_SEQ,
                               attn_layers=[1, 3], type_k="f32", type_v="f32", buffers="none")
    meta.state_read(none.state_write(0), 0)
    x = meta.seq_export(0)
    assert len(x.regions) == 0 and x.n_bytes == x.attn.n_bytes
    dst = make()
    with dst.seq_import_begin(x.header) as imp:
        assert imp.n_bytes == imp.attn.n_bytes
        imp.commit()
    assert not dst.recr.k(0).any() and dst.recr.seq_pos_max(0) == 4
    # an import dropped without commit or abort: the parts take changes again
    imp = dst.seq_import_begin(src.seq_export(1).header, 1)
    del imp
    import gc
    gc.collect()
    dst.recr.seq_rm(0)
    dst.seq_rm(0)
