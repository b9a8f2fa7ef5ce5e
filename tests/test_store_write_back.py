"""Write-back at eviction for every cache with a prefix index (docs/store.md, "With a cache"):
a prompt the cache's index evicts under pressure is written to the store from the cells it
let go, then loaded into a fresh cache with the original rows bit for bit — a UnifiedCache2026
of several streams or with 2-D positions, an ISWACache2026 (the base rows, the SWA windows the
SWA cache's index let go), a RecurrentCache (the states its checkpoint pool evicts at chunk
ends), a HybridCache (the attention rows, the states its checkpoint pool still holds or
evicts; with a sliding window, the windows and those states); the caches without an index are
refused with the reason."""
import numpy as np
import pytest

import kvcache
from kvcache import HybridCache, RecurrentCache, UBatch
from kvcache._store_parts import rows_of
from kvcache.store import PrefixStore, StoreError

C = 8


def rows(n, width, seed):
    return np.arange(n * width, dtype=np.float32).reshape(n, width) * 1e-3 + seed


def seq_rows(part, s):
    """Positions of s in part, and per layer its K and V rows (bytes) in position order."""
    cells, pos = part.seq_cells(s)
    o = np.argsort(pos)
    stream = s if part.n_stream > 1 else 0
    return pos[o].tolist(), [rows_of(part, il, cells[o], stream) for il in part.layers]


def same_rows(want, have, n):
    for (k1, v1), (k2, v2) in zip(want, have):
        np.testing.assert_array_equal(k1[:n], k2[:n])
        np.testing.assert_array_equal(v1[:n], v2[:n])


def ufill(c, s, toks, seed, xy=None):
    n = len(toks)
    extra = {} if xy is None else {"pos_x": xy[0], "pos_y": xy[1]}
    assert c.find_slot(UBatch(list(range(n)), [s] * n, tokens=toks, **extra))
    for il in c.layers:
        k = rows(n, 8, seed * 100 + il)
        c.store(il, k, -k)


def ucache(**kw):
    c = kvcache.UnifiedCache(32, 2, 8, 8, type_k="f32", type_v="f32", n_seq_max=2, semantics="2026", **kw)
    c.enable_prefix_reuse()
    return c


@pytest.mark.parametrize("v_trans", [False, True])
def test_several_streams(tmp_path, v_trans):
    """One stream per sequence: the prompt evicted from stream 1 is written from stream 1's rows."""
    def cache():
        return ucache(v_trans=v_trans, kv_unified=False)

    c = cache()
    assert c.n_stream == 2
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=C)
    st.write_back(c)
    a = list(range(1, 22))                          # 2 whole chunks and 5 tokens
    ufill(c, 0, list(range(50, 70)), seed=3)       # stream 0 keeps its own sequence
    ufill(c, 1, a, seed=1)
    _, want = seq_rows(c, 1)
    assert c.prefix_release(1, a) == len(a)
    assert st.match(a) == 0
    ufill(c, 1, list(range(100, 128)), seed=2)     # stream 1 needs the room: a's cells are evicted
    assert st.stats["evicted_saved"] == 2 and st.match(a) == 16
    d = cache()
    assert PrefixStore(d, tmp_path / "st", chunk_tokens=C).load(d, 1, a) == 16
    pos, have = seq_rows(d, 1)
    assert pos == list(range(16))
    same_rows(want, have, 16)
    assert d.seq_pos_max(0) == -1
    c._prefix_check()


