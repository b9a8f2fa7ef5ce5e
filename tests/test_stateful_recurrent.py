"""Property test: the C-backed RecurrentCache against a pure-Python model of llama.cpp's
recurrent cache.

The model below follows llama.cpp's ``llama_kv_cache_recurrent`` rule by rule: one cell per
state with a position, a copy source and a sequence set, and per sequence id a ``tail`` (the
cell holding its state, stored in the cell of the same index). A hypothesis state machine
applies the same operations to both — equal-split ubatches, commit / restore, every sequence
operation, s_copy / s_mask — through the trace-op table (kvcache.conformance.ops: the ops of
the recurrent golden traces, the model's results as the expectation), and after every step
compares the cell tables, head, n, used and the sequences' position ranges, and checks the
invariants the cell table must keep."""
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

import kvcache  # noqa: E402
from kvcache.conformance import Divergence, Target, recurrent  # noqa: E402
from kvcache.conformance.ops import start  # noqa: E402
from stateful_rules import SequenceRules  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(kvcache, "RecurrentCache"), reason="kvcache.RecurrentCache is not available")

POS_END = 2**31          # the upper bound of an open position range, past every position
P_MAX = 40


def _c_div(a, b):
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


class RecurrentModel:
    """The cell bookkeeping of a recurrent cache of ``size`` cells, in plain Python."""

    def __init__(self, size):
        self.size = size
        self.pos = [-1] * size
        self.src = [-1] * size
        self.tail = [-1] * size
        self.seq = [set() for _ in range(size)]
        self.head = 0
        self.n = 0
        self.used = 0

    def _empty(self, i):
        self.pos[i] = -1
        self.src[i] = -1

    def clear(self):
        for i in range(self.size):
            self.pos[i], self.src[i], self.tail[i] = -1, -1, -1
            self.seq[i] = set()
        self.head = 0
        self.used = 0

    def seq_rm(self, s, p0, p1):
        new_head = self.size
        p0 = max(p0, 0)
        p1 = POS_END if p1 < 0 else p1
        if s >= 0:
            t = self.tail[s]
            if t >= 0:
                cp = self.pos[t]
                if (0 < p0 <= cp) or (0 < p1 <= cp):
                    return False     # a state cannot be cut
                if p0 <= cp < p1:
                    self.tail[s] = -1
        elif p0 != p1 and (p0 != 0 or p1 != POS_END):
            return False
        for i in range(self.size):
            if p0 <= self.pos[i] < p1:
                if s < 0:
                    self.seq[i] = set()
                elif s in self.seq[i]:
                    self.seq[i].discard(s)
                else:
                    continue
                if not self.seq[i]:
                    if self.pos[i] >= 0:
                        self.used -= 1
                    self._empty(i)
                    if new_head == self.size:
                        new_head = i
        if new_head != self.size and new_head < self.head:
            self.head = new_head
        return True

    def _drop_tail(self, s):
        t = self.tail[s]
        if t >= 0:
            self.seq[t].discard(s)
            self.tail[s] = -1
            if not self.seq[t]:
                self._empty(t)
                self.used -= 1

    def seq_cp(self, src, dst, p0, p1):
        if src == dst:
            return
        self._drop_tail(dst)
        if self.tail[src] >= 0:
            self.seq[self.tail[src]].add(dst)
            self.tail[dst] = self.tail[src]

    def seq_keep(self, s):
        new_head = self.size
        for i in range(self.size):
            if i != s:
                self.tail[i] = -1
            if s not in self.seq[i]:
                if self.pos[i] >= 0:
                    self.used -= 1
                self._empty(i)
                self.seq[i] = set()
                if new_head == self.size:
                    new_head = i
            else:
                self.seq[i] = {s}
        if new_head != self.size and new_head < self.head:
            self.head = new_head

    def _seq_pos_op(self, s, p0, p1, f):
        p0 = max(p0, 0)
        p1 = POS_END if p1 < 0 else p1
        if p0 == p1:
            return
        t = self.tail[s]
        if t >= 0 and s in self.seq[t] and p0 <= self.pos[t] < p1:
            self.pos[t] = f(self.pos[t])

    def seq_add(self, s, p0, p1, shift):
        if shift:
            self._seq_pos_op(s, p0, p1, lambda p: p + shift)

    def seq_div(self, s, p0, p1, d):
        if d != 1:
            self._seq_pos_op(s, p0, p1, lambda p: _c_div(p, d))

    def seq_pos_min(self, s):
        ps = [self.pos[i] for i in range(self.size) if s in self.seq[i]]
        return min(ps) if ps else -1

    def seq_pos_max(self, s):
        return max([-1] + [self.pos[i] for i in range(self.size) if s in self.seq[i]])

    def set_full(self):
        self.n = self.size
        self.head = 0

    def commit(self):
        """Nothing to keep: a recurrent cache records no pending ranges."""

    def restore(self):
        """Nothing to undo (as commit)."""

    def _next_empty(self, start):
        c = start
        for _ in range(self.size):
            if c >= self.size:
                c -= self.size
            if not self.seq[c]:
                break
            c += 1
        return c

    def find_slot(self, ub):
        """Place an equal-split ubatch (``seq_id``: the ids of each group of ``n_seq_tokens``
        tokens; the first id's state is the group's)."""
        pos, groups, nst = [int(p) for p in ub.pos], [list(ids) for ids in ub.seq_id], ub.n_seq_tokens
        n_seqs = len(groups)
        if self.head > self.used + 2 * len(pos):
            self.head = 0
        lo, hi = self.size - 1, 0
        for ids in groups:
            for s in ids[1:]:
                self._drop_tail(s)   # a shared state is rebuilt from the first sequence's
        nxt = self._next_empty(self.head)
        for g, ids in enumerate(groups):
            s = ids[0]
            t = self.tail[s]
            has_cell = t >= 0 and len(self.seq[t]) == 1
            if not has_cell:
                assert not self.seq[nxt], "model: no empty cell"
                if t >= 0:
                    self.pos[nxt], self.src[nxt] = self.pos[t], self.src[t]
                    self.seq[t].discard(s)
                    self.seq[nxt].add(s)
                self.tail[s] = nxt
                if g + 1 < n_seqs:
                    nxt = self._next_empty(nxt + 1)
            lo, hi = min(lo, self.tail[s]), max(hi, self.tail[s])
        # gather the states in cells lo .. lo + n_seqs - 1, in group order
        for g, ids in enumerate(groups):
            dst, src = g + lo, self.tail[ids[0]]
            if dst != src:
                self.pos[dst], self.pos[src] = self.pos[src], self.pos[dst]
                self.src[dst], self.src[src] = self.src[src], self.src[dst]
                self.seq[dst], self.seq[src] = self.seq[src], self.seq[dst]
                for x in self.seq[src]:
                    self.tail[x] = src
                for x in self.seq[dst]:
                    self.tail[x] = dst
        for g, ids in enumerate(groups):
            c = g + lo
            self.pos[c] = pos[nst * g + nst - 1]
            self.seq[c] = set(ids)
            for x in ids:
                self.tail[x] = c
        self.head = lo
        self.n = hi - lo + 1
        self.used = sum(1 for ss in self.seq if ss)
        return self.n >= n_seqs

    def s_copy(self):
        out = []
        for i in range(self.n):
            c = i + self.head
            if self.src[c] < 0 or self.src[c] >= self.size:
                self.src[c] = c
            out.append(self.src[c])
            self.src[c] = c
        return out

    def s_mask(self):
        out = []
        for i in range(self.n):
            c = i + self.head
            out.append(1.0 if self.src[c] >= 0 else 0.0)
            if self.src[c] < 0:
                self.src[c] = c
        return out


