"""Prefix reuse for recurrent and hybrid memories (docs/prefix-reuse.md, "Recurrent and hybrid
models: what is reused"): checkpoints of sequences' states, resumed by later requests.

The states in these tests come from a toy recurrence with exact arithmetic: the state after a
token is a hash of the state before it and the token, so a state is the state after exactly one
chain of tokens, and "a resumed request ends in the state of the same computation from scratch"
is checked bit for bit. The attention part of a hybrid memory stores, as each token's K row, a
fingerprint of the tokens it was computed after (as tests/test_prefix_reuse.py does)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import HybridCache, RecurrentCache, StateError, UBatch
from lfm2_model import lfm2_chunk
from reference_checkpoint import CheckpointPoolModel

E = 4   # state row width


def step(state: np.ndarray, tok: int) -> np.ndarray:
    """The toy model's next state."""
    d = hashlib.blake2b(np.asarray(state, dtype=np.float32).tobytes() + int(tok).to_bytes(4, "little"),
                        digest_size=8).digest()
    return np.frombuffer(d, dtype=np.uint16).astype(np.float32)


def scratch(tokens) -> np.ndarray:
    """The state after tokens, computed from the zero state."""
    s = np.zeros(E, dtype=np.float32)
    for t in tokens:
        s = step(s, t)
    return s


def fingerprint(prefix) -> np.ndarray:
    """An attention K row: computed after every token of prefix."""
    d = hashlib.blake2b(np.asarray(prefix, dtype=np.int64).tobytes(), digest_size=8).digest()
    return np.frombuffer(d, dtype=np.uint16).astype(np.float32)


def rec(n_seq_max=4, checkpoints=8, per_seq=0, n_rs_seq=0, **kw) -> RecurrentCache:
    c = RecurrentCache(n_seq_max, 1, E, E, type_k="f32", type_v="f32", semantics="2026", n_rs_seq=n_rs_seq, **kw)
    c.enable_prefix_reuse(checkpoints=checkpoints, per_seq=per_seq)
    return c


def run_states(r, s_copy_row: int, toks, n_rs_seq: int, store) -> np.ndarray:
    """Run the toy recurrence over toks from the row s_copy names (the zero row rs_z reads zeros),
    storing the final state (plane 0) and the snapshots (planes 1 .. n_rs_seq) with store."""
    plane, cell = divmod(int(s_copy_row), r.size)
    state = np.zeros(E, np.float32) if (plane == 0 and cell == r.rs_z) else np.array(r.k(0, plane)[cell])
    states = []
    for t in toks:
        state = step(state, t)
        states.append(state)
    for p in range(min(len(toks) - 1, n_rs_seq) + 1):
        row = states[len(states) - 1 - p][None]
        store(row, p)
    return state


def compute(c: RecurrentCache, s: int, tokens, start: int) -> None:
    """The model computes tokens[start:] of sequence s at positions start.. in one ubatch."""
    n = len(tokens) - start
    assert c.find_slot(UBatch(list(range(start, len(tokens))), [s], n_seq_tokens=n))
    run_states(c, c.s_copy()[0], tokens[start:], c.n_rs_seq, lambda row, p: c.store(0, row, row, plane=p))


def state_of(c: RecurrentCache, s: int) -> np.ndarray:
    cell = c.cells()["tail"][s]
    return np.array(c.k(0)[cell])


# --- the recurrent cache ---------------------------------------------------------------------------

def test_a_request_resumes_from_the_deepest_checkpoint_exactly():
    c = rec()
    a = [5, 6, 7, 8, 9, 10, 11, 12]
    compute(c, 0, a, 0)
    c.seq_rm(0)
    compute(c, 0, a[:4], 0)                  # a prefill in chunks of 4, checkpointed at the boundary
    assert c.checkpoint(0, a) == 4           # the state is at position 3: the state after a[:4]
    compute(c, 0, a, 4)
    assert c.prefix_release(0, a + [99]) == 8     # the tokens past the state are not used
    assert c.seq_pos_max(0) == -1
    assert [ch for ch, _ in c.prefix_checkpoints()] == [a[:4], a]

    b = a[:6] + [1, 2]                       # shares 6 tokens: resumes from the checkpoint at 4
    assert c.prefix_match(b) == 4
    assert c.prefix_attach(1, b) == 4
    assert c.seq_pos_max(1) == 3
    np.testing.assert_array_equal(state_of(c, 1), scratch(a[:4]))
    compute(c, 1, b, 4)
    np.testing.assert_array_equal(state_of(c, 1), scratch(b))

    more = a + [3, 4]                        # a later turn: resumes from the end of the first
    assert c.prefix_attach(2, more) == 8
    compute(c, 2, more, 8)
    np.testing.assert_array_equal(state_of(c, 2), scratch(more))


def test_the_last_token_is_always_computed():
    c = rec()
    a = [1, 2, 3, 4]
    compute(c, 0, a, 0)
    c.prefix_release(0, a)
    assert c.prefix_match(a) == 0            # the whole request held: its last token still computed
    assert c.prefix_match(a + [5]) == 4
    assert c.prefix_attach(1, a) == 0 and c.seq_pos_max(1) == -1
    assert c.prefix_match([]) == 0 and c.prefix_match([1]) == 0


def test_salts_are_namespaces():
    c = rec()
    a = [1, 2, 3]
    compute(c, 0, a, 0)
    c.prefix_release(0, a, salt="tenant-a")
    assert c.prefix_match(a + [4]) == 0
    assert c.prefix_match(a + [4], salt=b"tenant-b") == 0
    assert c.prefix_match(a + [4], salt="tenant-a") == 3