def test_cells_with_2d_positions(tmp_path):
    """The evicted cells' 2-D positions (as the index took them) name the chunks and come back."""
    def cache():
        return ucache(v_trans=False, cell_ext=True)

    c = cache()
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=C)
    st.write_back(c)
    a = list(range(1, 19))
    xs, ys = [t % 5 for t in a], [t // 5 for t in a]
    ufill(c, 0, a, seed=1, xy=(xs, ys))
    _, want = seq_rows(c, 0)
    c.prefix_release(0, a)
    ufill(c, 0, list(range(100, 128)), seed=2, xy=([0] * 28, [0] * 28))
    assert st.stats["evicted_saved"] == 2
    assert st.match(a, pos_x=xs, pos_y=ys) == 16
    assert st.match(a, pos_x=ys, pos_y=xs) == 0    # other 2-D positions: other chunks
    d = cache()
    assert st.load(d, 1, a, pos_x=xs, pos_y=ys) == 16
    pos, have = seq_rows(d, 1)
    assert pos == list(range(16))
    same_rows(want, have, 16)
    cells, pos = d.seq_cells(1)
    ext = d.cells().ext[cells[np.argsort(pos)]]
    assert ext[:, 0].tolist() == xs[:16] and ext[:, 1].tolist() == ys[:16]


def iswa(swa_full, cell_ext=False):
    c = kvcache.ISWACache(64, 3, 16, 16, swa_layers=[1], n_swa=6, type_k="f32", type_v="f32", v_trans=False,
                          n_seq_max=2, n_batch=8, swa_full=swa_full, semantics="2026", cell_ext=cell_ext)
    c.enable_prefix_reuse()
    return c


def ifill(c, s, toks, seed):
    for a in range(0, len(toks), C):
        b = min(a + C, len(toks))
        assert c.find_slot(UBatch(list(range(a, b)), [s] * (b - a), tokens=toks[a:b]))
        for il in range(3):
            k = rows(b - a, 16, seed * 1000 + a + il)
            c.store(il, k, -k)


@pytest.mark.parametrize("swa_full", [True, False])
@pytest.mark.parametrize("cell_ext", [False, True])
def test_iswa(tmp_path, swa_full, cell_ext):
    """The base cache's index writes the rows, the SWA cache's the windows before the chunk ends
    it still held: a prefix is back once both indexes let it go (with the extension too, whose
    SWA index keeps the position of each token it holds without a cell)."""
    c = iswa(swa_full, cell_ext)
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=C)
    st.write_back(c)
    a = list(range(1, 29))                          # 3 whole chunks and 4 tokens
    ifill(c, 0, a, seed=1)
    _, want = seq_rows(c.base, 0)
    spos, swant = seq_rows(c.swa, 0)
    c.prefix_release(0, a)
    assert st.match(a) == 0
    ifill(c, 1, list(range(200, 256)), seed=2)     # both caches need the room
    c.prefix_evict(64)                              # the rest of what the indexes hold
    assert st.stats["evicted_saved"] > 0
    # the window before 24 (positions 19 .. 23) was held by the SWA cache: 24 tokens are usable
    assert st.match(a) == 24
    c.seq_rm(1)
    d = iswa(swa_full, cell_ext)
    assert PrefixStore(d, tmp_path / "st", chunk_tokens=C).load(d, 0, a) == 24
    pos, have = seq_rows(d.base, 0)
    assert pos == list(range(24))
    same_rows(want, have, 24)
    wpos, whave = seq_rows(d.swa, 0)
    assert wpos == list(range(19, 24))
    sel = np.searchsorted(spos, wpos)
    for (k1, v1), (k2, v2) in zip(swant, whave):
        np.testing.assert_array_equal(k1[sel], k2)
        np.testing.assert_array_equal(v1[sel], v2)


def hyb():
    h = HybridCache(24, 4, [0, 2], 8, 8, 12, 4, n_seq_max=2, type_k="f32", type_v="f32", v_trans=False)
    h.enable_prefix_reuse(checkpoints=8)
    return h


def run_hyb(h, s, toks, a, b):
    assert h.find_slot(UBatch(list(range(a, b)), [s], n_seq_tokens=b - a, tokens=toks[a:b]))
    for il in (1, 3):
        k = rows(b - a, 8, a + il + 7 * s)
        h.store(il, k, -k)
    for il in (0, 2):
        h.store_state(il, rows(1, 12, sum(toks[:b]) + il), rows(1, 4, b))


def test_hybrid(tmp_path):
    """The attention part's evicted rows, and the state after each chunk its checkpoint pool
    still holds: the state after 8 was checkpointed, after 16 it was not (no end part there)."""
    h = hyb()
    st = PrefixStore(h, tmp_path / "st", chunk_tokens=C)
    st.write_back(h)
    a = list(range(5, 23))                          # 18 tokens
    run_hyb(h, 0, a, 0, 8)
    assert h.checkpoint(0, a) == 8
    run_hyb(h, 0, a, 8, 18)
    _, want = seq_rows(h.attn, 0)
    state8 = h.recr._store_checkpoint(a[:8])
    h.prefix_release(0, a)                          # checkpoints the state after 18 too
    run_hyb(h, 1, list(range(60, 80)), 0, 20)       # the attention part needs the room
    assert st.stats["evicted_saved"] >= 2
    assert st.match(a) == 8
    g = hyb()
    assert PrefixStore(g, tmp_path / "st", chunk_tokens=C).load(g, 1, a) == 8
    pos, have = seq_rows(g.attn, 1)
    assert pos == list(range(8))
    same_rows(want, have, 8)
    assert g.recr._store_state(1) == (8, state8)


