"""The largest position, 2**31 - 1: an open range (p1 < 0, "no upper bound") includes it in every
operation of every cache, and the per-sequence position index stays in step with the cells.

Each unified-cache operation runs on the C cache and on the reference model (tests/reference.py)
from the same start; both must show the same cells and the same seq_pos_min / seq_pos_max."""
import numpy as np
import pytest

import kvcache
from reference import RefUBatch, UnifiedReference

TOP = 2**31 - 1


def pair(n_seq_max=3, **kw):
    """The C cache and the model, each holding seq 0 at positions 0, TOP - 1 and TOP, with TOP shared by 1."""
    args = dict(kv_size=32, n_seq_max=n_seq_max, n_pad=8)
    args.update(kw)
    c = kvcache.UnifiedCache(args["kv_size"], 1, 4, 4, type_k="f32", type_v="f32", v_trans=False,
                             n_seq_max=n_seq_max, n_pad=args["n_pad"], n_swa=args.get("n_swa", 0),
                             swa_type=args.get("swa_type", "none"))
    r = UnifiedReference(args["kv_size"], n_seq_max=n_seq_max, n_pad=args["n_pad"], n_swa=args.get("n_swa", 0),
                         swa_type=args.get("swa_type", "none"))
    pos, ids = [0, TOP - 1, TOP], [[0], [0], [0, 1]]
    assert c.find_slot(kvcache.UBatch(pos, ids))
    assert r.find_slot(RefUBatch(pos, ids))
    c.commit()
    r.commit()
    return c, r


def agree(c, r, n_seq_max=3):
    assert c.cells().nonempty() == r.cells().nonempty()
    assert c.used == r.used and c.head == r.head
    for s in range(n_seq_max):
        assert (c.seq_pos_min(s), c.seq_pos_max(s)) == (r.seq_pos_min(s), r.seq_pos_max(s)), s
        # the index agrees with the cells
        ps = [p for _, p, ids, _ in c.cells().nonempty() if s in ids]
        assert (c.seq_pos_min(s), c.seq_pos_max(s)) == ((min(ps), max(ps)) if ps else (-1, -1)), s


def test_the_reported_case():
    c = kvcache.UnifiedCache(64, 1, 4, 4)
    assert c.find_slot(kvcache.UBatch([0, TOP], [0, 0]))
    c.commit()
    c.seq_rm(0)
    assert c.used == 0 and (c.seq_pos_min(0), c.seq_pos_max(0)) == (-1, -1)