def test_bounds_lru_per_sequence_and_pins():
    c = rec(checkpoints=3, per_seq=2)
    a = list(range(1, 9))
    compute(c, 0, a[:2], 0)
    assert c.checkpoint(0, a) == 2
    compute(c, 0, a[:4], 2)
    assert c.checkpoint(0, a) == 4
    compute(c, 0, a[:6], 4)
    assert c.checkpoint(0, a) == 6           # the sequence's oldest (2) goes: per_seq = 2
    assert [len(ch) for ch, _ in c.prefix_checkpoints()] == [4, 6]
    pin = c.prefix_pin(a[:4])
    compute(c, 0, a, 6)
    assert c.checkpoint(0, a) == 8           # 4 is pinned: 6 goes
    assert [len(ch) for ch, _ in c.prefix_checkpoints()] == [4, 8]
    c.prefix_release(0, a)                    # held already: touched; the sequence's own no more
    b = [50, 51, 52]
    compute(c, 1, b, 0)
    assert c.prefix_release(1, b) == 3       # room for a third
    d = [60, 61]
    compute(c, 2, d, 0)
    assert c.prefix_match(b + [0]) == 3      # b used more recently than a
    assert c.prefix_release(2, d) == 2       # full: the least recently used unpinned (a) goes
    assert sorted(len(ch) for ch, _ in c.prefix_checkpoints()) == [2, 3, 4]
    assert c.prefix_stats == {"checkpoints": 3, "pinned": 1, "cap": 3, "per_seq": 2, "state_bytes": 2 * E * 4}
    assert c.prefix_evict(10) == 2 and c.prefix_stats["checkpoints"] == 1
    c.prefix_unpin(pin)
    with pytest.raises(ValueError):
        c.prefix_unpin(pin)
    assert c.prefix_evict(10) == 1
    c._prefix_check()


def test_all_pinned_keeps_nothing_and_changes_nothing():
    c = rec(checkpoints=1)
    compute(c, 0, [1, 2], 0)
    c.prefix_release(0, [1, 2])
    c.prefix_pin([1, 2])
    compute(c, 1, [3, 4], 0)
    assert c.checkpoint(1, [3, 4]) == 0
    assert [ch for ch, _ in c.prefix_checkpoints()] == [[1, 2]]
    assert c.seq_pos_max(1) == 1


def test_a_pending_rollback_checkpoints_the_rolled_back_state():
    c = rec(n_rs_seq=2)
    a = [4, 5, 6, 7, 8]
    compute(c, 0, a, 0)
    assert c.seq_rm(0, 4, -1)                # back to position 3
    assert c.checkpoint(0, a) == 4
    assert c.prefix_attach(1, a[:4] + [9]) == 4
    np.testing.assert_array_equal(state_of(c, 1), scratch(a[:4]))


def test_checkpoints_are_copies_the_cache_operations_leave_alone():
    c = rec()
    a = [1, 2, 3, 4]
    compute(c, 0, a, 0)
    c.checkpoint(0, a)
    blob = c.state_write()
    c.clear()
    assert c.prefix_attach(0, a + [5]) == 4
    np.testing.assert_array_equal(state_of(c, 0), scratch(a))
    c.state_read(blob)
    assert c.prefix_attach(1, a + [5]) == 4
    np.testing.assert_array_equal(state_of(c, 1), scratch(a))
    c.seq_cp(1, 2)                            # a shared state is checkpointed too
    assert c.checkpoint(2, a + [5]) == 4


def test_attach_is_placed_as_a_state_read_places_a_sequence():
    a = [1, 2, 3]
    c = rec()
    compute(c, 0, a, 0)
    c.prefix_release(0, a)
    ref = RecurrentCache(4, 1, E, E, type_k="f32", type_v="f32", semantics="2026")
    compute(ref, 0, a, 0)
    blob = ref.state_write(0)
    ref.seq_rm(0)
    compute(ref, 1, [9], 0)
    compute(c, 1, [9], 0)
    ref.state_read(blob, 2)
    assert c.prefix_attach(2, a + [4]) == 3
    got, want = c.cells(), ref.cells()
    for key in ("pos", "src", "tail"):
        assert got[key].tolist() == want[key].tolist()
    assert got["seq_id"] == want["seq_id"]
    assert (c.head, c.n, c.used, c.rs_z) == (ref.head, ref.n, ref.used, ref.rs_z)
    assert c.s_copy().tolist() == ref.s_copy().tolist()


def test_bad_input_changes_nothing():
    c = rec()
    compute(c, 0, [1, 2, 3], 0)
    before = (c.state_write(), c.prefix_checkpoints())
    with pytest.raises(ValueError, match="holds a state"):
        c.prefix_attach(0, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="holds no state"):
        c.checkpoint(1, [1, 2])
    with pytest.raises(ValueError, match="tokens has 2"):
        c.checkpoint(0, [1, 2])
    with pytest.raises(ValueError, match="tokens has 2"):
        c.prefix_release(0, [1, 2])
    with pytest.raises(TypeError, match="salt"):
        c.checkpoint(0, [1, 2, 3], salt=3)
    with pytest.raises(ValueError, match="seq_id"):
        c.prefix_attach(9, [1, 2])
    with pytest.raises(ValueError):
        c.prefix_attach(1, [-1, 2])
    with pytest.raises(ValueError, match="no checkpoint"):
        c.prefix_pin([1, 2, 3])
    with pytest.raises(ValueError):
        c.prefix_unpin(12345)
    assert (c.state_write(), c.prefix_checkpoints()) == before
    with pytest.raises(ValueError, match="checkpoints"):
        c.enable_prefix_reuse(checkpoints=0)
    with pytest.raises(ValueError, match="per_seq"):
        c.enable_prefix_reuse(checkpoints=2, per_seq=3)
    assert c.prefix_stats["cap"] == 8         # a refused enable leaves the pool as it was


