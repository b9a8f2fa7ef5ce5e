"""Property test: the C-backed ISWACache against a model made of two pure-Python unified caches.

The model is a base UnifiedReference (kv_size cells, no SWA) and an SWA UnifiedReference
(min(kv_size, pad(n_swa * n_seq_max + n_batch, n_pad)) cells), driven as llama.cpp's iSWA
cache drives its two caches: find_slot in both (the answer is the AND), per-sequence pruning
ranges recorded by sbatch_init, commit then prune of the SWA cache, restore, sequence
operations in both, seq_pos_min/max from the SWA cache. The operations of the iswa golden
traces are applied to both through the trace-op table (conformance.ops, the model's
results as the expectation); after every step both sub-caches' cell tables, head, n, used and
every sequence's position range are compared."""
import warnings

import numpy as np
import pytest

from conftest import need_module

hypothesis = need_module("test", "hypothesis")
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

import kvcache  # noqa: E402
from conformance import Target, iswa  # noqa: E402
from conformance.ops import start  # noqa: E402
from reference import RefUBatch, UnifiedReference  # noqa: E402
from stateful_rules import SequenceRules  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(kvcache, "ISWACache"), reason="kvcache.ISWACache is not available")

P_MAX = 40
N_EMBD = 4


def _pad(x, n):
    return (x + n - 1) // n * n


class ISWAModel:
    """Two unified reference caches and the pending pruning ranges, fanned out like the
    iSWA cache of llama.cpp."""

    def __init__(self, kv_size, n_swa, swa_type, n_batch, swa_full, n_seq_max, n_pad):
        size_swa = kv_size if swa_full else min(kv_size, _pad(n_swa * n_seq_max + n_batch, n_pad))
        self.base = UnifiedReference(kv_size, n_seq_max=n_seq_max, n_pad=n_pad)
        self.swa = UnifiedReference(size_swa, n_seq_max=n_seq_max, n_pad=n_pad, n_swa=n_swa, swa_type=swa_type)
        self.do_prune = not swa_full
        self.pending = {}      # seq_id -> [pmin, pmax]

    @property
    def has_shift(self):
        return self.base.has_shift or self.swa.has_shift

    def sbatch_init(self, pos, seq_ids):
        """Record the batch's ranges; the pending ranges as the cache lists them."""
        self.pending = {}
        if self.do_prune:
            for p, ids in zip(pos, seq_ids):
                for s in ids:
                    lo_hi = self.pending.setdefault(s, [p, p])
                    lo_hi[0] = min(lo_hi[0], p)
                    lo_hi[1] = max(lo_hi[1], p)
        return [[s, lo, hi] for s, (lo, hi) in sorted(self.pending.items())]

    def find_slot_each(self, ub):
        return self.each("find_slot", ub)

    def prune_swa(self, s, pmin, pmax):
        """Drop s from the SWA cells no position up to pmax can see; True when fewer than
        min(n_swa, pmin) of its cells were visible from pmin (a partial window)."""
        c = self.swa
        n_attended = 0
        for i in range(c.size):
            if s not in c.seq[i]:
                continue
            p0 = c.pos[i]
            if p0 <= pmin and not c.is_masked_swa(p0, pmin):
                n_attended += 1
            if c.is_masked_swa(p0, pmax):
                c._cell_seq_rm(i, s)
        return n_attended < min(c.n_swa, pmin)

    def commit(self):
        self.base.commit()
        self.swa.commit()
        partial = []
        if self.do_prune:
            for s in sorted(self.pending):
                if self.prune_swa(s, *self.pending[s]):
                    partial.append(s)
        self.pending = {}
        return partial

    def each(self, method, *args):
        a = getattr(self.base, method)(*args)
        b = getattr(self.swa, method)(*args)
        return a, b

    # the cache's methods that both sub-caches take alike
    def restore(self):
        self.each("restore")

    def clear(self):
        self.each("clear")

    def set_full(self):
        self.each("set_full")

    def seq_rm(self, seq_id, p0, p1):
        a, b = self.each("seq_rm", seq_id, p0, p1)
        return a and b

    def seq_cp(self, src, dst, p0, p1):
        self.each("seq_cp", src, dst, p0, p1)

    def seq_keep(self, seq_id):
        self.each("seq_keep", seq_id)

    def seq_add(self, seq_id, p0, p1, shift):
        self.each("seq_add", seq_id, p0, p1, shift)

    def seq_div(self, seq_id, p0, p1, d):
        self.each("seq_div", seq_id, p0, p1, d)

    def k_shift(self):
        return self.each("k_shift")

    def reset_shift(self):
        self.each("reset_shift")