def rec():
    """A Mamba-like recurrent cache: per layer a convolution row (R) and a scan state row (S)."""
    c = RecurrentCache(2, 2, 6, 4, type_k="f32", type_v="f32", semantics="2026")
    c.enable_prefix_reuse(checkpoints=2)
    return c


def run_rec(c, s, toks, a, b):
    assert c.find_slot(UBatch(list(range(a, b)), [s], n_seq_tokens=b - a))
    for il in range(2):
        c.store(il, rows(1, 6, sum(toks[:b]) + il), rows(1, 4, -b - il))


def test_recurrent(tmp_path):
    """Each checkpoint the pool evicts at a chunk's end (for a newer one, by prefix_evict) is
    written as that chunk's end part; one elsewhere, or of an unknown salt, is not."""
    c = rec()
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=C)
    st.write_back(c)
    a = list(range(3, 23))                          # 20 tokens
    run_rec(c, 0, a, 0, 8)
    assert c.checkpoint(0, a) == 8
    run_rec(c, 0, a, 8, 16)
    assert c.checkpoint(0, a) == 16
    state8, state16 = c._store_checkpoint(a[:8]), c._store_checkpoint(a[:16])
    run_rec(c, 0, a, 16, 20)
    assert st.match(a) == 0
    assert c.prefix_release(0, a) == 20             # the pool is full: the state after 8 goes
    assert st.stats["evicted_saved"] == 1 and st.match(a) == 8
    assert c.prefix_evict(2) == 2                   # the states after 16 and 20 (no chunk end)
    assert st.stats["evicted_saved"] == 2 and st.match(a) == 16 and c._spill_lost == 0
    c._prefix_check()
    d = rec()
    d2 = PrefixStore(d, tmp_path / "st", chunk_tokens=C)
    assert d2.load(d, 1, a) == 16
    assert d._store_state(1) == (16, state16)
    assert d2.load(d, 0, a[:12]) == 8
    assert d._store_state(0) == (8, state8)
    b = list(range(40, 48))
    run_rec(c, 1, b, 0, 8)
    assert c.checkpoint(1, b, salt="other") == 8
    c.prefix_evict(1)
    assert st.stats["evicted_skipped"] == 1 and st.match(b, salt="other") == 0
    st.write_back(c, False)
    run_rec(c, 1, b + b, 8, 16)
    c.checkpoint(1, b + b)
    c.prefix_evict(1)
    assert st.stats["evicted_saved"] == 2           # off: nothing written


def pool_of_two(tmp_path, **window):
    """A hybrid cache (with the window's arguments, if any) whose checkpoint pool holds two
    states, writing back to a store; sequence 0 has run 18 tokens with checkpoints after 8 and
    16. Returns the cache's maker, the cache, the store and the tokens."""
    def cache():
        h = HybridCache(24, 4, [0, 2], 8, 8, 12, 4, n_seq_max=2, type_k="f32", type_v="f32", v_trans=False,
                        **window)
        h.enable_prefix_reuse(checkpoints=2)
        return h

    h = cache()
    st = PrefixStore(h, tmp_path / "st", chunk_tokens=C)
    st.write_back(h)
    a = list(range(5, 23))                          # 18 tokens
    run_hyb(h, 0, a, 0, 8)
    assert h.checkpoint(0, a) == 8
    run_hyb(h, 0, a, 8, 16)
    assert h.checkpoint(0, a) == 16
    run_hyb(h, 0, a, 16, 18)
    return cache, h, st, a


def test_hybrid_pool_evicts_under_pressure(tmp_path):
    """A checkpoint the hybrid cache's pool evicts on its own is written then as its chunk's
    end part: once the attention part lets the rows go, that prefix loads back bit for bit."""
    cache, h, st, a = pool_of_two(tmp_path)
    _, want = seq_rows(h.attn, 0)
    state8 = h.recr._store_checkpoint(a[:8])
    h.prefix_release(0, a)                          # the pool keeps 16 and 18: the state after 8 goes
    assert h.recr._store_checkpoint(a[:8]) is None
    assert st.stats["evicted_saved"] == 1 and st.match(a) == 0      # the rows are still the index's
    run_hyb(h, 1, list(range(60, 80)), 0, 20)       # the attention part needs the room
    assert st.match(a[:12]) == 8
    g = cache()
    assert PrefixStore(g, tmp_path / "st", chunk_tokens=C).load(g, 1, a[:12]) == 8
    pos, have = seq_rows(g.attn, 1)
    assert pos == list(range(8))
    same_rows(want, have, 8)
    assert g.recr._store_state(1) == (8, state8)
    h._prefix_check()