def test_which_caches_and_memory():
    assert not hasattr(RecurrentCache(2, 1, E, E, type_k="f32", type_v="f32"), "enable_prefix_reuse")
    with pytest.raises(ValueError, match="no state memory"):
        RecurrentCache(2, 1, E, E, type_k="f32", type_v="f32", semantics="2026", buffers="none").enable_prefix_reuse()
    off = RecurrentCache(2, 1, E, E, type_k="f32", type_v="f32", semantics="2026")
    assert off.prefix_stats is None and not off.prefix_reuse and off.prefix_match([1, 2]) == 0
    with pytest.raises(RuntimeError, match="prefix reuse is off"):
        off.prefix_attach(0, [1, 2])
    bufs = [(np.zeros((2, E), np.float32), np.zeros((2, E), np.float32))]
    b = RecurrentCache(2, 1, E, E, type_k="f32", type_v="f32", semantics="2026", buffers=bufs)
    with pytest.raises(ValueError, match="memory="):
        b.enable_prefix_reuse(checkpoints=2)
    with pytest.raises(ValueError, match="need 64"):
        b.enable_prefix_reuse(checkpoints=2, memory=np.zeros(10, np.uint8))
    mem = np.zeros((2, 2 * E), np.float32)
    b.enable_prefix_reuse(checkpoints=2, memory=mem)
    compute(b, 0, [1, 2], 0)
    b.checkpoint(0, [1, 2])
    np.testing.assert_array_equal(mem[0], np.concatenate([scratch([1, 2])] * 2))   # the states live there
    with pytest.raises(ValueError, match="cannot resize"):
        mem.resize(1 << 20, refcheck=False)     # numpy would free the pool's memory under it
    b.disable_prefix_reuse()
    assert b.prefix_stats is None
    mem.resize(1 << 10, refcheck=False)          # the pool gone, the memory is mem's again



def test_checkpoint_memory_must_not_be_the_caches_own():
    # a pool over the cache's own states (or a hybrid memory's K/V) would overwrite them with
    # every checkpoint: refused, nothing changed
    r = rec(kv_size=8)
    compute(r, 0, [1, 2, 3], 0)
    before = (r.state_write(), r.prefix_stats)
    with pytest.raises(ValueError, match="memory and the cache's layer 0 V overlap"):
        r.enable_prefix_reuse(checkpoints=2, memory=r.v(0))
    assert (r.state_write(), r.prefix_stats) == before
    K, V = np.zeros((64, E), np.float32), np.zeros((64, E), np.float32)
    R, S = np.zeros((4, E), np.float32), np.zeros((4, E), np.float32)
    h = HybridCache(64, 2, [1], E, E, E, E, n_seq_max=4, type_k="f32", type_v="f32", v_trans=False,
                    buffers=({0: (K, V)}, {1: (R, S)}))
    assert h.find_slot(UBatch([0, 1], [0], n_seq_tokens=2))
    before = (h.state_write(), h.prefix_reuse)
    with pytest.raises(ValueError, match="memory and the attention part's layer 0 V overlap"):
        h.enable_prefix_reuse(checkpoints=2, memory=V)
    with pytest.raises(ValueError, match="memory and the cache's layer 1 K overlap"):
        h.enable_prefix_reuse(checkpoints=1, memory=R)
    assert (h.state_write(), h.prefix_reuse) == before
    h.enable_prefix_reuse(checkpoints=2, memory=np.zeros(2 * 4 * E * 2, np.uint8))
    assert h.prefix_stats["recr"]["cap"] == 2


# --- the hybrid memory -----------------------------------------------------------------------------

def hyb(kv_size=64, n_seq_max=4, checkpoints=8, **kw) -> HybridCache:
    h = HybridCache(kv_size, 2, [1], E, E, E, E, n_seq_max=n_seq_max, type_k="f32", type_v="f32", v_trans=False, **kw)
    h.enable_prefix_reuse(checkpoints=checkpoints)
    return h


def hcompute(h: HybridCache, s: int, tokens, start: int) -> bool:
    n = len(tokens) - start
    if not h.find_slot(UBatch(list(range(start, len(tokens))), [s], n_seq_tokens=n, tokens=list(tokens[start:]))):
        return False
    rows = np.stack([fingerprint(tokens[:p + 1]) for p in range(start, len(tokens))])
    h.store(0, rows, rows)
    run_states(h.recr, h.s_copy()[0], tokens[start:], h.n_rs_seq,
               lambda row, p: h.store_state(1, row, row, plane=p))
    return True


def hcheck(h: HybridCache, s: int, tokens) -> None:
    """Sequence s holds exactly the computation of tokens from scratch, in both parts."""
    cells, pos = h.attn.seq_cells(s)
    assert sorted(pos) == list(range(len(tokens)))
    k = np.asarray(h.attn.k(0)).reshape(-1, E)
    for cell, p in zip(cells, pos):
        np.testing.assert_array_equal(k[cell], fingerprint(tokens[:p + 1]))
    assert h.recr.seq_pos_max(s) == len(tokens) - 1
    np.testing.assert_array_equal(h.r(1)[h.recr.cells()["tail"][s]], scratch(tokens))


def test_hybrid_a_hit_is_a_checkpoint_the_attention_index_also_serves():
    h = hyb()
    a = list(range(1, 11))
    hcompute(h, 0, a, 0)
    h.seq_rm(0)
    hcompute(h, 0, a[:4], 0)
    assert h.checkpoint(0, a) == 4
    hcompute(h, 0, a, 4)
    assert h.prefix_release(0, a) == 10      # a request beginning with a resumes after all of it ..
    assert h.prefix_match(a) == 4            # .. a itself at the checkpoint before its last token
    assert h.prefix_match(a + [0]) == 10

    b = a[:7] + [50, 51]                     # the attention index holds 7 of b, the checkpoints 4
    assert h.prefix_attach(1, b) == 4
    assert h.attn.seq_pos_max(1) == 3        # the attention part cut back to the checkpoint
    hcompute(h, 1, b, 4)
    hcheck(h, 1, b)
    h.prefix_release(1, b)

    h.prefix_evict(n_cells=100)              # the attention index lets go: no hit, whatever is checkpointed
    assert h.prefix_stats["attn"]["cells"] == 0 and h.prefix_stats["recr"]["checkpoints"] == 3
    assert h.prefix_match(a + [0]) == 0
    assert h.prefix_attach(2, a + [0]) == 0 and h.seq_pos_max(2) == -1
    h._prefix_check()


