"""States of KVC_STREAM_BYTES (16 MiB) or more: written into a buffer and read, their K/V data
is copied with non-temporal stores (four 4 KiB pages at a time); a state_write() into its fresh
bytes object with plain stores; a file target in 1 MiB pieces with plain copies. Every path gives
the same bytes, at any alignment of the buffers, and a whole-cache read leaves every K/V byte as
a clear() and the read would (no byte of the cache before it is left)."""
import io

import numpy as np
import pytest

import kvcache

CELLS, LAYERS, WIDTH = 1024, 6, 1024    # 4 KiB of f16 K/V per cell and layer: 24 MiB when full


def _fill_kv(c, seed):
    rng = np.random.default_rng(seed)
    for il in range(c.n_layer):
        for a in (c.k(il), c.v(il)):
            flat = a.reshape(-1).view(np.uint8)
            flat[:] = rng.integers(0, 256, flat.size, dtype=np.uint8)


def _full_cache(v_trans, holes, **kw):
    """Every cell holding a token of one of 4 sequences (round robin); holes: sequence 1 removed,
    so that the listed cells are runs of 1 and 3 cells."""
    kw.setdefault("n_seq_max", 4)
    c = kvcache.UnifiedCache(CELLS, LAYERS, WIDTH, WIDTH, type_k="f16", type_v="f16", v_trans=v_trans, **kw)
    _fill_kv(c, 7)
    for t in range(CELLS):
        assert c.find_slot(kvcache.UBatch([t // 4], [t % 4]))
        c.commit()
    if holes:
        c.seq_rm(1, -1, -1)
    return c


def _kv(c):
    return [(c.k(il).copy(), c.v(il).copy()) for il in range(c.n_layer)]


def _same_kv(a, b):
    return all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for p, q in zip(a, b) for x, y in zip(p, q))


def _chunked(c, **kw):
    f = io.BytesIO()
    c.state_write_into(f, **kw)
    return f.getvalue()


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("layout", ["2025", "2026"])
def test_large_states_are_the_same_bytes_on_every_path(v_trans, holes, layout):
    c = _full_cache(v_trans, holes)
    ref = _chunked(c, layout=layout)
    assert len(ref) >= 16 << 20 and len(ref) == c.state_size(layout=layout)
    assert c.state_write(layout=layout) == ref
    for off in (0, 1, 16, 48, 63):
        buf = bytearray(len(ref) + 64)
        assert c.state_write_into(memoryview(buf)[off:off + len(ref)], layout=layout) == len(ref)
        assert buf[off:off + len(ref)] == ref and not any(buf[:off]) and not any(buf[off + len(ref):])


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("v_trans", [False, True])
def test_large_whole_reads_restore_every_byte(v_trans, holes):
    src = _full_cache(v_trans, holes)
    blob = src.state_write()
    fresh = kvcache.UnifiedCache(CELLS, LAYERS, WIDTH, WIDTH, type_k="f16", type_v="f16", v_trans=v_trans,
                                 n_seq_max=4)
    fresh.state_read(blob)
    # the cells the state lists are cells [0, n) in order; the rest of the cache is zeros
    n = int((src.cells().pos >= 0).sum())
    listed = np.flatnonzero(src.cells().pos >= 0)
    for il in range(LAYERS):
        k, v = fresh.k(il), fresh.v(il)
        assert np.array_equal(k[:n].view(np.uint16), src.k(il)[listed].view(np.uint16)) and not k[n:].view(np.uint16).any()
        vs = src.v(il)[:, listed] if v_trans else src.v(il)[listed]
        vd, rest = (v[:, :n], v[:, n:]) if v_trans else (v[:n], v[n:])
        assert np.array_equal(vd.view(np.uint16), vs.view(np.uint16)) and not rest.view(np.uint16).any()
    for off in (1, 40):
        # read from an unaligned buffer into a cache whose K/V held other bytes
        dst = _full_cache(v_trans, False)
        _fill_kv(dst, 11)
        buf = bytearray(len(blob) + off)
        buf[off:] = blob
        assert dst.state_read(memoryview(buf)[off:]) == len(blob)
        assert _same_kv(_kv(dst), _kv(fresh)) and dst.state_write() == blob


@pytest.mark.parametrize("v_trans", [False, True])
def test_large_whole_reads_into_streams_zero_what_no_section_fills(v_trans):
    """Semantics 2026 with a stream per sequence: a whole-cache read writes each stream's cells of
    its section and zeroes the rest of the K/V (a stream without a section all of it), as
    llama.cpp's clear and read leave them."""
    def cache():
        return kvcache.UnifiedCache(512, LAYERS, WIDTH, WIDTH, type_k="f16", type_v="f16", v_trans=v_trans,
                                    n_seq_max=4, semantics="2026", kv_unified=False, n_pad=1)
    src = cache()
    _fill_kv(src, 3)
    for s, n in ((0, 500), (1, 120), (3, 512)):      # stream 2 empty
        assert src.find_slot(kvcache.UBatch(list(range(n)), [s] * n))
    blob = src.state_write()
    assert len(blob) >= 16 << 20
    fresh = cache()
    fresh.state_read(blob)
    dst = cache()
    _fill_kv(dst, 5)
    assert dst.find_slot(kvcache.UBatch(list(range(300)), [2] * 300))
    assert dst.state_read(blob) == len(blob)
    assert _same_kv(_kv(dst), _kv(fresh)) and dst.state_write() == blob
    k = fresh.k(0).reshape(4, 512, -1)
    assert not k[2].any() and not k[1, 120:].any() and not k[0, 500:].any()
    assert np.array_equal(k[3].view(np.uint16), src.k(0).reshape(4, 512, -1)[3].view(np.uint16))


@pytest.mark.parametrize("v_trans", [False, True])
def test_a_state_written_on_several_threads_is_the_same_bytes(v_trans):
    """n_threads above 1: a state window of n_threads x 16 MiB or more is written as that many
    windows of whole pages, one a thread; the bytes are those of one thread, into a buffer, a
    fresh object and at an offset (a whole cache and one sequence), and they read back."""
    c = kvcache.UnifiedCache(2560, LAYERS, WIDTH, WIDTH, type_k="f16", type_v="f16", v_trans=v_trans, n_seq_max=4)
    _fill_kv(c, 11)
    for t in range(2560):
        assert c.find_slot(kvcache.UBatch([t // 4], [t % 4]))
        c.commit()
    c.seq_rm(2, 100, 300)
    ref, ref0 = c.state_write(), c.state_write(seq_id=0)
    assert len(ref) >= 3 * (16 << 20)
    for n in (2, 3, 4):
        c.n_threads = n
        assert c.state_write() == ref
        buf = bytearray(len(ref) + 5)
        c.state_write_into(memoryview(buf)[5:])
        assert buf[5:] == ref
        assert c.state_write(seq_id=0) == ref0
    c.clear()
    c.state_read(ref)
    assert c.state_write() == ref
