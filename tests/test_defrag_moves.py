"""K/V moves of a defrag plan against numpy applying the same plan.

Large enough that the row copies bypass the caches (non-temporal stores, from 16 MiB moved), with
V transposed (the moved cells are columns, moved four rows at a time, with a remainder) and not,
f16 and f32, and on a small cache (ordinary copies)."""
import numpy as np
import pytest

from kvcache import UBatch, UnifiedCache


def fragmented(kv_size, n_layer, widths, type_, v_trans, seed):
    rng = np.random.default_rng(seed)
    c = UnifiedCache(kv_size=kv_size, n_layer=n_layer, n_embd_k_gqa=widths, n_embd_v_gqa=widths,
                     type_k=type_, type_v=type_, v_trans=v_trans, n_seq_max=8)
    seqs = rng.integers(0, 8, size=kv_size)
    nxt = [0] * 8
    pos = []
    for s in seqs:
        pos.append(nxt[s])
        nxt[s] += 1
    assert c.find_slot(UBatch(pos, seqs.tolist()))
    c.commit()
    for il in c.layers:
        c.k(il)[...] = rng.standard_normal(c.k(il).shape)
        c.v(il)[...] = rng.standard_normal(c.v(il).shape)
    while c.used > kv_size // 2:
        s = int(rng.integers(0, 8))
        p = int(rng.integers(0, nxt[s]))
        c.seq_rm(s, p, p + 4)
    return c


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("type_,kv_size,n_layer,widths", [
    ("f16", 4096, 8, [1024] * 7 + [1030]),     # >= 16 MiB moved: streamed
    ("f32", 2048, 4, [1024, 1024, 1025, 1024]),
    ("f16", 256, 3, [8, 13, 6]),                # small: ordinary copies
])
def test_moves_match_the_plan(v_trans, type_, kv_size, n_layer, widths):
    c = fragmented(kv_size, n_layer, widths, type_, v_trans, seed=kv_size + n_layer)
    before = [(c.k(il).copy(), c.v(il).copy()) for il in c.layers]
    assert c.defrag_prepare(2**31 - 1)
    runs = c.defrag_runs()
    moved = int(runs[:, 2].sum())
    assert moved > kv_size // 8
    c.defrag_move()
    for il, (k0, v0) in zip(c.layers, before):
        k1, v1 = k0.copy(), v0.copy()
        for src, dst, n in runs.tolist():
            k1[dst:dst + n] = k0[src:src + n]
            if v_trans:
                v1[:, dst:dst + n] = v0[:, src:src + n]
            else:
                v1[dst:dst + n] = v0[src:src + n]
        assert np.array_equal(c.k(il), k1), il
        assert np.array_equal(c.v(il), v1), il