def hcheck_window(h: HybridCache, s: int, tokens) -> None:
    """hcheck for a hybrid memory with a sliding window: the base cache holds every position of
    tokens, the SWA cache at least the window before the next one, each computed after exactly
    the tokens before it."""
    n = len(tokens)
    for part, need in ((h.attn.base, range(n)), (h.attn.swa, range(max(0, n - h.n_swa), n))):
        cells, pos = part.seq_cells(s)
        assert set(need) <= set(pos) and all(0 <= p < n for p in pos)
        if part.layers:
            k = np.asarray(part.k(0)).reshape(-1, E)
            for cell, p in zip(cells, pos):
                np.testing.assert_array_equal(k[cell], fingerprint(tokens[:p + 1]))
    assert h.seq_pos_max(s) == n - 1
    np.testing.assert_array_equal(h.r(1)[h.recr.cells()["tail"][s]], scratch(tokens))


@pytest.mark.parametrize("swa_full", [True, False])
def test_hybrid_with_a_window_reuses_what_both_attention_caches_serve(swa_full):
    """A hybrid memory whose attention part is an iSWA pair (llama_memory_hybrid_iswa): a hit is
    a checkpoint both of the pair's caches serve. With swa_full the SWA cache keeps every prefix
    (the plain hybrid's hits); a SWA cache of windows (256 cells here, for 300 positions) serves
    only the hits whose window it still holds, a shorter checkpoint's when a longer one's is gone;
    every resumed request holds the computation from scratch."""
    h = hyb(n_swa=2, swa_layers=[0], swa_full=swa_full, kv_size=512, n_batch=8)
    assert h.prefix_reuse and set(h.prefix_stats) == {"attn", "recr"}
    assert h.attn.size_swa == (512 if swa_full else 256)
    a = [1 + i % 97 for i in range(300)]

    def run(s, tokens, start):
        for p in range(start, len(tokens), 8):
            assert hcompute(h, s, tokens[:p + 8], p)
            if p + 8 in (260, 292):
                assert h.checkpoint(s, tokens) == p + 8

    hcompute(h, 0, a[:4], 0)
    assert h.checkpoint(0, a) == 4
    run(0, a, 4)
    assert h.prefix_release(0, a) == 300    # the state after all of a, and the window before 300
    # b: both caches hold 7 of it, the checkpoints 4, whose window (positions 2, 3) a SWA cache
    # of windows has overwritten since; c: the checkpoint at 292, its window held; the next turn
    # resumes after all of a
    b, c, turn = a[:7] + [150, 151], a[:295] + [150, 151], a + [160, 161]
    assert [h.prefix_match(t) for t in (b, c, turn)] == [4 if swa_full else 0, 292, 300]
    assert h.prefix_attach(2, c) == 292
    hcompute(h, 2, c, 292)
    hcheck_window(h, 2, c)
    h.prefix_release(2, c)
    h._prefix_check()
    k = h.prefix_attach(1, b)
    assert k == (4 if swa_full else 0) and h.seq_pos_max(1) == k - 1
    hcompute(h, 1, b, k)
    hcheck_window(h, 1, b)
    h.prefix_release(1, b)
    h._prefix_check()
    # placing c's tokens in a full SWA cache of windows let its index go (ISWACache2026's rule):
    # a's window is no longer there, c's is
    k = h.prefix_attach(3, turn)
    assert k == (300 if swa_full else 292)
    hcompute(h, 3, turn, k)
    hcheck_window(h, 3, turn)
    h.prefix_release(3, turn)
    h.prefix_evict(n_cells=1000)            # every attention cell let go: no hit
    assert h.prefix_match(turn + [0]) == 0 and h.prefix_attach(3, turn + [0]) == 0
    h._prefix_check()
    h.disable_prefix_reuse()
    assert not h.prefix_reuse and h.prefix_match(a) == 0


@pytest.mark.parametrize("n_swa", [0, 4])
def test_hybrid_with_streams_resumes_only_where_one_stream_holds_the_prefix(n_swa):
    # the attention cells of a hit must lie in one stream (the run an attach takes): a checkpoint
    # whose prefix spans two streams is no hit, and a shorter one within the run is
    h = hyb(n_seq_max=2, kv_unified=False, n_swa=n_swa)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]
    assert hcompute(h, 0, a, 0)
    h.prefix_release(0, a)
    assert hcompute(h, 1, b[:3], 0)
    assert h.checkpoint(1, b) == 3
    assert hcompute(h, 1, b, 3)
    h.prefix_release(1, b)                  # [1 2 3] held in stream 0, [7 8] in stream 1
    request = b + [9]
    assert h.prefix_match(request) == 3
    assert h.prefix_attach(1, request) == 3
    h.update()
    assert hcompute(h, 1, request, 3)
    for part in (h.attn.base, h.attn.swa) if n_swa else (h.attn,):
        cells, pos = part.seq_cells(1)
        assert set(range(3, 6)) <= set(pos.tolist())
        if part.layers:
            k = np.asarray(part.k(0)).reshape(2, -1, E)[1]     # sequence 1's stream
            for cell, p in zip(cells, pos):
                np.testing.assert_array_equal(k[cell], fingerprint(request[:p + 1]))
    np.testing.assert_array_equal(h.r(1)[h.recr.cells()["tail"][1]], scratch(request))
    h._prefix_check()


def test_hybrid_prepare_that_fits_only_by_evicting_evicts_nothing():
    h = hyb(kv_size=16)
    a = list(range(1, 13))
    hcompute(h, 0, a, 0)
    assert h.prefix_release(0, a) == 12
    assert hcompute(h, 1, [5, 6, 7, 8], 0)       # the attention part full: 4 live cells, 12 held

    def view():
        return h.prefix_stats, h.attn.prefix_match(a + [0]), h.state_write(), h.attn.used

    ub = UBatch([4, 5], [1], n_seq_tokens=2, tokens=[9, 9])
    before = view()
    plan = h.prepare([ub])
    assert plan is not None and view() == before
    h._prefix_check()
    assert h.find_slot(ub)                       # the real placement evicts, where prepare said
    assert [(s, list(x)) for s, x in h.slot_info()] == [(s, list(x)) for s, x in plan[0]]
    assert h.attn.prefix_match(a + [0]) == 0


