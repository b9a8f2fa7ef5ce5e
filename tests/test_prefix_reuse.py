"""Prefix reuse on today's unified cache (docs/prefix-reuse.md): finished sequences hand their
cells to the cache's prefix index, new ones attach the longest held prefix.

The K rows in these tests are a fingerprint of the tokens the row was computed after (the token
and every token before it), which is what a real model's K/V depend on. So "a reused cell holds
the K/V of the same computation from scratch" is checked exactly: an attached cell's row must be
the fingerprint of the new request's own prefix."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvcache
from kvcache import UBatch, UnifiedCache

E = 4   # K / V row width


def fingerprint(prefix) -> np.ndarray:
    """The K row of the last token of `prefix`, computed after all of it."""
    d = hashlib.blake2b(np.asarray(prefix, dtype=np.int64).tobytes(), digest_size=8).digest()
    return (np.frombuffer(d, dtype=np.uint16).astype(np.float32))


def make(kv_size=64, n_seq_max=4, **kw) -> UnifiedCache:
    c = UnifiedCache(kv_size, 1, E, E, type_k="f32", type_v="f32", v_trans=False, n_seq_max=n_seq_max, n_pad=32,
                     semantics="2026", **kw)
    c.enable_prefix_reuse()
    return c


def compute(c, s, tokens, start, prefix=None):
    """Place tokens[start:] of sequence s at positions start.. and store their rows; the rows are
    the fingerprints of (prefix or tokens)[:p + 1]. Returns whether it fitted."""
    n = len(tokens) - start
    if n <= 0:
        return True
    ub = UBatch(list(range(start, len(tokens))), [s] * n, tokens=list(tokens[start:]))
    if not c.find_slot(ub):
        return False
    full = list(prefix if prefix is not None else tokens)
    rows = np.stack([fingerprint(full[:p + 1]) for p in range(start, len(tokens))])
    c.store(0, rows, rows)
    return True


def rows_of(c, s):
    """Sequence s's (positions, K rows) in position order."""
    cells, pos = c.seq_cells(s)
    k = np.asarray(c.k(0)).reshape(c.n_stream, -1, E)[s if c.n_stream > 1 else 0]   # a stream per sequence
    return pos, k[cells]


# --- the basic flow ---------------------------------------------------------------------------

def test_release_match_attach_reuses_the_cells_without_copying():
    c = make()
    prompt = [11, 12, 13, 14, 15]
    assert compute(c, 0, prompt, 0)
    cells0, _ = c.seq_cells(0)
    assert c.prefix_release(0) == 5
    assert c.used == 0 and c.seq_pos_max(0) == -1
    assert c.prefix_stats == {"cells": 5, "evictable": 5, "nodes": 1, "cap": 0}
    # at least one token is always left to compute
    assert c.prefix_match(prompt) == 4
    assert c.prefix_match(prompt + [16, 17]) == 5
    assert c.prefix_match([11, 12, 99]) == 2
    assert c.prefix_match([99, 12]) == 0
    assert c.prefix_match([11]) == 0
    k = c.prefix_attach(1, prompt + [16, 17])
    assert k == 5
    cells1, pos1 = c.seq_cells(1)
    assert list(pos1) == [0, 1, 2, 3, 4] and sorted(cells1) == sorted(cells0)
    assert c.used == 5
    assert c.prefix_stats["evictable"] == 0          # attached: protected
    assert compute(c, 1, prompt + [16, 17], k)
    pos, rows = rows_of(c, 1)
    for p in range(7):
        np.testing.assert_array_equal(rows[p], fingerprint((prompt + [16, 17])[:p + 1]))
    c._prefix_check()


def test_salts_are_namespaces():
    c = make()
    compute(c, 0, [1, 2, 3, 4], 0)
    c.prefix_release(0, salt="tenant-a")
    assert c.prefix_match([1, 2, 3, 4, 5], salt="tenant-a") == 4
    assert c.prefix_match([1, 2, 3, 4, 5], salt=b"tenant-a") == 4
    assert c.prefix_match([1, 2, 3, 4, 5]) == 0
    assert c.prefix_match([1, 2, 3, 4, 5], salt="tenant-b") == 0
    assert c.prefix_attach(2, [1, 2, 3, 4, 5], salt="tenant-b") == 0


def test_held_cells_are_in_no_mask_state_or_used_count():
    c = make()
    compute(c, 0, [1, 2, 3, 4, 5, 6], 0)
    c.prefix_release(0)
    compute(c, 1, [7, 8], 0)
    assert c.used == 2
    m = c.kq_mask(UBatch([2], [1]))
    shown = set(np.flatnonzero(m.reshape(-1) == 0))
    assert shown == set(c.seq_cells(1)[0])
    # the whole-cache state holds sequence 1's cells only: as a cache that never held the others
    d = make()
    compute(d, 1, [7, 8], 0)
    assert len(c.state_write()) == len(d.state_write())
    assert c.state_write(0) == d.state_write(0)


def test_placement_evicts_held_cells_lru_and_never_a_live_sequence():
    c = make(kv_size=64)
    for s, base in enumerate((100, 200, 300)):
        assert compute(c, s, list(range(base, base + 20)), 0)
    c.prefix_release(0)
    c.prefix_release(2)
    c.prefix_release(1)          # order of use: 0, 2, 1
    assert c.prefix_stats["cells"] == 60 and c.used == 0
    assert c.prefix_attach(3, list(range(200, 220)) + [1]) == 20   # 1 is attached: protected
    # 24 new cells need 20 evicted: the least recently used unprotected prefix (sequence 0's) goes
    assert compute(c, 0, list(range(24)), 0)
    assert c.prefix_match(list(range(100, 121))) == 0
    assert c.prefix_match(list(range(300, 321))) == 20
    assert c.prefix_match(list(range(200, 221))) == 20
    # no room even after evicting everything evictable: nothing placed, the live cells intact
    before = c.seq_cells(3)
    assert not compute(c, 2, list(range(500, 540)), 0)
    assert all(np.array_equal(a, b) for a, b in zip(before, c.seq_cells(3)))
    assert c.prefix_match(list(range(200, 221))) == 20
    c._prefix_check()


def test_pins_and_the_cap():
    c = make()
    compute(c, 0, [1, 2, 3, 4], 0)
    c.prefix_release(0)
    pin = c.prefix_pin([1, 2, 3])
    assert c.prefix_evict(100) == 0
    assert c.prefix_match([1, 2, 3, 4, 5]) == 4
    c.prefix_unpin(pin)
    with pytest.raises(ValueError, match="not a pin"):
        c.prefix_unpin(pin)
    with pytest.raises(ValueError, match="holds 0 of the 2 tokens"):
        c.prefix_pin([9, 9])
    assert c.prefix_evict(100) == 4
    c.enable_prefix_reuse(cap=6)
    compute(c, 0, list(range(10, 15)), 0)
    compute(c, 1, list(range(20, 25)), 0)
    assert c.prefix_release(0) == 5
    assert c.prefix_release(1) == 5          # the first one evicted to stay under the cap
    assert c.prefix_stats["cells"] == 5
    assert c.prefix_match(list(range(10, 16))) == 0
    # a prefix larger than the cap cannot be kept: the release says so and frees the cells
    compute(c, 0, list(range(30, 40)), 0)
    assert c.prefix_release(0) == 0
    assert c.used == 0


def test_moved_cells_are_forgotten_and_never_kept():
    c = make()
    prompt = list(range(1, 11))
    compute(c, 0, prompt, 0)
    c.prefix_release(0)
    assert c.prefix_attach(1, prompt + [11]) == 10
    # a context shift on the attached sequence moves cells the index holds: it forgets them from
    # the first moved one on (the removed ones stay: the index still holds them, unchanged)
    c.seq_rm(1, 2, 4)
    c.seq_add(1, 4, -1, -2)
    assert c.prefix_match(prompt + [11]) == 4
    c.update()
    # released again, only the unmoved head is kept (the moved cells' K/V saw tokens 3 and 4)
    assert c.prefix_release(1) == 2
    c._prefix_check()


def test_a_recomputed_middle_ends_what_is_kept():
    c = make()
    prompt = list(range(1, 11))
    compute(c, 0, prompt, 0)
    c.seq_rm(0, 3, 6)
    other = prompt[:3] + [90, 91, 92] + prompt[6:]
    compute(c, 0, other[:6], 3)      # positions 3..5 again, with other tokens
    # positions 6.. were computed after the old 3..5: not a prefix of anything computed now
    assert c.prefix_release(0) == 6


def test_tokens_argument_supplies_and_bounds():
    c = make()
    ub = UBatch([0, 1, 2, 3], [0] * 4)           # placed without token ids
    assert c.find_slot(ub)
    assert c.prefix_release(0) == 0              # unknown tokens: nothing kept
    assert c.find_slot(ub)
    assert c.prefix_release(0, tokens=[5, 6, 7, 8]) == 4
    assert c.prefix_match([5, 6, 7, 8, 9]) == 4
    compute(c, 1, [1, 2, 3, 4], 0)
    assert c.prefix_release(1, tokens=[1, 2, 9]) == 2   # a recorded token that differs ends it


def test_clear_and_state_read_forget_the_index():
    c = make()
    compute(c, 0, [1, 2, 3, 4], 0)
    blob = c.state_write()
    c.prefix_release(0)
    c.state_read(blob)
    assert c.prefix_stats["cells"] == 0 and c.seq_pos_max(0) == 3
    c.prefix_release(0)
    assert c.prefix_stats["cells"] == 0     # restored cells carry no token ids
    compute(c, 1, [1, 2, 3], 0)
    c.prefix_release(1)
    c.clear()
    assert c.prefix_stats["cells"] == 0 and c.prefix_match([1, 2, 3, 4]) == 0
    c._prefix_check()


