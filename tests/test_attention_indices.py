"""Attention indices (UnifiedCache.attention_indices, ISWACache.attention_indices,
kvcache.torch_attention): for random caches of both semantics (many sequences, shared prefixes
from seq_cp, holes from seq_rm, shifts from seq_add, sliding windows, a stream per sequence, 2-D
positions), the cells each token sees through the indices are exactly the cells its KQ mask
shows, and attention through the indices (torch, both of its paths) equals attention through
the dense mask to 1e-5; out= buffers reused; the refusals of bad arguments; FlashInfer against
the torch reference where a GPU and FlashInfer are there."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvcache import AttentionIndices, ISWACache, UBatch, UnifiedCache

from conftest import need_module

N_SEQ = 6


def make_cache(semantics, kv_size=256, per_seq=False, swa=("none", 0), ext=False, n_seq=N_SEQ):
    return UnifiedCache(kv_size=kv_size, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=n_seq, n_pad=1,
                        swa_type=swa[0], n_swa=swa[1], buffers=None, semantics=semantics,
                        kv_unified=not per_seq, cell_ext=ext)


def random_ubatch(c, rng, per_seq, ext, n_seq=N_SEQ):
    """Runs of tokens of random sequences after each one's last position (with a stream per
    sequence: each sequence's tokens together, as many for each), now and then a gap, two
    tokens swapped, a second id, or (2-D) a repeated position."""
    nxt = [c.seq_pos_max(s) + 1 + (int(rng.integers(0, 4)) if rng.random() < 0.1 else 0) for s in range(n_seq)]
    decode = rng.random() < 0.4
    pos, ids, xs, ys = [], [], [], []
    if per_seq:
        seqs = rng.permutation(n_seq)[:int(rng.integers(1, n_seq + 1))]
        runs = [(int(s), 1 if decode else int(rng.integers(1, 5))) for s in seqs]
        per = runs[0][1]
        runs = [(s, per) for s, _ in runs]
    else:
        runs = [(int(rng.integers(0, n_seq)), 1 if decode else int(rng.integers(1, 7)))
                for _ in range(int(rng.integers(1, 8)))]
    for s, n in runs:
        for i in range(n):
            repeat = ext and i > 0 and rng.random() < 0.4
            p = pos[-1] if repeat else nxt[s]
            if not repeat:
                nxt[s] += 1
            pos.append(p)
            extra = (s + 1) % n_seq
            ids.append([s, extra] if not per_seq and rng.random() < 0.1 else [s])
            xs.append(int(rng.integers(0, 3)))
            ys.append(int(rng.integers(0, 2)))
        if n > 1 and rng.random() < 0.1 and not ext:
            pos[-1], pos[-2] = pos[-2], pos[-1]
    kw = dict(pos_x=xs, pos_y=ys) if ext else {}
    return UBatch(pos, ids, **kw)


def random_op(c, rng, per_seq, n_seq=N_SEQ):
    s, d = (int(x) for x in rng.integers(0, n_seq, size=2))
    top = max(c.seq_pos_max(s), 0)
    p = int(rng.integers(0, top + 1))
    op = rng.integers(0, 6)
    if op == 0:
        c.seq_rm(s, p, p + int(rng.integers(1, 5)))
    elif op == 1 and not per_seq and s != d:
        c.seq_rm(d, -1, -1)
        c.seq_cp(s, d, 0, p)
    elif op == 2:
        c.seq_add(s, p, -1, int(rng.integers(-3, 4)))
    elif op == 3 and rng.random() < 0.3:
        c.seq_rm(s, -1, -1)


def mask_rows(c, ub, causal):
    """The bool KQ mask of ub as [n_tokens, cols] and each token's stream."""
    m = np.asarray(c.kq_mask(ub, causal=causal, dtype="bool", pad=False))
    if m.ndim == 3:
        n_groups, nst = m.shape[:2]
        streams = [g for g, _ in c.slot_info()]
        return m.reshape(n_groups * nst, -1), np.repeat(streams, nst)
    return m, np.zeros(m.shape[0], dtype=np.int64)


def token_rows(idx):
    """Each token's K/V rows as the groups' rule gives them."""
    out = {}
    for g in range(len(idx.qo_indptr) - 1):
        t0, t1 = int(idx.qo_indptr[g]), int(idx.qo_indptr[g + 1])
        rows = idx.kv_indices[idx.kv_indptr[g]:idx.kv_indptr[g + 1]]
        q, L = t1 - t0, len(rows)
        for i in range(q):
            out[t0 + i] = rows[:L - q + i + 1] if idx.causal[g] else rows
    return out