def test_hybrid_release_without_tokens_and_failures():
    h = hyb()
    a = [1, 2, 3, 4]
    hcompute(h, 0, a, 0)
    # the cells' own tokens go to the index, and the final state is checkpointed as the state
    # after them: the same as with the tokens given
    assert h.prefix_release(0) == 4
    assert h.prefix_stats["attn"]["cells"] == 4 and h.prefix_stats["recr"]["checkpoints"] == 1
    assert h.recr.prefix_checkpoints()[0][0] == a
    assert h.prefix_attach(3, a + [9]) == 4
    hcheck(h, 3, a)
    h.seq_rm(3)
    # cells placed without token ids: the tokens of the state are not known, nothing is kept
    assert h.find_slot(UBatch([0, 1, 2], [3], n_seq_tokens=3))
    assert h.prefix_release(3) == 0 and h.prefix_stats["recr"]["checkpoints"] == 1
    hcompute(h, 1, a, 0)
    with pytest.raises(ValueError, match="tokens has 3"):
        h.prefix_release(1, a[:3])
    assert h.seq_pos_max(1) == 3
    assert h.prefix_release(1, a) == 4       # the index and the checkpoint both hold a
    hcompute(h, 2, [7], 0)
    with pytest.raises(ValueError, match="attach into an empty sequence"):
        h.prefix_attach(2, a + [5])
    pin = h.prefix_pin(a)
    with pytest.raises(ValueError):
        h.prefix_pin(a[:2])                   # no checkpoint of exactly these
    assert h.prefix_stats["recr"]["pinned"] == 1
    with pytest.raises(ValueError):
        h.prefix_unpin((pin[0], pin[1] + 1))    # half a pin: nothing is unpinned
    with pytest.raises(ValueError):
        h.prefix_unpin((pin[0] + 1, pin[1]))
    assert h.prefix_stats["recr"]["pinned"] == 1
    h.prefix_unpin(pin)
    assert h.prefix_stats["recr"]["pinned"] == 0
    with pytest.raises(ValueError):
        h.prefix_unpin(pin)
    off = HybridCache(16, 2, [1], E, E, E, E, type_k="f32", type_v="f32")
    assert off.prefix_match([1, 2]) == 0 and off.prefix_stats is None
    with pytest.raises(RuntimeError, match="prefix reuse is off"):
        off.prefix_attach(0, [1, 2])


def test_hybrid_failed_state_read_keeps_what_reuse_knows_of_the_sequences():
    """A state read that fails (here: its recurrent part cut short) leaves both parts as they were,
    the prefix index's knowledge of the sequences' cells included: the tokens the cells were
    computed with (a release keeps them all) and the lock of an attached sequence on its prefix
    (not evictable while the sequence holds it)."""
    h = hyb(kv_size=16)
    a = [1, 2, 3, 4, 5, 6]
    hcompute(h, 0, a, 0)
    other = HybridCache(16, 2, [1], E, E, E, E, n_seq_max=4, type_k="f32", type_v="f32", v_trans=False)
    assert other.find_slot(UBatch([0, 1, 2], [0], n_seq_tokens=3))
    cut = other.state_write(0)[:-4]
    before = (h.state_write(), h.state_write(0), h.prefix_stats, h.seq_pos_max(0), h.attn.used)
    with pytest.raises(StateError, match="recurrent part"):
        h.state_read(cut, 0)
    assert (h.state_write(), h.state_write(0), h.prefix_stats, h.seq_pos_max(0), h.attn.used) == before
    assert h.prefix_release(0) == 6 and h.prefix_stats["attn"]["cells"] == 6
    assert h.prefix_attach(1, a + [7]) == 6
    before = (h.state_write(), h.prefix_stats)
    assert before[1]["attn"]["evictable"] == 0
    with pytest.raises(StateError, match="recurrent part"):
        h.state_read(cut, 1)
    assert (h.state_write(), h.prefix_stats) == before
    hcheck(h, 1, a)
    h._prefix_check()


def test_hybrid_state_read_with_a_bad_part_evicts_nothing():
    # the room a sequence's cells need is looked for (evicting held prefixes, as placement does)
    # only once every part of the state is read: a read that fails on its recurrent part leaves
    # the prefixes the index holds
    h = hyb(kv_size=16)
    hcompute(h, 0, list(range(1, 11)), 0)
    assert h.prefix_release(0) == 10
    hcompute(h, 1, [1, 2, 3, 4], 0)                       # 2 cells free, 10 held by the index
    other = HybridCache(16, 2, [1], E, E, E, E, n_seq_max=4, type_k="f32", type_v="f32", v_trans=False)
    assert other.find_slot(UBatch(list(range(5)), [0], n_seq_tokens=5))
    blob = other.state_write(0)
    before = (h.state_write(), h.prefix_stats, h.attn.used)
    with pytest.raises(StateError, match="recurrent part"):
        h.state_read(blob[:-4], 2)
    assert (h.state_write(), h.prefix_stats, h.attn.used) == before
    assert h.state_read(blob, 2) == len(blob)             # the whole state: room made by eviction
    assert h.seq_pos_max(2) == 4 and h.prefix_stats["attn"]["cells"] < 10
    h._prefix_check()


def test_hybrid_import_refused_for_its_state_evicts_nothing():
    # an export whose recurrent state does not stand where its attention cells end is refused
    # before the attention part looks for room (which would evict the prefixes the index holds)
    src = HybridCache(16, 2, [1], E, E, E, E, n_seq_max=4, type_k="f32", type_v="f32", v_trans=False)
    assert src.find_slot(UBatch([0, 1, 2], [0], n_seq_tokens=3))
    assert src.attn.find_slot(UBatch(list(range(3, 9)), [0] * 6))     # the attention part alone goes on
    header = src.seq_export(0).header
    h = hyb(kv_size=16)
    hcompute(h, 0, list(range(1, 11)), 0)
    assert h.prefix_release(0) == 10
    hcompute(h, 1, [1, 2, 3, 4], 0)                       # 2 cells free, 10 held by the index
    before = (h.state_write(), h.prefix_stats, h.attn.used)
    with pytest.raises(StateError, match="the recurrent state is at position 2, the attention part's cells end at 8"):
        h.seq_import_begin(header, 2)
    assert (h.state_write(), h.prefix_stats, h.attn.used) == before
    assert h.find_slot(UBatch([4], [1], n_seq_tokens=1))    # not left importing
    h._prefix_check()


