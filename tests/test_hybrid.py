"""kvcache.HybridCache: today's hybrid memory (an attention cache and a recurrent memory driven
together), against llama.cpp's rules and a pure-Python model (tests/reference_hybrid.py)."""
import numpy as np
import pytest

from conftest import need_module

import kvcache
from kvcache.hybrid import split_batch

from reference_hybrid import HybridReference


def lfm2(**kw):
    """The geometry of the interop-hybrid tiny LFM2 model: layers 0 and 2 short convolutions
    (R 128 floats, no S), 1 and 3 attention (2 KV heads of 16)."""
    args = dict(kv_size=256, n_layer=4, recurrent_layers=[0, 2], n_embd_k_gqa=32, n_embd_v_gqa=32, n_embd_r=128,
                n_embd_s=0, n_seq_max=4)
    args.update(kw)
    return kvcache.HybridCache(**args)


def decode(h, s, p0, n):
    ubs = list(h.ubatches(list(range(p0, p0 + n)), [s] * n, 64))
    for ub in ubs:
        assert h.find_slot(ub)
    return ubs


def test_parts():
    h = lfm2(n_rs_seq=4)
    assert h.attn_layers == (1, 3) and h.recurrent_layers == (0, 2) and h.n_layer == 4
    assert isinstance(h.attn, kvcache.UnifiedCache2026) and h.attn.size == 256 and h.attn.n_pad == 1
    assert isinstance(h.recr, kvcache.RecurrentCache) and h.recr.semantics == "2026" and h.recr.size == 4
    assert h.recr.n_embd_k == [128, 128] and h.recr.n_embd_v == [0, 0]
    # the recurrent rows: a cell per sequence, 1 + n_rs_seq planes, f32
    assert h.recr.total_size == 2 * 4 * 5 * 128 * 4
    assert h.total_size == h.attn.total_size + h.recr.total_size
    assert h.semantics == "2026" and not h.has_shift


def test_falcon_and_nemotron_layer_filters():
    # Falcon-H1: every layer in both parts; Nemotron-H: feed-forward layers in neither
    f = kvcache.HybridCache(64, 3, recurrent_layers=[0, 1, 2], attn_layers=[0, 1, 2], n_embd_k_gqa=8,
                            n_embd_v_gqa=8, n_embd_r=16, n_embd_s=32)
    assert f.attn_layers == f.recurrent_layers == (0, 1, 2)
    n = kvcache.HybridCache(64, 4, recurrent_layers=[0, 2], attn_layers=[3], n_embd_k_gqa=8, n_embd_v_gqa=8,
                            n_embd_r=16, n_embd_s=32)
    assert n.attn.layers == (3,) and n.recr.n_layer == 2
    with pytest.raises(ValueError, match="recurrent_layers"):
        kvcache.HybridCache(64, 2, recurrent_layers=[], n_embd_k_gqa=8, n_embd_v_gqa=8, n_embd_r=16)
    with pytest.raises(ValueError, match="not an attention layer"):
        n.store(1, np.zeros((1, 8), np.float16))
    with pytest.raises(ValueError, match="not a recurrent layer"):
        n.r(3)


def test_decode_rollback_and_positions():
    h = lfm2(n_rs_seq=4)
    decode(h, 0, 0, 12)
    decode(h, 0, 12, 4)
    # the recurrent part holds the last position only: the pair's range is the intersection
    assert (h.seq_pos_min(0), h.seq_pos_max(0), h.attn.seq_pos_min(0)) == (15, 15, 0)
    before = (h.attn.seq_pos_max(0), h.recr.seq_pos_max(0), h.attn.used)
    # llama.cpp accepts this and reads an older state (rule C9): refused, neither part changed
    assert h.seq_rm(0, 12, -1) is False
    assert (h.attn.seq_pos_max(0), h.recr.seq_pos_max(0), h.attn.used) == before
    assert h.rollback_ok(0, 3) and h.seq_rm(0, 13, -1)
    assert (h.attn.seq_pos_max(0), h.recr.seq_pos_max(0), h.seq_pos_max(0)) == (12, 12, 12)
    assert h.s_copy().tolist() == [3 * 4 + 0]
    # a cut inside the state: refused by the recurrent part, the attention part keeps its cells
    assert not h.seq_rm(0, 2, 5) and h.attn.seq_pos_min(0) == 0 and h.attn.used == 13
    assert h.seq_rm(0) and h.seq_pos_max(0) == -1 and h.attn.used == 0


def test_seq_add_past_the_largest_position_saturates_in_both_parts():
    h = lfm2()
    decode(h, 0, 0, 10)
    h.seq_add(0, 0, -1, 2**31 - 1)
    assert h.attn.seq_pos_max(0) == h.recr.seq_pos_max(0) == h.seq_pos_max(0) == 2**31 - 1
    blob = h.state_write(0)
    other = lfm2()
    assert other.state_read(blob, 1) == len(blob)
    assert other.seq_pos_max(1) == 2**31 - 1