def test_held_cells_take_no_sequence_id():
    c = make(kv_size=1024, n_seq_max=256)
    for s in range(256):
        compute(c, s, [1000 + s, 1, 2], 0)
    for s in range(256):
        assert c.prefix_release(s) == 3
    assert c.prefix_stats["cells"] == 768
    for s in range(256):
        assert c.prefix_attach(s, [1000 + s, 1, 2, 3]) == 3
    c._prefix_check()


def test_a_hit_in_another_stream_is_a_stream_copy():
    c = make(kv_size=64, n_seq_max=2, kv_unified=False)
    prompt = [5, 6, 7, 8]
    compute(c, 0, prompt, 0)
    c.prefix_release(0)
    assert c.prefix_attach(1, prompt + [9]) == 4
    assert c.pending_copies == 1
    c.update()
    compute(c, 1, prompt + [9], 4)
    cells, pos = c.seq_cells(1)
    k = np.asarray(c.k(0)).reshape(2, 64, E)[1]
    for p, cell in zip(pos, cells):
        np.testing.assert_array_equal(k[cell], fingerprint((prompt + [9])[:p + 1]))
    c._prefix_check()


def test_a_prefix_spanning_two_streams_attaches_the_run_of_its_first():
    c = make(kv_size=64, n_seq_max=2, kv_unified=False)
    compute(c, 0, [1, 2, 3, 4, 5, 6], 0)
    c.prefix_release(0, salt="x")
    compute(c, 1, [1, 2, 3, 7, 8], 0)
    c.prefix_release(1, salt="x")          # [1 2 3] held in stream 0, [7 8] after it in stream 1
    assert c.prefix_stats["cells"] == 8
    # what an attach takes: the run in the stream of the first token
    assert c.prefix_match([1, 2, 3, 7, 8], salt="x") == 3
    # sequence 1 lives in stream 1, which the copy from stream 0 overwrites: [7 8] are forgotten
    assert c.prefix_attach(1, [1, 2, 3, 7, 8], salt="x") == 3
    c._prefix_check()
    assert c.prefix_match([1, 2, 3, 7, 8], salt="x") == 3
    c.update()
    c.prefix_release(1)
    c._prefix_check()


@pytest.mark.parametrize("swa_full", [True, False])
def test_an_iswa_pair_with_streams_attaches_what_it_matches(swa_full):
    # a prefix spanning two streams: each cache attaches the run in the stream of its first, so
    # the pair's hit is that run, in both caches (not an internal error, nothing else forgotten)
    c = _iswa(kv_unified=False, swa_full=swa_full, n_batch=8)
    c.enable_prefix_reuse()
    assert _iswa_compute(c, 0, [1, 2, 3, 4, 5, 6], 0)
    c.prefix_release(0)
    assert _iswa_compute(c, 1, [1, 2, 3, 7, 8], 0)
    c.prefix_release(1)                    # [1 2 3] held in stream 0, [7 8] after it in stream 1
    second = [1, 2, 3, 7, 8, 9]
    assert c.prefix_match(second) == 3
    assert c.prefix_attach(1, second) == 3
    c.update()
    assert _iswa_compute(c, 1, second, 3)
    for part, il in ((c.base, 0), (c.swa, 1)):
        cells, pos = part.seq_cells(1)
        k = np.asarray(part.k(il)).reshape(3, -1, E)[1]
        assert set(range(3, 6)) <= set(pos.tolist())
        for p, cell in zip(pos, cells):
            np.testing.assert_array_equal(k[cell], fingerprint(second[:p + 1]) + il)
        part._prefix_check()


# --- iSWA ---------------------------------------------------------------------------------------

def _iswa(**kw):
    c = kvcache.ISWACache(64, 2, E, E, swa_layers=[1], n_swa=4, type_k="f32", type_v="f32", v_trans=False,
                          n_seq_max=3, n_pad=32, semantics="2026", **kw)
    return c


def _iswa_compute(c, s, tokens, start):
    n = len(tokens) - start
    if not c.find_slot(UBatch(list(range(start, len(tokens))), [s] * n, tokens=list(tokens[start:]))):
        return False
    rows = np.stack([fingerprint(tokens[:p + 1]) for p in range(start, len(tokens))])
    for il in range(2):
        c.store(il, rows + il, rows + il)
    return True


def test_iswa_reuses_what_both_caches_hold():
    c = _iswa()
    c.enable_prefix_reuse()
    prompt = list(range(1, 13))
    assert _iswa_compute(c, 0, prompt, 0)
    assert c.prefix_release(0) == 12
    stats = c.prefix_stats
    assert stats["base"]["cells"] == 12 and stats["swa"]["cells"] == 12
    second = prompt[:9] + [50, 51]
    assert c.prefix_match(second) == 9
    assert c.prefix_attach(1, second) == 9
    assert _iswa_compute(c, 1, second, 9)
    for part, il in ((c.base, 0), (c.swa, 1)):
        cells, pos = part.seq_cells(1)
        k = np.asarray(part.k(il))
        for p, cell in zip(pos, cells):
            np.testing.assert_array_equal(k[cell], fingerprint(second[:p + 1]) + il)
    # a prefix one cache lost is not reused: the SWA cache's cells of the first prompt evicted
    c.prefix_release(1)
    c.swa.prefix_evict(100)
    assert c.prefix_match(prompt + [1]) == 0
    assert c.prefix_attach(2, prompt + [1]) == 0 and c.base.seq_pos_max(2) == -1
    c.base._prefix_check()
    c.swa._prefix_check()


@pytest.mark.parametrize("window", [False, True])
def test_iswa_enable_again_with_a_smaller_cap_evicts_down_to_it(window):
    # as a unified cache's: least recently used first
    c = _small() if window else _iswa()
    c.enable_prefix_reuse()
    for s, first in ((0, 100), (1, 200)):
        assert _iswa_compute(c, s, list(range(first, first + 8)), 0)
        c.prefix_release(s)
    assert c.prefix_stats["base"]["cells"] == 16
    c.enable_prefix_reuse(cap=8)
    assert c.prefix_stats["base"]["cells"] == 8
    assert c.prefix_match(list(range(100, 109))) == 0 and c.prefix_match(list(range(200, 209))) == 8
    c.base._prefix_check()
    c.swa._prefix_check()


def test_an_iswa_enable_one_cache_refuses_leaves_the_other_as_it_was():
    # the SWA cache switched on by itself in the other mode: the pair's enable is refused, and
    # the base cache keeps its cap (a later release is not held to the refused call's cap)
    c = _small()
    c.base.enable_prefix_reuse()
    c.swa.enable_prefix_reuse()
    with pytest.raises(ValueError, match="another mode"):
        c.enable_prefix_reuse(cap=4)
    assert _iswa_compute(c, 0, list(range(100, 108)), 0)
    assert c.base.prefix_release(0) == 8
    assert c.base.prefix_stats["cells"] == 8
    c.base._prefix_check()


# --- iSWA with a small SWA cache (window mode) ----------------------------------------------------

N_SWA = 4


def _small(**kw):
    # the SWA cache: n_swa * n_seq_max + n_batch cells, padded to 256 (llama.cpp's rule)
    return kvcache.ISWACache(1024, 2, E, E, swa_layers=[1], n_swa=N_SWA, type_k="f32", type_v="f32", v_trans=False,
                             n_seq_max=3, n_batch=8, swa_full=False, semantics="2026", **kw)


def _small_compute(c, s, tokens, start, step=8):
    """tokens[start:] of s in ubatches of at most `step` (the SWA cache's ubatch size)."""
    for a in range(start, len(tokens), step):
        if not _iswa_compute(c, s, tokens[:min(a + step, len(tokens))], a):
            return False
    return True


def _check_rows(c, s, tokens):
    """Every row s holds in either cache is the fingerprint of the prefix it was computed after;
    the base holds every position, the SWA cache at least the window of the next one."""
    for part, il in ((c.base, 0), (c.swa, 1)):
        cells, pos = part.seq_cells(s)
        k = np.asarray(part.k(il)).reshape(part.n_stream, -1, E)[s if part.n_stream > 1 else 0]
        for p, cell in zip(pos, cells):
            np.testing.assert_array_equal(k[cell], fingerprint(tokens[:p + 1]) + il, err_msg=f"layer {il} pos {p}")
    assert list(c.base.seq_cells(s)[1]) == list(range(len(tokens)))
    window = set(range(max(0, len(tokens) - N_SWA + 1), len(tokens)))
    assert window <= set(c.swa.seq_cells(s)[1].tolist())


def test_small_swa_cache_reuses_where_the_window_is_held():
    c = _small()
    assert c.swa.size < c.base.size
    c.enable_prefix_reuse()
    prompt = list(range(1, 301))                      # longer than the SWA cache: it overwrites the first ones
    assert _small_compute(c, 0, prompt, 0)
    held_swa = sorted(c.swa.seq_cells(0)[1].tolist())
    assert held_swa[0] > 0                             # positions the SWA cache no longer has
    assert c.prefix_release(0) == 300
    assert c.prefix_stats["swa"]["cells"] == len(held_swa)
    # a continuation (the next turn of a chat): everything but the last token
    turn = prompt + [400, 401, 402]
    assert c.prefix_match(turn) == 300
    # a request sharing only the beginning: the base holds it, the SWA cache not its window
    assert c.prefix_match(prompt[:5] + [50, 51]) == 0
    # a hit ending where the SWA cache still holds the window before it
    p = held_swa[-1] - 2
    assert c.prefix_match(prompt[:p] + [60]) == p
    assert c.prefix_attach(1, prompt[:p] + [60]) == p
    assert list(c.base.seq_cells(1)[1]) == list(range(p))
    assert sorted(c.swa.seq_cells(1)[1].tolist()) == list(range(p - N_SWA + 1, p))
    assert _small_compute(c, 1, prompt[:p] + [60], p)
    _check_rows(c, 1, prompt[:p] + [60])
    # the chat turn attaches the whole previous prompt and computes its tail
    assert c.prefix_attach(2, turn) == 300
    assert _small_compute(c, 2, turn, 300)
    _check_rows(c, 2, turn)
    # decoding on: the attached window slides out and is overwritten; the index keeps the prompt
    for t in range(20):
        turn = turn + [700 + t]
        assert _small_compute(c, 2, turn, len(turn) - 1)
        c.base._prefix_check()
        c.swa._prefix_check()
    _check_rows(c, 2, turn)
    assert c.prefix_release(2) == len(turn)
    assert c.prefix_match(turn + [1]) == len(turn)
    c.prefix_release(1)
    c.base._prefix_check()
    c.swa._prefix_check()


