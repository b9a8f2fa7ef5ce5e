"""Property test: the C-backed UnifiedCache against the pure-Python reference model.

A hypothesis state machine applies the same random operations to both — slot searches,
commits and restores, every sequence operation, K-shifts, defrags, masks — on small caches,
through the trace-op table (conformance.ops: the ops of the unified golden traces,
with the model's results as the expectation), and after every step compares everything the
cell table shows: positions, sequence sets, shifts of non-empty cells, head, n, used,
has_shift and the per-sequence position range. The golden traces pin the model itself
(tests/test_golden.py).

Set ``KVCACHE_STATEFUL_TARGET=reference`` to drive the model against a second model (a
check of the machine itself, used before the C-backed cache exists)."""
import dataclasses
import os

import numpy as np
import pytest

from conftest import need_module

hypothesis = need_module("test", "hypothesis")
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

import kvcache  # noqa: E402
from conformance import unified  # noqa: E402
from conformance.ops import apply_op, start  # noqa: E402
from reference import UnifiedReference  # noqa: E402
from stateful_rules import SequenceRules  # noqa: E402

TARGET = os.environ.get("KVCACHE_STATEFUL_TARGET", "c")
HAVE_TARGET = TARGET == "reference" or hasattr(kvcache, "UnifiedCache")

P_MAX = 48          # positions are drawn from [0, P_MAX]: small, so sequences collide and shift
N_EMBD = 4


@st.composite
def configs(draw):
    kv_size = draw(st.sampled_from([32, 64]))
    n_pad = draw(st.sampled_from([p for p in (8, 16, 32, 64) if kv_size % p == 0]))
    swa_type = draw(st.sampled_from(["none", "standard", "chunked"]))
    n_swa = 0 if swa_type == "none" else draw(st.integers(1, 16))
    # mostly a few sequences; sometimes more than 64, so that cells hold sets of several words
    n_seq_max = draw(st.one_of(st.integers(1, 4), st.integers(1, 4), st.sampled_from([65, 130, 256])))
    return dict(kv_size=kv_size, n_seq_max=n_seq_max, n_pad=n_pad,
                n_swa=n_swa, swa_type=swa_type, n_layer=draw(st.integers(1, 3)))


def trace_config(cfg, use_alibi, n_buckets):
    """The trace header config of the caches of cfg: every layer N_EMBD wide, f32 rows."""
    n_layer = cfg["n_layer"]
    return dict(cfg, n_embd_k_gqa=[N_EMBD] * n_layer, n_embd_v_gqa=[N_EMBD] * n_layer, layers=list(range(n_layer)),
                type_k="f32", type_v="f32", v_trans=False, use_alibi=use_alibi, n_rel_attn_bkts=n_buckets)


def make_target():
    return unified.reference_target() if TARGET == "reference" else unified.kvcache_target()


def as_list(a):
    return np.asarray(a).tolist()


def ubatch_args(pos, seq_id, n_seq_tokens=1):
    """The arguments of an op on a ubatch (groups of n_seq_tokens tokens)."""
    return {"pos": pos, "seq_id": seq_id, "n_seq_tokens": n_seq_tokens}