def test_hybrid_with_a_window_evicts_in_neither_attention_cache_when_one_has_no_room():
    # a sequence's state read and import look for room in both caches of the iSWA attention part
    # before either evicts: the SWA cache, its held cells pinned, has none, so the base cache
    # keeps its prefix; once both can make room, both evict
    def hyb16(**kw):
        return HybridCache(16, 3, [2], E, E, E, E, n_seq_max=4, type_k="f32", type_v="f32", v_trans=False,
                           n_swa=8, swa_layers=[0], swa_full=True, n_batch=16, **kw)

    src = hyb16()
    assert src.find_slot(UBatch([0, 1, 2], [0], n_seq_tokens=3))
    header, blob = src.seq_export(0).header, src.state_write(0)

    def full():
        h = hyb16()
        h.enable_prefix_reuse(checkpoints=2)
        for s, t in ((0, 0), (2, 2), (3, 3), (1, 7)):
            assert h.find_slot(UBatch(list(range(4)), [s], n_seq_tokens=4, tokens=[t] * 4))
        assert h.prefix_release(1) == 4                  # both attention caches: 12 live cells, 4 held
        return h

    h = full()
    pin = h.attn.swa.prefix_pin([7] * 4)
    before = (h.prefix_stats, h.state_write(), h.attn.base.used, h.attn.swa.used)
    with pytest.raises(StateError, match="SWA cache .*no room"):
        h.state_read(blob, 1)
    assert (h.prefix_stats, h.state_write(), h.attn.base.used, h.attn.swa.used) == before
    with pytest.raises(StateError, match="no room"):
        h.seq_import_begin(header, 1)
    assert (h.prefix_stats, h.state_write(), h.attn.base.used, h.attn.swa.used) == before
    assert before[0]["attn"]["base"]["cells"] == 4
    h._prefix_check()
    h.attn.swa.prefix_unpin(pin)
    with h.seq_import_begin(header, 1) as imp:
        imp.commit()
    assert h.prefix_stats["attn"]["base"]["cells"] < 4 and h.prefix_stats["attn"]["swa"]["cells"] < 4
    h = full()
    assert h.state_read(blob, 1) == len(blob)
    assert h.prefix_stats["attn"]["base"]["cells"] < 4 and h.prefix_stats["attn"]["swa"]["cells"] < 4
    assert h.seq_pos_max(1) == 2
    h._prefix_check()


# --- against the model -----------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 8, 7, 6], [1, 2]]
SALTS = [None, "x"]


class CheckpointMachine(RuleBasedStateMachine):
    """Random requests through a recurrent cache with checkpoints, against CheckpointPoolModel;
    every live sequence's state is always the state of its own tokens from scratch."""

    def __init__(self):
        super().__init__()
        self.c = rec(n_seq_max=3, checkpoints=4, per_seq=2)
        self.m = CheckpointPoolModel(4, 2)
        self.pins: list = []
        self.done: list = []    # (tokens, salt) of the requests released
        self.live: dict[int, tuple[list[int], object]] = {}   # seq -> (tokens computed, salt)

    @rule(s=st.integers(0, 2), pick=st.integers(0, 50), tail=st.lists(st.integers(1, 9), max_size=3),
          salt=st.sampled_from(SALTS), chunk=st.integers(1, 4))
    def request(self, s, pick, tail, salt, chunk):
        """A new request in s (a prompt, or an earlier request's tokens and more, as a chat's next
        turn): attach, then its prefill in chunks, each checkpointed."""
        if s in self.live:
            return
        bases = [(b, salt) for b in PROMPTS] + self.done   # a next turn keeps its salt
        base, salt = bases[pick % len(bases)]
        tokens = base + tail
        want = self.m.match(salt, tokens)
        k = self.c.prefix_attach(s, tokens, salt=salt)
        self.m.disown(s)
        assert k == want
        at = k
        while at < len(tokens):
            end = min(len(tokens), at + chunk)
            compute(self.c, s, tokens[:end], at)
            at = end
            assert self.c.checkpoint(s, tokens, salt=salt) == self.m.save(s, salt, tokens[:at])
        self.live[s] = (tokens, salt)

    @rule(s=st.integers(0, 2), t=st.integers(1, 9))
    def decode(self, s, t):
        if s in self.live:
            tokens, salt = self.live[s]
            compute(self.c, s, tokens + [t], len(tokens))
            self.live[s] = (tokens + [t], salt)

    @rule(s=st.integers(0, 2))
    def release(self, s):
        if s in self.live:
            tokens, salt = self.live.pop(s)
            assert self.c.prefix_release(s, tokens + [0], salt=salt) == self.m.save(s, salt, tokens)
            self.done.append((tokens, salt))
            self.m.disown(s)

    @rule(s=st.integers(0, 2))
    def drop(self, s):
        """A request ends without keeping anything."""
        if s in self.live:
            self.live.pop(s)
            assert self.c.seq_rm(s)

    @rule(base=st.sampled_from(PROMPTS), n=st.integers(0, 6), salt=st.sampled_from(SALTS))
    def match(self, base, n, salt):
        tokens = (base * 2)[:n]
        assert self.c.prefix_match(tokens, salt=salt) == self.m.match(salt, tokens)

    @rule(base=st.sampled_from(PROMPTS), n=st.integers(1, 6), salt=st.sampled_from(SALTS))
    def pin(self, base, n, salt):
        chain = base[:n]
        held = self.m.pin(salt, chain)
        if held is None:
            with pytest.raises(ValueError):
                self.c.prefix_pin(chain, salt=salt)
        else:
            self.pins.append((self.c.prefix_pin(chain, salt=salt), held))

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 10))
    def unpin(self, i):
        pin, held = self.pins.pop(i % len(self.pins))
        if self.m.unpin(held):
            self.c.prefix_unpin(pin)
        else:
            with pytest.raises(ValueError):
                self.c.prefix_unpin(pin)

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        assert self.c.prefix_evict(n) == self.m.evict(n)

    @rule()
    def clear(self):
        self.c.clear()
        self.live.clear()

    @invariant()
    def agree(self):
        self.c._prefix_check()
        got = sorted(((tuple(ch), p) for ch, p in self.c.prefix_checkpoints()), key=lambda x: (len(x[0]), x))
        assert got == sorted(self.m.chains(), key=lambda x: (len(x[0]), x))
        for s, (tokens, _) in self.live.items():
            assert self.c.seq_pos_max(s) == len(tokens) - 1
            np.testing.assert_array_equal(state_of(self.c, s), scratch(tokens))



CheckpointMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_checkpoints_against_the_model = CheckpointMachine.TestCase


class HybridReuseMachine(RuleBasedStateMachine):
    """Random requests through a hybrid memory with reuse: every live sequence holds, in both
    parts, the computation of its own tokens from scratch; a hit is never deeper than what the
    attention index holds, and always a checkpoint's length."""

    def __init__(self):
        super().__init__()
        self.h = hyb(kv_size=40, n_seq_max=3, checkpoints=4)
        self.live: dict[int, list[int]] = {}
        self.done: list[list[int]] = []

    @rule(s=st.integers(0, 2), pick=st.integers(0, 50), tail=st.lists(st.integers(1, 9), max_size=3),
          chunk=st.integers(1, 4))
    def request(self, s, pick, tail, chunk):
        if s in self.live:
            return
        bases = PROMPTS + self.done
        tokens = bases[pick % len(bases)] + tail
        lens = {len(ch) for ch, _ in self.h.recr.prefix_checkpoints() if tokens[:len(ch)] == ch}
        k = self.h.prefix_attach(s, tokens)
        assert k == 0 or (k in lens and k < len(tokens))
        at = k
        while at < len(tokens):
            end = min(len(tokens), at + chunk)
            if not hcompute(self.h, s, tokens[:end], at):
                self.h.seq_rm(s)
                return
            at = end
            self.h.checkpoint(s, tokens)
        self.live[s] = tokens

    @rule(s=st.integers(0, 2), own=st.booleans())
    def release(self, s, own):
        if s in self.live:
            tokens = self.live.pop(s)
            # without tokens: the ones the cells recorded (every cell was placed with its token)
            self.h.prefix_release(s, None if own else tokens)
            self.done.append(tokens)

    @rule(n=st.integers(0, 8), m=st.integers(0, 2))
    def evict(self, n, m):
        self.h.prefix_evict(n, m)

    @invariant()
    def exact(self):
        self.h._prefix_check()
        for s, tokens in self.live.items():
            hcheck(self.h, s, tokens)


HybridReuseMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_hybrid_reuse_is_exact = HybridReuseMachine.TestCase


# --- a real model ----------------------------------------------------------------------------------

def test_a_mamba_model_gets_the_same_logits_from_a_checkpoint():
    """A tiny transformers Mamba (random weights) whose layers' states (the convolution's window
    as R, the SSM state as S) live in a RecurrentCache: a request resumed from a checkpoint gets
    bit for bit the next-token logits of the same request computed from scratch in the same
    chunks, and within float tolerance those of one prefill."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=4,
                                   expand=2, use_mambapy=False)
    model = transformers.MambaForCausalLM(cfg).eval()
    d_inner = cfg.intermediate_size
    wr, ws = d_inner * cfg.conv_kernel, d_inner * cfg.state_size
    c = RecurrentCache(2, cfg.num_hidden_layers, wr, ws, type_k="f32", type_v="f32", semantics="2026")
    c.enable_prefix_reuse(checkpoints=4)

    def model_cache(rows, n_past):
        """A transformers cache holding the states of rows ((R, S) per layer), n_past tokens in."""
        cache = transformers.DynamicCache(config=cfg)
        if rows is None:
            return cache
        for layer, (r, s) in zip(cache.layers, rows):
            conv = torch.from_numpy(np.array(r)).reshape(1, d_inner, cfg.conv_kernel)
            ssm = torch.from_numpy(np.array(s)).reshape(1, d_inner, cfg.state_size)
            layer.lazy_initialization(conv_states=conv, recurrent_states=ssm)
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(ssm)
            layer.has_previous_state[0] = True
            layer.cumulative_length_linear.fill_(n_past)
        return cache

    def chunk(s, tokens, start, end):
        """The model computes tokens[start:end] of sequence s, its states read from and written to
        the cache as a graph's s_copy and store would."""
        assert c.find_slot(UBatch(list(range(start, end)), [s], n_seq_tokens=end - start))
        plane, cell = divmod(int(c.s_copy()[0]), c.size)
        rows = None if (plane == 0 and cell == c.rs_z) else [
            (c.k(il, plane)[cell], c.v(il, plane)[cell]) for il in range(cfg.num_hidden_layers)]
        cache = model_cache(rows, start)
        with torch.no_grad():
            out = model(torch.tensor([tokens[start:end]]), cache=cache, use_cache=True)
        for il, layer in enumerate(cache.layers):
            c.store(il, layer.conv_states[0].reshape(1, -1).numpy(), layer.recurrent_states[0].reshape(1, -1).numpy())
        return out.logits[0, -1]

    def from_scratch(tokens, cuts):
        cache = transformers.DynamicCache(config=cfg)
        with torch.no_grad():
            for a, b in zip([0] + cuts, cuts + [len(tokens)]):
                logits = model(torch.tensor([tokens[a:b]]), cache=cache, use_cache=True).logits[0, -1]
            whole = model(torch.tensor([tokens])).logits[0, -1]
        return logits, whole

    a = [3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12]
    chunk(0, a, 0, 5)
    assert c.checkpoint(0, a) == 5             # the prefill's chunk boundary
    chunk(0, a, 5, len(a))
    assert c.prefix_release(0, a) == len(a)

    b = a[:8] + [21, 22, 23]                   # shares 8 tokens: resumes at the boundary, 5
    assert c.prefix_attach(1, b) == 5
    got = chunk(1, b, 5, len(b))
    want, whole = from_scratch(b, [5])
    assert torch.equal(got, want)
    torch.testing.assert_close(got, whole, atol=1e-4, rtol=1e-4)
    c.prefix_release(1, b)

    turn = a + [30, 31]                        # the next turn: resumes after all of a
    assert c.prefix_attach(0, turn) == len(a)
    got = chunk(0, turn, len(a), len(turn))
    want, whole = from_scratch(turn, [5, len(a)])
    assert torch.equal(got, want)
    torch.testing.assert_close(got, whole, atol=1e-4, rtol=1e-4)


