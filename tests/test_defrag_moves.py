"""K/V moves of a defrag plan against numpy applying the same plan.

Large enough that the row copies bypass the caches (non-temporal stores, from 16 MiB moved), with
V transposed (the moved cells are columns: the AVX-512 path where the processor has it, and the
scalar one, four rows at a time with a remainder, under KVCACHE_NO_AVX512) and not, f16 and f32,
rows of any length (on and off 64-byte lines, shorter than the vector path's window), plans whose
sources are spread thinly, and on a small cache (ordinary copies)."""
import numpy as np
import pytest

from kvcache import UBatch, UnifiedCache


def fragmented(kv_size, n_layer, widths, type_, v_trans, seed, sparse_top=False):
    rng = np.random.default_rng(seed)
    c = UnifiedCache(kv_size=kv_size, n_layer=n_layer, n_embd_k_gqa=widths, n_embd_v_gqa=widths,
                     type_k=type_, type_v=type_, v_trans=v_trans, n_seq_max=8, n_pad=2)
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
    if sparse_top:
        # the upper half nearly empty: each chunk's sources spread far apart
        for i in range(kv_size):
            if rng.random() < (0.9 if i >= kv_size // 2 else 0.3):
                c.seq_rm(int(seqs[i]), pos[i], pos[i] + 1)
        return c
    while c.used > kv_size // 2:
        s = int(rng.integers(0, 8))
        p = int(rng.integers(0, nxt[s]))
        c.seq_rm(s, p, p + 4)
    return c


@pytest.fixture(params=["auto", "scalar"])
def column_path(request, monkeypatch):
    """The transposed-V moves' path: whatever the processor allows, or the scalar one."""
    if request.param == "scalar":
        monkeypatch.setenv("KVCACHE_NO_AVX512", "1")
    else:
        monkeypatch.delenv("KVCACHE_NO_AVX512", raising=False)
    return request.param


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("type_,kv_size,n_layer,widths,sparse_top", [
    ("f16", 4096, 8, [1024] * 7 + [1030], False),     # >= 16 MiB moved: streamed
    ("f32", 2048, 4, [1024, 1024, 1025, 1024], False),
    ("f16", 256, 3, [8, 13, 6], False),                # small: ordinary copies
    ("f16", 1000, 2, [37, 64], False),                 # V rows of 2000 bytes: off 64-byte lines
    ("f32", 70, 2, [9, 16], False),                    # last 16-lane chunk overlaps the one before
    ("f16", 40, 2, [5, 7], False),                     # rows shorter than a 64-element window
    ("f16", 2048, 2, [33, 64], True),                  # sources spread thinly: windows split
    ("f32", 1024, 2, [17, 32], True),
])
def test_moves_match_the_plan(v_trans, type_, kv_size, n_layer, widths, sparse_top, column_path):
    c = fragmented(kv_size, n_layer, widths, type_, v_trans, seed=kv_size + n_layer, sparse_top=sparse_top)
    before = [(c.k(il).copy(), c.v(il).copy()) for il in c.layers]
    assert c.defrag_prepare(2**31 - 1)
    runs = c.defrag_runs()
    moved = int(runs[:, 2].sum())
    assert moved > kv_size // 16
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


@pytest.mark.parametrize("n_threads", [1, 64])
def test_threads_of_a_large_move(n_threads):
    """A streamed move shared among the layers' threads (or kept on the caller's) moves the same."""
    c = fragmented(4096, 8, [1024] * 8, "f16", True, seed=5)
    ref = fragmented(4096, 8, [1024] * 8, "f16", True, seed=5)
    assert c.n_threads == 0                              # the default: as many as useful
    c.n_threads = n_threads
    assert c.n_threads == n_threads
    assert c.defrag_prepare(2**31 - 1) and ref.defrag_prepare(2**31 - 1)
    c.defrag_move()
    ref.defrag_move()
    for il in c.layers:
        assert np.array_equal(c.k(il), ref.k(il)) and np.array_equal(c.v(il), ref.v(il)), il


def test_n_threads_is_checked():
    c = UnifiedCache(64, 1, 4, 4)
    for bad, exc in ((65, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="n_threads"):
            c.n_threads = bad
        assert c.n_threads == 0