def test_small_swa_cache_chunked_window():
    c = _small(swa_type="chunked")
    c.enable_prefix_reuse()
    prompt = list(range(1, 301))
    assert _small_compute(c, 0, prompt, 0)
    c.prefix_release(0)
    # a query at a chunk boundary sees nothing before it: the base alone serves it
    assert c.prefix_match(prompt[:6] + [90]) == 4     # the chunk of 6 begins at 4: its window is gone
    assert c.prefix_match(prompt[:8] + [90]) == 8
    assert c.prefix_attach(1, prompt[:8] + [90]) == 8
    assert c.swa.seq_pos_max(1) == -1 and c.base.seq_pos_max(1) == 7
    assert _small_compute(c, 1, prompt[:8] + [90], 8)
    for part, il in ((c.base, 0), (c.swa, 1)):
        cells, pos = part.seq_cells(1)
        for p, cell in zip(pos, cells):
            np.testing.assert_array_equal(np.asarray(part.k(il))[cell], fingerprint((prompt[:8] + [90])[:p + 1]) + il)
    c.base._prefix_check()
    c.swa._prefix_check()


def test_small_swa_cache_placement_overwrites_held_cells_as_llama_cpp():
    """Sequences attached to a window keep placing in a small SWA cache: the held cells their
    windows left are overwritten (the index remembers their tokens without them)."""
    c = _small()
    c.enable_prefix_reuse()
    prompt = list(range(1, 13))
    assert _small_compute(c, 0, prompt, 0)
    c.prefix_release(0)
    for s in range(3):
        assert c.prefix_attach(s, prompt + [20 + s]) == 12
    toks = {s: prompt + [20 + s] for s in range(3)}
    for s in range(3):
        assert _small_compute(c, s, toks[s], 12)
    for _ in range(c.swa.size):
        for s in range(3):
            toks[s] = toks[s] + [s + 1]
            assert _small_compute(c, s, toks[s], len(toks[s]) - 1)
    for s in range(3):
        _check_rows(c, s, toks[s])
    c.swa._prefix_check()


# --- cells with the extension (M-RoPE's 2-D positions, per-layer embeddings) --------------------

def _ext_cache(**kw):
    c = UnifiedCache(64, 1, E, E, type_k="f32", type_v="f32", v_trans=False, n_seq_max=3, n_pad=32,
                     semantics="2026", cell_ext=True, **kw)
    c.enable_prefix_reuse()
    return c


def _ext_compute(c, s, tokens, xs, ys, start):
    """Rows are the fingerprints of the (token, x, y) triples they were computed after."""
    n = len(tokens) - start
    assert c.find_slot(UBatch(list(range(start, len(tokens))), [s] * n, tokens=tokens[start:], pos_x=xs[start:],
                              pos_y=ys[start:]))
    trip = [v for t in zip(tokens, xs, ys) for v in t]
    rows = np.stack([fingerprint(trip[:3 * (p + 1)]) for p in range(start, len(tokens))])
    c.store(0, rows, rows)


def test_cell_ext_cells_match_on_tokens_and_2d_positions():
    c = _ext_cache()
    toks, xs, ys = [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 2, 2]
    _ext_compute(c, 0, toks, xs, ys, 0)
    assert c.prefix_release(0) == 6
    assert c.prefix_match(toks + [7], pos_x=xs + [0], pos_y=ys + [0]) == 6
    xs2 = xs[:3] + [9] + xs[4:]                       # the same tokens, another 2-D position at 3
    assert c.prefix_match(toks + [7], pos_x=xs2 + [0], pos_y=ys + [0]) == 3
    assert c.prefix_match(toks + [7]) == 1            # zeros: only position 0 is (0, 0)
    assert c.prefix_attach(1, toks + [7], pos_x=xs2 + [0], pos_y=ys + [0]) == 3
    cells, pos = c.seq_cells(1)
    assert c.cells().ext[cells].tolist() == [[xs[p], ys[p], toks[p]] for p in pos]   # given back to the cells
    _ext_compute(c, 1, toks + [7], xs2 + [0], ys + [0], 3)
    trip = [v for t in zip(toks + [7], xs2 + [0], ys + [0]) for v in t]
    pos, rows = rows_of(c, 1)
    for p in pos:
        np.testing.assert_array_equal(rows[p], fingerprint(trip[:3 * (p + 1)]))
    # the second prompt differs from the held one at 3: nothing of it past there is kept
    assert c.prefix_release(1) == 3
    assert c.prefix_match(toks + [7], pos_x=xs2 + [0], pos_y=ys + [0]) == 3
    pin = c.prefix_pin(toks, pos_x=xs, pos_y=ys)
    with pytest.raises(ValueError, match="holds 3 of the 6"):
        c.prefix_pin(toks, pos_x=xs2, pos_y=ys)
    c.prefix_unpin(pin)
    with pytest.raises(ValueError, match="pos_x must hold one value per token"):
        c.prefix_match(toks, pos_x=[0])
    c._prefix_check()


def test_cell_ext_keeps_a_prompt_through_its_image_up_to_a_gap():
    c = _ext_cache()
    pos = [0, 1, 2, 3, 3, 3, 3, 5]                    # an image of 2 x 2 tokens at position 3
    ub = UBatch(pos, [0] * 8, tokens=[1, 2, 3, 9, 9, 9, 9, 4], pos_x=[0, 0, 0, 0, 1, 0, 1, 0],
                pos_y=[0, 0, 0, 0, 0, 1, 1, 0])
    assert c.find_slot(ub)
    # the image is kept (tests/test_prefix_images.py); the text at 5 is not where M-RoPE puts the
    # text after an image whose largest x or y is 3 (at 4): something it saw may have gone
    assert c.prefix_release(0) == 7
    assert c.prefix_match([1, 2, 3, 9, 9], pos=[0, 1, 2, 3, 3], pos_x=[0, 0, 0, 0, 1]) == 4
    c._prefix_check()


def test_cell_ext_iswa_matches_on_2d_positions_in_both_caches():
    c = kvcache.ISWACache(64, 2, E, E, swa_layers=[1], n_swa=4, swa_full=True, n_seq_max=3, semantics="2026",
                          cell_ext=True)
    c.enable_prefix_reuse()
    toks, xs, ys = [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 2, 2]
    assert c.find_slot(UBatch(list(range(6)), [0] * 6, tokens=toks, pos_x=xs, pos_y=ys))
    assert c.prefix_release(0) == 6
    assert c.prefix_match(toks + [7], pos_x=xs + [0], pos_y=ys + [0]) == 6
    xs2 = xs[:3] + [9] + xs[4:]
    assert c.prefix_match(toks + [7], pos_x=xs2 + [0], pos_y=ys + [0]) == 3
    assert c.prefix_match(toks + [7]) == 1            # zeros: only position 0 is (0, 0)
    assert c.prefix_attach(1, toks + [7], pos_x=xs2 + [0], pos_y=ys + [0]) == 3
    for part in (c.base, c.swa):                       # both caches give the cells their extension back
        cells, pos = part.seq_cells(1)
        assert sorted(pos) == [0, 1, 2]
        assert part.cells().ext[cells].tolist() == [[xs[p], ys[p], toks[p]] for p in pos]
    pin = c.prefix_pin(toks, pos_x=xs, pos_y=ys)
    with pytest.raises(ValueError, match="holds 3 of the 6"):
        c.prefix_pin(toks, pos_x=xs2, pos_y=ys)
    c.prefix_unpin(pin)
    with pytest.raises(ValueError, match="pos_x must hold one value per token"):
        c.prefix_attach(2, toks, pos_x=[0])
    assert c.seq_pos_max(2) == -1
    plain = kvcache.ISWACache(64, 2, E, E, swa_layers=[1], n_swa=4, semantics="2026")
    plain.enable_prefix_reuse()
    with pytest.raises(ValueError, match="cell_ext=False"):
        plain.prefix_match([1, 2], pos_y=[0, 0])


@pytest.mark.parametrize("swa_full", [True, False])
def test_a_prefix_copied_from_another_stream_leaves_the_window_as_recomputation(swa_full):
    # an image at one position placed a token per ubatch: placement may take the cells a
    # sequence's window left as seen from one past its last position; after an attach from
    # another stream it goes on after the attached cells, as after computing the prefix there,
    # so no query of the image loses a cell of its window
    def fresh():
        return kvcache.ISWACache(256, 2, E, E, swa_layers=[1], n_swa=4, swa_full=swa_full, n_batch=8, n_seq_max=2,
                                 kv_unified=False, cell_ext=True, semantics="2026")

    prompt = [4, 3, 4, 2]
    req = prompt + [1, 901, 902, 903]
    pos, xs, ys = [0, 1, 2, 3, 4, 5, 5, 5], [0, 0, 0, 0, 0, 5, 6, 7], [0, 0, 0, 0, 0, 5, 5, 5]

    def place(c, s, a, b):
        for j in range(a, b):
            ub = UBatch([pos[j]], [s], tokens=[req[j]], pos_x=[xs[j]], pos_y=[ys[j]])
            assert c.find_slot(ub)
        return c.attention_indices(ub, positions=True)[1].kv_pos.tolist()

    c = fresh()
    c.enable_prefix_reuse()
    place(c, 0, 0, 4)
    assert c.prefix_release(0) == 4
    assert c.prefix_attach(1, req, pos=pos, pos_x=xs, pos_y=ys) == 4
    assert c.base.pending_copies == 1
    c.update()
    scratch = fresh()
    place(scratch, 1, 0, 4)
    seen = place(scratch, 1, 4, 8)
    assert sorted(seen) == [2, 3, 4, 5, 5, 5]          # the last image token's window: positions 2 .. 5
    assert place(c, 1, 4, 8) == seen
    c.base._prefix_check()
    c.swa._prefix_check()