def test_an_lfm2_hybrid_model_gets_the_same_logits_from_a_reused_prefix():
    """A tiny transformers LFM2 (random weights; short convolutions in layers 0 and 2, attention
    in 1 and 3) whose attention K/V and convolution states live in a HybridCache: a request
    resumed from a checkpoint and the attention index's cells gets bit for bit the next-token
    logits of the same request computed from scratch in the same chunks."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Lfm2Config(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, conv_L_cache=3,
                                  hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                  max_position_embeddings=256, vocab_size=50)
    model = transformers.Lfm2ForCausalLM(cfg).eval()
    head = cfg.hidden_size // cfg.num_attention_heads
    n_kv, L = cfg.num_key_value_heads, cfg.conv_L_cache
    conv_layers, attn_layers = (0, 2), (1, 3)
    h = HybridCache(64, 4, list(conv_layers), n_kv * head, n_kv * head, cfg.hidden_size * L, 0, n_seq_max=2,
                    type_k="f32", type_v="f32", v_trans=False)
    h.enable_prefix_reuse(checkpoints=4)

    def chunk(s, tokens, start, end):
        return lfm2_chunk(torch, transformers, model, cfg, h, s, tokens, start, end)

    def from_scratch(tokens, cuts):
        cache = transformers.DynamicCache(config=cfg)
        with torch.no_grad():
            for a, b in zip([0] + cuts, cuts + [len(tokens)]):
                logits = model(torch.tensor([tokens[a:b]]), cache=cache, use_cache=True).logits[0, -1]
        return logits

    a = [3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12]
    chunk(0, a, 0, 4)
    assert h.checkpoint(0, a) == 4
    chunk(0, a, 4, 9)
    assert h.checkpoint(0, a) == 9
    chunk(0, a, 9, len(a))
    assert h.prefix_release(0, a) == len(a)

    b = a[:7] + [21, 22]                       # the attention index holds 7 of b, the checkpoints 4
    assert h.prefix_attach(1, b) == 4
    assert torch.equal(chunk(1, b, 4, len(b)), from_scratch(b, [4]))
    h.prefix_release(1, b)

    turn = a + [30, 31]                        # the next turn resumes after all of a
    assert h.prefix_attach(0, turn) == len(a)
    assert torch.equal(chunk(0, turn, len(a), len(turn)), from_scratch(turn, [4, 9, len(a)]))


@pytest.mark.parametrize("swa_full", [True, False])
def test_an_lfm2_with_a_window_gets_the_same_logits_from_a_reused_prefix(swa_full):
    """The tiny LFM2 with a sliding window of 4 on its attention layers (llama.cpp's
    llama_memory_hybrid_iswa; the model attends through llama.cpp's SWA mask, lfm2_chunk): a
    request resumed from a checkpoint and the iSWA pair's cells gets bit for bit the next-token
    logits of the same request computed in the same chunks in a fresh memory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from lfm2_model import tiny_lfm2

    torch.manual_seed(0)
    model, cfg = tiny_lfm2(transformers)
    head = cfg.hidden_size // cfg.num_attention_heads
    width = cfg.num_key_value_heads * head

    def memory():
        return HybridCache(512, 4, [0, 2], width, width, cfg.hidden_size * cfg.conv_L_cache, 0, n_seq_max=2,
                           type_k="f32", type_v="f32", v_trans=False, n_swa=4, n_batch=8, swa_full=swa_full)

    h = memory()
    h.enable_prefix_reuse(checkpoints=4)

    def chunk(c, s, tokens, start, end):
        return lfm2_chunk(torch, transformers, model, cfg, c, s, tokens, start, end)

    def fresh(tokens, cuts):
        c = memory()
        for a, b in zip([0] + cuts, cuts + [len(tokens)]):
            logits = chunk(c, 0, tokens, a, b)
        return logits

    # 280 positions in chunks of 4, then 8 (more than the 256 cells of a SWA cache of windows,
    # which overwrites the cells its window has left)
    a = [(7 * i + 3) % 50 for i in range(280)]
    cuts = [4] + list(range(12, 280, 8))
    for x, y in zip([0] + cuts, cuts + [len(a)]):
        chunk(h, 0, a, x, y)
        if y in (4, 268):
            assert h.checkpoint(0, a) == y
    assert h.prefix_release(0, a) == len(a)

    def resumed(s, tokens, want):
        k = h.prefix_attach(s, tokens)
        assert k == want
        logits = chunk(h, s, tokens, k, len(tokens))
        assert torch.equal(logits, fresh(tokens, [x for x in cuts if x <= k]))
        h.prefix_release(s, tokens)

    resumed(0, a[:271] + [30, 31], 268)        # the window before 268 held in both
    # both caches hold 7 of this one, the checkpoints 4, whose window a SWA cache of windows
    # has overwritten since
    resumed(1, a[:7] + [21, 22], 4 if swa_full else 0)
    h._prefix_check()