@pytest.mark.parametrize("swa_full", [True, False])
def test_hybrid_with_a_window(tmp_path, swa_full):
    """A hybrid memory with a sliding window of 4 (its base cache holding no layer): the SWA
    cache's index writes the windows it still held, the base cache's the states the checkpoint
    pool still holds; a prefix ends where a chunk has both."""
    h = HybridCache(24, 4, [0, 2], 8, 8, 12, 4, n_seq_max=2, type_k="f32", type_v="f32", v_trans=False,
                    n_swa=4, n_batch=8, swa_full=swa_full)
    h.enable_prefix_reuse(checkpoints=8)
    st = PrefixStore(h, tmp_path / "st", chunk_tokens=C)
    st.write_back(h)
    a = list(range(5, 23))                          # 18 tokens
    run_hyb(h, 0, a, 0, 8)
    assert h.checkpoint(0, a) == 8
    run_hyb(h, 0, a, 8, 18)
    spos, swant = seq_rows(h.attn.swa, 0)
    state8 = h.recr._store_checkpoint(a[:8])
    h.prefix_release(0, a)
    run_hyb(h, 1, list(range(60, 80)), 0, 20)       # both caches need the room
    h.prefix_evict(n_cells=24, n_checkpoints=8)     # the rest of what the indexes hold
    assert st.stats["evicted_saved"] >= 1
    # the window before 8 (positions 5 .. 7) still held when evicted; the state after 16 never taken
    assert st.match(a) == 8
    h.seq_rm(1, -1, -1)
    g = HybridCache(24, 4, [0, 2], 8, 8, 12, 4, n_seq_max=2, type_k="f32", type_v="f32", v_trans=False,
                    n_swa=4, n_batch=8, swa_full=swa_full)
    assert PrefixStore(g, tmp_path / "st", chunk_tokens=C).load(g, 1, a) == 8
    wpos, whave = seq_rows(g.attn.swa, 1)
    assert wpos == [5, 6, 7] and g.attn.base.seq_pos_max(1) == 7
    sel = np.searchsorted(spos, wpos)
    for (k1, v1), (k2, v2) in zip(swant, whave):
        np.testing.assert_array_equal(k1[sel], k2)
        np.testing.assert_array_equal(v1[sel], v2)
    assert g.recr._store_state(1) == (8, state8)


@pytest.mark.parametrize("swa_full", [True, False])
def test_hybrid_with_a_window_pool_evicts_under_pressure(tmp_path, swa_full):
    """A windowed hybrid memory's pool evicts the state after 8 on its own: that state is the
    chunk's state part, the window the SWA cache's index writes later its window part; the
    prefix loads once both are there (the base cache, holding no layer, has no state left to
    write for 8 when its cells go)."""
    cache, h, st, a = pool_of_two(tmp_path, n_swa=4, n_batch=8, swa_full=swa_full)
    spos, swant = seq_rows(h.attn.swa, 0)
    state8 = h.recr._store_checkpoint(a[:8])
    h.prefix_release(0, a)                          # the pool keeps 16 and 18: the state after 8 goes
    assert h.recr._store_checkpoint(a[:8]) is None
    assert st.stats["evicted_saved"] == 1 and st.match(a) == 0      # no window part yet
    run_hyb(h, 1, list(range(60, 80)), 0, 20)       # both caches need the room
    h.prefix_evict(n_cells=24, n_checkpoints=8)   # the rest: the state after 16 goes with its window
    assert st.match(a) == 16 and st.match(a[:12]) == 8
    h.seq_rm(1, -1, -1)
    g = cache()
    assert PrefixStore(g, tmp_path / "st", chunk_tokens=C).load(g, 1, a[:12]) == 8
    wpos, whave = seq_rows(g.attn.swa, 1)
    assert wpos == [5, 6, 7] and g.attn.base.seq_pos_max(1) == 7
    sel = np.searchsorted(spos, wpos)
    for (k1, v1), (k2, v2) in zip(swant, whave):
        np.testing.assert_array_equal(k1[sel], k2)
        np.testing.assert_array_equal(v1[sel], v2)
    assert g.recr._store_state(1) == (8, state8)


