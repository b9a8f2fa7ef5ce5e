"""kq_mask(out=buf, reuse=True): a decode loop's mask rewritten where the cells changed must equal
a fresh mask after any sequence of operations (find_slot / commit / restore, the sequence
operations, defrag through update, state reads that succeed or fail, clear; one stream and a
stream per sequence, with and without a sliding window; every dtype, padded and not), and the
buffer rules: reuse needs out, a buffer written by another call or shape is rewritten whole."""
import zlib

import numpy as np
import pytest

import kvcache

DTYPES = {"f32": np.float32, "f16": np.float16, "bool": np.bool_}


def _cache(semantics, streams, swa):
    kw = dict(n_swa=6, swa_type="standard") if swa else {}
    if semantics == "2026":
        return kvcache.UnifiedCache(96, 1, 4, 4, type_k="f32", type_v="f32", v_trans=False, n_pad=1, n_seq_max=4,
                                    semantics="2026", kv_unified=not streams, **kw)
    return kvcache.UnifiedCache(96, 1, 4, 4, type_k="f32", type_v="f32", v_trans=False, n_pad=8, n_seq_max=4, **kw)


def _mask_shape(c, ub, pad):
    fresh = c.kq_mask(ub, dtype="f32", pad=pad)
    return fresh.shape


@pytest.mark.parametrize("semantics,streams,swa", [("2025", False, False), ("2025", False, True),
                                                   ("2026", False, False), ("2026", False, True),
                                                   ("2026", True, False), ("2026", True, True)])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bool"])
def test_reused_mask_equals_fresh(semantics, streams, swa, dtype):
    # a seed of its own per case (hash() of strings changes from one process to the next)
    rng = np.random.default_rng(zlib.crc32(repr((semantics, streams, swa, dtype)).encode()))
    c = _cache(semantics, streams, swa)
    pad = False if semantics == "2026" else bool(rng.integers(2))
    nxt = [0, 0, 0, 0]
    buf = None
    saved = None
    patched = 0
    for step in range(400):
        op = rng.integers(10)
        s, s2 = int(rng.integers(4)), int(rng.integers(4))
        if op <= 3:
            # (a chunk of 8 or more goes into its empty cells as one run)
            n = int(rng.integers(1, 6)) if op else int(rng.integers(8, 17))
            ok = c.find_slot(kvcache.UBatch(np.arange(nxt[s], nxt[s] + n, dtype=np.int32), [s], n_seq_tokens=n))
            if ok:
                nxt[s] += n
                if semantics == "2025":
                    c.restore() if rng.integers(5) == 0 else c.commit()
        elif op == 4:
            c.seq_rm(s if rng.integers(5) else -1, int(rng.integers(-1, 40)), int(rng.integers(-1, 60)))
        elif op == 5:
            if semantics == "2026" and streams:
                if s != s2:
                    c.seq_cp(s, s2)
                    c.update()
            else:
                c.seq_cp(s, s2, int(rng.integers(-1, 30)), -1)
            nxt[s2] = max(nxt[s2], nxt[s])
        elif op == 6:
            c.seq_add(s, int(rng.integers(-1, 20)), -1, int(rng.integers(-5, 6)))
            c.update()
        elif op == 7:
            if rng.integers(2):
                saved = c.state_write()
            elif saved is not None:
                # in the layout it was written in: a whole state this small can parse in both
                c.state_read(saved, layout=kvcache.DEFAULT_LAYOUT)
            else:
                with pytest.raises(kvcache.StateError):
                    c.state_read(b"\x00" * 16)
        elif op == 8 and semantics == "2025":
            c.update(n_max_nodes=65536)
        elif op == 9 and rng.integers(30) == 0:
            c.clear()
            nxt = [0, 0, 0, 0]
        # the decode batch of the sequences the test follows: one token each, grouped per sequence
        seqs = [q for q in range(4) if q % 2 == step // 50 % 2 or q == 3]
        # (at the position each goes on from, or a little before: the window's end moves both ways)
        ub = kvcache.UBatch(np.array([max(0, nxt[q] - int(rng.integers(3))) for q in seqs], dtype=np.int32),
                            [[q] for q in seqs])
        shape = _mask_shape(c, ub, pad)
        if buf is None or buf.shape != shape:
            buf = np.zeros(shape, dtype=DTYPES[dtype])
            c.kq_mask(ub, out=buf, dtype=dtype, pad=pad)
            continue
        before = buf.copy()
        c.kq_mask(ub, out=buf, dtype=dtype, pad=pad, reuse=True)
        fresh = c.kq_mask(ub, dtype=dtype, pad=pad)
        assert np.array_equal(buf.view(np.uint8), fresh.view(np.uint8)), step
        patched += not np.array_equal(before.view(np.uint8), buf.view(np.uint8))
        # the fresh mask is a buffer of its own: buf is still the one the cache remembers
        buf2 = buf
        c.kq_mask(ub, out=buf2, dtype=dtype, pad=pad, reuse=True)
        assert np.array_equal(buf2.view(np.uint8), fresh.view(np.uint8)), step
    assert patched > 0


def test_reuse_needs_out():
    c = _cache("2025", False, False)
    assert c.find_slot(kvcache.UBatch([0], [0]))
    with pytest.raises(ValueError, match="reuse=True needs out"):
        c.kq_mask(kvcache.UBatch([0], [0]), reuse=True)


def test_a_buffer_written_by_another_call_is_rewritten_whole():
    c = _cache("2025", False, False)
    for s in range(2):
        assert c.find_slot(kvcache.UBatch(np.arange(5, dtype=np.int32), [s], n_seq_tokens=5))
        c.commit()
    ub0, ub1 = kvcache.UBatch([5], [0]), kvcache.UBatch([5], [1])
    a = c.kq_mask(ub0, pad=False)
    b = np.zeros_like(a)
    c.kq_mask(ub1, out=b, pad=False)          # b is the remembered buffer now, with ub1's mask
    c.kq_mask(ub0, out=a, pad=False)          # and now a, with ub0's
    c.kq_mask(ub1, out=b, pad=False, reuse=True)   # b is not remembered any more: written whole
    assert np.array_equal(b, c.kq_mask(ub1, pad=False))
    # a different sequence in a row of the remembered buffer: that row is rewritten
    c.kq_mask(ub1, out=a, pad=False, reuse=True)
    assert np.array_equal(a, c.kq_mask(ub1, pad=False))
    # ALiBi is always written whole
    c.kq_mask(ub1, out=a, pad=False, alibi=True)
    c.kq_mask(ub1, out=a, pad=False, alibi=True, reuse=True)
    assert np.array_equal(a, c.kq_mask(ub1, pad=False, alibi=True))