@pytest.mark.parametrize("swa_full", [True, False])
def test_held_cells_leave_a_window_as_a_cache_without_reuse_does(swa_full):
    # an image at one position placed a token per ubatch: placement may take the cells a
    # sequence's window left as seen from one past its last position. The cells the index holds
    # are not free for placement, so they do not make it search from the start of the cache,
    # where it would meet such cells of the request's own window before any free cell
    toks1 = [901, 902, 903, 2, 901, 902, 903, 4, 900, 901, 902, 903, 904, 905]
    pos1 = [0, 0, 0, 3, 4, 4, 4, 7, 8, 8, 8, 8, 8, 8]
    xs1 = [0, 0, 0, 0, 4, 4, 4, 0, 8, 9, 10, 8, 9, 10]
    ys1 = [0, 1, 2, 0, 4, 5, 6, 0, 8, 8, 8, 9, 9, 9]
    toks2 = toks1[:5] + [901, 902, 903, 900, 901, 902, 903, 900, 901, 1]
    pos2 = pos1[:5] + [5, 5, 5, 8, 8, 8, 8, 10, 10, 12]
    xs2 = xs1[:5] + [0, 6, 7, 8, 9, 8, 9, 10, 11, 0]
    ys2 = ys1[:5] + [0, 0, 0, 8, 8, 9, 9, 10, 10, 0]

    def place(c, s, toks, pos, xs, ys, a, b):
        seen = []
        for j in range(a, b):
            ub = UBatch([pos[j]], [s], tokens=[toks[j]], pos_x=[xs[j]], pos_y=[ys[j]])
            assert c.find_slot(ub)
            seen.append(sorted(c.attention_indices(ub, positions=True)[1].kv_pos.tolist()))
        return seen

    def fresh():
        return kvcache.ISWACache(512, 2, E, E, swa_layers=[1], n_swa=4, swa_full=swa_full, n_batch=8, n_seq_max=2,
                                 cell_ext=True, semantics="2026")

    reused, plain = fresh(), fresh()
    reused.enable_prefix_reuse()
    for c in (reused, plain):
        place(c, 0, toks1, pos1, xs1, ys1, 0, len(toks1))
    reused.prefix_release(0)
    plain.seq_rm(0)
    assert reused.prefix_attach(1, toks2, pos=pos2, pos_x=xs2, pos_y=ys2) == 5
    place(plain, 1, toks2, pos2, xs2, ys2, 0, 5)
    seen = place(plain, 1, toks2, pos2, xs2, ys2, 5, len(toks2))
    assert seen[6] == [5, 5, 5, 8, 8, 8, 8]             # the last token of the image at 8 sees 5 .. 8
    assert place(reused, 1, toks2, pos2, xs2, ys2, 5, len(toks2)) == seen
    reused.base._prefix_check()
    reused.swa._prefix_check()


def test_cell_ext_per_layer_embeddings_match_their_token():
    c = _ext_cache(ple_token=99)
    assert c.find_slot(UBatch([0, 1, 2], [0] * 3))                 # computed without token ids: 99's embedding
    assert c.prefix_release(0, tokens=[5, 6, 7]) == 3
    assert c.prefix_match([5, 6, 7, 8]) == 0                       # the cells' embedding input was not 5, 6, 7
    assert c.find_slot(UBatch([0, 1, 2], [1] * 3, tokens=[5, 6, 7]))
    assert c.prefix_release(1) == 0                                # held for the same tokens with another input
    c.prefix_evict(100)
    assert c.find_slot(UBatch([0, 1, 2], [1] * 3, tokens=[5, 6, 7]))
    assert c.prefix_release(1) == 3
    assert c.prefix_match([5, 6, 7, 8]) == 3
    c._prefix_check()


# --- publishing a running request ----------------------------------------------------------------

def test_publish_shares_a_running_prefix():
    c = make()
    system = [5, 6, 7, 8, 9, 10]
    assert compute(c, 0, system + [1, 2], 0)
    assert c.prefix_publish(0) == 8
    assert c.seq_pos_max(0) == 7 and c.prefix_stats["cells"] == 8 and c.prefix_stats["evictable"] == 0
    assert c.prefix_attach(1, system + [3]) == 6
    assert compute(c, 1, system + [3], 6)
    pos, rows = rows_of(c, 1)
    for p in range(7):
        np.testing.assert_array_equal(rows[p], fingerprint((system + [3])[:p + 1]))
    # the publisher goes on: decodes, drops its tail and computes another; publishes again
    assert compute(c, 0, system + [1, 2, 4], 8)
    c.seq_rm(0, 7, -1)
    assert compute(c, 0, system + [1, 11, 12], 7)
    assert c.prefix_publish(0) == 9
    assert c.prefix_match(system + [1, 2, 0]) == 8          # the removed tail stays: its K/V did not change
    assert c.prefix_match(system + [1, 11, 12, 0]) == 9
    c._prefix_check()
    assert c.prefix_release(1) == 7
    # a shift moves what the publisher holds: the index forgets it from the first moved cell on
    c.seq_rm(0, 0, 1)
    c.seq_add(0, 1, -1, -1)
    assert c.prefix_match(system + [0]) == 1
    assert c.prefix_match(system + [1, 11, 12, 0]) == 1
    c._prefix_check()
    c.seq_rm(0, -1, -1)
    c._prefix_check()


def test_a_sequence_holding_the_prefix_it_attached_keeps_it_and_what_follows():
    """A released sequence whose leading cells are, cell for cell, the prefix it attached keeps
    them as the index holds them, and what it computed after: also where the index's path was
    put together from two requests' cells computed out of order (the first tokens' cells later
    than the next ones', the same K/V all the same)."""
    c = make()
    head, tail = [21, 22, 23, 24, 25], [26, 27, 28, 29, 30]
    assert compute(c, 1, head + tail, 0)          # B computes all ten first
    assert compute(c, 0, head, 0)                 # A computes the first five later
    assert c.prefix_release(0) == 5               # the index: A's five cells
    assert c.prefix_release(1) == 10              # and B's last five after them
    assert c.prefix_attach(2, head + tail + [31, 32]) == 10
    assert compute(c, 2, head + tail + [31, 32], 10)
    assert c.prefix_release(2) == 12
    assert c.prefix_attach(3, head + tail + [31, 32, 33]) == 12
    pos, rows = rows_of(c, 3)
    for p in range(12):
        np.testing.assert_array_equal(rows[p], fingerprint((head + tail + [31, 32])[:p + 1]))
    # a sequence that lost the prefix's cells and computed its own keeps only what it computed right
    c.seq_rm(3, 4, -1)
    assert compute(c, 3, head + [40, 41], 4, prefix=head + [40, 41])
    assert c.prefix_release(3) == 7
    assert c.prefix_match(head + [40, 41, 0]) == 7
    assert c.prefix_match(head + tail + [31, 32, 0]) == 12
    c._prefix_check()


@pytest.mark.parametrize("publish", [False, True])
@pytest.mark.parametrize("change", ["middle, same token", "middle, other token", "tail"])
def test_an_attached_prefix_changed_is_kept_only_as_it_is_now(publish, change):
    """A release trusts the cells an attach gave its sequence only while they stay as placed: a
    cell of the attached prefix removed and computed again (with the same token or another)
    ends what the release keeps after it; a tail removed and computed with other tokens is kept
    as computed now; also after a publish."""
    c = make()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    assert compute(c, 0, prompt, 0)
    assert c.prefix_release(0) == 8
    assert c.prefix_attach(1, prompt + [9]) == 8
    if publish:
        assert compute(c, 1, prompt + [9], 8)
        assert c.prefix_publish(1) == 9
    if change == "tail":
        c.seq_rm(1, 5, -1)
        other = prompt[:5] + [50, 51, 52]
        assert compute(c, 1, other, 5)
        kept = 8
    else:
        c.seq_rm(1, 2, 3)
        other = prompt[:2] + [3 if change == "middle, same token" else 77] + prompt[3:]
        assert compute(c, 1, other[:3], 2, prefix=other)
        kept = 3   # positions 3.. were computed before the new position 2: not after it
        other = other[:3]
    assert c.prefix_release(1) == kept
    assert c.prefix_match(other + [0]) == kept
    assert c.prefix_attach(2, other + [0]) == kept
    pos, rows = rows_of(c, 2)
    for p in range(kept):
        np.testing.assert_array_equal(rows[p], fingerprint(other[:p + 1]))
    assert c.prefix_match(prompt + [0]) == 8        # the first prompt's cells are still the index's
    c._prefix_check()


def test_publish_in_an_iswa_cache():
    for c in (_iswa(), _small()):
        c.enable_prefix_reuse()
        prompt = list(range(1, 21))
        assert _small_compute(c, 0, prompt, 0)
        assert c.prefix_publish(0) == 20
        assert c.prefix_attach(1, prompt + [30]) == 20
        assert _small_compute(c, 1, prompt + [30], 20)
        for part, il in ((c.base, 0), (c.swa, 1)):
            cells, pos = part.seq_cells(1)
            for p, cell in zip(pos, cells):
                np.testing.assert_array_equal(np.asarray(part.k(il))[cell], fingerprint((prompt + [30])[:p + 1]) + il)
        c.base._prefix_check()
        c.swa._prefix_check()


# --- bad input --------------------------------------------------------------------------------