def check_against_mask(c, ub, causal):
    idx = c.attention_indices(ub, causal=causal, positions=True)
    m, streams = mask_rows(c, ub, causal)
    assert idx.n_kv == m.shape[1]
    q_len = np.diff(idx.qo_indptr)
    assert (idx.causal == (causal & (q_len > 1))).all()
    rows = token_rows(idx)
    size = c.size
    for t in range(ub.n_tokens):
        got = np.sort(rows[t])
        st = int(streams[t])
        want = np.flatnonzero(m[t]) + st * size
        np.testing.assert_array_equal(got, want, err_msg=f"token {t}, causal {causal}")
    for g in range(len(idx.stream)):
        a, b = idx.kv_indptr[g], idx.kv_indptr[g + 1]
        cells = idx.kv_indices[a:b] - idx.stream[g] * size
        np.testing.assert_array_equal(idx.kv_pos[a:b], c.stream_cells()[idx.stream[g]].pos[cells])
        key = idx.kv_pos[a:b].astype(np.int64) << 32 | cells
        assert (np.diff(key) > 0).all(), "rows ordered by position, then cell"
    return idx


CONFIGS = [
    ("2025", False, ("none", 0), False),
    ("2025", False, ("standard", 7), False),
    ("2025", False, ("chunked", 5), False),
    ("2026", False, ("none", 0), False),
    ("2026", True, ("none", 0), False),
    ("2026", True, ("standard", 6), False),
    ("2026", False, ("none", 0), True),
    ("2026", True, ("chunked", 4), True),
]


def drive(cfg, seed, steps, each):
    semantics, per_seq, swa, ext = cfg
    rng = np.random.default_rng(seed)
    c = make_cache(semantics, per_seq=per_seq, swa=swa, ext=ext)
    placed = 0
    for _ in range(steps):
        random_op(c, rng, per_seq)
        ub = random_ubatch(c, rng, per_seq, ext)
        if not c.find_slot(ub):
            c.clear()
            continue
        if semantics == "2025":
            c.commit()
        placed += 1
        each(c, ub)
    assert placed > steps // 2
    return c


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda cfg: "-".join(map(str, cfg)))
def test_indices_are_the_mask(cfg):
    def each(c, ub):
        check_against_mask(c, ub, True)
        check_against_mask(c, ub, False)
    drive(cfg, 11, 120, each)


@settings(deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cfg=st.sampled_from(CONFIGS))
def test_indices_are_the_mask_hypothesis(seed, cfg):
    def each(c, ub):
        check_against_mask(c, ub, bool(seed & 1))
    drive(cfg, seed, 12, each)


def _dense_attention(torch, c, ub, q, k, v, causal):
    """SDPA with the ubatch's KQ mask over every K/V row (each token's stream's columns)."""
    m, streams = mask_rows(c, ub, causal)
    full = np.zeros((ub.n_tokens, k.shape[0]), dtype=np.bool_)
    for t in range(ub.n_tokens):
        base = int(streams[t]) * c.size
        full[t, base:base + m.shape[1]] = m[t]
    F = torch.nn.functional
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=torch.from_numpy(full), enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda cfg: "-".join(map(str, cfg)))
def test_attention_through_indices_is_attention_through_the_mask(cfg):
    torch = need_module("torch", "torch")
    from kvcache.torch_attention import attention_from_indices

    gen = torch.Generator().manual_seed(5)
    n_rows = 256 * (N_SEQ if cfg[1] else 1)
    k = torch.randn(n_rows, 2, 16, generator=gen)
    v = torch.randn(n_rows, 2, 8, generator=gen)

    def each(c, ub):
        for causal in (True, False):
            idx = c.attention_indices(ub, causal=causal)
            q = torch.randn(ub.n_tokens, 4, 16, generator=gen)
            want = _dense_attention(torch, c, ub, q, k, v, causal)
            for dense_at in (0.0, float("inf")):
                got = attention_from_indices(q, k, v, idx, dense_at=dense_at)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    drive(cfg, 23, 40, each)


