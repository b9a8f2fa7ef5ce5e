"""Property test: the C-backed RecurrentCache against a pure-Python model of llama.cpp's
recurrent cache.

The model below follows llama.cpp's ``llama_kv_cache_recurrent`` rule by rule: one cell per
state with a position, a copy source and a sequence set, and per sequence id a ``tail`` (the
cell holding its state, stored in the cell of the same index). A hypothesis state machine
applies the same operations to both — equal-split ubatches, commit / restore, every sequence
operation, s_copy / s_mask — through the trace-op table (conformance.ops: the ops of
the recurrent golden traces, the model's results as the expectation), and after every step
compares the cell tables, head, n, used and the sequences' position ranges, and checks the
invariants the cell table must keep.

The reference's find_slot can lose a state and leave a record pointing at a cell that does not
hold its sequence. Its gather step swaps cells and moves only the records of the sequences in
the two cells. A group's first sequence given an empty cell in the same call is in none, so its
record keeps that index after an earlier group's state has been swapped there, and gathering it
swaps that state away again; the groups are then written over whatever states their cells hold.
The sequences of a state that lands under another group are dropped from it, and their records
keep that cell's index. The cache reproduces this and the model models it: a later find_slot
with such a sequence first in its group is where the reference stops on an assertion (the cache
raises RuntimeError and changes nothing), and seq_cp through such a record can leave ``used``
off until the next find_slot counts the cells again."""
import copy

import pytest

from conftest import need_module

hypothesis = need_module("test", "hypothesis")
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

import kvcache  # noqa: E402
from conformance import Divergence, Target, recurrent  # noqa: E402
from conformance.ops import start  # noqa: E402
from stateful_rules import SequenceRules  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(kvcache, "RecurrentCache"), reason="kvcache.RecurrentCache is not available")

POS_END = 2**31          # the upper bound of an open position range, past every position
P_MAX = 40
U32 = 2**32     # the reference counts used cells in a uint32_t, which wraps