def test_bad_input_changes_nothing():
    c = make()
    compute(c, 0, [1, 2, 3], 0)
    c.prefix_release(0)
    compute(c, 1, [1, 2], 0)
    before = (c.prefix_stats, c.seq_cells(1)[0].tolist())
    with pytest.raises(ValueError, match="sequence 1 is not empty"):
        c.prefix_attach(1, [1, 2, 3, 4])
    with pytest.raises(TypeError, match="salt must be str, bytes or None"):
        c.prefix_attach(2, [1, 2, 3, 4], salt=3)
    with pytest.raises(TypeError, match="tokens must"):
        c.prefix_match("1234")
    with pytest.raises(ValueError, match="one-dimensional"):
        c.prefix_match(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match=r"tokens\[1\] holds -2, outside \[0, 2147483648\)"):
        c.prefix_attach(2, [1, -2, 3])
    with pytest.raises(ValueError, match="token ids"):
        c.prefix_attach(2, np.array([1, -2, 3], dtype=np.int16))
    with pytest.raises(TypeError):
        c.prefix_attach(2, [1.5, 2])
    with pytest.raises(ValueError, match="seq_id"):
        c.prefix_attach(9, [1, 2])
    with pytest.raises(ValueError, match="seq_id"):
        c.prefix_publish(-1)
    with pytest.raises(TypeError, match="salt must be str, bytes or None"):
        c.prefix_publish(1, salt=1.5)
    with pytest.raises(ValueError, match=r"tokens\[0\] holds -1"):
        c.prefix_publish(1, tokens=[-1, 2])
    assert (c.prefix_stats, c.seq_cells(1)[0].tolist()) == before
    c._prefix_check()


def test_failed_state_read_keeps_the_attached_prefix_protected():
    # the read's dry run takes the sequence out to look for room: a failure puts back its lock
    # on the prefix it attached, so that the prefix stays unevictable while the sequence holds it
    c = UnifiedCache(16, 1, E, E, type_k="f32", type_v="f32", n_seq_max=4, n_pad=1, semantics="2026")
    c.enable_prefix_reuse()
    compute(c, 0, [1, 2, 3, 4], 0)
    assert c.prefix_release(0) == 4
    assert c.prefix_attach(1, [1, 2, 3, 4, 5]) == 4
    assert c.find_slot(UBatch(list(range(10)), [2] * 10))
    big = UnifiedCache(16, 1, E, E, type_k="f32", type_v="f32", n_seq_max=4, n_pad=1, semantics="2026")
    assert big.find_slot(UBatch(list(range(8)), [0] * 8))
    before = (c.state_write(), c.prefix_stats, c.used)
    assert before[1]["evictable"] == 0
    with pytest.raises(kvcache.StateError, match="no room"):
        c.state_read(big.state_write(0), 1)
    assert (c.state_write(), c.prefix_stats, c.used) == before
    # a placement that cannot fit evicts nothing: the held cells are sequence 1's
    assert not c.find_slot(UBatch([0, 1, 2], [3] * 3))
    assert c.prefix_stats == before[1] and c.seq_pos_max(1) == 3
    c._prefix_check()


def test_an_aborted_import_keeps_the_tokens_the_cells_were_computed_with():
    # seq_import_begin's dry run places the incoming cells where the sequence's stood: an abort
    # leaves the sequence's cells as they were, with what reuse recorded of them
    c = make()
    compute(c, 0, [1, 2, 3, 4, 5, 6], 0)
    src = UnifiedCache(64, 1, E, E, type_k="f32", type_v="f32", v_trans=False, n_pad=32, semantics="2026")
    assert src.find_slot(UBatch([0, 1, 2], [0] * 3))
    imp = c.seq_import_begin(src.seq_export(0).header, 0)
    imp.abort()
    assert c.prefix_release(0) == 6 and c.prefix_stats["cells"] == 6
    c._prefix_check()


def test_a_placement_that_cannot_fit_evicts_nothing_live_sequences_hold():
    # the index's cells that a live sequence holds too (a copy of an attached sequence, a released
    # sequence's cells shared with another) free nothing when evicted: a placement that cannot
    # fit without them fails and evicts nothing
    c = UnifiedCache(16, 1, E, E, type_k="f32", type_v="f32", n_seq_max=4, n_pad=1, semantics="2026")
    c.enable_prefix_reuse()
    compute(c, 0, [1, 2, 3, 4], 0)
    assert c.prefix_release(0) == 4
    assert c.prefix_attach(1, [1, 2, 3, 4, 5]) == 4
    c.seq_cp(1, 2)
    c.seq_rm(1)                                  # sequence 2 holds the prefix's cells, unlocked
    assert c.find_slot(UBatch(list(range(10)), [3] * 10))
    before = (c.prefix_stats, c.used)
    assert not c.find_slot(UBatch([0, 1, 2, 3], [0] * 4))
    assert (c.prefix_stats, c.used) == before == ({"cells": 4, "evictable": 4, "nodes": 1, "cap": 0}, 14)
    c.seq_rm(3)
    compute(c, 1, [5, 6, 7], 0)
    c.seq_cp(1, 0)
    assert c.prefix_release(1) == 3              # sequence 0 holds the released cells too
    assert c.find_slot(UBatch(list(range(9)), [3] * 9))
    before = (c.prefix_stats, c.used)
    assert not c.find_slot(UBatch([0, 1], [1] * 2))
    assert (c.prefix_stats, c.used) == before
    c._prefix_check()


def _pinned_and_shared(c):
    """Fill c (16 cells): 4 held cells no live sequence holds, [1, 2, 3, 4]; 4 evictable held
    cells sequence 3 holds too, [5, 6, 7, 8]; 8 cells of sequence 0."""
    assert c.find_slot(UBatch([0, 1, 2, 3], [0] * 4, tokens=[1, 2, 3, 4]))
    assert c.prefix_release(0) == 4
    assert c.find_slot(UBatch([0, 1, 2, 3], [1] * 4, tokens=[5, 6, 7, 8]))
    assert c.prefix_release(1) == 4
    assert c.prefix_attach(2, [5, 6, 7, 8, 9]) == 4
    c.seq_cp(2, 3)
    c.seq_rm(2)
    assert c.find_slot(UBatch(list(range(8)), [0] * 8, tokens=[9] * 8))


def test_a_placement_evicts_nothing_when_only_pinned_or_shared_cells_could_make_room():
    # the room eviction can make is the evictable cells no live sequence holds too: with the
    # cells that would free room pinned, a placement that cannot fit (a pair's in either cache)
    # evicts nothing
    c = UnifiedCache(16, 1, E, E, n_seq_max=4, n_pad=1, semantics="2026", buffers=None)
    c.enable_prefix_reuse()
    _pinned_and_shared(c)
    pin = c.prefix_pin([1, 2, 3, 4])
    before = (c.prefix_stats, c.used)
    assert not c.find_slot(UBatch([8], [0]))
    assert (c.prefix_stats, c.used) == before == ({"cells": 8, "evictable": 4, "nodes": 2, "cap": 0}, 12)
    c.prefix_unpin(pin)
    assert c.find_slot(UBatch([8], [0]))              # the unpinned cells make room
    c._prefix_check()
    pair = _pair16()
    pair.enable_prefix_reuse()
    _pinned_and_shared(pair)
    pin = pair.base.prefix_pin([1, 2, 3, 4])          # the SWA cache can make room, the base cannot
    before = (pair.prefix_stats, pair.state_write())
    assert pair.find_slot_each(UBatch([8], [0])) == (False, True)
    assert (pair.prefix_stats, pair.state_write()) == before
    pair.base.prefix_unpin(pin)
    assert pair.find_slot(UBatch([8], [0]))
    pair.base._prefix_check()
    pair.swa._prefix_check()


def _pair16():
    return kvcache.ISWACache(16, n_layer=2, n_embd_k_gqa=E, n_embd_v_gqa=E, swa_layers=[0], n_swa=8, n_batch=16,
                             swa_full=True, n_pad=1, n_seq_max=4, semantics="2026", buffers=None)


def _full_pair():
    """A pair of 16 cells a cache, both full: 12 live cells, and 4 the index holds ([7] * 4)."""
    pair = _pair16()
    pair.enable_prefix_reuse()
    for s in (0, 2, 3):
        assert pair.find_slot(UBatch(list(range(4)), [s] * 4, tokens=[s] * 4))
    assert pair.find_slot(UBatch(list(range(4)), [1] * 4, tokens=[7] * 4))
    pair.prefix_release(1)
    return pair


def test_a_pair_placement_that_fails_in_one_cache_evicts_in_neither():
    # an iSWA pair places in both caches or in neither: a cache whose index could make room by
    # evicting does not evict while the other finds none (the pair's find_slot fails anyway)
    pair = _full_pair()
    pin = pair.base.prefix_pin([7] * 4)           # the base cache's held cells cannot be evicted
    before = (pair.prefix_stats, pair.state_write())
    assert pair.find_slot_each(UBatch([4], [0], tokens=[1])) == (False, True)   # the SWA cache could
    assert not pair.find_slot(UBatch([4], [0], tokens=[1]))
    assert (pair.prefix_stats, pair.state_write()) == before
    assert pair.prefix_stats["swa"] == {"cells": 4, "evictable": 4, "nodes": 1, "cap": 0}
    pair.base.prefix_unpin(pin)                   # now both can make room: both evict
    assert pair.find_slot(UBatch([4], [0], tokens=[1]))
    assert pair.prefix_stats["base"]["cells"] < 4 and pair.prefix_stats["swa"]["cells"] < 4
    assert (pair.base.seq_pos_max(0), pair.swa.seq_pos_max(0)) == (4, 4)