@st.composite
def configs(draw):
    kv_size = draw(st.sampled_from([32, 64]))
    return dict(kv_size=kv_size, n_pad=draw(st.sampled_from([8, 16, 32])), n_swa=draw(st.integers(4, 8)),
                swa_type=draw(st.sampled_from(["standard", "chunked"])), n_batch=draw(st.integers(1, 16)),
                swa_full=draw(st.sampled_from([False, False, False, True])), n_seq_max=draw(st.integers(1, 3)))


def as_list(a):
    return np.asarray(a).tolist()


_MODEL_ARGS = ("kv_size", "n_swa", "swa_type", "n_batch", "swa_full", "n_seq_max", "n_pad")


class ISWACacheMachine(SequenceRules, RuleBasedStateMachine):
    """Model and cache receive every operation; the invariant compares them after each step."""

    model = ISWAModel
    p_max = P_MAX

    @initialize(cfg=configs())
    def create(self, cfg):
        self.cfg = cfg
        self.n_seq_max = cfg["n_seq_max"]
        config = dict(cfg, n_layer=2, n_embd_k_gqa=[N_EMBD] * 2, n_embd_v_gqa=[N_EMBD] * 2, swa_layers=[1],
                      type_k="f32", type_v="f32", v_trans=False)
        target = Target("iSWA model", lambda config: self.model(**{k: config[k] for k in _MODEL_ARGS}), RefUBatch,
                        family=iswa.FAMILY, data=False)
        model = start(target, config)
        # the cache is checked against the sub-cache sizes of the model
        config = dict(config, size_base=model.cache.base.size, size_swa=model.cache.swa.size)
        self.replays = (model, start(iswa.kvcache_target(), config))
        self.ref, self.sut = (r.cache for r in self.replays)

    # --- helpers -----------------------------------------------------------------------------

    def shift_if_pending(self):
        """C2: a pending K-shift is applied and reset before a ubatch is placed."""
        if self.ref.has_shift:
            self.both("k_shift")

    def place(self, pos, seq_id, nst):
        self.shift_if_pending()
        return self.both("find_slot", pos=pos, seq_id=seq_id, n_seq_tokens=nst)["ok"]

    def commit_both(self):
        """Commit both; the cache warns of as many partial windows as the model finds (the
        table's commit compares the warnings with a trace's log only)."""
        partial = self.ref.commit()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.sut.commit()
        got = [w for w in caught if issubclass(w.category, kvcache.SWAWarning)] \
            if hasattr(kvcache, "SWAWarning") else None
        if got is not None:
            assert len(got) == len(partial), f"partial-window warnings: model {partial}, cache {len(got)}"

    # --- rules -------------------------------------------------------------------------------

    @rule(data=st.data(), commit=st.sampled_from([True, True, True, False]))
    def decode_batch(self, data, commit):
        """A batch of one or more sequences continuing where they stopped: sbatch_init, then
        ubatches of at most n_ubatch tokens in batch order, then commit (or restore)."""
        seqs = data.draw(st.lists(st.integers(0, self.n_seq_max - 1), min_size=1, max_size=3, unique=True),
                         label="seqs")
        pos, ids = [], []
        for s in seqs:
            n = data.draw(st.integers(1, 10), label="n_tokens")
            p = self.ref.base.seq_pos_max(s) + 1
            shared = data.draw(st.lists(st.integers(0, self.n_seq_max - 1), max_size=1), label="also")
            pos += list(range(p, p + n))
            ids += [sorted({s, *shared})] * n
        self.both("sbatch_init", pos=pos, seq_id=ids)
        n_ubatch = data.draw(st.integers(1, 16), label="n_ubatch")
        ok = True
        for i in range(0, len(pos), n_ubatch):
            ok = self.place(pos[i:i + n_ubatch], ids[i:i + n_ubatch], 1)
            if not ok:
                break
        if ok and commit:
            self.commit_both()
        else:
            self.both("restore")

    @rule(data=st.data())
    def find_slot(self, data):
        """A free-form ubatch (groups of n_seq_tokens tokens, arbitrary positions)."""
        nst = data.draw(st.sampled_from([1, 1, 2, 3]), label="n_seq_tokens")
        n_groups = data.draw(st.integers(1, max(1, 8 // nst)), label="n_groups")
        idl = st.lists(st.integers(0, self.n_seq_max - 1), min_size=1, max_size=3, unique=True).map(sorted)
        seq_id = data.draw(st.lists(idl, min_size=n_groups, max_size=n_groups), label="seq_id")
        pos = data.draw(st.lists(st.integers(0, P_MAX), min_size=n_groups * nst, max_size=n_groups * nst),
                        label="pos")
        self.place(pos, seq_id, nst)

    @rule(data=st.data())
    def sbatch_init(self, data):
        n = data.draw(st.integers(1, 8), label="n")
        pos = data.draw(st.lists(st.integers(0, P_MAX), min_size=n, max_size=n), label="pos")
        ids = data.draw(st.lists(st.lists(st.integers(0, self.n_seq_max - 1), min_size=1, max_size=2, unique=True),
                                 min_size=n, max_size=n), label="ids")
        self.both("sbatch_init", pos=pos, seq_id=ids)

    @rule()
    def commit(self):
        self.commit_both()

    @precondition(lambda self: hasattr(self, "ref") and self.ref.base.used >= self.ref.base.size // 2)
    @rule()
    def clear(self):
        self.both("clear")

    @rule()
    def k_shift(self):
        self.shift_if_pending()

    # --- the comparison ----------------------------------------------------------------------

    @invariant()
    def same_state(self):
        if not hasattr(self, "ref"):
            return
        for name, r, t in (("base", self.ref.base, self.sut.base), ("swa", self.ref.swa, self.sut.swa)):
            assert (r.head, r.n, r.used) == (t.head, t.n, t.used), \
                f"{name} head/n/used: model {(r.head, r.n, r.used)}, cache {(t.head, t.n, t.used)}"
            assert r.has_shift == bool(t.has_shift), f"{name} has_shift"
            rc, tc = r.cells(), t.cells()
            assert rc.nonempty() == tc.nonempty(), f"{name} cells"
            assert as_list(rc.pos) == as_list(tc.pos), f"{name} pos"
            assert as_list(rc.seq_mask) == as_list(tc.seq_mask), f"{name} seq_mask"
        assert self.ref.has_shift == bool(self.sut.has_shift), "has_shift"
        for s in range(self.n_seq_max):
            want = (self.ref.swa.seq_pos_min(s), self.ref.swa.seq_pos_max(s))
            assert (self.sut.seq_pos_min(s), self.sut.seq_pos_max(s)) == want, f"seq_pos {s}"
            assert (self.sut.base.seq_pos_min(s), self.sut.base.seq_pos_max(s)) == \
                (self.ref.base.seq_pos_min(s), self.ref.base.seq_pos_max(s)), f"base seq_pos {s}"


ISWACacheMachine.TestCase.settings = hypothesis.settings(hypothesis.settings.default, stateful_step_count=60)
TestISWACache = ISWACacheMachine.TestCase


class _NoPruneModel(ISWAModel):
    """A model that forgets to slide the window on commit (a plausible slip)."""

    def prune_swa(self, s, pmin, pmax):
        return False


def test_machine_detects_a_divergent_model():
    """The comparison must be able to fail: a model that never prunes is caught."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    class Broken(ISWACacheMachine):
        model = _NoPruneModel

    with pytest.raises(AssertionError, match="swa"):
        run_state_machine_as_test(Broken, settings=settings(
            max_examples=200, stateful_step_count=30, deadline=None, phases=[Phase.generate],
            suppress_health_check=list(HealthCheck), database=None))