def test_caches_without_write_back_are_refused():
    st = PrefixStore(kvcache.UnifiedCache(32, 2, 8, 8, type_k="f32", type_v="f32", v_trans=False,
                                          semantics="2025"), chunk_tokens=C)
    with pytest.raises(StoreError, match="'2025' has no prefix index"):
        st.write_back(kvcache.UnifiedCache(32, 2, 8, 8, type_k="f32", type_v="f32", v_trans=False,
                                           semantics="2025"))
    old = kvcache.ISWACache(64, 3, 16, 16, swa_layers=[1], n_swa=6, type_k="f32", type_v="f32", v_trans=False,
                            n_seq_max=2, semantics="2025")
    with pytest.raises(StoreError, match="'2025' has no prefix index"):
        PrefixStore(old, chunk_tokens=C).write_back(old)
    r = RecurrentCache(2, 2, 6, 4, type_k="f32", type_v="f32", semantics="2026")
    with pytest.raises(RuntimeError, match="prefix reuse is off"):
        PrefixStore(r, chunk_tokens=C).write_back(r)
    with pytest.raises(StoreError, match="not the store's"):
        PrefixStore(iswa(True), chunk_tokens=C).write_back(hyb())


def _rows_cache():
    c = kvcache.UnifiedCache(32, 1, 8, 8, type_k="f32", type_v="f32", n_seq_max=3, semantics="2026", v_trans=False,
                             n_pad=1)
    c.enable_prefix_reuse()
    return c


def _fill_rows(c, s, toks, seed):
    n = len(toks)
    assert c.find_slot(UBatch(list(range(n)), [s] * n, tokens=toks))
    r = np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)
    c.store(0, r, -r)
    return r


def _seq_k(c, s):
    cells, pos = c.seq_cells(s)
    return np.asarray(c.k(0))[cells[np.argsort(pos)]]


def _stored_and_held(n_stored):
    """A store holding a prompt b of n_stored tokens, and a cache whose index holds another, a
    (21 tokens, released): (store, cache, a, a's K rows, b)."""
    src = _rows_cache()
    b = list(range(500, 500 + n_stored))
    _fill_rows(src, 0, b, 7)
    st = PrefixStore(src, chunk_tokens=4)
    st.save(src, 0, b)
    c = _rows_cache()
    a = list(range(1, 22))
    rows_a = _fill_rows(c, 0, a, 1)
    return st, c, a, rows_a, b


def test_a_load_that_evicts_writes_back_the_evicted_rows_before_its_own():
    # the import reserves cells the index held (evicting their prompt), then writes its rows into
    # them: the evicted prompt must reach the store before that, from its own rows
    st, c, a, rows_a, b = _stored_and_held(21)
    st.write_back(c)
    c.prefix_release(0, a)
    assert st.load(c, 1, b) == 20
    assert st.stats["evicted_saved"] > 0 and st.match(a) == 20
    _fill_rows(c, 2, [900], 3)                 # a later operation hands over nothing stale
    d = _rows_cache()
    assert st.load(d, 0, a) == 20
    np.testing.assert_array_equal(_seq_k(d, 0), rows_a[:20])


def test_a_load_without_room_keeps_the_index():
    st, c, a, _, b = _stored_and_held(28)
    c.prefix_release(0, a)
    _fill_rows(c, 2, list(range(800, 808)), 2)      # 3 free + 21 evictable < the 28 cells b needs
    before = c.prefix_stats
    with pytest.raises(kvcache.StateError, match="no room"):
        st.load(c, 1, b)
    assert c.prefix_stats == before and c.prefix_match(a + [0]) == 21
    assert not c.find_slot(UBatch(list(range(25)), [1] * 25))   # nor does a placement that cannot fit
    assert c.prefix_stats == before
    c._prefix_check()


def test_a_failing_write_back_is_counted_and_warned_and_the_call_stands(tmp_path):
    """The cache's placement is done when the store writes: a failure there loses the evicted
    prefixes only, and says so (counter, last_error, RuntimeWarning), never silently."""
    c = ucache()
    st = PrefixStore(c, tmp_path / "st", chunk_tokens=C)
    st.write_back(c)
    a = list(range(1, 22))
    ufill(c, 0, a, seed=1)
    assert c.prefix_release(0, a) == len(a)

    def boom(*args):
        raise MemoryError("no room for the rows")

    st._write_evicted = boom
    with pytest.warns(RuntimeWarning, match="write-back of evicted prefixes: MemoryError: no room for the rows"):
        ufill(c, 1, list(range(100, 128)), seed=2)      # evicts a's cells, and is placed
    assert c.seq_pos_max(1) == 27 and st.match(a) == 0
    assert st.stats["write_back_errors"] == 1 and "MemoryError" in st.last_error
    c._prefix_check()