def test_a_pair_import_or_state_read_that_fails_in_one_cache_evicts_in_neither():
    # a sequence's import and state read look for room in both caches before either evicts: the
    # SWA cache, its held cells pinned, has none, so the base cache keeps its prefix and writes
    # none of it back
    src = _pair16()
    assert src.find_slot(UBatch([0, 1, 2], [0] * 3))
    header, blob = src.seq_export(0).header, src.state_write(0)
    pair = _full_pair()
    written = []
    pair.base._spill_set(lambda cache, records: written.extend(records))
    pin = pair.swa.prefix_pin([7] * 4)

    def now():
        return pair.prefix_stats, pair.state_write(), pair.base.used, pair.swa.used, pair.base.prefix_match([7] * 5)

    before = now()
    with pytest.raises(kvcache.StateError, match="no room"):
        pair.seq_import_begin(header, 1)
    assert now() == before and written == []
    with pytest.raises(kvcache.StateError, match="part 1 of 2 .*no room"):
        pair.state_read(blob, 1)
    assert now() == before and before[4] == 4
    assert pair.find_slot(UBatch([4], [0], tokens=[1])) is False and written == []   # (nothing pending either)
    pair.base._prefix_check()
    pair.swa._prefix_check()
    pair.swa.prefix_unpin(pin)                    # now both can make room: both evict
    with pair.seq_import_begin(header, 1) as imp:
        imp.commit()
    assert pair.prefix_stats["base"]["cells"] < 4 and pair.prefix_stats["swa"]["cells"] < 4 and len(written) == 1
    pair = _full_pair()
    assert pair.state_read(blob, 1) == len(blob)
    assert pair.prefix_stats["base"]["cells"] < 4 and pair.prefix_stats["swa"]["cells"] < 4
    for part in (pair.base, pair.swa):
        assert part.seq_pos_max(1) == 2
        part._prefix_check()


def test_a_refused_import_or_state_read_counts_held_cells_as_taken():
    # 16 cells: 8 live, 4 held and pinned, 4 free; a 6-cell sequence finds 4 free cells, not 8
    src = UnifiedCache(16, 1, E, E, n_pad=1, n_seq_max=2, semantics="2026", buffers=None)
    assert src.find_slot(UBatch(list(range(6)), [0] * 6))
    header, blob = src.seq_export(0).header, src.state_write(0)
    c = UnifiedCache(16, 1, E, E, n_pad=1, n_seq_max=2, semantics="2026", buffers=None)
    c.enable_prefix_reuse()
    assert c.find_slot(UBatch(list(range(4)), [0] * 4, tokens=[7] * 4))
    c.prefix_release(0)
    pin = c.prefix_pin([7] * 4)
    assert c.find_slot(UBatch(list(range(8)), [0] * 8, tokens=[1] * 8))
    with pytest.raises(kvcache.StateError, match=r"2 cells missing .* 4 are free without it: neither used nor held"):
        c.seq_import_begin(header, 1)
    with pytest.raises(kvcache.StateError, match=r"16 cells, 12 used or held by the prefix index"):
        c.state_read(blob, 1)
    c.prefix_unpin(pin)
    c._prefix_check()


def test_a_sequence_state_read_fits_in_the_cells_it_frees():
    # a full cache: sequence 0 holds 10 cells, sequence 1 six. A state read into 0 removes 0 first,
    # so 10 cells fit (its own) unless another sequence shares them, or the prefix index holds them
    # (then only by evicting them); 11 never fit
    def cache(reuse=False):
        c = UnifiedCache(16, 1, E, E, n_pad=1, n_seq_max=3, semantics="2026")
        if reuse:
            c.enable_prefix_reuse()
        return c

    def blob(n):
        src = cache()
        assert src.find_slot(UBatch(list(range(n)), [0] * n, tokens=list(range(n))))
        src.k(0)[:n] = np.arange(n * E).reshape(n, E)
        return src.state_write(0)

    def full(shared=False, reuse=False):
        c = cache(reuse)
        assert c.find_slot(UBatch(list(range(10)), [0] * 10, tokens=list(range(10))))
        assert c.find_slot(UBatch(list(range(6)), [1] * 6, tokens=list(range(6))))
        if shared:
            c.seq_cp(0, 2, -1, -1)
        return c

    def read(c, data, n):
        c.state_read(data, 0)
        assert c.seq_pos_max(0) == n - 1 and c.used == 6 + n and c.seq_pos_max(1) == 5
        assert sorted(np.array(c.k(0))[c.seq_cells(0)[0], 0].tolist()) == [i * E for i in range(n)]

    def refused(c, data):
        before = (c.cells().pos.copy(), c.cells().seq_mask.copy(), np.array(c.k(0), copy=True))
        with pytest.raises(kvcache.StateError, match="no room"):
            c.state_read(data, 0)
        after = (c.cells().pos, c.cells().seq_mask, np.array(c.k(0)))
        assert all(np.array_equal(x, y) for x, y in zip(before, after))

    read(full(), blob(10), 10)
    read(full(), blob(4), 4)
    refused(full(shared=True), blob(10))
    refused(full(), blob(11))
    c = full(reuse=True)
    c.prefix_publish(0)
    assert c.prefix_stats["cells"] == 10
    read(c, blob(10), 10)
    assert c.prefix_stats["cells"] == 0
    c._prefix_check()


def test_a_window_mode_placement_that_cannot_fit_evicts_and_demotes_nothing():
    # a small SWA cache (window mode) lets go of held cells (evicted, or demoted to ghosts while
    # pinned) only when that makes room: with too few of them the placement, and the pair's
    # import and state read, fail in both caches and leave both indexes as they were
    pair = kvcache.ISWACache(512, n_layer=2, n_embd_k_gqa=E, n_embd_v_gqa=E, swa_layers=[0], n_swa=8, n_batch=16,
                             swa_full=False, n_seq_max=4, semantics="2026", buffers=None)
    pair.enable_prefix_reuse()
    n = pair.swa.size - 6
    assert pair.find_slot(UBatch(list(range(n)), [0] * n, tokens=[5] * n))
    pair.seq_cp(0, 1)                             # cells of two sequences: no placement takes them
    assert pair.find_slot(UBatch(list(range(4)), [2] * 4, tokens=[7] * 4))
    pair.prefix_release(2)                        # the SWA cache: 2 free cells, 4 held
    src = kvcache.ISWACache(512, n_layer=2, n_embd_k_gqa=E, n_embd_v_gqa=E, swa_layers=[0], n_swa=8, n_batch=16,
                            swa_full=False, n_seq_max=4, semantics="2026", buffers=None)
    assert src.find_slot(UBatch(list(range(7)), [0] * 7))
    header, blob = src.seq_export(0).header, src.state_write(0)

    def now():
        return pair.prefix_stats, pair.state_write(), pair.base.prefix_match([7] * 5), pair.swa.prefix_match([7] * 5)

    for pinned in (False, True):
        pin = pair.swa.prefix_pin([7] * 4) if pinned else None
        before = now()
        assert before[0]["swa"]["cells"] == 4 and before[3] == 4
        assert pair.find_slot_each(UBatch(list(range(8)), [3] * 8, tokens=[1] * 8)) == (True, False)
        assert now() == before
        with pytest.raises(kvcache.StateError, match="no room"):
            pair.seq_import_begin(header, 3)
        assert now() == before
        with pytest.raises(kvcache.StateError, match="part 1 of 2 .*no room"):
            pair.state_read(blob, 3)
        assert now() == before
        pair.base._prefix_check()
        pair.swa._prefix_check()
        if pin is not None:
            pair.swa.prefix_unpin(pin)
    # 6 cells: the 2 free and the 4 held (evicted, or demoted while pinned) make room
    pin = pair.swa.prefix_pin([7] * 4)
    assert pair.find_slot(UBatch(list(range(6)), [3] * 6, tokens=[1] * 6))
    assert pair.prefix_stats["swa"]["cells"] == 0 and pair.swa.prefix_match([7] * 5) == 4   # ghosts
    pair.swa.prefix_unpin(pin)
    pair.swa._prefix_check()


def test_a_sliding_window_placement_counts_the_cells_its_window_left_before_evicting():
    # 4 held cells and 12 of a live sequence whose window left its first 8: 10 more tokens fit by
    # taking those 8 (llama.cpp's rule) and evicting 4 held cells, as in a cache without reuse
    # where the released sequence is simply gone; the room test counts the cells the window left
    def fresh():
        return kvcache.UnifiedCache(16, 1, E, E, n_seq_max=2, n_pad=1, n_swa=4, swa_type="standard", buffers=None,
                                    semantics="2026")

    def place(c, s, p0, n, tok0):
        return c.find_slot(UBatch(list(range(p0, p0 + n)), [s], n, tokens=list(range(tok0, tok0 + n))))

    reused, plain = fresh(), fresh()
    reused.enable_prefix_reuse()
    for c in (reused, plain):
        assert place(c, 1, 0, 4, 100)
        assert place(c, 0, 0, 12, 0)
    reused.prefix_release(1)
    plain.seq_rm(1, -1, -1)
    assert reused.prefix_stats["cells"] == 4 and reused.used == plain.used == 12
    assert place(plain, 0, 12, 10, 12)
    assert place(reused, 0, 12, 10, 12)
    assert _infos(reused.slot_info()) == _infos(plain.slot_info())
    assert [x.tolist() for x in reused.seq_cells(0)] == [x.tolist() for x in plain.seq_cells(0)]
    assert reused.prefix_stats["cells"] == 0
    reused._prefix_check()


# --- prepare: the dry run evicts nothing ------------------------------------------------------------

def _infos(plan):
    """slot_infos as plain lists (prepare's per ubatch, or one slot_info())."""
    return [(int(st), [int(x) for x in cells]) for st, cells in plan]