class RecurrentCacheMachine(SequenceRules, RuleBasedStateMachine):
    """Model and cache receive every operation; the invariants compare them after each step."""

    model = RecurrentModel
    p_max = P_MAX
    seq_rm_any = False    # seq_rm(-1, ...) has the reference's own semantics: seq_rm_all

    # mostly a few sequences; sometimes more than 64 (a cell's set of several words)
    @initialize(n_seq_max=st.one_of(st.integers(1, 6), st.integers(1, 6), st.sampled_from([65, 70, 130])),
                extra=st.integers(0, 10), data=st.data())
    def create(self, n_seq_max, extra, data):
        self.n_seq_max = n_seq_max
        config = {"n_seq_max": n_seq_max, "kv_size": n_seq_max + extra, "n_layer": 1,
                  "n_embd_k_gqa": [2], "n_embd_v_gqa": [2], "type_k": "f32", "type_v": "f32"}
        model = Target("recurrent model", lambda config: self.model(config["kv_size"]), kvcache.UBatch,
                       family=recurrent.FAMILY, data=False)
        # the cell bookkeeping only: a cache without K/V buffers
        cache = Target("kvcache.RecurrentCache(buffers=None)",
                       lambda config: kvcache.RecurrentCache(config["n_seq_max"], 1, 2, 2, kv_size=config["kv_size"],
                                                             buffers=None),
                       kvcache.UBatch, family=recurrent.FAMILY, data=False)
        self.replays = (start(model, config), start(cache, config))
        self.ref, self.sut = (r.cache for r in self.replays)
        assert self.sut.size == self.ref.size
        # most runs start from a busy cache: a few ubatches, some states shared
        for _ in range(data.draw(st.integers(0, 6), label="prefill")):
            self.find_slot(data, data.draw(st.integers(1, 3), label="nst"))
            self.same_state()

    # --- rules -------------------------------------------------------------------------------

    @rule(data=st.data(), nst=st.integers(1, 3))
    def place(self, data, nst):
        self.find_slot(data, nst)

    @rule(data=st.data())
    def decode_step(self, data):
        """One token for one or more sequences, each continuing its own state."""
        self.find_slot(data, 1)

    def find_slot(self, data, nst):
        """An equal-split ubatch: groups of nst tokens, each sequence in at most one group."""
        order = data.draw(st.permutations(range(self.n_seq_max)), label="order")
        n_groups = data.draw(st.integers(1, self.n_seq_max), label="n_groups")
        cuts = sorted(data.draw(st.lists(st.integers(1, self.n_seq_max - 1), unique=True,
                                         max_size=self.n_seq_max - 1), label="cuts")) if self.n_seq_max > 1 else []
        parts = [list(order[a:b]) for a, b in zip([0] + cuts, cuts + [self.n_seq_max])][:n_groups]
        # the first id of a group is its state; the others share it
        groups = [[p[0]] + sorted(p[1:]) for p in parts]
        pos = []
        for ids in groups:
            if data.draw(st.booleans(), label="continues"):
                p = self.ref.seq_pos_max(ids[0]) + 1
            else:
                p = data.draw(st.integers(0, P_MAX), label="start")
            pos += list(range(p, p + nst))
        # a state that does not continue warns; the op ignores that
        self.both("find_slot", pos=pos, seq_id=groups, n_seq_tokens=nst, n_seqs=len(groups))

    @rule()
    def commit(self):
        self.both("commit")

    @rule(data=st.data())
    def drop_sequence(self, data):
        """A finished request: its whole state goes (a partial range is mostly refused)."""
        s = self.seq(data)
        p0 = data.draw(st.sampled_from([-1, 0]), label="p0")
        self.both("seq_rm", seq_id=s, p0=p0, p1=-1)

    @rule(data=st.data())
    def seq_rm_all(self, data):
        """seq_rm(-1, ...) keeps the tails (as the reference does): it is followed by clear()."""
        p0, p1 = data.draw(st.sampled_from([(-1, -1), (0, -1), (5, 5), (0, 7), (3, -1)]), label="range")
        ok = self.both("seq_rm", seq_id=-1, p0=p0, p1=p1)["ret"]
        self.same_state()
        if ok:
            self.both("clear")

    @rule(data=st.data())
    def fan_out(self, data):
        """Every sequence takes one state (parallel sampling from a prompt): the freed cells do
        not move head, so the next search starts far from the used cells."""
        src = self.seq(data)
        for dst in range(self.n_seq_max):
            self.both("seq_cp", src=src, dst=dst, p0=-1, p1=-1)

    @rule()
    def clear(self):
        self.both("clear")

    @rule()
    def s_copy(self):
        assert all(0 <= x < self.ref.size for x in self.both("s_copy")["values"])

    @rule()
    def s_mask(self):
        self.both("s_mask")

    # --- the comparison ----------------------------------------------------------------------

    @invariant()
    def same_state(self):
        if not hasattr(self, "ref"):
            return
        r, t = self.ref, self.sut
        assert (r.head, r.n, r.used) == (t.head, t.n, t.used), \
            f"head/n/used: model {(r.head, r.n, r.used)}, cache {(t.head, t.n, t.used)}"
        cells = t.cells()
        assert cells["pos"].tolist() == r.pos, "pos"
        assert cells["src"].tolist() == r.src, "src"
        assert cells["tail"].tolist() == r.tail, "tail"
        assert cells["seq_id"] == [sorted(ss) for ss in r.seq], "seq_id"
        for s in range(self.n_seq_max):
            assert (t.seq_pos_min(s), t.seq_pos_max(s)) == (r.seq_pos_min(s), r.seq_pos_max(s)), f"seq_pos {s}"

    @invariant()
    def cells_are_consistent(self):
        """What the cell table must keep whatever the operations (checked on the cache)."""
        if not hasattr(self, "sut"):
            return
        t = self.sut
        cells = t.cells()
        seqs, tail = cells["seq_id"], cells["tail"].tolist()
        for s in range(self.n_seq_max):
            holders = [i for i in range(t.size) if s in seqs[i]]
            assert len(holders) <= 1, f"sequence {s} in cells {holders}"
            assert tail[s] == (holders[0] if holders else -1), f"tail of sequence {s}"
            ps = [int(cells["pos"][i]) for i in holders]
            # the largest position starts from -1, as in the reference: a state shifted below 0
            # reports -1
            assert (t.seq_pos_min(s), t.seq_pos_max(s)) == ((min(ps), max(-1, *ps)) if ps else (-1, -1))
        assert all(x == -1 for x in tail[self.n_seq_max:]), "tails past n_seq_max"
        assert t.used == sum(1 for ss in seqs if ss), "used"
        assert 0 <= t.head and t.head + t.n <= t.size


RecurrentCacheMachine.TestCase.settings = hypothesis.settings(hypothesis.settings.default, stateful_step_count=60)
TestRecurrentCache = RecurrentCacheMachine.TestCase


class _StaleUsedModel(RecurrentModel):
    """A model that forgets to count a cell freed when a sequence leaves a state (a plausible slip)."""

    def _drop_tail(self, s):
        used = self.used
        super()._drop_tail(s)
        self.used = used


def test_machine_detects_a_divergent_model():
    """The comparison must be able to fail: a model with a wrong used count is caught."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    class Broken(RecurrentCacheMachine):
        model = _StaleUsedModel

    # caught by the invariant, or by an op that shows the count (find_slot)
    with pytest.raises((AssertionError, Divergence), match="used"):
        run_state_machine_as_test(Broken, settings=settings(
            max_examples=200, stateful_step_count=30, deadline=None, phases=[Phase.generate],
            suppress_health_check=list(HealthCheck), database=None))
