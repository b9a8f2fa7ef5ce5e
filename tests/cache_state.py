"""Busy caches of every variant, and snapshots of everything about them that can be observed.

A snapshot holds the cells, the counters, the current placement, the flags, every sequence's
position range and every K/V byte: two equal snapshots mean no caller could tell the caches
apart. The reliability tests compare them around operations that fail ("a call that raises
leaves the cache exactly as it was") and check the cell invariants the reference model
(tests/reference.py) keeps by construction after operations that succeed.
"""
import numpy as np

import kvcache
from reference import UnifiedReference


def fill_random(cache, seed):
    """Random bytes in every K/V byte of a cache (each part of an iSWA cache)."""
    rng = np.random.default_rng(seed)
    parts = (cache.base, cache.swa) if isinstance(cache, kvcache.ISWACache) else (cache,)
    for part in parts:
        if part.buffers == "none":
            continue
        layers = part.layers if isinstance(part, kvcache.UnifiedCache) else range(part.n_layer)
        for il in layers:
            for a in (part.k(il), part.v(il)):
                raw = a.view(np.uint8)
                raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    return cache


def busy_unified(type_k="f16", type_v="f16", v_trans=True, kv_size=64, n_seq_max=4, seed=0, buffers="owned",
                 widths=(8, 16)):
    """A unified cache holding sequences 0..2 with shared cells, holes and an uncommitted slot."""
    c = kvcache.UnifiedCache(kv_size, len(widths), list(widths), [2 * w for w in widths], type_k=type_k,
                             type_v=type_v, v_trans=v_trans, n_seq_max=n_seq_max, n_pad=32, buffers=buffers)
    rng = np.random.default_rng(seed)
    for p in range(14):
        s = p % 3
        ids = [s] + ([3] if n_seq_max > 3 and rng.random() < 0.3 else [])
        assert c.find_slot(kvcache.UBatch(pos=[p], seq_id=[ids]))
        c.commit()
    c.seq_rm(2, 4, 9)
    c.seq_add(1, 6, -1, 2)
    assert c.find_slot(kvcache.UBatch(pos=[20, 21], seq_id=[0, 0]))   # left uncommitted
    return fill_random(c, seed)


def _ext_of(p, n, cell_ext):
    """The per-cell extension fields of a ubatch of n tokens, the first at step p, for a cache
    with it (cell_ext): token ids, 2-D positions, both or neither, by p; {} otherwise."""
    if not cell_ext:
        return {}
    tokens = {"tokens": [1000 + 7 * p + t for t in range(n)]} if p % 4 != 3 else {}
    grid = {"pos_x": [(p + t) % 3 + 1 for t in range(n)], "pos_y": [(p + t) % 5 + 2 for t in range(n)]}
    return {**tokens, **(grid if p % 4 in (1, 3) else {})}