class UnifiedCacheMachine(SequenceRules, RuleBasedStateMachine):
    """Both caches receive every operation (the model's results are what the target's must
    be); the invariant compares them after each step."""

    make_target = staticmethod(make_target)

    @initialize(cfg=configs(), data=st.data())
    def create(self, cfg, data):
        self.cfg = cfg
        # the model's hparams: ALiBi masks or not, the T5 bucket count
        config = trace_config(cfg, data.draw(st.booleans(), label="alibi"),
                              data.draw(st.sampled_from([2, 8, 32, 64]), label="n_buckets"))
        self.replays = (start(unified.reference_target(), config), start(self.make_target(), config))
        self.ref, self.sut = (r.cache for r in self.replays)
        self.n_seq_max = n = cfg["n_seq_max"]
        # the ids in play: all of a few, or a handful from every word of a wide set
        self.ids = list(range(n)) if n <= 4 else sorted({0, 1, 63, 64, n // 2 + 3, n - 2, n - 1})
        # most runs start from a busy cache: a few prompts, then interleaved decoding
        prompts = st.tuples(st.sampled_from(self.ids), st.integers(1, 12))
        for s, n in data.draw(st.lists(prompts, max_size=8), label="prefill"):
            p = self.ref.seq_pos_max(s) + 1
            self.place(list(range(p, p + n)), [[s]] * n)
            self.both("commit")

    # --- strategies that depend on the configuration ----------------------------------------

    def prange(self, data):
        """A position range: anywhere, or a short one starting at a position in use (which
        punches holes into sequences)."""
        used = sorted({p for p in self.ref.pos if p >= 0})
        if used and data.draw(st.booleans(), label="at a used position"):
            p0 = data.draw(st.sampled_from(used), label="p0")
            return p0, p0 + data.draw(st.integers(1, 4), label="len")
        p0 = data.draw(st.integers(-1, P_MAX), label="p0")
        p1 = data.draw(st.integers(-1, P_MAX + 1), label="p1")
        return p0, p1

    def ubatch(self, data, max_tokens=8):
        n_seq_tokens = data.draw(st.sampled_from([1, 1, 1, 2, 3]), label="n_seq_tokens")
        n_groups = data.draw(st.integers(1, max(1, max_tokens // n_seq_tokens)), label="n_groups")
        ids = st.lists(st.sampled_from(self.ids), min_size=1, max_size=3)
        seq_id = data.draw(st.lists(ids, min_size=n_groups, max_size=n_groups), label="seq_id")
        n_tokens = n_groups * n_seq_tokens
        if data.draw(st.booleans(), label="consecutive"):
            p = data.draw(st.integers(0, P_MAX), label="start")
            pos = list(range(p, p + n_tokens))
        else:
            pos = data.draw(st.lists(st.integers(0, P_MAX), min_size=n_tokens, max_size=n_tokens), label="pos")
        return pos, seq_id, n_seq_tokens

    def place(self, pos, seq_id, nst=1):
        """find_slot in both caches (K/V rows filled where they hold data): whether it fit."""
        if self.ref.has_shift:
            self.both("k_shift")  # C2: a pending shift is applied before a ubatch is placed
        return self.both("find_slot", **ubatch_args(pos, seq_id, nst))["ok"]

    # --- rules -------------------------------------------------------------------------------

    @rule(data=st.data(), commit=st.sampled_from([True, True, True, False]))
    def find_slot(self, data, commit):
        self.place(*self.ubatch(data))
        if commit:  # mostly, so that the cache fills up; the rest is left for restore()
            self.both("commit")

    @rule(data=st.data())
    def find_slot_large(self, data):
        """A ubatch that often does not fit: the failed search still moves head."""
        n_tokens = data.draw(st.integers(self.cfg["kv_size"] // 4, self.cfg["kv_size"] + 1), label="n_tokens")
        s = self.seq(data)
        self.place(list(range(n_tokens)), [[s]] * n_tokens)

    @rule(data=st.data())
    def decode_round(self, data):
        """One decoding step of several sequences, token by token (as a server interleaves
        them): leaves each sequence's cells scattered, so removals make holes to defrag."""
        seqs = data.draw(st.lists(st.sampled_from(self.ids), min_size=1, max_size=4), label="seqs")
        rounds = data.draw(st.integers(1, 4), label="rounds")
        for s in seqs * rounds:
            self.place([self.ref.seq_pos_max(s) + 1], [[s]])
            self.both("commit")

    @rule()
    def commit(self):
        self.both("commit")

    @rule(data=st.data())
    def drop_sequence(self, data):
        """A finished request: its sequence leaves every cell."""
        self.both("seq_rm", seq_id=self.seq(data), p0=-1, p1=-1)

    @precondition(lambda self: self.ref.used >= self.ref.size // 2)  # keep caches busy
    @rule()
    def clear(self):
        self.both("clear")

    @rule()
    def k_shift(self):
        self.both("k_shift")

    def plan_defrag(self, data):
        # budgets of 0..4 moves (n_max_nodes = 2L + 6L*m + r), below 2L (wraps around to
        # unlimited), and large
        n_layer = self.cfg["n_layer"]
        m = data.draw(st.integers(0, 4), label="max_moves")
        n_max_nodes = data.draw(st.one_of(
            st.integers(0, 6 * n_layer - 1).map(lambda r: 2 * n_layer + 6 * n_layer * m + r),
            st.integers(-4, 2 * n_layer - 1),
            st.sampled_from([8192, 2**31 - 1])), label="n_max_nodes")
        self.both("defrag", n_max_nodes=n_max_nodes)   # the plan, then the moves update() makes

    @rule(data=st.data())
    def defrag(self, data):
        self.plan_defrag(data)

    @precondition(lambda self: self.ref.used > 0)
    @rule(data=st.data())
    def punch_holes_and_defrag(self, data):
        """Scattered removals, then a defrag plan: many holes, sources far apart, so move
        budgets matter."""
        occupied = [(p, seqs[0]) for _, p, seqs, _ in self.ref.cells().nonempty()]
        for p, s in data.draw(st.lists(st.sampled_from(occupied), min_size=1, max_size=8, unique=True),
                              label="holes"):
            self.both("seq_rm", seq_id=s, p0=p, p1=p + 1)
        self.plan_defrag(data)

    @rule(thold=st.sampled_from([-1.0, 0.0, 0.1, 0.5]))
    def defrag_sched(self, thold):
        self.both("defrag_sched", thold=thold)

    @rule(data=st.data(), causal=st.booleans())
    def kq_mask(self, data, causal):
        # bit for bit (the hash of the float32 values): -inf, and +0.0 vs -0.0
        self.both("mask", **ubatch_args(*self.ubatch(data)), causal=causal)

    @rule(data=st.data())
    def pos_bucket(self, data):
        self.both("pos_bucket", **ubatch_args(*self.ubatch(data)))

    @rule(data=st.data())
    def rejected_call(self, data):
        """C5: a call with an out-of-range sequence id raises ValueError and changes nothing
        (what a check shows of each cache; the invariant then compares both caches)."""
        bad = data.draw(st.sampled_from([self.n_seq_max, kvcache.MAX_SEQ, 1000, -7]), label="bad")
        op = data.draw(st.sampled_from([
            {"op": "seq_rm", "seq_id": bad, "p0": -1, "p1": -1},
            {"op": "seq_cp", "src": 0, "dst": bad, "p0": -1, "p1": -1},
            {"op": "seq_keep", "seq_id": bad},
            {"op": "seq_add", "seq_id": bad, "p0": -1, "p1": -1, "shift": 1},
            {"op": "seq_div", "seq_id": bad, "p0": -1, "p1": -1, "d": 2},
            {"op": "find_slot", **ubatch_args([0, 1], [[0], [bad]])},
            {"op": "mask", **ubatch_args([0, 1], [[0], [0, bad]]), "causal": True}]), label="op")
        for replay in self.replays:
            with pytest.raises(ValueError):
                apply_op(replay, 0, {**op, "expect": {"exception": "invalid_argument"}})

    # --- the comparison -------------------------------------------------------------------------

    @invariant()
    def same_state(self):
        if not hasattr(self, "ref"):
            return
        r, t = self.ref, self.sut
        assert (r.head, r.n, r.used) == (t.head, t.n, t.used), \
            f"head/n/used: model {(r.head, r.n, r.used)}, target {(t.head, t.n, t.used)}"
        assert r.has_shift == bool(t.has_shift), "has_shift"
        rc, tc = r.cells(), t.cells()
        assert rc.nonempty() == tc.nonempty(), "cells"
        assert as_list(rc.pos) == as_list(tc.pos), "pos"
        assert as_list(rc.seq_mask) == as_list(tc.seq_mask), "seq_mask"
        for s in self.ids:
            assert (r.seq_pos_min(s), r.seq_pos_max(s)) == (t.seq_pos_min(s), t.seq_pos_max(s)), f"seq_pos {s}"

    @invariant()
    def model_is_consistent(self):
        if not hasattr(self, "ref"):
            return
        r = self.ref
        assert 0 <= r.head <= r.size  # a failed search can leave head at size
        assert r.n == 0 or (r.n % r.n_pad == 0 and r.n <= r.size)
        for i in range(r.size):
            assert (r.pos[i] == -1) == (not r.seq[i]), f"cell {i}: empty position iff no sequence"
            assert r.pos[i] >= -1
        if not r.has_shift:
            assert not any(r.k_shift()), "a shift without has_shift"


UnifiedCacheMachine.TestCase.settings = hypothesis.settings(
    hypothesis.settings.default, stateful_step_count=60)
TestUnifiedCache = pytest.mark.skipif(
    not HAVE_TARGET, reason="kvcache.UnifiedCache is not available in this build")(UnifiedCacheMachine.TestCase)


class _StickyHeadReference(UnifiedReference):
    """A model whose seq_add forgets to restart the search at 0 (a plausible slip)."""

    def seq_add(self, seq_id, p0, p1, shift):
        head = self.head
        super().seq_add(seq_id, p0, p1, shift)
        if self.head == 0:
            self.head = head


def test_machine_detects_a_divergent_target():
    """The comparison must be able to fail: a target with a wrong head rule is caught."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    class Broken(UnifiedCacheMachine):
        make_target = staticmethod(lambda: dataclasses.replace(
            unified.reference_target(),
            make_cache=lambda config: _StickyHeadReference(**unified.reference_arguments(config))))

    with pytest.raises(AssertionError, match="head/n/used"):
        run_state_machine_as_test(Broken, settings=settings(
            max_examples=200, stateful_step_count=40, deadline=None, phases=[Phase.generate],
            suppress_health_check=list(HealthCheck), database=None))


