"""ubatches(): each cache cuts a batch the way llama.cpp's decoder does for it — in batch order for
the unified and iSWA caches, by sequence (equal, or one sequence with pooled embeddings) for the
recurrent cache — and the iSWA cache records the batch's pruning ranges first."""
import warnings

import numpy as np
import pytest

from kvcache import Batch, ISWACache, RecurrentCache, UBatch, UnifiedCache

POS = [0, 1, 2, 0, 1, 3, 2, 4, 0, 5]
SEQ = [0, 0, 0, 1, 1, 0, 1, 0, [2, 3], 0]


def shape(ub):
    return (ub.n_tokens, ub.n_seq_tokens, ub.n_seqs, ub.pos.tolist(), ub.seq_id, ub.ids.tolist(),
            ub.equal_seqs)


def reference_split(mode, n_ubatch, **kw):
    """The splitter driven directly, on a twin batch."""
    b = Batch(POS, SEQ, simple_split=(mode == "simple"), **kw)
    split = getattr(b, f"split_{mode}")
    out = []
    while (ub := split(n_ubatch)) is not None:
        out.append(shape(ub))
    return out, b.out_ids.tolist()


def unified():
    return UnifiedCache(kv_size=64, n_layer=2, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=4)


def recurrent():
    return RecurrentCache(n_seq_max=4, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4)


def iswa(**kw):
    args = dict(kv_size=64, n_layer=2, n_embd_k_gqa=4, n_embd_v_gqa=4, swa_layers=[1], n_swa=2,
                n_batch=8, n_seq_max=4)
    args.update(kw)
    return ISWACache(**args)


@pytest.mark.parametrize("make", [unified, iswa], ids=["unified", "iswa"])
@pytest.mark.parametrize("n_ubatch", [1, 3, 4, 10, 100])
@pytest.mark.parametrize("embd_pooled", [False, True])
def test_unified_and_iswa_split_in_batch_order(make, n_ubatch, embd_pooled):
    cache = make()
    batch = Batch(POS, SEQ, output=[t % 3 == 0 for t in range(len(POS))])
    got = [shape(ub) for ub in cache.ubatches(batch, n_ubatch, embd_pooled=embd_pooled)]
    want, out_ids = reference_split("simple", n_ubatch, output=[t % 3 == 0 for t in range(len(POS))])
    assert got == want
    assert batch.out_ids.tolist() == out_ids
    assert sum(g[0] for g in got) == len(POS)
    assert all(g[1] == 1 and not g[6] for g in got)


@pytest.mark.parametrize("n_ubatch", [1, 2, 3, 5, 6, 100])
@pytest.mark.parametrize("embd_pooled, mode", [(False, "equal"), (True, "seq")])
def test_recurrent_splits_by_sequence(n_ubatch, embd_pooled, mode):
    cache = recurrent()
    batch = Batch(POS, SEQ, simple_split=False)
    got = [shape(ub) for ub in cache.ubatches(batch, n_ubatch, embd_pooled=embd_pooled)]
    want, out_ids = reference_split(mode, n_ubatch)
    assert got == want
    assert batch.out_ids.tolist() == out_ids
    assert sum(g[0] for g in got) == len(POS)
    if mode == "seq":
        assert all(g[2] == 1 for g in got)     # one sequence group per ubatch


def test_equal_and_seq_splits_differ_on_this_batch():
    """So that the recurrent test above can tell the two modes apart."""
    equal, seq = reference_split("equal", 6)[0], reference_split("seq", 6)[0]
    assert [g[:6] for g in equal] != [g[:6] for g in seq]


@pytest.mark.parametrize("make, wrong", [
    (unified, dict(simple_split=False)),
    (iswa, dict(simple_split=False)),
    (recurrent, dict(simple_split=True)),
], ids=["unified", "iswa", "recurrent"])
def test_batch_built_for_the_other_splitter_is_rejected(make, wrong):
    cache = make()
    with pytest.raises(ValueError, match="simple_split"):
        cache.ubatches(Batch(POS, SEQ, **wrong), 4)
    with pytest.raises(TypeError, match="Batch"):
        cache.ubatches(UBatch([0], [0]), 4)


@pytest.mark.parametrize("make, simple", [(unified, True), (iswa, True), (recurrent, False)],
                         ids=["unified", "iswa", "recurrent"])
def test_bad_n_ubatch_is_rejected_before_splitting(make, simple):
    cache = make()
    batch = Batch(POS, SEQ, simple_split=simple)
    for bad, exc in ((0, ValueError), (-1, ValueError), ("4", TypeError), (2.0, TypeError)):
        with pytest.raises(exc):
            cache.ubatches(batch, bad)
    assert batch.n_tokens_left == len(POS)


def test_iswa_records_the_whole_batch_before_the_first_ubatch():
    cache = iswa()
    batch = Batch(POS, SEQ)
    it = cache.ubatches(batch, 3)
    assert cache.pending == [[0, 0, 5], [1, 0, 2], [2, 0, 0], [3, 0, 0]]
    assert batch.n_tokens_left == len(POS)      # nothing split yet
    first = next(it)
    assert first.pos.tolist() == [0, 1, 2]
    assert cache.pending == [[0, 0, 5], [1, 0, 2], [2, 0, 0], [3, 0, 0]]


def test_iswa_rejects_a_batch_with_a_sequence_it_does_not_have():
    cache = iswa(n_seq_max=2)
    cache.sbatch_init([0], [1])
    batch = Batch(POS, SEQ)
    with pytest.raises(ValueError, match="seq_id"):
        cache.ubatches(batch, 4)
    assert cache.pending == [[1, 0, 0]]
    assert batch.n_tokens_left == len(POS)


def test_iswa_decode_loop_prunes_with_the_whole_batch_range():
    """The window slides once per batch, by the batch's last position, not per ubatch."""
    cache = iswa(n_swa=3, kv_size=32)
    rng = np.random.default_rng(1)
    for start in (0, 7):
        pos = list(range(start, start + 7))
        batch = Batch(pos, [0] * 7)
        for ub in cache.ubatches(batch, 3):
            assert cache.find_slot(ub)
            for il in range(cache.n_layer):
                cache.store(il, rng.standard_normal((ub.n_tokens, 4)).astype(np.float32),
                            rng.standard_normal((ub.n_tokens, 4)).astype(np.float32))
            # mask of every ubatch against both caches, as a decoder builds them
            base_mask, swa_mask = cache.kq_mask(ub)
            assert base_mask.shape[1] == cache.base.n and swa_mask.shape[1] == cache.swa.n
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cache.commit()
        last = start + 6
        swa_pos = sorted(p for _, p, _, _ in cache.swa.cells().nonempty())
        assert swa_pos == [last - 2, last - 1, last]
        assert sorted(p for _, p, _, _ in cache.base.cells().nonempty()) == list(range(last + 1))