def busy_unified_2026(kv_unified=True, type_k="f16", type_v="f16", v_trans=True, kv_size=64, n_seq_max=4, seed=0,
                      buffers="owned", widths=(8, 16), n_swa=0, cell_ext=False):
    """A cache of semantics "2026" (one stream, or a stream per sequence) holding sequences 0..3
    in scattered cells with holes (one stream: some cells shared with sequence 3), a shifted
    sequence and a last placement; n_swa > 0: a sliding window, so that a sequence's state
    leaves cells out; cell_ext: with the per-cell extension, the ubatches giving token ids and
    2-D positions (most cells' extensions not at their defaults)."""
    swa = {"n_swa": n_swa, "swa_type": "standard"} if n_swa else {}
    c = kvcache.UnifiedCache(kv_size, len(widths), list(widths), [2 * w for w in widths], type_k=type_k,
                             type_v=type_v, v_trans=v_trans, n_seq_max=n_seq_max, n_pad=1, buffers=buffers,
                             semantics="2026", kv_unified=kv_unified, cell_ext=cell_ext, **swa)
    rng = np.random.default_rng(seed)
    for p in range(16):
        s = p % 4
        ids = [s] + ([3] if kv_unified and s != 3 and rng.random() < 0.3 else [])
        assert c.find_slot(kvcache.UBatch(pos=[p // 4 * 2 + (s == 1)], seq_id=[ids], **_ext_of(p + seed, 1, cell_ext)))
    c.seq_rm(2, 2, 5)
    c.seq_add(1, 3, -1, 2)
    assert c.find_slot(kvcache.UBatch(pos=[20, 21], seq_id=[0, 0], **_ext_of(16 + seed, 2, cell_ext)))
    return fill_random(c, seed)


def busy_iswa(v_trans=True, seed=0, n_seq_max=3, swa_full=False, buffers="owned", kv_size=64, semantics="2025",
              kv_unified=True, cell_ext=False):
    """An iSWA cache with three sequences in both parts and random K/V bytes; semantics "2026":
    today's pair (one stream, or a stream per sequence with kv_unified=False), the SWA cache
    holding cells outside the window that a sequence's state leaves out; cell_ext (2026): with
    the per-cell extension, set by the ubatches."""
    today = dict(semantics="2026", kv_unified=kv_unified, n_pad=1) if semantics == "2026" else {}
    if cell_ext:
        today["cell_ext"] = True
    c = kvcache.ISWACache(kv_size, 4, 8, 8, swa_layers=[0, 2], n_swa=4, n_batch=8, v_trans=v_trans,
                          n_seq_max=n_seq_max, swa_full=swa_full, buffers=buffers, **today)
    for p in range(10):
        assert c.find_slot(kvcache.UBatch(pos=[p], seq_id=[p % 3], **_ext_of(p + seed, 1, cell_ext)))
        if not today:
            c.commit()
    return fill_random(c, seed)


def busy_recurrent(seed=0, buffers="owned"):
    """A recurrent cache with three sequences (one state each) and random K/V bytes."""
    c = kvcache.RecurrentCache(4, 2, [6, 10], [12, 4], kv_size=6, buffers=buffers)
    for s in range(3):
        assert c.find_slot(kvcache.UBatch(pos=[0, 1], seq_id=[s], n_seq_tokens=2))
        c.commit()
    return fill_random(c, seed)


def _bytes_of(part, layers):
    if part.buffers == "none":
        return ()
    return tuple((part.k(il).tobytes(), part.v(il).tobytes()) for il in layers)


def _unified_snapshot(c):
    cells = c.cells()
    return ("unified", cells.pos.tobytes(), cells.shift.tobytes(), cells.seq_mask.tobytes(), c.head, c.n,
            c.used, c.slot, c.has_shift, c.do_defrag, c.defrag_ids.tobytes(),
            tuple((c.seq_pos_min(s), c.seq_pos_max(s)) for s in range(c.n_seq_max)),
            _bytes_of(c, c.layers))


def _unified_2026_snapshot(c):
    streams = tuple((t.pos.tobytes(), t.shift.tobytes(), t.seq_mask.tobytes(),
                     None if t.ext is None else t.ext.tobytes()) for t in c.stream_cells())
    return ("unified2026", streams, c.heads, c.used_per_stream, c.has_shift, c.pending_copies,
            tuple((st, cells.tobytes()) for st, cells in c.slot_info()),
            tuple((c.seq_pos_min(s), c.seq_pos_max(s)) for s in range(c.n_seq_max)), _bytes_of(c, c.layers))


def _recurrent_snapshot(c):
    cells = c.cells()
    return ("recurrent", cells["pos"].tobytes(), cells["src"].tobytes(), cells["tail"].tobytes(),
            tuple(map(tuple, cells["seq_id"])), c.head, c.n, c.used, c.cell_max(),
            tuple((c.seq_pos_min(s), c.seq_pos_max(s)) for s in range(c.n_seq_max)),
            _bytes_of(c, range(c.n_layer)))


def snapshot(cache):
    """Everything observable about a cache (without changing it), as a comparable value."""
    if isinstance(cache, kvcache.ISWACache):
        return ("iswa", snapshot(cache.base), snapshot(cache.swa), tuple(map(tuple, cache.pending)))
    if isinstance(cache, kvcache.RecurrentCache):
        return _recurrent_snapshot(cache)
    if cache.semantics == "2026":
        return _unified_2026_snapshot(cache)
    return _unified_snapshot(cache)


def assert_unchanged(cache, before, what=""):
    after = snapshot(cache)
    if after != before:
        diff = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        raise AssertionError(f"{what}: the cache changed (snapshot fields {diff})")


def check_unified_invariants(c, strict=True):
    """The cell table of a unified cache is consistent with itself and with the reference
    model's reading of it: used, n, sequence ranges, empty cells hold no sequence, and a slot
    search from here places tokens where the reference model places them. Commits the
    cache's pending slots (the probe is undone with restore).

    strict: every used cell holds a sequence, as after operations through the API (a whole
    cache state read from a blob may, as llama.cpp's, hold used cells listing no sequence)."""
    cells = c.cells()
    pos, shift = cells.pos, cells.shift
    holds_any = cells.seq_mask.any(axis=1)
    nonempty = pos != -1
    assert c.used == int(nonempty.sum())
    assert not np.any(holds_any & ~nonempty), "an empty cell holds a sequence"
    if strict:
        assert np.all(holds_any == nonempty), "a used cell holds no sequence"
    assert np.all(pos[nonempty] >= 0)
    assert 0 <= c.head <= c.size     # a failed search may leave head at size, as the reference does
    assert c.n <= c.size and c.n % c.n_pad == 0
    for s in range(c.n_seq_max):
        held = pos[cells.holds(s)]
        want = (int(held.min()), int(held.max())) if held.size else (-1, -1)
        assert (c.seq_pos_min(s), c.seq_pos_max(s)) == want, f"sequence {s}"
    if not c.has_shift:
        assert not np.any(shift[nonempty]), "shifts without has_shift"
    # the reference model loaded with these cells agrees with the cache's index structures
    ref = UnifiedReference(c.size, c.n_seq_max, c.n_pad, c.n_swa, c.swa_type, n_layer=max(1, len(c.layers)))
    ref.pos = pos.tolist()
    ref.shift = shift.tolist()
    ref.seq = [set(cells.seq_ids(i)) for i in range(c.size)]
    ref.has_shift = c.has_shift
    ref.head, ref.n = c.head, c.n
    assert ref.used == c.used
    c.commit()
    for ub in (kvcache.UBatch([1000, 1001, 1002], [0, 0, 0]), kvcache.UBatch([7], [[0] if c.n_seq_max == 1 else [0, 1]])):
        assert c.find_slot(ub) == ref.find_slot(ub)
        assert (c.head, c.n) == (ref.head, ref.n)
        assert c.cells().nonempty() == ref.cells().nonempty()
        for s in range(c.n_seq_max):
            assert (c.seq_pos_min(s), c.seq_pos_max(s)) == (ref.seq_pos_min(s), ref.seq_pos_max(s))
        c.restore()
        ref.restore()
    assert c.cells() == cells


def check_recurrent_invariants(c):
    """A recurrent cache's sequence ranges match its cells."""
    cells = c.cells()
    for s in range(c.n_seq_max):
        pos = [int(cells["pos"][i]) for i, ids in enumerate(cells["seq_id"]) if s in ids]
        want = (min(pos), max(pos)) if pos else (-1, -1)
        assert (c.seq_pos_min(s), c.seq_pos_max(s)) == want