def test_decode_of_many_sequences_batches_by_length():
    torch = need_module("torch", "torch")
    from kvcache.torch_attention import attention_from_indices

    c = make_cache("2025", kv_size=4096, n_seq=64)
    rng = np.random.default_rng(1)
    lens = rng.integers(1, 40, size=64)
    for s, n in enumerate(lens):
        ub = UBatch(list(range(int(n))), [s] * int(n))
        assert c.find_slot(ub)
        c.commit()
    ub = UBatch([int(n) for n in lens], list(range(64)))
    assert c.find_slot(ub)
    idx = c.attention_indices(ub)
    assert len(idx.causal) == 64 and not idx.causal.any()
    assert len(idx.kv_indices) == int(lens.sum()) + 64
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(4096, 2, 16, generator=gen), torch.randn(4096, 2, 16, generator=gen)
    q = torch.randn(64, 2, 16, generator=gen)
    want = _dense_attention(torch, c, ub, q, k, v, True)
    torch.testing.assert_close(attention_from_indices(q, k, v, idx), want, atol=1e-5, rtol=1e-5)
    # the dense path with the cache's own mask
    buf = np.empty((64, 4096), np.bool_)
    got = attention_from_indices(q, k, v, idx, dense_at=0.0,
                                 mask=lambda: c.kq_mask(ub, pad=False, dtype="bool", out=buf))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"mask\(\) must give a bool mask \[n_tokens, n_kv\] of one stream"):
        attention_from_indices(q, k, v, idx, dense_at=0.0, mask=lambda: buf[:3])


def test_iswa_has_one_set_per_half():
    c = ISWACache(kv_size=256, n_layer=2, n_embd_k_gqa=4, n_embd_v_gqa=4, swa_layers=[1], n_swa=8,
                  n_seq_max=2, buffers=None, n_pad=1)
    for p in range(0, 40, 5):
        ub = UBatch(list(range(p, p + 5)) + [p], [0] * 5 + [1])
        assert c.find_slot(ub)
        if hasattr(c, "commit"):
            c.commit()
        base, swa = c.attention_indices(ub)
        for half, idx in ((c.base, base), (c.swa, swa)):
            np.testing.assert_array_equal(half.attention_indices(ub).kv_indices, idx.kv_indices)
        m_swa = np.asarray(c.kq_mask(ub, dtype="bool", pad=False)[1])
        rows = token_rows(swa)
        for t in range(ub.n_tokens):
            np.testing.assert_array_equal(np.sort(rows[t]), np.flatnonzero(m_swa[t]))
    bufs = (AttentionIndices.buffers(8, 64), AttentionIndices.buffers(8, 64))
    base, swa = c.attention_indices(ub, out=bufs)
    assert np.shares_memory(base.kv_indices, bufs[0].kv_indices)
    assert np.shares_memory(swa.kv_indices, bufs[1].kv_indices)


def test_out_buffers_are_reused_and_filled():
    c = make_cache("2026", kv_size=512)
    buf = AttentionIndices.buffers(8, 512, positions=True)
    for p in range(20):
        ub = UBatch([p, p, p], [0, 1, 2])
        assert c.find_slot(ub)
        got = c.attention_indices(ub, out=buf, positions=True)
        fresh = c.attention_indices(ub, positions=True)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "causal", "stream", "kv_pos"):
            np.testing.assert_array_equal(getattr(got, name), getattr(fresh, name))
            assert np.shares_memory(getattr(got, name), getattr(buf, name))
        assert got.n_kv == fresh.n_kv
    assert got.kv_indices.dtype == np.int32 and got.causal.dtype == np.bool_