class StaleRecord(Exception):
    """Where the reference stops on an assertion: a group's first sequence has a record
    pointing at a cell that does not hold it."""


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
        # set when the reference's used stops being the number of used cells: seq_cp through
        # a stale record whose cell is empty (lowered for dst's cell, or dst added to src's),
        # or seq_keep emptying a cell whose state was shifted below position 0 (kept);
        # find_slot and clear count again
        self.miscounted = False

    def _empty(self, i):
        self.pos[i] = -1
        self.src[i] = -1

    def clear(self):
        for i in range(self.size):
            self.pos[i], self.src[i], self.tail[i] = -1, -1, -1
            self.seq[i] = set()
        self.head = 0
        self.used = 0
        self.miscounted = False

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
                        self.used = (self.used - 1) % U32
                    self._empty(i)
                    if new_head == self.size:
                        new_head = i
        if new_head != self.size and new_head < self.head:
            self.head = new_head
        return True

    def _drop_tail(self, s):
        t = self.tail[s]
        if t >= 0:
            if s not in self.seq[t] and not self.seq[t]:
                self.miscounted = True     # a stale record: its cell was not in use
            self.seq[t].discard(s)
            self.tail[s] = -1
            if not self.seq[t]:
                self._empty(t)
                self.used = (self.used - 1) % U32

    def seq_cp(self, src, dst, p0, p1):
        if src == dst:
            return
        self._drop_tail(dst)
        if self.tail[src] >= 0:
            if not self.seq[self.tail[src]]:
                self.miscounted = True     # a stale record: dst joins a cell not counted as used
            self.seq[self.tail[src]].add(dst)
            self.tail[dst] = self.tail[src]

    def seq_keep(self, s):
        new_head = self.size
        for i in range(self.size):
            if i != s:
                self.tail[i] = -1
            if s not in self.seq[i]:
                if (self.pos[i] >= 0) != bool(self.seq[i]):
                    self.miscounted = True
                if self.pos[i] >= 0:
                    self.used = (self.used - 1) % U32
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
        tokens; the first id's state is the group's), or raise StaleRecord with nothing changed
        (the cache works on a copy)."""
        pos, groups, nst = [int(p) for p in ub.pos], [list(ids) for ids in ub.seq_id], ub.n_seq_tokens
        before = copy.deepcopy(self.__dict__)
        try:
            return self._find_slot(pos, groups, nst)
        except StaleRecord:
            self.__dict__ = before
            raise

    def _find_slot(self, pos, groups, nst):
        n_seqs = len(groups)
        if self.head > (self.used + 2 * len(pos)) % U32:
            self.head = 0
        lo, hi = self.size - 1, 0
        for ids in groups:
            for s in ids[1:]:
                self._drop_tail(s)   # a shared state is rebuilt from the first sequence's
        nxt = self._next_empty(self.head)
        for g, ids in enumerate(groups):
            s = ids[0]
            t = self.tail[s]
            if t >= 0 and s not in self.seq[t]:
                raise StaleRecord(s, t)
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
        # gather the states in cells lo .. lo + n_seqs - 1, in group order; only the records of
        # the sequences in the two cells follow a swap (a sequence given an empty cell above is
        # in none and keeps the old index: see the module docstring)
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
        self.miscounted = False
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
        self.start(n_seq_max, n_seq_max + extra)
        # most runs start from a busy cache: a few ubatches, some states shared
        for _ in range(data.draw(st.integers(0, 6), label="prefill")):
            self.find_slot(data, data.draw(st.integers(1, 3), label="nst"))
            self.same_state()

    def start(self, n_seq_max, kv_size):
        """A new model and cache of kv_size cells."""
        self.n_seq_max = n_seq_max
        config = {"n_seq_max": n_seq_max, "kv_size": kv_size, "n_layer": 1,
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
        self.place_groups(pos, groups, nst)

    def place_groups(self, pos, groups, nst):
        """find_slot on both: the cache's warnings (states that do not continue, which the op
        ignores), or None when the model refuses the ubatch and the cache refuses it too."""
        try:
            self.both("find_slot", pos=pos, seq_id=groups, n_seq_tokens=nst, n_seqs=len(groups))
        except StaleRecord as e:
            refused = f"sequence {e.args[0]} points at cell {e.args[1]}, which does not hold it"
            with pytest.raises(RuntimeError, match=refused):
                self.sut.find_slot(kvcache.UBatch(pos, groups, n_seq_tokens=nst))
            return None
        return self.sut.warnings

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
        """seq_rm(-1, ...) keeps the records (as the reference does): a server follows it with
        clear(); without one, a find_slot with such a sequence first in a group is refused."""
        p0, p1 = data.draw(st.sampled_from([(-1, -1), (0, -1), (5, 5), (0, 7), (3, -1)]), label="range")
        ok = self.both("seq_rm", seq_id=-1, p0=p0, p1=p1)["ret"]
        self.same_state()
        if ok and data.draw(st.booleans(), label="then_clear"):
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
            if holders:
                assert tail[s] == holders[0], f"tail of sequence {s}"
            else:
                # none, or a stale record as the reference leaves it (see the module docstring)
                assert -1 <= tail[s] < t.size, f"tail of sequence {s}"
            ps = [int(cells["pos"][i]) for i in holders]
            # the largest position starts from -1, as in the reference: a state shifted below 0
            # reports -1
            assert (t.seq_pos_min(s), t.seq_pos_max(s)) == ((min(ps), max(-1, *ps)) if ps else (-1, -1))
        assert all(x == -1 for x in tail[self.n_seq_max:]), "tails past n_seq_max"
        if not self.ref.miscounted:
            assert t.used == sum(1 for ss in seqs if ss), "used"
        assert 0 <= t.head and t.head + t.n <= t.size


RecurrentCacheMachine.TestCase.settings = hypothesis.settings(hypothesis.settings.default, stateful_step_count=60)
TestRecurrentCache = RecurrentCacheMachine.TestCase


# --- fixed sequences (hypothesis has no @example for state machines) ----------------------------
# The expected tables are what the reference's code does for these calls, traced step by step.


def _machine(n_seq_max, size):
    m = RecurrentCacheMachine()
    m.start(n_seq_max, size)
    return m


def _op(m, name, **args):
    """One op on model and cache (their fields must agree), then every check of the machine."""
    got = m.both(name, **args)
    _check(m)
    return got


def _place(m, pos, groups):
    found = m.place_groups(pos, groups, 1)
    _check(m)
    return found


def _check(m):
    m.same_state()
    m.cells_are_consistent()


def _table(c):
    cells = c.cells()
    return (c.head, c.n, c.used, cells["pos"].tolist(), cells["src"].tolist(), cells["tail"].tolist(),
            cells["seq_id"])


def _warned(*seqs):
    """The reference's warnings for states at position 0 given one more token at position 0."""
    return [f"find_slot: non-consecutive token position 0 after 0 for sequence {s} with 1 new tokens"
            for s in seqs]


