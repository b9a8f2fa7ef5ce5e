"""A defrag plan between defrag_prepare() and defrag_move(): the cells already moved, their K/V
rows not yet. Whatever comes next — a second prepare, update(), a slot and its rows, a state
write or read, any sequence operation — first moves the rows of the pending plan (a cache with
K/V memory) or drops the plan (a metadata-only cache: its owner moves its own rows), so no row
is ever moved by a stale plan and none is lost.

Each case runs the operation on two caches from the same fragmented start: one between
prepare and move, the other after both; the two must end byte for byte the same."""
import numpy as np
import pytest

import kvcache
from kvcache import UBatch, UnifiedCache

from cache_state import snapshot

WIDTH = 8


def fragmented(v_trans=False, buffers="owned"):
    """Tokens of sequences 0..2 with holes; every K/V row holds a value naming its token."""
    c = UnifiedCache(64, 2, WIDTH, WIDTH, type_k="f32", type_v="f32", v_trans=v_trans, n_seq_max=4, n_pad=8,
                     buffers=buffers, n_embd_head_k=WIDTH, rope=kvcache.RopeParams(WIDTH))
    seqs = [0, 1, 2] * 10
    assert c.find_slot(UBatch(list(range(30)), seqs))
    c.commit()
    if buffers != "none":
        tag = (np.arange(30, dtype=np.float32) + 1)[:, None]
        for il in c.layers:
            c.k(il)[:30] = tag + 100 * il
            if v_trans:
                c.v(il)[:, :30] = (tag + 1000 * il).T
            else:
                c.v(il)[:30] = tag + 1000 * il
    c.seq_rm(1)
    c.seq_rm(0, 0, 6)
    return c


def rows_follow_tokens(c, before):
    """Every token's rows are where its cell went: compare with the rows it had in `before`
    (cell index -> rows), matched through (position, sequences)."""
    where = {(p, tuple(ids)): i for i, p, ids, _ in before["cells"]}
    for i, p, ids, _ in c.cells().nonempty():
        j = where.get((p, tuple(ids)))
        if j is None:
            continue
        for il in c.layers:
            assert np.array_equal(c.k(il)[i], before["k"][il][j]), (il, i, j)


def rows_of(c):
    return {"cells": c.cells().nonempty(), "k": {il: c.k(il).copy() for il in c.layers}}


STORE = np.full((2, WIDTH), -7.0, np.float32)


def _place_and_store(c):
    assert c.find_slot(UBatch([40, 41], [3, 3]))
    for il in c.layers:
        c.store(il, STORE, STORE)
    c.commit()


OPS = {
    "prepare again": lambda c: c.defrag_prepare(65536),
    "update": lambda c: c.update(),
    "sched and update": lambda c: (c.defrag_sched(-1.0), c.update()),
    "find_slot and store": _place_and_store,
    "seq_rm": lambda c: c.seq_rm(2, 10, 20),
    "seq_cp": lambda c: c.seq_cp(0, 3),
    "seq_keep": lambda c: c.seq_keep(2),
    "seq_add and update with rope": lambda c: (c.seq_add(0, 0, -1, 2), c.update()),
    "seq_div": lambda c: c.seq_div(2, 0, -1, 2),
    "clear": lambda c: c.clear(),
    "set_full": lambda c: c.set_full(),
    "commit": lambda c: c.commit(),
    "restore": lambda c: (c.find_slot(UBatch([50], [3])), c.restore()),
    "state_read whole": lambda c: c.state_read(fragmented(c.v_trans).state_write()),
    "state_read one": lambda c: c.state_read(fragmented(c.v_trans).state_write(2), 3),
}
# the operations after which a token's rows can still be found by its position and sequences
KEEP_TOKENS = {"prepare again", "update", "sched and update", "find_slot and store", "seq_rm", "seq_cp",
               "seq_keep", "set_full", "commit", "restore", "state_read one"}


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("op", list(OPS))
def test_an_operation_between_prepare_and_move_first_moves_the_rows(op, v_trans):
    early, late = fragmented(v_trans), fragmented(v_trans)
    before = rows_of(early)
    assert early.defrag_prepare(65536) and late.defrag_prepare(65536)
    late.defrag_move()
    OPS[op](early)
    OPS[op](late)
    early.defrag_move()                                # nothing left to move: a no-op
    late.defrag_move()
    assert snapshot(early) == snapshot(late)
    if op in KEEP_TOKENS:
        rows_follow_tokens(early, before)


def test_a_second_prepare_then_move_keeps_every_row():
    """The issue's first case: every moved cell ended up with another cell's rows."""
    c = fragmented()
    before = rows_of(c)
    assert c.defrag_prepare(65536)
    c.defrag_prepare(65536)
    c.defrag_move()
    rows_follow_tokens(c, before)


def test_state_write_between_prepare_and_move():
    c = fragmented()
    want = fragmented()
    assert c.defrag_prepare(65536) and want.defrag_prepare(65536)
    want.defrag_move()
    assert c.state_write() == want.state_write()
    assert c.state_write(2) == want.state_write(2)
    buf = bytearray(c.state_size())
    c.state_write_into(buf)
    assert bytes(buf) == want.state_write()


def test_reading_the_rows_between_prepare_and_move():
    c = fragmented()
    before = rows_of(c)
    assert c.defrag_prepare(65536)
    rows_follow_tokens(c, before)                      # k() is a data access: the rows move first


def test_update_reports_the_pending_moves():
    c = fragmented()
    assert c.defrag_prepare(65536)
    runs = c.defrag_runs()
    assert len(runs)
    c.defrag_sched(-1.0)
    plan = c.update()
    assert not c.do_defrag
    # the pending plan was applied, then the scheduled one found nothing left to move
    assert plan.defrag_runs is None and not plan.moved


def test_metadata_only_drops_the_pending_plan():
    """Without K/V memory the owner moves its rows after reading the plan; once anything else
    happens the plan is gone (an owner that missed it must not apply it later)."""
    c = fragmented(buffers="none")
    assert c.defrag_prepare(65536)
    runs = c.defrag_runs()
    assert len(runs) and len(c.defrag_ids)
    assert c.defrag_runs().tolist() == runs.tolist()   # reading the plan keeps it
    c.find_slot(UBatch([40], [3]))
    assert c.defrag_runs().tolist() == [] and c.defrag_ids.tolist() == []
    # the two-step way: read the plan, move, then defrag_move() (nothing to move here)
    d = fragmented(buffers="none")
    assert d.defrag_prepare(65536)
    plan = d.defrag_runs()
    d.defrag_move()
    assert d.defrag_runs().tolist() == plan.tolist()   # still there: it was applied, not dropped