def test_prepare_that_fits_only_by_evicting_evicts_nothing():
    # three held prompts, used A, B, C in that order, C protected by an attached sequence, and a
    # full cache: the batch fits only by evicting A then B, which prepare reports without doing
    c = UnifiedCache(16, 1, E, E, type_k="f32", type_v="f32", n_seq_max=4, n_pad=1, semantics="2026")
    c.enable_prefix_reuse()
    prompts = [[10 + k] * 4 for k in range(3)]
    for s, p in enumerate(prompts):
        assert compute(c, s, p, 0)
    for s in range(3):
        c.prefix_release(s)
    assert c.prefix_attach(2, prompts[2] + [1]) == 4
    assert compute(c, 3, [5] * 4, 0)
    spilled = []
    c._spill_set(lambda cache, records: spilled.extend(list(r[1]) for r in records))

    def view():
        return c.prefix_stats, [c.prefix_match(p + [0]) for p in prompts], c.state_write(), c.used

    ubs = [UBatch([4, 5, 6], [3] * 3, tokens=[6] * 3), UBatch([7, 8, 9], [3] * 3, tokens=[7] * 3)]
    before = view()
    assert before[0] == {"cells": 12, "evictable": 8, "nodes": 3, "cap": 0} and before[3] == 8
    # one ubatch that fits by evicting, then one that does not fit even so: no, and nothing went
    assert c.prepare([ubs[0], UBatch(list(range(7, 16)), [3] * 9)]) is None
    assert view() == before and not spilled
    plan = c.prepare(ubs)
    assert plan is not None
    assert view() == before and not spilled
    c._prefix_check()
    # the real placement evicts A, then B, and puts the tokens where prepare said
    for ub, infos in zip(ubs, plan):
        assert c.find_slot(ub)
        assert _infos(c.slot_info()) == _infos(infos)
    assert [c.prefix_match(p + [0]) for p in prompts] == [0, 0, 4]
    assert spilled == prompts[:2]
    c._prefix_check()


@pytest.mark.parametrize("kv_unified", [True, False])
def test_prepare_finds_the_cells_placement_takes_after_evicting(kv_unified):
    # random caches kept full by the index (prompts released, some attached, some pinned, some
    # sharing a prefix): whatever prepare answers, it leaves the index and the cells as they were
    # (held cells, recency, the cells' state), and the placements that follow take exactly the
    # cells it named, evicting as it foresaw
    rng = np.random.default_rng(7)
    n_seq = 4
    c = UnifiedCache(96, 1, E, E, type_k="f32", type_v="f32", n_seq_max=n_seq, n_pad=1, semantics="2026",
                     kv_unified=kv_unified, buffers=None)
    c.enable_prefix_reuse()
    prompts: list[list[int]] = []
    pins = []
    fitted = evicting = 0
    for rnd in range(400):
        op = rng.integers(0, 6)
        s = int(rng.integers(0, n_seq))
        if op <= 2:
            # a request: attach what the index holds of a prompt (an old one extended, or new), compute
            # the rest, release it to the index (or keep it running)
            base = prompts[int(rng.integers(0, len(prompts)))] if prompts and rng.integers(0, 2) else []
            toks = base[: int(rng.integers(0, len(base) + 1))] + [int(t) for t in rng.integers(1, 50, rng.integers(1, 20))]
            c.seq_rm(s)
            k = c.prefix_attach(s, toks)
            ub = UBatch(list(range(k, len(toks))), [s] * (len(toks) - k), tokens=toks[k:])
            if c.find_slot(ub):
                prompts.append(toks)
                if rng.integers(0, 4):
                    c.prefix_release(s)
            else:
                c.seq_rm(s)
        elif op == 3 and prompts and len(pins) < 2:
            toks = prompts[int(rng.integers(0, len(prompts)))]
            if c.prefix_match(toks + [0]) == len(toks):
                pins.append(c.prefix_pin(toks))
        elif op == 3 and pins:
            try:
                c.prefix_unpin(pins.pop())
            except ValueError:   # its prefix went (a stream a prompt was copied into is forgotten first)
                pass
        else:
            # prepare of one to three ubatches, then the placements themselves
            ubs = []
            for _ in range(int(rng.integers(1, 4))):
                q = int(rng.integers(0, n_seq))
                p0 = c.seq_pos_max(q) + 1 + sum(len(u.pos) for u in ubs if u.seq_id[0][0] == q)
                n = int(rng.integers(1, 40))
                ubs.append(UBatch(list(range(p0, p0 + n)), [q] * n, tokens=[int(t) for t in rng.integers(1, 50, n)]))
            before = (c.prefix_stats, [c.prefix_match(t + [0]) for t in prompts[-20:]], c.state_write(), c.used)
            plan = c.prepare(ubs)
            assert (c.prefix_stats, [c.prefix_match(t + [0]) for t in prompts[-20:]], c.state_write(), c.used) == before
            c._prefix_check()
            if plan is None:
                continue
            fitted += 1
            held = c.prefix_stats["cells"]
            for ub, infos in zip(ubs, plan):
                assert c.find_slot(ub), rnd
                assert _infos(c.slot_info()) == _infos(infos), rnd
            evicting += c.prefix_stats["cells"] < held
            c._prefix_check()
    assert fitted > 30 and evicting > 10, (fitted, evicting)


def test_iswa_prepare_that_one_cache_cannot_fit_evicts_in_neither():
    pair = _full_pair()
    pin = pair.swa.prefix_pin([7] * 4)            # the SWA cache's held cells cannot be evicted

    def view():
        return (pair.prefix_stats, pair.base.prefix_match([7] * 5), pair.swa.prefix_match([7] * 5),
                pair.state_write())

    ub = UBatch([4], [0], tokens=[1])
    before = view()
    assert pair.prepare([ub]) is None             # the base cache could make room, the SWA cache not
    assert view() == before
    pair.swa.prefix_unpin(pin)
    before = view()
    plan = pair.prepare([ub])                     # both fit by evicting: both say where
    assert plan is not None and view() == before
    pair.base._prefix_check()
    pair.swa._prefix_check()
    assert pair.find_slot(ub)
    assert [_infos(x) for x in pair.slot_info()] == [_infos(part[0]) for part in plan]
    assert pair.prefix_stats["base"]["cells"] < 4 and pair.prefix_stats["swa"]["cells"] < 4


def test_reuse_off_and_unavailable():
    c = UnifiedCache(64, 1, E, E, n_seq_max=2, semantics="2026")
    assert not c.prefix_reuse and c.prefix_stats is None
    assert c.prefix_match([1, 2, 3]) == 0
    with pytest.raises(RuntimeError, match="prefix reuse is off"):
        c.prefix_release(0)
    with pytest.raises(RuntimeError, match="prefix reuse is off"):
        c.prefix_publish(0)
    assert not hasattr(UnifiedCache(64, 1, E, E), "enable_prefix_reuse")   # the 2025 cache has none
    m = kvcache.ISWACache(64, 2, E, E, swa_layers=[1], n_swa=4, swa_full=False, semantics="2026", cell_ext=True)
    m.enable_prefix_reuse()                  # a small SWA cache with the extension (tests/test_prefix_images.py)
    assert m.prefix_reuse and m.base.prefix_reuse and m.swa.prefix_reuse
    with pytest.raises(ValueError, match="cell_ext=False"):
        c.prefix_match([1, 2], pos_x=[0, 0])
    c.enable_prefix_reuse()
    compute(c, 0, [1, 2, 3], 0)
    c.prefix_release(0)
    c.disable_prefix_reuse()
    assert c.prefix_stats is None and c.used == 0


# --- the state machine ------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 8, 7], [1, 2], [4, 4, 4, 4, 4, 4, 4, 4]]