@pytest.mark.parametrize("op,args,cells_after", [
    ("seq_rm", (0, -1, -1), [[2, TOP, [1], 0]]),
    ("seq_rm", (-1, -1, -1), []),
    ("seq_rm", (0, TOP, -1), [[0, 0, [0], 0], [1, TOP - 1, [0], 0], [2, TOP, [1], 0]]),
    ("seq_rm", (1, 5, -1), [[0, 0, [0], 0], [1, TOP - 1, [0], 0], [2, TOP, [0], 0]]),
    ("seq_rm", (0, 0, TOP), [[2, TOP, [0, 1], 0]]),              # an explicit bound excludes it
    ("seq_cp", (0, 2, -1, -1), [[0, 0, [0, 2], 0], [1, TOP - 1, [0, 2], 0], [2, TOP, [0, 1, 2], 0]]),
    ("seq_cp", (0, 2, TOP, -1), [[0, 0, [0], 0], [1, TOP - 1, [0], 0], [2, TOP, [0, 1, 2], 0]]),
    ("seq_add", (1, 0, -1, -10), [[0, 0, [0], 0], [1, TOP - 1, [0], 0], [2, TOP - 10, [0, 1], -10]]),
    ("seq_add", (0, TOP, -1, -1), [[0, 0, [0], 0], [1, TOP - 1, [0], 0], [2, TOP - 1, [0, 1], -1]]),
    ("seq_add", (0, 1, -1, 5), [[0, 0, [0], 0], [1, TOP, [0], 5], [2, TOP, [0, 1], 5]]),  # saturates
    ("seq_div", (0, 1, -1, 2), [[0, 0, [0], 0], [1, TOP // 2, [0], TOP // 2], [2, TOP // 2, [0, 1], TOP // 2 + 1]]),
    ("seq_div", (1, TOP, -1, 3), [[0, 0, [0], 0], [1, TOP - 1, [0], 0], [2, TOP // 3, [0, 1], TOP - TOP // 3]]),
    ("seq_keep", (1,), [[2, TOP, [1], 0]]),
])
def test_open_ranges_include_the_top_position(op, args, cells_after):
    c, r = pair()
    getattr(c, op)(*args)
    getattr(r, op)(*args)
    agree(c, r)
    assert c.cells().nonempty() == cells_after


def test_masks_and_window_at_the_top():
    c, r = pair(kv_size=32, n_swa=4, swa_type="standard")
    ub = [TOP - 1, TOP], [[0], [1]]
    mask = c.kq_mask(kvcache.UBatch(*ub))
    assert np.array_equal(mask, r.kq_mask(RefUBatch(*ub)))
    assert np.isfinite(mask[:2, :3]).tolist() == [[False, True, False], [False, False, True]]
    assert c.prune_swa(0, TOP, TOP) is True             # only 2 of the window's 4 cells are there
    assert c.cells().nonempty() == [[1, TOP - 1, [0], 0], [2, TOP, [0, 1], 0]]
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (TOP - 1, TOP)


def test_state_round_trip_and_restore_into_a_sequence_at_the_top():
    c, _ = pair()
    whole = c.state_write(layout="2025")
    one = c.state_write(0, layout="2025")
    d = kvcache.UnifiedCache(32, 1, 4, 4, type_k="f32", type_v="f32", v_trans=False, n_seq_max=3, n_pad=8)
    d.state_read(whole, layout="2025")
    assert d.cells().nonempty() == c.cells().nonempty()
    assert (d.seq_pos_min(1), d.seq_pos_max(1)) == (TOP, TOP)
    # reading seq 0 again first removes all of seq 0, the cell at TOP included
    d.state_read(one, 0, layout="2025")
    assert sorted(p for _, p, ids, _ in d.cells().nonempty() if 0 in ids) == [0, TOP - 1, TOP]
    assert (d.seq_pos_min(0), d.seq_pos_max(0)) == (0, TOP)
    d.seq_rm(0)
    assert d.cells().nonempty() == [[2, TOP, [1], 0]]
    assert (d.seq_pos_min(0), d.seq_pos_max(0)) == (-1, -1)


def test_a_sequence_blob_planting_the_top_position():
    """A blob (llama.cpp's single-sequence layout) with one cell at TOP: reading it and removing
    the sequence again leaves nothing behind, index included."""
    src = kvcache.UnifiedCache(32, 1, 4, 4, type_k="f32", type_v="f32", v_trans=False, n_seq_max=2, n_pad=8)
    assert src.find_slot(kvcache.UBatch([TOP], [1]))
    blob = src.state_write(1, layout="2025")
    cell = blob.index((TOP).to_bytes(4, "little"))
    assert cell == 4                                       # cell_count, then the cell's position
    c = kvcache.UnifiedCache(32, 1, 4, 4, type_k="f32", type_v="f32", v_trans=False, n_seq_max=2, n_pad=8)
    assert c.find_slot(kvcache.UBatch([3, 4], [0, 1]))
    c.commit()
    def held():
        return sorted((p, ids) for _, p, ids, _ in c.cells().nonempty())

    c.state_read(blob, 0, layout="2025")                                  # seq 0 is replaced
    assert held() == [(4, [1]), (TOP, [0])]
    c.state_read(blob, 0, layout="2025")                                  # again: the previous TOP cell goes first
    assert held() == [(4, [1]), (TOP, [0])]
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (TOP, TOP)
    c.seq_rm(0, -1, -1)
    assert held() == [(4, [1])] and (c.seq_pos_min(0), c.seq_pos_max(0)) == (-1, -1)


def test_iswa_at_the_top():
    c = kvcache.ISWACache(64, 2, 4, 4, swa_layers=[1], n_swa=4, n_batch=8, n_seq_max=2, n_pad=8)
    c.sbatch_init([TOP - 1, TOP], [0, 0])
    assert c.find_slot(kvcache.UBatch([TOP - 1, TOP], [0, 0]))
    with pytest.warns(kvcache.SWAWarning):                 # nothing of the window before TOP - 1
        c.commit()
    assert c.seq_pos_max(0) == TOP
    c.seq_rm(0)
    assert c.base.used == 0 and c.swa.used == 0
    assert (c.base.seq_pos_max(0), c.swa.seq_pos_max(0)) == (-1, -1)


def test_recurrent_at_the_top():
    c = kvcache.RecurrentCache(2, 1, 4, 4)
    assert c.find_slot(kvcache.UBatch([TOP], [0]))
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (TOP, TOP)
    c.seq_add(0, 0, -1, -1)                                # the open range holds TOP
    assert c.seq_pos_max(0) == TOP - 1
    c.seq_add(0, 0, -1, 1)
    c.seq_div(0, TOP, -1, 1)
    assert c.seq_pos_max(0) == TOP
    assert c.seq_rm(0, -1, -1) is True                    # not "a state cut in two"
    assert c.cells()["seq_id"][0] == [] and c.seq_pos_max(0) == -1
    assert c.find_slot(kvcache.UBatch([TOP], [1]))
    assert c.seq_rm(-1, 0, -1) is True
    assert c.seq_pos_max(1) == -1