def test_find_slot_in_both_or_neither():
    h = lfm2(kv_size=8)
    decode(h, 0, 0, 6)
    recr = h.recr.cells()
    assert not h.find_slot(kvcache.UBatch(list(range(6, 9)), [1], n_seq_tokens=3)), "3 cells > 2 free"
    after = h.recr.cells()
    assert all(np.array_equal(recr[k], after[k]) for k in ("pos", "src", "tail")) and recr["seq_id"] == after["seq_id"]
    assert h.attn.used == 6 and h.seq_pos_max(1) == -1
    assert h.prepare([kvcache.UBatch([6, 7], [0], n_seq_tokens=2)]) is not None
    assert h.prepare([kvcache.UBatch([6, 7, 8], [0], n_seq_tokens=3)]) is None
    assert h.attn.used == 6 and h.seq_pos_max(0) == 5


def test_seq_ops_to_both():
    h = lfm2()
    decode(h, 0, 0, 5)
    h.seq_cp(0, 1)
    assert h.seq_pos_max(1) == 4 and h.recr.cells()["seq_id"][0] == [0, 1]
    h.seq_add(1, 0, -1, 3)
    assert h.recr.seq_pos_max(0) == 7, "the shared state's position moves for both"
    assert h.attn.seq_pos_max(1) == 7 and h.attn.seq_pos_max(0) == 7, "and the shared cells'"
    assert (h.seq_pos_min(0), h.seq_pos_max(0), h.attn.seq_pos_min(0)) == (7, 7, 3)
    h.seq_keep(1)
    assert h.seq_pos_max(0) == -1 and h.attn.seq_pos_min(1) == 3
    h.clear()
    assert h.attn.used == 0 and h.recr.used == 0


def test_masks_inputs_and_buffers():
    h = lfm2(type_k="f32", type_v="f32")
    ub = kvcache.UBatch([0, 1, 2], [0], n_seq_tokens=3)
    assert h.find_slot(ub)
    m = h.kq_mask(ub)
    assert m.shape[-2] == 3 and np.isneginf(m[0, 0, 1])
    assert h.s_copy().tolist() == [0] and h.rs_z == 0
    h.store(1, np.ones((3, 32), np.float32), np.ones((3, 32), np.float32))
    h.store_state(2, np.full((1, 128), 7, np.float32))
    assert h.r(2)[0, 0] == 7 and h.r(0)[0, 0] == 0
    none = lfm2(buffers="none")
    assert none.find_slot(ub)
    with pytest.raises(RuntimeError):
        none.r(0)
    k = {il: (np.zeros((256, 32), np.float16), np.zeros((256, 32), np.float16)) for il in (1, 3)}
    r = {il: (np.zeros((4, 128), np.float32), np.zeros((4, 0), np.float32)) for il in (0, 2)}
    b = lfm2(buffers=(k, r))
    assert b.find_slot(ub)
    b.store_state(0, np.full((1, 128), 5, np.float32))
    assert r[0][0][0, 0] == 5


def test_split_batch():
    # the trailing n_rs_seq + 1 tokens of a sequence stay in one ubatch
    got = [(u.n_tokens, u.n_seq_tokens) for u in split_batch(list(range(4)) + list(range(6)), [0] * 4 + [1] * 6, 6,
                                                              n_keep_tail=5)]
    assert got == [(4, 4), (6, 6)]
    got = [(u.n_tokens, u.n_seq_tokens) for u in split_batch(list(range(10)), [0] * 10, 8, n_keep_tail=5)]
    assert got == [(5, 5), (5, 5)]
    # equal splits, sequences taking a token each in turn
    ubs = list(split_batch([0, 1, 0, 1, 2], [0, 0, 1, 1, 1], 4))
    assert [(u.n_tokens, u.n_seq_tokens) for u in ubs] == [(4, 2), (1, 1)]
    assert list(ubs[0].pos) == [0, 1, 0, 1]
    # consecutive ids only with a stream per sequence
    ubs = list(split_batch([0, 0, 0], [0, 2, 1], 8, sequential=True))
    assert [list(u.seq_id) for u in ubs] == [[[0], [1]], [[2]]], "2 waits: 0 then 1 are consecutive"
    # by sequence when every token is an output
    ubs = list(split_batch([0, 0, 1, 1], [0, 1, 0, 1], 8, embd_all=True))
    assert [list(u.pos) for u in ubs] == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match="must exceed"):
        list(split_batch([0], [0], 4, n_keep_tail=4))


# --- the state machine ----------------------------------------------------------------------------

hypothesis = need_module("test", "hypothesis")
from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402