class PrefixReuseMachine(RuleBasedStateMachine):
    """Requests start from a match, compute, decode, shift, copy, save and restore, end into the
    index; placement evicts. Every step: the index agrees with the cells, every live sequence's
    rows are the fingerprints of what its cells were computed after, the mask shows each
    sequence exactly its own cells."""

    N_SEQ = 3
    KW: dict = {}

    def __init__(self):
        super().__init__()
        self.c = make(kv_size=32, n_seq_max=self.N_SEQ, **self.KW)
        self.toks = {s: [] for s in range(self.N_SEQ)}     # the live sequences' tokens
        self.keys = {s: [] for s in range(self.N_SEQ)}     # what each position's row was computed after
        self.pins = []

    def _live(self, s):
        return bool(self.toks[s])

    def _clear(self, s):
        self.toks[s], self.keys[s] = [], []

    @rule(s=st.integers(0, 2), base=st.sampled_from(PROMPTS), tail=st.lists(st.integers(1, 9), max_size=4),
          salt=st.sampled_from([None, "x"]))
    def start(self, s, base, tail, salt):
        if self._live(s):
            return
        prompt = base + tail
        k = self.c.prefix_attach(s, prompt, salt=salt)
        assert 0 <= k <= len(prompt) - 1
        if self.c.pending_copies:
            self.c.update()   # a prefix from another stream: its rows come with the stream copy
        pos, rows = rows_of(self.c, s)
        assert list(pos) == list(range(k))
        for p in range(k):
            np.testing.assert_array_equal(rows[p], fingerprint(prompt[:p + 1]), err_msg=f"attached position {p}")
        self.toks[s], self.keys[s] = prompt[:k], [tuple(prompt[:p + 1]) for p in range(k)]
        if compute(self.c, s, prompt, k):
            self.toks[s] = list(prompt)
            self.keys[s] = [tuple(prompt[:p + 1]) for p in range(len(prompt))]
        else:
            self.c.seq_rm(s, -1, -1)
            self._clear(s)

    @rule(s=st.integers(0, 2), t=st.integers(1, 9))
    def decode(self, s, t):
        if not self._live(s):
            return
        toks = self.toks[s] + [t]
        if compute(self.c, s, toks, len(toks) - 1):
            self.toks[s] = toks
            self.keys[s] = self.keys[s] + [tuple(toks)]

    @rule(s=st.integers(0, 2), salt=st.sampled_from([None, "x"]))
    def release(self, s, salt):
        if not self._live(s):
            return
        kept = self.c.prefix_release(s, salt=salt)
        # only rows computed after exactly the sequence's own prefix can be kept
        good = 0
        while good < len(self.toks[s]) and self.keys[s][good] == tuple(self.toks[s][:good + 1]):
            good += 1
        assert kept <= good
        self._clear(s)

    @rule(s=st.integers(0, 2), salt=st.sampled_from([None, "x"]))
    def publish(self, s, salt):
        if not self._live(s):
            return
        kept = self.c.prefix_publish(s, salt=salt)
        good = 0
        while good < len(self.toks[s]) and self.keys[s][good] == tuple(self.toks[s][:good + 1]):
            good += 1
        assert kept <= good
        assert list(rows_of(self.c, s)[0]) == list(range(len(self.toks[s])))   # it goes on, holding everything

    @rule(s=st.integers(0, 2), p0=st.integers(0, 8))
    def truncate(self, s, p0):
        if not self._live(s):
            return
        self.c.seq_rm(s, p0, -1)
        self.toks[s], self.keys[s] = self.toks[s][:p0], self.keys[s][:p0]

    @rule(s=st.integers(0, 2), a=st.integers(0, 4), d=st.integers(1, 3))
    def context_shift(self, s, a, d):
        n = len(self.toks[s])
        mine = set(self.c.seq_cells(s)[0].tolist())
        shared = any(mine & set(self.c.seq_cells(o)[0].tolist()) for o in range(self.N_SEQ) if o != s)
        if n < a + d + 1 or shared:
            return   # a shift moves shared cells for every sequence holding them (not modelled here)
        self.c.seq_rm(s, a, a + d)
        self.c.seq_add(s, a + d, -1, -d)
        self.c.update()
        self.toks[s] = self.toks[s][:a] + self.toks[s][a + d:]
        self.keys[s] = self.keys[s][:a] + self.keys[s][a + d:]

    @rule(src=st.integers(0, 2), dst=st.integers(0, 2))
    def copy(self, src, dst):
        if src == dst or not self._live(src) or self._live(dst) or self.c.n_stream > 1:
            return
        self.c.seq_cp(src, dst, -1, -1)
        self.toks[dst], self.keys[dst] = list(self.toks[src]), list(self.keys[src])

    @rule(s=st.integers(0, 2))
    def save_restore(self, s):
        if not self._live(s):
            return
        blob = self.c.state_write(s)
        self.c.seq_rm(s, -1, -1)
        try:
            self.c.state_read(blob, s)
        except kvcache.StateError as e:
            # cells it shared with other sequences come back unshared: they may not fit
            assert "no room" in str(e)
            self._clear(s)

    @rule(s=st.integers(0, 2), toks=st.lists(st.integers(1, 9), min_size=1, max_size=30), chunk=st.integers(1, 8))
    def prepare_then_decode(self, s, toks, chunk):
        # prepare of a decode in chunks changes nothing (the index, its order of use, the cells)
        # and says where the real placements put each chunk, or that one of them does not fit
        if not self._live(s):
            return
        full, n0 = self.toks[s] + toks, len(self.toks[s])
        starts = list(range(n0, len(full), chunk))
        ubs = [UBatch(list(range(a, min(a + chunk, len(full)))), [s] * len(full[a:a + chunk]),
                      tokens=full[a:a + chunk]) for a in starts]
        before = (self.c.prefix_stats, self.c.state_write(), self.c.used)
        plan = self.c.prepare(ubs)
        assert (self.c.prefix_stats, self.c.state_write(), self.c.used) == before
        self.c._prefix_check()
        for k, a in enumerate(starts):
            end = min(a + chunk, len(full))
            if not compute(self.c, s, full[:end], a):
                assert plan is None
                return
            assert plan is None or _infos(self.c.slot_info()) == _infos(plan[k])   # None: a later one fails
            self.toks[s] = full[:end]
            self.keys[s] = self.keys[s] + [tuple(full[:p + 1]) for p in range(a, end)]
        assert plan is not None

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        self.c.prefix_evict(n)

    @rule(base=st.sampled_from(PROMPTS), n=st.integers(1, 6))
    def pin(self, base, n):
        if self.c.prefix_match(base[:n] + [0]) == min(n, len(base)):
            self.pins.append(self.c.prefix_pin(base[:n]))

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self):
        try:
            self.c.prefix_unpin(self.pins.pop())
        except ValueError:
            pass    # its prefix left the index (a shift moved its cells)

    @invariant()
    def agrees(self):
        self.c._prefix_check()
        used = 0
        for s in range(self.N_SEQ):
            pos, rows = rows_of(self.c, s)
            assert list(pos) == list(range(len(self.toks[s])))
            for p in range(len(pos)):
                np.testing.assert_array_equal(rows[p], fingerprint(self.keys[s][p]), err_msg=f"seq {s} pos {p}")
            if self._live(s):
                used += len(pos)
                m = self.c.kq_mask(UBatch([len(pos)], [s]))
                shown = set(np.flatnonzero(m.reshape(-1) == 0))
                assert shown == set(self.c.seq_cells(s)[0])
        if self.c.n_stream == 1:
            assert self.c.used == len({int(x) for s in range(self.N_SEQ) for x in self.c.seq_cells(s)[0]})


PrefixReuseMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_prefix_reuse_against_fingerprints = PrefixReuseMachine.TestCase


class PrefixReuseStreamsMachine(PrefixReuseMachine):
    KW = {"kv_unified": False}


PrefixReuseStreamsMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_prefix_reuse_streams_against_fingerprints = PrefixReuseStreamsMachine.TestCase


LONG_PROMPTS = [list(range(1, 90)), list(range(1, 60)) + [20, 21, 22], [9] * 70, [1, 2, 3], list(range(1, 120))]


class SmallSWAMachine(RuleBasedStateMachine):
    """An iSWA cache whose SWA cache is small (window mode): requests attach, compute, decode,
    publish, truncate and end into the indexes; placement overwrites the cells windows left and
    evicts. Every step: both indexes agree with their cells, every row a live sequence holds in
    either cache is the fingerprint of its own prefix, the base holds all of it and the SWA
    cache the window before its next position."""

    KW: dict = {}

    def __init__(self):
        super().__init__()
        self.c = _small(**self.KW)
        self.c.enable_prefix_reuse()
        self.toks = {s: [] for s in range(3)}

    @rule(s=st.integers(0, 2), base=st.sampled_from(LONG_PROMPTS), tail=st.lists(st.integers(1, 9), max_size=6),
          salt=st.sampled_from([None, "x"]))
    def start(self, s, base, tail, salt):
        if self.toks[s]:
            return
        prompt = base + tail
        m = self.c.prefix_match(prompt, salt=salt)
        k = self.c.prefix_attach(s, prompt, salt=salt)
        assert k == m and 0 <= k <= len(prompt) - 1
        self.c.update()    # a prefix from another stream: the copy
        if k:
            _check_rows(self.c, s, prompt[:k])
        if _small_compute(self.c, s, prompt, k):
            self.toks[s] = list(prompt)
        else:
            self.c.seq_rm(s, -1, -1)

    @rule(s=st.integers(0, 2), t=st.integers(1, 9), n=st.integers(1, 40))
    def decode(self, s, t, n):
        for _ in range(n if self.toks[s] else 0):
            toks = self.toks[s] + [t]
            if not _small_compute(self.c, s, toks, len(toks) - 1):
                break
            self.toks[s] = toks

    @rule(s=st.integers(0, 2), salt=st.sampled_from([None, "x"]), end=st.booleans())
    def release(self, s, salt, end):
        if not self.toks[s]:
            return
        if end:
            assert self.c.prefix_release(s, salt=salt) <= len(self.toks[s])
            self.toks[s] = []
        else:
            assert self.c.prefix_publish(s, salt=salt) <= len(self.toks[s])

    @rule(s=st.integers(0, 2), p0=st.integers(1, 200))
    def truncate(self, s, p0):
        held = set(self.c.swa.seq_cells(s)[1].tolist())
        if p0 >= len(self.toks[s]) or not set(range(max(0, p0 - N_SWA + 1), p0)) <= held:
            return   # the SWA cache no longer holds the window there (llama.cpp cannot roll back either)
        self.c.seq_rm(s, p0, -1)
        self.toks[s] = self.toks[s][:p0]

    @rule(s=st.integers(0, 2), toks=st.lists(st.integers(1, 9), min_size=1, max_size=30), chunk=st.integers(1, 8))
    def prepare_then_decode(self, s, toks, chunk):
        # prepare changes neither cache (window mode: a placement that overwrites held cells
        # turns them into ghosts in the real placement only) and says where both real
        # placements put each chunk, or that one does not fit
        if not self.toks[s]:
            return
        full, n0 = self.toks[s] + toks, len(self.toks[s])
        starts = list(range(n0, len(full), chunk))
        ubs = [UBatch(list(range(a, min(a + chunk, len(full)))), [s] * len(full[a:a + chunk]),
                      tokens=full[a:a + chunk]) for a in starts]
        before = (self.c.prefix_stats, self.c.state_write())
        plan = self.c.prepare(ubs)
        assert (self.c.prefix_stats, self.c.state_write()) == before
        self.c.base._prefix_check()
        self.c.swa._prefix_check()
        for k, a in enumerate(starts):
            end = min(a + chunk, len(full))
            if not _iswa_compute(self.c, s, full[:end], a):
                assert plan is None
                return
            if plan is not None:   # None: a later one fails
                assert [_infos(x) for x in self.c.slot_info()] == [_infos(plan[0][k]), _infos(plan[1][k])]
            self.toks[s] = full[:end]
        assert plan is not None

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        self.c.prefix_evict(n)

    @invariant()
    def agrees(self):
        self.c.base._prefix_check()
        self.c.swa._prefix_check()
        for s in range(3):
            if self.toks[s]:
                _check_rows(self.c, s, self.toks[s])
            else:
                assert self.c.base.seq_pos_max(s) == -1 and self.c.swa.seq_pos_max(s) == -1


SmallSWAMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_small_swa_reuse_against_fingerprints = SmallSWAMachine.TestCase


class SmallSWAStreamsMachine(SmallSWAMachine):
    """The same with a stream per sequence: a prefix held in another stream comes over by a stream
    copy, and a hit is what both caches attach from one stream."""
    KW = {"kv_unified": False}


SmallSWAStreamsMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
test_small_swa_reuse_with_streams_against_fingerprints = SmallSWAStreamsMachine.TestCase
