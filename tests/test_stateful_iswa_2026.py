"""Property test: the C-backed ``ISWACache(semantics="2026")`` against a model made of two
pure-Python ``UnifiedReference2026`` caches.

The model drives its base cache (kv_size cells per stream, no window) and its SWA cache (the
size today's llama.cpp gives it, kvcache.plan.swa_size) as today's llama.cpp drives an iSWA
pair: a ubatch is placed only when both caches' dry runs found room (then in both, each as
its own find_slot places it), prepare is the dry run of both, every sequence operation and
update goes to both, seq_pos_min/max are the SWA cache's, a state is the base cache's part
then the SWA cache's, read all or nothing, and a sequence handed off lands as its state read
does. After every step both halves' cells (every stream, heads, used, seq_pos, has_shift) and
the hash of every K and V byte are compared. What today's llama.cpp aborts on raises
ValueError and changes neither half."""
import copy

import numpy as np
import pytest

from conftest import need_module

hypothesis = need_module("test", "hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from kvcache import ISWACache, UBatch  # noqa: E402
from conformance.common import fill_rows  # noqa: E402
from conformance.unified2026 import _bytes_sha256, _check_fields  # noqa: E402
from kvcache.plan import swa_size  # noqa: E402
from reference import RefUBatch  # noqa: E402
from reference2026 import UnifiedReference2026  # noqa: E402
from stateful_rules import draw_copy_range, draw_ubatch, hand_off_alike, read_alike  # noqa: E402

N_EMBD = 4


class ISWAReference2026:
    """Two UnifiedReference2026 caches driven as today's llama.cpp drives its iSWA cache."""

    def __init__(self, kv_size, n_layer, swa_layers, n_swa, swa_type, n_batch, swa_full, n_seq_max, kv_unified,
                 v_trans, type_v):
        size_swa = swa_size(kv_size, n_swa, n_seq_max, n_batch, 1, swa_full, "2026", kv_unified)
        common = dict(n_layer=n_layer, n_embd_k_gqa=N_EMBD, n_embd_v_gqa=N_EMBD, type_k="f32", type_v=type_v,
                      v_trans=v_trans, n_seq_max=n_seq_max, n_pad=1, kv_unified=kv_unified)
        self.swa_layers = tuple(sorted(swa_layers))
        self.base = UnifiedReference2026(kv_size, layers=[il for il in range(n_layer) if il not in swa_layers],
                                         **common)
        self.swa = UnifiedReference2026(size_swa, layers=list(self.swa_layers), n_swa=n_swa, swa_type=swa_type,
                                        **common)
        self.halves = (self.base, self.swa)

    def find_slot_each(self, ub):
        # llama.cpp prepares both caches and applies the ubatch only when both found room
        room = [h.prepare([ub]) is not None for h in self.halves]
        if all(room):
            for h in self.halves:
                assert h.find_slot(ub)
        return tuple(room)

    def prepare(self, ubs):
        got = [h.prepare(ubs) for h in self.halves]
        return None if None in got else tuple(got)

    def cache_of(self, il):
        return self.swa if il in self.swa_layers else self.base

    def state_write(self, seq_id):
        return b"".join(h.state_write(seq_id) for h in self.halves)

    def state_read(self, blob, seq_id):
        saved = copy.deepcopy(self.halves)
        try:
            n = self.base.state_read(blob, seq_id)
            return n + self.swa.state_read(memoryview(blob)[n:], seq_id)
        except BaseException:
            self.base, self.swa = saved
            self.halves = saved
            raise


@st.composite
def configs(draw):
    kv_unified = draw(st.booleans())
    n_seq_max = draw(st.integers(1, 3))
    swa_full = draw(st.booleans())
    # a SWA cache smaller than the base one needs more than 256 cells in the base (today's
    # SWA cache is padded to 256); small base caches with swa_full fill up and reuse cells
    kv_size = draw(st.sampled_from([512] if not swa_full else [16, 32, 48]))
    n_layer = draw(st.integers(2, 3))
    swa_layers = draw(st.lists(st.integers(0, n_layer - 1), min_size=1, max_size=n_layer - 1, unique=True))
    return dict(kv_size=kv_size, n_layer=n_layer, swa_layers=swa_layers, n_swa=draw(st.integers(1, 10)),
                swa_type=draw(st.sampled_from(["standard", "chunked"])), n_batch=draw(st.sampled_from([8, 64])),
                swa_full=swa_full, n_seq_max=n_seq_max, kv_unified=kv_unified, v_trans=draw(st.booleans()),
                type_v=draw(st.sampled_from(["f32", "f16"])))


class ISWA2026Machine(RuleBasedStateMachine):
    """Model and cache receive every operation; the invariant compares both halves."""

    @initialize(cfg=configs())
    def create(self, cfg):
        self.cfg = cfg
        self.ref = ISWAReference2026(**cfg)
        self.cache = self.new_cache()
        assert (self.cache.size_base, self.cache.size_swa) == (self.ref.base.size, self.ref.swa.size)
        self.multi = not cfg["kv_unified"] and cfg["n_seq_max"] > 1
        self.p_max = 3 * self.ref.swa.size // 2

    # --- helpers -----------------------------------------------------------------------------

    def new_cache(self):
        cfg = self.cfg
        return ISWACache(cfg["kv_size"], cfg["n_layer"], N_EMBD, N_EMBD, swa_layers=cfg["swa_layers"],
                         n_swa=cfg["n_swa"], swa_type=cfg["swa_type"], n_batch=cfg["n_batch"],
                         swa_full=cfg["swa_full"], type_k="f32", type_v=cfg["type_v"], v_trans=cfg["v_trans"],
                         n_seq_max=cfg["n_seq_max"], n_pad=1, semantics="2026", kv_unified=cfg["kv_unified"])

    def seq(self, data):
        return data.draw(st.integers(0, self.cfg["n_seq_max"] - 1), label="seq_id")

    def prange(self, data):
        return (data.draw(st.integers(-1, self.p_max), label="p0"),
                data.draw(st.integers(-1, self.p_max + 1), label="p1"))

    def ubatch(self, data, max_tokens=8):
        """pos and seq_id of a ubatch the cache takes (stateful_rules.draw_ubatch)."""
        return draw_ubatch(data, self.cfg["n_seq_max"], self.multi, self.ref.swa.seq_pos_max, self.p_max,
                           max_tokens)

    def settle(self):
        # a pending shift or stream copy is applied before a placement, as a decode does
        if any(h.has_shift or h.pending_copies for h in self.ref.halves):
            self.update()

    def place(self, pos, seq_id):
        got = self.cache.find_slot_each(UBatch(pos, seq_id))
        assert got == self.ref.find_slot_each(RefUBatch(pos, seq_id))
        if all(got):
            for mine, theirs in zip(self.cache.slot_info(), (h.slot_info() for h in self.ref.halves)):
                assert [(s, c.tolist()) for s, c in mine] == [(s, c.tolist()) for s, c in theirs]
            p = np.asarray(pos, dtype=np.int64)
            first = np.asarray([ids[0] for ids in seq_id], dtype=np.int64)
            for il in range(self.cfg["n_layer"]):
                k, v = fill_rows(il, p, first, N_EMBD, N_EMBD)
                self.cache.store(il, k, v)
                self.ref.cache_of(il).store(il, k, v)
        else:
            assert self.cache.slot_info() == ([], [])

    def refused(self, call, ref_call=None):
        """Both raise ValueError (the invariant then sees that nothing changed)."""
        with pytest.raises(ValueError):
            call(self.cache)
        if ref_call is not None:
            with pytest.raises(ValueError):
                ref_call(self.ref)

    # --- rules -------------------------------------------------------------------------------

    @rule(data=st.data())
    def find_slot(self, data):
        self.settle()
        self.place(*self.ubatch(data))

    @rule(data=st.data())
    def decode_round(self, data):
        """Token by token, one sequence after another: the SWA cache fills up and reuses the
        cells its window has left (and purges what lies before them)."""
        seqs = data.draw(st.lists(st.integers(0, self.cfg["n_seq_max"] - 1), min_size=1, max_size=3), label="seqs")
        for _ in range(data.draw(st.integers(1, 8), label="rounds")):
            for s in seqs:
                self.settle()
                self.place([self.ref.swa.seq_pos_max(s) + 1], [[s]])

    @rule(data=st.data())
    def find_slot_large(self, data):
        """A run that often fits one cache and not the other: placed in neither then."""
        self.settle()
        s = self.seq(data)
        big = max(self.ref.base.size, self.ref.swa.size)
        n = data.draw(st.integers(min(self.ref.base.size, self.ref.swa.size) // 2, big + 1), label="n_tokens")
        p = max(self.ref.swa.seq_pos_max(s) + 1, 0)
        self.place(list(range(p, p + n)), [[s]] * n)

    @rule(data=st.data())
    def prepare(self, data):
        self.settle()
        ubs = [self.ubatch(data, 16) for _ in range(data.draw(st.integers(1, 3), label="n_ubatches"))]
        got = self.cache.prepare([UBatch(p, s) for p, s in ubs])
        want = self.ref.prepare([RefUBatch(p, s) for p, s in ubs])
        assert (got is None) == (want is None)
        if got is not None:
            for mine, theirs in zip(got, want):
                assert [[(s, c.tolist()) for s, c in si] for si in mine] == \
                       [[(s, c.tolist()) for s, c in si] for si in theirs]

    @rule(data=st.data())
    def seq_rm(self, data):
        s = data.draw(st.integers(-1, self.cfg["n_seq_max"] - 1), label="seq_id")
        p0, p1 = self.prange(data)
        assert self.cache.seq_rm(s, p0, p1) == (self.ref.base.seq_rm(s, p0, p1) & self.ref.swa.seq_rm(s, p0, p1))

    def each(self, name, *args):
        """The operation on the pair and on both halves of the model."""
        getattr(self.cache, name)(*args)
        for h in self.ref.halves:
            getattr(h, name)(*args)

    @rule(data=st.data())
    def seq_cp(self, data):
        src, dst = self.seq(data), self.seq(data)
        self.each("seq_cp", src, dst, *draw_copy_range(data, self.multi, src, dst, self.prange))

    @rule(data=st.data())
    def seq_keep(self, data):
        self.each("seq_keep", self.seq(data))

    @rule(data=st.data(), shift=st.integers(-12, 12))
    def seq_add(self, data, shift):
        self.each("seq_add", self.seq(data), *self.prange(data), shift)

    @rule(data=st.data(), d=st.integers(1, 4))
    def seq_div(self, data, d):
        self.each("seq_div", self.seq(data), *self.prange(data), d)

    @rule()
    def update(self):
        got = self.cache.update()
        for mine, theirs in zip(got, (h.update() for h in self.ref.halves)):
            assert (mine.status, mine.copies, mine.had_shift) == (theirs.status, theirs.copies, theirs.had_shift)
            assert mine.shift.tolist() == theirs.shift.tolist()

    @precondition(lambda self: any(h.used_per_stream != (0,) * h.n_stream for h in self.ref.halves))
    @rule()
    def clear(self):
        self.each("clear")

    @rule(data=st.data(), causal=st.booleans())
    def mask(self, data, causal):
        pos, seq_id = self.ubatch(data, 12)
        got = self.cache.kq_mask(UBatch(pos, seq_id), causal=causal)
        for mine, h in zip(got, self.ref.halves):
            assert np.array_equal(mine, h.kq_mask(RefUBatch(pos, seq_id), causal=causal))

    @rule(data=st.data())
    def seq_pos(self, data):
        s = self.seq(data)
        assert (self.cache.seq_pos_min(s), self.cache.seq_pos_max(s)) == \
               (self.ref.swa.seq_pos_min(s), self.ref.swa.seq_pos_max(s))

    # --- states --------------------------------------------------------------------------------

    def read_both(self, blob, seq_id):
        return read_alike(lambda: self.cache.state_read(blob, seq_id, layout="2026"),
                          lambda: self.ref.state_read(blob, seq_id))

    @rule(data=st.data())
    def state_round_trip(self, data):
        """The state of the whole pair or of a sequence (the SWA half without the cells its
        window has left), read back into the pair or into a sequence."""
        seq_id = data.draw(st.integers(-1, self.cfg["n_seq_max"] - 1), label="seq_id")
        blob = self.cache.state_write(seq_id, layout="2026", prefix=False)
        assert blob == self.ref.state_write(seq_id)
        assert self.cache.state_size(seq_id, layout="2026", prefix=False) == len(blob)
        dst = -1 if seq_id < 0 else self.seq(data)
        assert self.read_both(blob, dst) in (len(blob), "StateError")

    @rule(data=st.data())
    def state_read_damaged(self, data):
        """A state cut short or with a byte changed: both take it alike, or both refuse it and
        neither half changed."""
        seq_id = data.draw(st.integers(-1, self.cfg["n_seq_max"] - 1), label="seq_id")
        blob = bytearray(self.ref.state_write(seq_id))
        if data.draw(st.booleans(), label="cut"):
            blob = blob[:data.draw(st.integers(0, len(blob) - 1), label="length")]
        else:
            at = data.draw(st.integers(0, len(blob) - 1), label="at")
            blob[at] ^= data.draw(st.integers(1, 255), label="xor")
        self.read_both(bytes(blob), -1 if seq_id < 0 else self.seq(data))

    @rule(data=st.data())
    def hand_off(self, data):
        """A sequence moved by seq_export / seq_import_begin into a copy of the pair (into a
        sequence drawn) leaves it as state_read of the sequence's state leaves another copy, or
        both refuse alike and neither half changed."""
        whole = self.cache.state_write(-1, layout="2026")   # read in the layout it was written in
        moved, read = self.new_cache(), self.new_cache()
        for c in (moved, read):
            c.state_read(whole, layout="2026")
        hand_off_alike(self.cache, moved, read, self.seq(data), self.seq(data))

    # --- what today's llama.cpp aborts on --------------------------------------------------------

    @rule(data=st.data())
    def bad_sequence_id(self, data):
        bad = data.draw(st.sampled_from([-2, self.cfg["n_seq_max"], 256]), label="bad")
        self.refused(lambda c: c.seq_keep(bad), lambda r: r.base.seq_keep(bad))
        self.refused(lambda c: c.seq_add(bad, 0, 4, 1), lambda r: r.base.seq_add(bad, 0, 4, 1))
        self.refused(lambda c: c.seq_cp(bad, 0), lambda r: r.base.seq_cp(bad, 0))
        self.refused(lambda c: c.find_slot(UBatch([0], [bad if bad >= 0 else 256])))
        self.refused(lambda c: c.seq_div(0, 0, 4, 0))
        self.refused(lambda c: c.prepare([]))

    @precondition(lambda self: self.multi)
    @rule(data=st.data())
    def partial_copy_across_streams(self, data):
        p0 = data.draw(st.integers(1, min(self.ref.base.size, self.ref.swa.size) - 2), label="p0")
        self.refused(lambda c: c.seq_cp(0, 1, p0, -1), lambda r: r.base.seq_cp(0, 1, p0, -1))

    @precondition(lambda self: self.multi)
    @rule(data=st.data())
    def ungrouped_ubatch(self, data):
        bad = data.draw(st.sampled_from([[[0], [1], [0]], [[0], [0], [1]], [[0, 1], [0, 1]]]), label="seq_id")
        pos = list(range(len(bad)))
        self.refused(lambda c: c.find_slot(UBatch(pos, bad)))
        self.refused(lambda c: c.kq_mask(UBatch(pos, bad)))
        self.refused(lambda c: c.prepare([UBatch([0], [0]), UBatch(pos, bad)]))

    @rule()
    def the_seed_operations_are_not_there(self):
        if hasattr(self, "cache"):
            for name in ("commit", "restore", "set_full", "defrag_sched", "sbatch_init"):
                assert not hasattr(self.cache, name), name

    @invariant()
    def same_state(self):
        if not hasattr(self, "cache"):
            return
        for mine, theirs in zip((self.cache.base, self.cache.swa), self.ref.halves):
            assert _check_fields(mine) == _check_fields(theirs)
            for il in mine.layers:
                assert _bytes_sha256(mine.k(il)) == _bytes_sha256(theirs.k(il)), ("K", il)
                assert _bytes_sha256(mine.v(il)) == _bytes_sha256(theirs.v(il)), ("V", il)


ISWA2026Machine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_iswa_2026_against_the_model = ISWA2026Machine.TestCase