class HybridMachine(RuleBasedStateMachine):
    """The C-backed HybridCache and the model receive the same operations; after each step their
    recurrent tables, pending rollbacks, the attention part's sequence ranges and the pair's
    answers must agree."""

    @initialize(n_seq_max=st.integers(1, 4), n_rs_seq=st.sampled_from([0, 1, 3]), kv_size=st.sampled_from([8, 24]))
    def create(self, n_seq_max, n_rs_seq, kv_size):
        self.n_seq_max = n_seq_max
        self.h = kvcache.HybridCache(kv_size, 3, [0, 2], 4, 4, 8, 4, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq,
                                     type_k="f32", type_v="f32", buffers="none")
        self.m = HybridReference(kv_size, 3, [0, 2], n_seq_max=n_seq_max, n_rs_seq=n_rs_seq)

    def seq(self, data):
        return data.draw(st.integers(0, self.n_seq_max - 1))

    @rule(data=st.data())
    def find_slot(self, data):
        seqs = data.draw(st.lists(st.integers(0, self.n_seq_max - 1), min_size=1, max_size=3, unique=True))
        k = data.draw(st.integers(1, 5))
        pos = []
        for s in seqs:
            p = self.m.seq_pos_max(s) + 1 if data.draw(st.booleans()) else data.draw(st.integers(0, 20))
            pos += list(range(p, p + k))
        ub = kvcache.UBatch(pos, seqs, n_seq_tokens=k)
        try:
            got = self.h.find_slot(ub)
        except RuntimeError:
            got = None
        assert got == self.m.find_slot(ub, [[s] for s in seqs], k)
        if got:
            assert self.h.s_copy().tolist() == self.m.recr.s_copy()

    @rule(data=st.data())
    def seq_rm(self, data):
        s = data.draw(st.integers(-1, self.n_seq_max - 1))
        top = max(self.m.seq_pos_max(max(s, 0)), 0)
        p0 = data.draw(st.one_of(st.just(-1), st.integers(0, top + 2), st.integers(max(top - 4, 0), top + 1)))
        p1 = data.draw(st.one_of(st.just(-1), st.integers(0, top + 3)))
        assert self.h.seq_rm(s, p0, p1) == self.m.seq_rm(s, p0, p1)

    @rule(data=st.data())
    def rollback(self, data):
        s = self.seq(data)
        n = data.draw(st.integers(1, 4))
        top = self.m.seq_pos_max(s)
        assert self.h.rollback_ok(s, n) == self.m.recr.rollback_ok(s, n)
        assert self.h.seq_rm(s, top - n + 1, -1) == self.m.seq_rm(s, top - n + 1, -1)

    @rule(data=st.data())
    def seq_cp(self, data):
        a, b = self.seq(data), self.seq(data)
        self.h.seq_cp(a, b)
        self.m.seq_cp(a, b)

    @rule(data=st.data())
    def seq_keep(self, data):
        s = self.seq(data)
        self.h.seq_keep(s)
        self.m.seq_keep(s)

    @rule(data=st.data())
    def seq_add(self, data):
        s, p0, sh = self.seq(data), data.draw(st.integers(0, 10)), data.draw(st.integers(-3, 3))
        self.h.seq_add(s, p0, -1, sh)
        self.m.seq_add(s, p0, -1, sh)
        if self.h.attn.has_shift:
            self.h.update()
            self.m.attn.update()

    @rule(data=st.data())
    def seq_div(self, data):
        s, d = self.seq(data), data.draw(st.integers(1, 3))
        self.h.seq_div(s, 0, -1, d)
        self.m.seq_div(s, 0, -1, d)
        if self.h.attn.has_shift:
            self.h.update()
            self.m.attn.update()

    @rule()
    def clear(self):
        self.h.clear()
        self.m.clear()

    @invariant()
    def same(self):
        if not hasattr(self, "h"):
            return
        c = self.h.recr.cells()
        t = self.m.recr.table()
        assert c["pos"].tolist() == t["pos"] and c["src"].tolist() == t["src"] and c["tail"].tolist() == t["tail"]
        assert c["seq_id"] == t["seq_id"]
        r = self.h.recr
        # used is the reference's counter, unsigned (seq_cp through a stale record can take it below 0)
        assert (r.head, r.n, r.used, r.rs_z) == (t["head"], t["n"], t["used"] % 2**32, t["rs_z"])
        assert [r.pending_rollback(s) for s in range(self.n_seq_max)] == t["pending"]
        for s in range(self.n_seq_max):
            assert (self.h.attn.seq_pos_min(s), self.h.attn.seq_pos_max(s)) == \
                (self.m.attn.seq_pos_min(s), self.m.attn.seq_pos_max(s))
            assert (self.h.seq_pos_min(s), self.h.seq_pos_max(s)) == (self.m.seq_pos_min(s), self.m.seq_pos_max(s))
        assert self.h.attn.used_per_stream == self.m.attn.used_per_stream


HybridMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_hybrid_against_the_model = HybridMachine.TestCase