def test_gathering_overwrites_a_state_and_leaves_its_record():
    """Seq 2 joins seq 0 (its cell 0 empties) and seq 1 (new) is given cell 0. Gathering swaps
    seq 0's state from cell 2 into cell 0, then swaps cell 1 (seq 3's) with cell 0, where seq 1's
    record still points: seqs 0 and 2 are written over seq 3's state, seq 1 over seq 0's, and
    seq 3 is in no cell while its record says 0."""
    m = _machine(6, 6)
    every = [[0, 1, 2, 3, 4, 5]]
    _place(m, [0], every)
    _op(m, "seq_rm", seq_id=-1, p0=-1, p1=-1)
    _op(m, "clear")
    _place(m, [0], every)
    _place(m, [0], every)
    _op(m, "seq_rm", seq_id=-1, p0=-1, p1=-1)
    _op(m, "clear")
    assert _place(m, [0, 0, 0], [[2], [3], [0]]) == []
    assert _table(m.sut) == (0, 3, 3, [0, 0, 0, -1, -1, -1], [-1] * 6, [2, -1, 0, 1, -1, -1],
                             [[2], [3], [0], [], [], []])
    assert _place(m, [0, 0], [[0, 2], [1]]) == _warned(0, 1)
    assert _table(m.sut) == (0, 3, 2, [0, 0, -1, -1, -1, -1], [-1] * 6, [0, 1, 0, 0, -1, -1],
                             [[0, 2], [1], [], [], [], []])
    # placing seq 3 is where the reference stops on an assertion: refused, nothing changes
    before = _table(m.sut)
    assert _place(m, [1], [[3]]) is None
    assert _table(m.sut) == before
    # seq_rm of the whole sequence drops the record (its cell, at position 0, lies in the range)
    assert _op(m, "seq_rm", seq_id=3, p0=-1, p1=-1)["ret"] is True
    assert _place(m, [0], [[3]]) == []
    assert _table(m.sut) == (2, 1, 3, [0, 0, 0, -1, -1, -1], [-1] * 6, [0, 1, 0, 2, -1, -1],
                             [[0, 2], [1], [3], [], [], []])


def test_a_finished_sequence_and_a_new_one_in_one_step_lose_a_state():
    """The same loss with one sequence per group, as a server's decode step meets it: seq 2
    finishes, seq 0 continues and seq 1 starts. The states' copy sources follow the swaps:
    seq 0 continues from seq 3's state (row 1), seq 1 starts from seq 0's (row 2), and seq 3
    has none."""
    m = _machine(4, 4)
    _place(m, [0, 0, 0], [[2], [3], [0]])
    assert _op(m, "s_copy")["values"] == [0, 1, 2]
    assert _op(m, "seq_rm", seq_id=2, p0=-1, p1=-1)["ret"] is True
    assert _place(m, [1, 0], [[0], [1]]) == _warned(1)
    assert _table(m.sut) == (0, 3, 2, [1, 0, -1, -1], [1, 2, -1, -1], [0, 1, -1, 0], [[0], [1], [], []])
    assert _op(m, "s_copy")["values"] == [1, 2, 2]
    assert m.sut.seq_pos_max(3) == -1
    assert _place(m, [1], [[3]]) is None


def test_seq_cp_onto_a_stale_record_miscounts_used():
    """A stale record whose cell has emptied survives seq_rm (the cell's position -1 lies
    outside every range); seq_cp onto it lowers used for that cell, as the reference does."""
    m = _machine(6, 6)
    _place(m, [0, 0, 0], [[2], [3], [0]])
    _place(m, [0, 0], [[0, 2], [1]])
    assert _op(m, "seq_rm", seq_id=0, p0=-1, p1=-1)["ret"] is True
    assert _op(m, "seq_rm", seq_id=2, p0=-1, p1=-1)["ret"] is True
    assert _op(m, "seq_rm", seq_id=3, p0=-1, p1=-1)["ret"] is True
    assert m.sut.cells()["tail"][3] == 0 and m.sut.used == 1
    _op(m, "seq_cp", src=1, dst=3, p0=-1, p1=-1)
    assert m.ref.miscounted
    assert _table(m.sut) == (0, 3, 0, [-1, 0, -1, -1, -1, -1], [-1] * 6, [-1, 1, -1, 1, -1, -1],
                             [[], [1, 3], [], [], [], []])
    _place(m, [1], [[1]])          # find_slot counts the cells again
    assert not m.ref.miscounted and m.sut.used == 2


def test_seq_rm_all_without_clear_then_seq_cp_wraps_used():
    """seq_rm(-1) keeps the records; seq_cp onto one lowers used below 0 (a uint32_t in the
    reference) and still adds the destination to the source's emptied cell."""
    m = _machine(3, 3)
    assert _place(m, [4, 7], [[0], [1]]) == []
    assert _op(m, "seq_rm", seq_id=-1, p0=-1, p1=-1)["ret"] is True
    assert _table(m.sut) == (0, 2, 0, [-1] * 3, [-1] * 3, [0, 1, -1], [[], [], []])
    _op(m, "seq_cp", src=1, dst=0, p0=-1, p1=-1)
    assert _table(m.sut) == (0, 2, 2**32 - 1, [-1] * 3, [-1] * 3, [1, 1, -1], [[], [0], []])
    assert _place(m, [0, 0], [[0], [2]]) == []
    assert _table(m.sut) == (0, 2, 2, [0, 0, -1], [-1] * 3, [0, 1, 1], [[0], [2], []])
    assert _place(m, [0], [[1]]) is None


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
