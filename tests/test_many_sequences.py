"""Caches of more than 64 sequences (up to kvcache.MAX_SEQ = 256, today's LLAMA_MAX_SEQ): a cell's
sequence set spans several 64-bit words, and every operation of every cache must treat the ids
past 63 as it treats the others.

The unified cache runs a long random workload next to the reference model (tests/reference.py),
compared after every step; the other caches and the splitter check the ids of the upper words
by hand."""
import struct

import numpy as np
import pytest

import kvcache
import kvcache.statefile
from kvcache import Batch, ISWACache, RecurrentCache, StateError, UBatch, UnifiedCache
from kvcache._core import describe_state
from reference import RefUBatch, UnifiedReference

SIZES = [65, 128, 200, 256]


def test_the_bound_comes_from_the_core():
    assert kvcache.MAX_SEQ == 256
    assert UnifiedCache(8, 1, 4, 4, n_seq_max=256, n_pad=8).n_seq_max == 256
    for make in (lambda: UnifiedCache(8, 1, 4, 4, n_seq_max=257, n_pad=8),
                 lambda: RecurrentCache(257, 1, 4, 4),
                 lambda: ISWACache(64, 2, 4, 4, swa_layers=[1], n_swa=4, n_seq_max=257),
                 lambda: UBatch([0], [256]), lambda: Batch([0], [256])):
        with pytest.raises(ValueError, match="256"):
            make()