def test_bad_arguments():
    c = make_cache("2025")
    ub = UBatch([0, 1, 2], [0, 0, 1])
    with pytest.raises(ValueError, match="not the one last placed"):
        c.attention_indices(ub)
    assert c.find_slot(ub)
    c.commit()
    other = UBatch([5, 6, 7], [0, 0, 1])
    with pytest.raises(ValueError, match="not the one last placed"):
        c.attention_indices(other)
    with pytest.raises(TypeError, match="ub must be a kvcache.UBatch"):
        c.attention_indices([0, 1, 2])
    with pytest.raises(TypeError, match="causal must be a bool"):
        c.attention_indices(ub, causal=1)
    with pytest.raises(TypeError, match="positions must be a bool"):
        c.attention_indices(ub, positions="yes")
    with pytest.raises(TypeError, match="out must be a kvcache.AttentionIndices"):
        c.attention_indices(ub, out=np.zeros(10, np.int32))
    good = AttentionIndices.buffers(4, 16)
    with pytest.raises(ValueError, match=r"out.kv_indices must be a writable contiguous 1-D int32 array, got int64"):
        c.attention_indices(ub, out=good._replace(kv_indices=np.zeros(16, np.int64)))
    with pytest.raises(ValueError, match=r"out.causal must be a writable contiguous 1-D bool array"):
        c.attention_indices(ub, out=good._replace(causal=np.zeros(4, np.int32)))
    with pytest.raises(ValueError, match=r"out.qo_indptr must be a writable contiguous 1-D int32"):
        c.attention_indices(ub, out=good._replace(qo_indptr=np.zeros((5, 1), np.int32)))
    with pytest.raises(ValueError, match=r"out.kv_indptr must be a writable contiguous 1-D int32"):
        c.attention_indices(ub, out=good._replace(kv_indptr=np.zeros(10, np.int32)[::2]))
    with pytest.raises(ValueError, match="out.kv_indices is read-only"):
        ro = np.zeros(16, np.int32)
        ro.flags.writeable = False
        c.attention_indices(ub, out=good._replace(kv_indices=ro))
    with pytest.raises(ValueError, match=r"out is too small for 2 groups and 3 indices \(out.kv_indices has 2 "
                                         r"entries, needs 3\)"):
        c.attention_indices(ub, out=AttentionIndices.buffers(4, 2))
    with pytest.raises(ValueError, match=r"out.qo_indptr has 2 entries, needs 3"):
        c.attention_indices(ub, out=AttentionIndices.buffers(1, 16))
    with pytest.raises(ValueError, match=r"out.kv_pos must be a writable 1-D int32 array \(positions=True"):
        c.attention_indices(ub, positions=True, out=good)
    with pytest.raises(ValueError, match=r"n_indices"):
        AttentionIndices.buffers(4, -1)
    # a failed call leaves the cache as it was: the placement stays, the indices are the same
    np.testing.assert_array_equal(c.attention_indices(ub).kv_indices, [0, 1, 2])
    c.seq_rm(1, 0, 1)
    with pytest.raises(ValueError, match="not the one last placed"):
        c.attention_indices(ub)


def test_torch_reference_bad_arguments():
    torch = need_module("torch", "torch")
    from kvcache.torch_attention import attention_from_indices

    c = make_cache("2025")
    ub = UBatch([0, 1], [0, 0])
    assert c.find_slot(ub)
    idx = c.attention_indices(ub)
    q, k = torch.zeros(2, 2, 4), torch.zeros(8, 1, 4)
    with pytest.raises(TypeError, match="idx must be a kvcache.AttentionIndices"):
        attention_from_indices(q, k, k, tuple(idx))
    with pytest.raises(ValueError, match="q must have one row per token of the ubatch"):
        attention_from_indices(q[:1], k, k, idx)
    with pytest.raises(ValueError, match="k and v must hold every row"):
        attention_from_indices(q, k[:1], k[:1], idx)
    with pytest.raises(ValueError, match="multiple of k's"):
        attention_from_indices(torch.zeros(2, 3, 4), torch.zeros(8, 2, 4), torch.zeros(8, 2, 4), idx)


def test_flashinfer_matches_the_torch_reference():
    torch = need_module("torch", "torch")
    if not torch.cuda.is_available():
        pytest.skip("FlashInfer needs a CUDA GPU, and there is none")
    flashinfer = pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
    from kvcache.torch_attention import attention_from_indices

    c = make_cache("2025", kv_size=4096, n_seq=32)
    rng = np.random.default_rng(4)
    for s in range(32):
        n = int(rng.integers(1, 300))
        assert c.find_slot(UBatch(list(range(n)), [s] * n))
        c.commit()
        if s % 3 == 0:
            c.seq_rm(s, n // 3, n // 3 + 5)   # a hole
    ub = UBatch([c.seq_pos_max(s) + 1 for s in range(32)], list(range(32)))
    assert c.find_slot(ub)
    idx = c.attention_indices(ub)
    dev = torch.device("cuda")
    H, Hkv, D = 8, 8, 128
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(4096, Hkv, D, generator=gen)
    v = torch.randn(4096, Hkv, D, generator=gen)
    q = torch.randn(ub.n_tokens, H, D, generator=gen)
    want = attention_from_indices(q, k, v, idx, dense_at=float("inf"))
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)   # noqa: E731
    w.plan(as_t(idx.kv_indptr), as_t(idx.kv_indices), as_t(np.ones(len(idx.causal), np.int32)), H, Hkv, D, 1,
           q_data_type=torch.float32, kv_data_type=torch.float32)
    got = w.run(q.to(dev), (k.to(dev)[:, None], v.to(dev)[:, None]))
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=2e-3)
