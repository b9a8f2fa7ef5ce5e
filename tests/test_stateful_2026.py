"""Property test: the C-backed ``UnifiedCache(semantics="2026")`` against the pure-Python model
``reference2026.UnifiedReference2026`` (tests/reference2026.py).

A hypothesis state machine applies the same random operations to both through the trace-op
table (conformance.ops, family ``unified2026``; the model's results are the
expectation): scattered placements with their K/V rows (the fill rule), dry runs, every
sequence operation (within and across streams), updates (stream copies, shifts), masks,
position buckets; caches of one stream and of several, with and without a sliding window.
After every step it compares what a trace's ``check`` shows (heads, used, used_max_p1, n_kv,
every cell of every stream, seq_pos, has_shift; with the per-cell extension, every cell's) and
the hash of every K and V byte. Caches with the per-cell extension get token ids and 2-D
positions in their ubatches (masks of 2-D ubatches, state round trips carrying it). What
today's llama.cpp aborts on must raise ValueError in both and change nothing."""
import numpy as np
import pytest

from conftest import need_module

hypothesis = need_module("test", "hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from kvcache import StateError, UBatch, UnifiedCache, UnifiedCache2025, UnifiedCache2026  # noqa: E402
from conformance import unified2026  # noqa: E402
from conformance.ops import apply_op, start  # noqa: E402
from reference import RefUBatch  # noqa: E402
from reference2026 import UnifiedReference2026  # noqa: E402
from stateful_rules import (SequenceEditRules, draw_copy_range, draw_ext, draw_ubatch, hand_off_alike,  # noqa: E402
                            read_alike)


P_MAX = 60
N_EMBD = 4


@st.composite
def configs(draw):
    kv_unified = draw(st.booleans())
    n_seq_max = draw(st.integers(1, 4))
    kv_size = draw(st.sampled_from([16, 32, 64] if not kv_unified else [16, 32, 64, 320]))
    n_pad = draw(st.sampled_from([p for p in (1, 8, 16) if kv_size % p == 0]))
    swa_type = draw(st.sampled_from(["none", "none", "standard", "chunked"]))
    n_swa = 0 if swa_type == "none" else draw(st.integers(1, 12))
    n_layer = draw(st.integers(1, 2))
    cell_ext = draw(st.booleans())
    ext = dict(cell_ext=True, **({"ple_token": 7} if draw(st.booleans()) else {})) if cell_ext else {}
    return dict(**ext, kv_size=kv_size, n_layer=n_layer, n_embd_k_gqa=[N_EMBD] * n_layer,
                n_embd_v_gqa=[N_EMBD] * n_layer, type_k="f32", type_v=draw(st.sampled_from(["f32", "f16"])),
                v_trans=draw(st.booleans()), n_seq_max=n_seq_max, n_pad=n_pad, n_swa=n_swa, swa_type=swa_type,
                layers=list(range(n_layer)), kv_unified=kv_unified, n_stream=1 if kv_unified else n_seq_max,
                n_rel_attn_bkts=32, use_alibi=False)


class Unified2026Machine(SequenceEditRules, RuleBasedStateMachine):
    """Both caches receive every operation; the invariant compares them after each step."""

    p_max = P_MAX

    @initialize(cfg=configs())
    def create(self, cfg):
        self.cfg = cfg
        self.replays = (start(unified2026.reference_target(), cfg), start(unified2026.kvcache_target(), cfg))
        self.ref = self.replays[0].cache
        self.multi = cfg["n_stream"] > 1
        self.n_seq_max = cfg["n_seq_max"]

    def rejected(self, name, **args):
        """An op both must refuse with ValueError, changing nothing a check shows."""
        op = {"op": name, **args, "expect": {"exception": "invalid_argument"}}
        for r in self.replays:
            with pytest.raises(ValueError):
                apply_op(r, 0, op)

    def ubatch(self, data, max_tokens=8):
        """pos and seq_id lists of a ubatch the cache takes (stateful_rules.draw_ubatch)."""
        return draw_ubatch(data, self.cfg["n_seq_max"], self.multi, self.ref.seq_pos_max, P_MAX, max_tokens)

    def ext(self, data, n):
        """The ubatch's token ids and 2-D positions, for a cache with the per-cell extension."""
        return draw_ext(data, n, self.cfg.get("cell_ext", False))

    def settle(self):
        # as the traces do (FORMAT-2026 "update"): a pending shift or copy is applied first
        if self.ref.has_shift or self.ref.pending_copies:
            self.both("update")

    # --- rules -------------------------------------------------------------------------------

    @rule(data=st.data())
    def find_slot(self, data):
        self.settle()
        pos, seq_id = self.ubatch(data)
        self.both("find_slot", pos=pos, seq_id=seq_id, **self.ext(data, len(pos)))

    @rule(data=st.data())
    def decode_round(self, data):
        """Token by token, one sequence after another: fills the ring, so that placements
        wrap, skip used cells and (with a window) reuse the cells a window has left."""
        seqs = data.draw(st.lists(st.integers(0, self.cfg["n_seq_max"] - 1), min_size=1, max_size=4), label="seqs")
        for _ in range(data.draw(st.integers(1, 6), label="rounds")):
            for s in seqs:
                self.settle()
                self.both("find_slot", pos=[self.ref.seq_pos_max(s) + 1], seq_id=[[s]])

    @rule(data=st.data())
    def find_slot_large(self, data):
        """A group that often does not fit (a failed find_slot changes nothing)."""
        self.settle()
        n = data.draw(st.integers(self.cfg["kv_size"] // 2, self.cfg["kv_size"] + 1), label="n_tokens")
        s = self.seq(data)
        p = max(self.ref.seq_pos_max(s) + 1, 0)
        self.both("find_slot", pos=list(range(p, p + n)), seq_id=[[s]] * n)

    @rule(data=st.data())
    def prepare(self, data):
        self.settle()
        ubs = [dict(zip(("pos", "seq_id"), self.ubatch(data, 16)))
               for _ in range(data.draw(st.integers(1, 3), label="n_ubatches"))]
        self.both("prepare", ubatches=ubs)

    @rule(data=st.data())
    def seq_cp(self, data):
        """Across streams whole sequences only (a part is an abort: see below)."""
        src, dst = self.seq(data), self.seq(data)
        p0, p1 = draw_copy_range(data, self.multi, src, dst, self.prange)
        self.both("seq_cp", src=src, dst=dst, p0=p0, p1=p1)

    @rule()
    def update(self):
        self.both("update")

    @precondition(lambda self: sum(self.ref.used_per_stream) > 0)
    @rule()
    def clear(self):
        self.both("clear", data=True)

    @rule(data=st.data(), causal=st.booleans())
    def mask(self, data, causal):
        pos, seq_id = self.ubatch(data, 12)
        self.both("mask", pos=pos, seq_id=seq_id, causal=causal, **self.ext(data, len(pos)))

    @precondition(lambda self: not self.multi)
    @rule(data=st.data())
    def pos_bucket(self, data):
        pos, seq_id = self.ubatch(data)
        self.both("pos_bucket", pos=pos, seq_id=seq_id)

    # --- what today's llama.cpp aborts on ---------------------------------------------------

    @rule(data=st.data())
    def bad_sequence_id(self, data):
        bad = data.draw(st.sampled_from([-2, self.cfg["n_seq_max"], 255, 256]), label="bad")
        name = data.draw(st.sampled_from(["seq_keep", "seq_add", "seq_div", "seq_rm"]), label="op")
        args = {"seq_keep": {}, "seq_rm": {"p0": -1, "p1": -1}, "seq_add": {"p0": 0, "p1": 4, "shift": 1},
                "seq_div": {"p0": 0, "p1": 4, "d": 2}}[name]
        if name == "seq_rm" and bad == -1:
            return
        self.rejected(name, seq_id=bad, **args)
        self.rejected("seq_cp", src=bad, dst=0, p0=-1, p1=-1)

    @precondition(lambda self: self.multi)
    @rule(data=st.data())
    def partial_copy_across_streams(self, data):
        p0 = data.draw(st.integers(1, self.cfg["kv_size"] - 2), label="p0")
        self.rejected("seq_cp", src=0, dst=1, p0=p0, p1=-1)

    @precondition(lambda self: self.multi)
    @rule(data=st.data())
    def ungrouped_ubatch(self, data):
        bad = data.draw(st.sampled_from([[[0], [1], [0]], [[0], [0], [1]], [[0, 1], [0, 1]]]), label="seq_id")
        pos = list(range(len(bad)))
        self.rejected("find_slot", pos=pos, seq_id=bad)
        self.rejected("mask", pos=pos, seq_id=bad, causal=True)
        self.rejected("prepare", ubatches=[{"pos": [0], "seq_id": [[0]]}, {"pos": pos, "seq_id": bad}])

    def read_both(self, blob, seq_id):
        """state_read into both: the bytes consumed, or that both raise StateError (and then
        nothing changes, which the invariant sees)."""
        return read_alike(*(lambda c=r.cache: c.state_read(blob, seq_id, layout="2026") for r in self.replays))

    @rule(data=st.data())
    def state_round_trip(self, data):
        """A state (the whole cache's or a sequence's) written by both, the same bytes, read back
        into the whole cache or into a sequence (often another one)."""
        seq_id = data.draw(st.integers(-1, self.n_seq_max - 1), label="seq_id")
        blobs = [r.cache.state_write(seq_id, layout="2026", prefix=False) for r in self.replays]
        assert blobs[0] == blobs[1]
        assert self.replays[1].cache.state_size(seq_id, layout="2026", prefix=False) == len(blobs[1])
        dst = -1 if seq_id < 0 else self.seq(data)
        assert self.read_both(blobs[0], dst) in (len(blobs[0]), "StateError")

    @rule(data=st.data())
    def state_read_damaged(self, data):
        """A state cut short or with a byte changed: both take it or both refuse it alike."""
        seq_id = data.draw(st.integers(-1, self.n_seq_max - 1), label="seq_id")
        blob = bytearray(self.ref.state_write(seq_id, layout="2026"))
        if data.draw(st.booleans(), label="cut"):
            blob = blob[:data.draw(st.integers(0, len(blob) - 1), label="length")]
        else:
            at = data.draw(st.integers(0, min(len(blob), 64) - 1), label="at")
            blob[at] ^= data.draw(st.integers(1, 255), label="xor")
        self.read_both(bytes(blob), -1 if seq_id < 0 else self.seq(data))

    @rule(data=st.data())
    def hand_off(self, data):
        """A sequence of the cache moved by seq_export / seq_import_begin into a copy of the
        cache (into a sequence drawn, often another one) gives what state_read of its state
        gives in another copy, or both refuse alike, changing nothing."""
        cache = self.replays[1].cache
        # the layout it is written in, as docs/state.md says to read one's own states (a tiny
        # cache's whole state may frame in both layouts, and a read without one refuses it)
        whole = cache.state_write(-1, layout="2026")
        moved, read = (start(unified2026.kvcache_target(), self.cfg).cache for _ in range(2))
        for c in (moved, read):
            c.state_read(whole, layout="2026")
        seq_id = data.draw(st.integers(0, self.n_seq_max - 1), label="seq_id")
        if self.multi and any(snap.holds(seq_id).any() for k, snap in enumerate(cache.stream_cells()) if k != seq_id):
            # a whole state read takes cells of a sequence in another's stream (as llama.cpp does, a
            # damaged state can hold them); a hand-off moves one stream, so it refuses the sequence
            with pytest.raises(ValueError, match="a hand-off moves one stream"):
                cache.seq_export(seq_id)
            return
        hand_off_alike(cache, moved, read, seq_id, self.seq(data))

    @rule()
    def bad_divisor_and_empty_prepare(self):
        self.rejected("seq_div", seq_id=0, p0=0, p1=4, d=0)
        self.rejected("prepare", ubatches=[])

    @invariant()
    def same_state(self):
        if hasattr(self, "replays"):
            self.both("check")
            self.both("kvhash")


Unified2026Machine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_unified_2026_against_the_model = Unified2026Machine.TestCase


# --- direct checks of the API the machine does not reach ---------------------------------------

def _cache(**kw):
    args = dict(kv_size=64, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, type_k="f32", type_v="f32", n_pad=1,
                semantics="2026")
    args.update(kw)
    return UnifiedCache(**args)


def test_slot_info_and_store_into_scattered_cells_per_stream():
    c, r = _cache(n_seq_max=2, kv_unified=False, v_trans=True), UnifiedReference2026(
        64, 1, 4, 4, "f32", "f32", True, n_seq_max=2, n_pad=1, kv_unified=False)
    for cache, ub in ((c, UBatch), (r, RefUBatch)):
        assert cache.find_slot(ub([0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1]))
        cache.seq_rm(0, 1, 2)                        # a hole in stream 0
        assert cache.find_slot(ub([3, 4, 3, 4], [0, 0, 1, 1]))
    got = [(s, cells.tolist()) for s, cells in c.slot_info()]
    assert got == [(s, cells.tolist()) for s, cells in r.slot_info()] == [(0, [1, 3]), (1, [3, 4])]
    assert c.slot_indices().tolist() == [1, 3, 3, 4]
    k = np.arange(16, dtype=np.float32).reshape(4, 4)
    c.store(0, k, k + 100)
    r.store(0, k, k + 100)
    assert np.array_equal(c.k(0), r.k(0)) and np.array_equal(c.v(0), r.v(0))
    assert c.k(0).shape == (128, 4) and c.v(0).shape == (2, 4, 64)
    assert c.k(0)[64 + 4].tolist() == k[3].tolist()          # stream 1, cell 4: row 64 + 4


def test_metadata_only_cache_hands_out_the_scattered_cells():
    c = _cache(buffers="none")
    assert c.find_slot(UBatch([0, 1, 2], [0, 0, 0]))
    c.seq_rm(0, 1, 2)
    assert c.find_slot(UBatch([1, 3], [0, 0]))
    assert [(s, x.tolist()) for s, x in c.slot_info()] == [(0, [1, 3])]


# what only the mid-2025 cache has: today's has no such members at all
SEED_ONLY = ("commit", "restore", "set_full", "prune_swa", "slot", "do_defrag", "defrag_sched", "defrag_prepare",
             "defrag_ids", "defrag_runs", "defrag_move")


def test_the_seed_operations_are_absent():
    c = _cache()
    assert type(c) is UnifiedCache2026 and isinstance(c, UnifiedCache)
    assert c.find_slot(UBatch([0, 1], [0, 0]))
    before = c.stream_cells()
    for name in SEED_ONLY:
        assert hasattr(UnifiedCache2025, name) and not hasattr(UnifiedCache2026, name), name
        with pytest.raises(AttributeError):
            getattr(c, name)
    assert c.stream_cells() == before and c.slot_info()[0][1].tolist() == [0, 1]
    with pytest.raises(ValueError):
        c.kq_mask(UBatch([2], [0]), pad=True)
    with pytest.raises(ValueError):
        _cache(n_seq_max=2, kv_unified=False).cells()
    with pytest.raises(ValueError):
        UnifiedCache(64, 1, 4, 4, n_pad=1, kv_unified=False)      # streams need semantics "2026"
    with pytest.raises(ValueError):
        UnifiedCache(64, 1, 4, 4, n_pad=1, semantics="2027")


def test_the_seed_semantics_has_one_group_in_slot_info():
    c = UnifiedCache(64, 1, 4, 4, n_pad=32)
    assert c.semantics == "2025" and c.n_stream == 1 and c.kv_unified
    assert c.slot_info() == []
    assert c.find_slot(UBatch([0, 1, 2], [0, 0, 0]))
    assert [(s, x.tolist()) for s, x in c.slot_info()] == [(0, [0, 1, 2])]
    assert type(c) is UnifiedCache2025
    for name in ("prepare", "pending_copies"):
        assert hasattr(UnifiedCache2026, name) and not hasattr(UnifiedCache2025, name), name
    with pytest.raises(AttributeError):
        c.prepare([UBatch([3], [0])])


def test_update_returns_the_stream_copies_as_a_plan():
    c = _cache(n_seq_max=2, kv_unified=False)
    assert c.find_slot(UBatch([0, 1], [0, 0]))
    c.store(0, np.ones((2, 4), np.float32), np.ones((2, 4), np.float32))
    c.seq_cp(0, 1, -1, -1)
    assert c.pending_copies == 1 and not c.k(0)[64:].any()
    u = c.update()
    assert (u.status, u.copies, u.had_shift, bool(u), u.k_shift) == (0, 1, False, True, None)
    assert np.array_equal(c.k(0)[64:66], c.k(0)[:2]) and c.pending_copies == 0
    assert c.update().status == 1


def test_update_rotates_every_stream_as_the_seed_rotates_its_cells():
    """With RoPE, the K rows of each stream turn by their cells' shifts exactly as a seed cache's
    rows do (after the stream copies)."""
    from kvcache import RopeParams
    rope = RopeParams(8, mode="neox", freq_base=10000.0)
    kw = dict(n_layer=1, n_embd_k_gqa=16, n_embd_v_gqa=4, type_k="f32", type_v="f32", n_embd_head_k=8, rope=rope)
    today = UnifiedCache(64, n_pad=1, n_seq_max=3, semantics="2026", kv_unified=False, **kw)
    seed = UnifiedCache(64, n_pad=32, **kw)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((6, 16)).astype(np.float32)
    v = np.zeros((6, 4), np.float32)
    assert today.find_slot(UBatch(list(range(6)), [2] * 6))
    today.store(0, k, v)
    assert seed.find_slot(UBatch(list(range(6)), [0] * 6))
    seed.store(0, k, v)
    seed.commit()
    today.seq_cp(2, 1)                          # stream 1 gets stream 2's cells, copied by update
    for c, s in ((today, 2), (today, 1), (seed, 0)):
        c.seq_add(s, 2, -1, 5)
    u = today.update()
    plan = seed.update()
    assert (u.copies, u.had_shift, u.rotated, plan.rotated) == (1, True, True, True)
    assert u.shift[2 * 64:2 * 64 + 6].tolist() == u.shift[64:70].tolist() == [0, 0, 5, 5, 5, 5]
    for stream in (1, 2):
        assert np.array_equal(today.k(0)[stream * 64:stream * 64 + 6], seed.k(0)[:6])
    assert not today.k(0)[:64].any() and not today.has_shift


def test_a_batch_of_several_sequences_goes_to_the_streams_in_equal_splits():
    from kvcache import Batch
    c = _cache(n_seq_max=3, kv_unified=False)
    b = Batch([0, 1, 2, 0, 1, 2, 0, 1], [0, 0, 0, 1, 1, 1, 2, 2], simple_split=False)
    placed = 0
    for ub in c.ubatches(b, 6):
        assert c.find_slot(ub)
        placed += sum(len(cells) for _, cells in c.slot_info())
    assert placed == 8 and c.used_per_stream == (3, 3, 2)
    with pytest.raises(ValueError):
        list(c.ubatches(Batch([0], [0]), 4))


# what today's llama.cpp aborts on (FORMAT-2026.md "Aborts"), as (call, streams it applies to)
_ABORTS = [
    (lambda c: c.seq_rm(-2, -1, -1), (1, 4)),
    (lambda c: c.seq_rm(4, -1, -1), (1, 4)),            # n_seq_max: llama.cpp's batch check refuses it
    (lambda c: c.seq_rm(255, -1, -1), (1, 4)),
    (lambda c: c.seq_cp(-1, 0), (1, 4)),
    (lambda c: c.seq_cp(0, 4), (1, 4)),
    (lambda c: c.seq_keep(-1), (1, 4)),
    (lambda c: c.seq_add(-1, 0, 4, 1), (1, 4)),
    (lambda c: c.seq_div(4, 0, 4, 2), (1, 4)),
    (lambda c: c.seq_div(0, 0, 4, 0), (1, 4)),
    (lambda c: c.seq_pos_min(-1), (1, 4)),
    (lambda c: c.seq_pos_max(4), (1, 4)),
    (lambda c: c.find_slot(UBatch([0], [4])), (1, 4)),
    (lambda c: c.prepare([]), (1, 4)),
    (lambda c: c.seq_cp(0, 1, 2, -1), (4,)),            # part of a sequence across streams
    (lambda c: c.seq_cp(0, 1, -1, 7), (4,)),
    (lambda c: c.find_slot(UBatch([5, 5, 6], [0, 1, 0])), (4,)),      # not grouped per sequence
    (lambda c: c.find_slot(UBatch([5, 6, 5], [0, 0, 1])), (4,)),      # groups of unequal length
    (lambda c: c.find_slot(UBatch([5, 6], [[0, 1], [0, 1]])), (4,)),  # a token of two sequences
    (lambda c: c.kq_mask(UBatch([5, 5, 6], [0, 1, 0])), (4,)),
    (lambda c: c.prepare([UBatch([5], [0]), UBatch([5, 6, 5], [0, 0, 1])]), (4,)),
    (lambda c: c.pos_bucket(UBatch([5], [0]), 32), (4,)),
]


@pytest.mark.parametrize("n_stream", [1, 4])
@pytest.mark.parametrize("k", range(len(_ABORTS)))
def test_what_llama_cpp_aborts_on_raises_value_error_and_changes_nothing(k, n_stream):
    call, streams = _ABORTS[k]
    if n_stream not in streams:
        pytest.skip("applies to the other stream count")
    c = _cache(n_seq_max=4, kv_unified=n_stream == 1)
    assert c.find_slot(UBatch([0, 1, 2, 3, 4] * 4, [s for s in range(4) for _ in range(5)] if n_stream > 1
                              else [0, 1, 2, 3] * 5))
    c.store(0, np.ones((20, 4), np.float32), np.ones((20, 4), np.float32))
    before = (c.stream_cells(), c.heads, c.pending_copies, c.k(0).copy(), c.v(0).copy(), c.slot_indices())
    with pytest.raises(ValueError):
        call(c)
    after = (c.stream_cells(), c.heads, c.pending_copies, c.k(0), c.v(0), c.slot_indices())
    assert before[:3] == after[:3] and all(np.array_equal(a, b) for a, b in zip(before[3:], after[3:]))


def test_store_into_borrowed_buffers_of_every_stream():
    """Borrowed K/V memory holds every stream: K rows stream * size + cell, V transposed per stream."""
    k_mem = np.zeros((2 * 64, 4), np.float32)
    v_mem = np.zeros((2, 4, 64), np.float32)
    c = _cache(n_seq_max=2, kv_unified=False, v_trans=True, buffers={0: (k_mem, v_mem)})
    assert c.find_slot(UBatch([0, 1, 0, 1], [0, 0, 1, 1]))
    rows = np.arange(16, dtype=np.float32).reshape(4, 4)
    c.store(0, rows, rows + 50)
    assert k_mem[64 + 1].tolist() == rows[3].tolist() and v_mem[1, :, 1].tolist() == (rows[3] + 50).tolist()
    assert k_mem[0].tolist() == rows[0].tolist() and np.shares_memory(c.k(0), k_mem)
    with pytest.raises(ValueError):
        _cache(n_seq_max=2, kv_unified=False, buffers={0: (np.zeros((64, 4), np.float32), v_mem)})


# --- the state of a 2026 cache -----------------------------------------------------------------

def _filled(n_seq_max=4, kv_unified=False, **kw):
    c = _cache(n_seq_max=n_seq_max, kv_unified=kv_unified, **kw)
    for s in range(n_seq_max):
        assert c.find_slot(UBatch(list(range(3 + s)), [s] * (3 + s)))
        rows = np.arange(4 * (3 + s), dtype=np.float32).reshape(3 + s, 4) + 10 * s
        c.store(0, rows, rows + 0.5)
    return c


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("v_trans", [True, False])
def test_state_round_trips_whole_and_per_sequence(kv_unified, v_trans):
    c = _filled(kv_unified=kv_unified, v_trans=v_trans)
    assert c.n_stream == (1 if kv_unified else 4)
    whole = c.state_write()
    d = _filled(kv_unified=kv_unified, v_trans=v_trans)
    d.clear()
    assert d.state_read(whole) == len(whole) == c.state_size()
    assert d.stream_cells() == c.stream_cells() and d.state_write() == whole
    assert np.array_equal(d.k(0), c.k(0)) and np.array_equal(d.v(0), c.v(0))
    for s in range(4):
        blob = c.state_write(s)
        e = _cache(n_seq_max=4, kv_unified=kv_unified, v_trans=v_trans)
        assert e.state_read(blob, s) == len(blob)
        assert e.state_write(s) == blob and e.seq_pos_max(s) == 2 + s
        if not kv_unified:       # the other streams stay empty and are written as such
            assert all(not t.nonempty() for k, t in enumerate(e.stream_cells()) if k != s)
            assert len(c.state_write(s, prefix=False)) == len(blob) - 8


def test_state_layouts_without_stream_counts_hold_one_stream():
    one = _filled(n_seq_max=2, kv_unified=True)
    blob = one.state_write(layout="2025")
    other = _cache(n_seq_max=2)
    assert other.state_read(blob, layout="2025") == len(blob) and other.stream_cells() == one.stream_cells()
    four = _filled()
    for call in (lambda: four.state_write(layout="2025"), lambda: four.state_size(layout="2025"),
                 lambda: four.state_write_into(bytearray(1 << 16), layout="2025"),
                 lambda: four.state_read(blob, layout="2025")):
        with pytest.raises(ValueError, match="4 streams"):
            call()


def test_bad_state_reads_change_nothing():
    four, one = _filled(), _filled(kv_unified=True)
    snap = lambda c: (c.stream_cells(), c.heads, c.state_write(), c.k(0).tobytes(), c.v(0).tobytes())  # noqa: E731
    before = snap(four)
    with pytest.raises(StateError, match="n_stream mismatch"):
        four.state_read(one.state_write())
    with pytest.raises(StateError, match="n_stream mismatch"):
        one.state_read(four.state_write(0), 0)
    whole = four.state_write()
    for cut in (3, 5, 40, len(whole) - 1):
        with pytest.raises(StateError):
            four.state_read(whole[:cut])
    two = _cache(n_seq_max=2)
    assert two.find_slot(UBatch([0], [[0, 1]]))
    twice = bytearray(two.state_write())
    assert twice[12:24] == bytes([2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0])
    twice[20] = 0                                                  # the cell lists seq 0 twice
    with pytest.raises(StateError, match="listed twice"):
        one.state_read(bytes(twice))
    with pytest.raises(StateError):                               # converting checks as much
        four.state_read(whole[:-1], convert=True)
    # no room: seq 0's 3 cells into the one stream of 64 cells, 62 of them seq 1's
    full = _cache(n_seq_max=2)
    assert full.find_slot(UBatch(list(range(62)), [1] * 62))
    cells, heads = full.stream_cells(), full.heads
    with pytest.raises(StateError, match="no room"):
        full.state_read(one.state_write(0), 0)
    assert full.stream_cells() == cells and full.heads == heads
    assert snap(four) == before


def test_a_sequence_state_of_empty_sections_keeps_the_sequence():
    four = _filled()
    before = four.stream_cells()
    empty = _cache(n_seq_max=4, kv_unified=False).state_write(2)
    assert len(empty) == 8 + 4 + 4 * 4
    assert four.state_read(empty, 2) == len(empty) and four.stream_cells() == before


def _v_rows(c, il=0):
    """V of every stream as (n_stream, size, n_embd_v) rows, whatever the cache's V layout."""
    v = c.v(il)
    return v.transpose(0, 2, 1) if c.v_trans else v.reshape(c.n_stream, c.size, -1)


@pytest.mark.parametrize("kv_unified", [True, False], ids=["one-stream", "streams"])
@pytest.mark.parametrize("v_trans", [True, False], ids=["from-transposed", "from-rows"])
def test_state_read_converts_the_v_layout(kv_unified, v_trans):
    """convert=True reads a state whose V layout is not the cache's: every cell's V row lands in
    the cell the read places it in (whole: cell k of stream s; a sequence: the cells its
    placement picks), the rest as without convert; converting back gives the first state."""
    from cache_state import busy_unified_2026, snapshot

    src = busy_unified_2026(kv_unified, v_trans=v_trans, type_k="f32", type_v="f32")
    for seq_id in (-1, 1, 2):
        dst = busy_unified_2026(kv_unified, v_trans=not v_trans, type_k="f32", type_v="f32", seed=5)
        before = snapshot(dst)
        blob = src.state_write(seq_id)
        with pytest.raises(StateError, match="V layout.*conversion not requested"):
            dst.state_read(blob, seq_id)
        assert snapshot(dst) == before
        assert dst.state_read(blob, seq_id, convert=True) == len(blob)
        got, want = _v_rows(dst), _v_rows(src)
        for s, (a, b) in enumerate(zip(dst.stream_cells(), src.stream_cells())):
            if seq_id < 0:
                held = np.flatnonzero(b.pos != -1)
                np.testing.assert_array_equal(got[s, :len(held)], want[s, held])
                assert a.pos[:len(held)].tolist() == b.pos[held].tolist()
            elif s == (seq_id if src.n_stream > 1 else 0):
                mine, theirs = np.flatnonzero(a.holds(seq_id)), np.flatnonzero(b.holds(seq_id))
                mine, theirs = mine[np.argsort(a.pos[mine])], theirs[np.argsort(b.pos[theirs])]
                assert a.pos[mine].tolist() == b.pos[theirs].tolist() and len(mine) > 0
                np.testing.assert_array_equal(got[s, mine], want[s, theirs])
        back = busy_unified_2026(kv_unified, v_trans=v_trans, type_k="f32", type_v="f32", seed=5)
        ref = busy_unified_2026(kv_unified, v_trans=v_trans, type_k="f32", type_v="f32", seed=5)
        back.state_read(dst.state_write(seq_id), seq_id, convert=True)
        ref.state_read(blob, seq_id)
        assert snapshot(back) == snapshot(ref)
        # the same layout: convert changes nothing about the read
        same = busy_unified_2026(kv_unified, v_trans=v_trans, type_k="f32", type_v="f32", seed=5)
        same.state_read(blob, seq_id, convert=True)
        assert snapshot(same) == snapshot(ref)


def test_seq_cells_are_those_of_the_sequences_stream():
    c = _cache(n_seq_max=3, kv_unified=False)
    assert c.find_slot(UBatch([0, 1, 2, 5, 6, 7], [1, 1, 1, 2, 2, 2]))
    c.seq_rm(2, 6, 7)
    assert [x.tolist() for x in c.seq_cells(1)] == [[0, 1, 2], [0, 1, 2]]
    assert [x.tolist() for x in c.seq_cells(2)] == [[0, 2], [5, 7]]
    assert [x.tolist() for x in c.seq_cells(0)] == [[], []]
