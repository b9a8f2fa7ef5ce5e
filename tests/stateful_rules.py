"""The rules every cache's state machine has: the sequence operations (and, for the seed's
caches, restore and set_full), each applied to the model and to the cache through the trace-op
table.

A machine mixes :class:`SequenceRules` (or :class:`SequenceEditRules`, for today's cache)
into its RuleBasedStateMachine and sets ``replays`` (the model's and the cache's
:class:`conformance.Replay`) and ``n_seq_max``."""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import rule


def read_alike(*reads):
    """Run each read (a callable): all return the same byte count, or all raise StateError
    (then "StateError"); that outcome."""
    from kvcache import StateError

    got = []
    for read in reads:
        try:
            got.append(read())
        except StateError:
            got.append("StateError")
    assert all(g == got[0] for g in got), got
    return got[0]


def hand_off_alike(cache, moved, read, seq_id, dst):
    """Sequence seq_id of cache moved by seq_export / seq_import_begin into moved (as dst) leaves
    moved as state_read of its state (layout "2026") leaves read; or both refuse it, StateError,
    and the import changed nothing. moved and read start alike."""
    from kvcache import StateError
    from kvcache.handoff import copy_regions
    from cache_state import snapshot

    exp = cache.seq_export(seq_id)
    before = snapshot(moved)
    try:
        imp = moved.seq_import_begin(exp.header, dst)
    except StateError:
        assert snapshot(moved) == before
        with pytest.raises(StateError):
            read.state_read(cache.state_write(seq_id, layout="2026"), dst, layout="2026")
        return
    copy_regions(exp.regions, imp.regions)
    imp.commit()
    read.state_read(cache.state_write(seq_id, layout="2026"), dst, layout="2026")
    assert snapshot(moved) == snapshot(read)


def draw_copy_range(data, multi, src, dst, prange):
    """The [p0, p1) of a seq_cp in today's semantics: across streams (multi, src != dst) whole
    sequences only (a part is what llama.cpp aborts on); otherwise any ``prange(data)``."""
    if multi and src != dst:
        return data.draw(st.sampled_from([(-1, -1), (0, -1), (-1, 0)]), label="whole")
    return prange(data)


def draw_ubatch(data, n_seq_max, multi, pos_max, p_max, max_tokens=8):
    """pos and seq_id lists of a ubatch a cache of today's semantics takes: one stream: tokens
    of any sequences, interleaved, a token may carry several ids; several streams (multi):
    groups per sequence of one length, one id per token, each group starting after its
    sequence's largest position (``pos_max(s)``) or anywhere in [0, p_max]."""
    if multi:
        seqs = data.draw(st.lists(st.integers(0, n_seq_max - 1), min_size=1, unique=True), label="groups")
        nst = data.draw(st.integers(1, max(1, max_tokens // len(seqs))), label="n_seq_tokens")
        seq_id = [[s] for s in seqs for _ in range(nst)]
        pos = []
        for s in seqs:
            p = max(pos_max(s) + 1, 0) if data.draw(st.booleans(), label="next") else \
                data.draw(st.integers(0, p_max), label="start")
            pos += list(range(p, p + nst))
        return pos, seq_id
    n = data.draw(st.integers(1, max_tokens), label="n_tokens")
    ids = st.lists(st.integers(0, n_seq_max - 1), min_size=1, max_size=2)
    seq_id = data.draw(st.lists(ids, min_size=n, max_size=n), label="seq_id")
    if data.draw(st.booleans(), label="consecutive"):
        p = data.draw(st.integers(0, p_max), label="start")
        return list(range(p, p + n)), seq_id
    return data.draw(st.lists(st.integers(0, p_max), min_size=n, max_size=n), label="pos"), seq_id

from conformance.ops import apply_both


def draw_ext(data, n, cell_ext):
    """The optional token ids and 2-D positions of a ubatch of n tokens (op fields), for a cache
    with the per-cell extension: none, token ids, 2-D positions or both; 2-D positions from a
    small range, so that tokens at one position often compare by them."""
    if not cell_ext:
        return {}
    out = {}
    if data.draw(st.booleans(), label="tokens"):
        out["tokens"] = data.draw(st.lists(st.integers(-1, 50), min_size=n, max_size=n), label="token ids")
    if data.draw(st.booleans(), label="2-D"):
        out["pos_x"] = data.draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n), label="pos_x")
        out["pos_y"] = data.draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n), label="pos_y")
    return out


class SequenceEditRules:
    """seq_rm, seq_cp, seq_keep, seq_add and seq_div as rules (every semantics has them)."""

    #: whether seq_rm draws sequence id -1 (any sequence) too
    seq_rm_any = True
    #: positions are drawn from [-1, p_max]
    p_max = 40

    def both(self, name, **args):
        """Apply one op to model and cache; the fields the model gives (the cache's are equal)."""
        return apply_both(*self.replays, {"op": name, **args})

    #: the sequence ids in play, or None for all of [0, n_seq_max)
    ids = None

    def seq(self, data, allow_any=False):
        """A valid sequence id (or -1, any sequence, with allow_any)."""
        if self.ids is not None:
            return data.draw(st.sampled_from(([-1] if allow_any else []) + self.ids), label="seq_id")
        return data.draw(st.integers(-1 if allow_any else 0, self.n_seq_max - 1), label="seq_id")

    def prange(self, data):
        """A position range [p0, p1), either end -1 (open) too."""
        p0 = data.draw(st.integers(-1, self.p_max), label="p0")
        return p0, data.draw(st.integers(-1, self.p_max + 1), label="p1")

    @rule(data=st.data())
    def seq_rm(self, data):
        s = self.seq(data, allow_any=self.seq_rm_any)
        p0, p1 = self.prange(data)
        self.both("seq_rm", seq_id=s, p0=p0, p1=p1)

    @rule(data=st.data())
    def seq_cp(self, data):
        src, dst = self.seq(data), self.seq(data)
        p0, p1 = self.prange(data)
        self.both("seq_cp", src=src, dst=dst, p0=p0, p1=p1)

    @rule(data=st.data())
    def seq_keep(self, data):
        self.both("seq_keep", seq_id=self.seq(data))

    @rule(data=st.data(), shift=st.integers(-12, 12))
    def seq_add(self, data, shift):
        s = self.seq(data)
        p0, p1 = self.prange(data)
        self.both("seq_add", seq_id=s, p0=p0, p1=p1, shift=shift)

    @rule(data=st.data(), d=st.integers(1, 4))
    def seq_div(self, data, d):
        s = self.seq(data)
        p0, p1 = self.prange(data)
        self.both("seq_div", seq_id=s, p0=p0, p1=p1, d=d)


class SequenceRules(SequenceEditRules):
    """The sequence edits, restore and set_full (the seed's caches) as rules."""

    @rule()
    def restore(self):
        self.both("restore")

    @rule()
    def set_full(self):
        self.both("set_full")