def _agree(c, r, n_seq_max):
    assert (c.head, c.n, c.used, bool(c.has_shift)) == (r.head, r.n, r.used, r.has_shift)
    cells, ref = c.cells(), r.cells()
    assert cells.seq_mask.shape == (c.size, (n_seq_max + 63) // 64)
    assert cells.nonempty() == ref.nonempty()
    assert np.array_equal(cells.seq_mask, ref.seq_mask)
    for s in range(n_seq_max):
        assert (c.seq_pos_min(s), c.seq_pos_max(s)) == (r.seq_pos_min(s), r.seq_pos_max(s)), s


@pytest.mark.parametrize("n_seq_max", SIZES)
def test_unified_against_the_reference(n_seq_max):
    rng = np.random.default_rng(n_seq_max)
    kw = dict(n_seq_max=n_seq_max, n_pad=8, n_swa=6, swa_type="standard")
    c = UnifiedCache(128, 2, 4, 4, type_k="f32", type_v="f32", v_trans=False, **kw)
    r = UnifiedReference(128, n_layer=2, **kw)
    # ids from every word of the set: the last one, ids around 63/64, and some at random
    hot = sorted({0, 63, 64, n_seq_max - 1, n_seq_max // 2, *rng.integers(0, n_seq_max, 4).tolist()})
    nxt = {s: 0 for s in range(n_seq_max)}

    def ids():
        k = int(rng.integers(1, 4))
        return sorted(set(rng.choice(hot, k).tolist()), key=lambda s: rng.random())

    for step in range(300):
        op = int(rng.integers(0, 12))
        if op < 4:
            n = int(rng.integers(1, 6))
            groups = [ids() for _ in range(n)]
            pos = []
            for g in groups:
                pos.append(nxt[g[0]])
                nxt[g[0]] += 1
            a, b = r.find_slot(RefUBatch(pos, groups)), c.find_slot(UBatch(pos, groups))
            assert a == b
            if a:
                mask = c.kq_mask(UBatch(pos, groups))
                assert np.array_equal(mask, r.kq_mask(RefUBatch(pos, groups)))
                if rng.random() < 0.8:
                    c.commit()
                    r.commit()
        elif op == 4:
            c.restore()
            r.restore()
        elif op == 5:
            s = int(rng.choice(hot + [-1]))
            p0, p1 = int(rng.integers(-1, 8)), int(rng.integers(-1, 12))
            assert c.seq_rm(s, p0, p1) == r.seq_rm(s, p0, p1)
        elif op == 6:
            a, b = rng.choice(hot, 2).tolist()
            c.seq_cp(a, b, -1, -1)
            r.seq_cp(a, b, -1, -1)
        elif op == 7:
            s, d = int(rng.choice(hot)), int(rng.integers(-3, 4))
            c.seq_add(s, 0, -1, d)
            r.seq_add(s, 0, -1, d)
        elif op == 8:
            s = int(rng.choice(hot))
            c.seq_div(s, 0, -1, 2)
            r.seq_div(s, 0, -1, 2)
        elif op == 9 and rng.random() < 0.2:
            s = int(rng.choice(hot))
            c.seq_keep(s)
            r.seq_keep(s)
        elif op == 10:
            assert c.defrag_prepare(65536) == r.defrag_prepare(65536)
            assert c.defrag_ids.tolist() == r.defrag_ids
            c.defrag_move()
        else:
            assert np.array_equal(c.k_shift(), r.k_shift())
            c.reset_shift()
            r.reset_shift()
        _agree(c, r, n_seq_max)
    # the state of every sequence and of the whole cache round-trips, ids past 63 included
    whole = c.state_write(layout="2025")
    d = UnifiedCache(128, 2, 4, 4, type_k="f32", type_v="f32", v_trans=False, **kw)
    assert d.state_read(whole, exact=True, layout="2025") == len(whole)
    # the cells in order, packed from cell 0 (a whole state lists the used cells only)
    assert [x[1:3] for x in d.cells().nonempty()] == [x[1:3] for x in c.cells().nonempty()]
    assert d.state_write(layout="2025") == whole
    for s in hot:
        blob = c.state_write(s, layout="2025")
        e = UnifiedCache(128, 2, 4, 4, type_k="f32", type_v="f32", v_trans=False, **kw)
        e.state_read(blob, n_seq_max - 1 - s, layout="2025")
        assert e.seq_pos_max(n_seq_max - 1 - s) == c.seq_pos_max(s)
        back = UnifiedCache(128, 2, 4, 4, type_k="f32", type_v="f32", v_trans=False, **kw)
        back.state_read(e.state_write(n_seq_max - 1 - s, layout="2025"), s, layout="2025")   # through another id and back
        assert back.state_write(s, layout="2025") == blob
    desc = describe_state(whole)
    for i, (_, p, held, _) in enumerate(c.cells().nonempty()):
        words = desc["seq"][i].tolist()
        assert [64 * w + b for w in range(4) for b in range(64) if words[w] >> b & 1] == held


@pytest.mark.parametrize("n_seq_max", SIZES)
def test_unified_ids_in_a_state_are_checked_against_the_cache(n_seq_max):
    src = UnifiedCache(32, 1, 4, 4, n_seq_max=256, n_pad=8)
    assert src.find_slot(UBatch([0, 1], [[n_seq_max - 1], [n_seq_max - 1, 255]]))
    blob = src.state_write(layout="2025")
    dst = UnifiedCache(32, 1, 4, 4, n_seq_max=n_seq_max, n_pad=8)
    if n_seq_max == 256:
        dst.state_read(blob, layout="2025")
        assert dst.cells().nonempty() == src.cells().nonempty()
    else:
        before = dst.cells()
        with pytest.raises(StateError, match=f"sequence id 255 out of range \\[0, {n_seq_max}\\)"):
            dst.state_read(blob, layout="2025")
        assert dst.cells() == before


@pytest.mark.parametrize("n_seq_max", [130, 256])
def test_iswa_prunes_sequences_of_every_word(n_seq_max):
    c = ISWACache(64, 2, 4, 4, swa_layers=[1], n_swa=2, n_batch=8, n_seq_max=n_seq_max, n_pad=8)
    hi = n_seq_max - 1
    for p in range(4):
        ub_pos, ub_ids = [p, p], [[hi], [65]]
        assert c.sbatch_init(ub_pos, ub_ids) == [[65, p, p], [hi, p, p]]
        assert c.find_slot(UBatch(ub_pos, ub_ids))
        c.commit()
    # the SWA cache kept the last n_swa positions of both, the base cache all of them
    assert (c.swa.seq_pos_min(hi), c.swa.seq_pos_min(65)) == (2, 2)
    assert (c.base.seq_pos_min(hi), c.base.seq_pos_max(65)) == (0, 3)
    c.seq_cp(hi, 200 % n_seq_max, -1, -1)
    assert c.base.seq_pos_max(200 % n_seq_max) == 3
    blob = c.state_write(hi, layout="2025")
    d = ISWACache(64, 2, 4, 4, swa_layers=[1], n_swa=2, n_batch=8, n_seq_max=n_seq_max, n_pad=8)
    d.state_read(blob, 64, layout="2025")
    assert (d.base.seq_pos_min(64), d.swa.seq_pos_min(64)) == (0, 2)


@pytest.mark.parametrize("n_seq_max", SIZES)
def test_recurrent_states_of_every_word(n_seq_max):
    c = RecurrentCache(n_seq_max, 1, 4, 4)
    hi, mid = n_seq_max - 1, 64 if n_seq_max > 65 else 40
    # one group per sequence id, the second one's two ids sharing a state (copy-on-share)
    assert c.find_slot(UBatch([0, 1, 2, 0, 1, 2], [[hi], [mid, 5]], n_seq_tokens=3))
    seqs = c.cells()["seq_id"]
    assert sorted(map(tuple, filter(None, seqs))) == [(5, mid), (hi,)]
    assert (c.seq_pos_max(hi), c.seq_pos_max(mid), c.seq_pos_max(5)) == (2, 2, 2)
    c.seq_cp(hi, 63, -1, -1)
    assert [63, hi] in c.cells()["seq_id"]
    c.seq_add(hi, 0, -1, 10)
    assert c.seq_pos_max(63) == 12                       # the shared state moved with it
    whole = c.state_write(layout="2025")
    d = RecurrentCache(n_seq_max, 1, 4, 4)
    d.state_read(whole, layout="2025")
    assert d.cells()["seq_id"] == c.cells()["seq_id"] and d.state_write(layout="2025") == whole
    one = c.state_write(hi, layout="2025")
    d.state_read(one, 128 % n_seq_max, layout="2025")
    assert d.seq_pos_max(128 % n_seq_max) == 12
    assert c.seq_rm(hi, -1, -1)
    assert c.seq_pos_max(hi) == -1 and c.seq_pos_max(63) == 12
    c.seq_keep(mid)
    assert [ids for ids in c.cells()["seq_id"] if ids] == [[mid]]


def test_batch_splitter_with_ids_of_every_word():
    ids = [0, 255, 64, 255, 0, 130]
    b = Batch(list(range(len(ids))), ids, simple_split=False)
    seen = []
    for ub in b.ubatches(8, "equal"):
        groups = ub.seq_id
        assert all(len(g) == 1 for g in groups)
        assert len({g[0] for g in groups}) == len(groups)     # one group per sequence
        seen += [g[0] for g in groups for _ in range(ub.n_seq_tokens)]
    assert sorted(seen) == sorted(ids)
    b = Batch([0, 1, 2], [[255, 3], [255, 3], [70]], simple_split=False)
    out = [ub.seq_id for ub in b.ubatches(4, "seq")]
    assert [[255, 3]] in out and [[70]] in out


@pytest.mark.parametrize("layout", kvcache.LAYOUTS)
def test_every_layout_carries_ids_up_to_255(layout):
    """Sequence ids below n_seq_max = 256 in every layout: the whole state lists them, a
    sequence's state (with the prefix naming it, where the layout has one) moves to another id."""
    c = kvcache.UnifiedCache(512, 1, 8, 8, n_seq_max=256, n_pad=1)
    assert c.find_slot(kvcache.UBatch([0, 1, 2, 0], [[0, 255], [255], [255], [254]]))
    c.commit()
    whole = c.state_write(-1, layout=layout)
    d = kvcache.UnifiedCache(512, 1, 8, 8, n_seq_max=256, n_pad=1)
    assert d.state_read(whole, -1, layout=layout) == len(whole)
    assert d.state_write(-1, layout=layout) == whole and d.seq_pos_max(255) == 2 and d.seq_pos_max(254) == 0
    one = c.state_write(255, layout=layout)
    if kvcache._core.layout_info(layout)["prefix"]:
        assert struct.unpack_from("<Ii", one) == (kvcache.statefile.SEQ_MAGIC, 255)
    assert d.state_read(one, 200, layout=layout) == len(one)
    assert d.seq_pos_max(200) == 2
