"""Attention indices (UnifiedCache.attention_indices, ISWACache.attention_indices,
kvcache.torch_attention): for random caches of both semantics (many sequences, shared prefixes
from seq_cp, holes from seq_rm, shifts from seq_add, sliding windows, a stream per sequence, 2-D
positions), the cells each token sees through the indices are exactly the cells its KQ mask
shows, and attention through the indices (torch, both of its paths) equals attention through
the dense mask to 1e-5, with ALiBi too; across decode steps and sequence operations the indices
written into reused out= buffers equal a build from scratch (from the cells' table alone); the
hybrid memory's attention part; how the torch function chooses its path; the refusals of bad
arguments; FlashInfer against the torch reference where a GPU and FlashInfer are there."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvcache import AttentionIndices, HybridCache, ISWACache, UBatch, UnifiedCache

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


def mask_rows(c, ub, causal, alibi=False):
    """The bool KQ mask of ub (with alibi, the f32 one of alibi=True) as [n_tokens, cols] and
    each token's stream."""
    if alibi:
        m = np.asarray(c.kq_mask(ub, causal=causal, alibi=True, dtype="f32", pad=False))
    else:
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
    assert idx.span == (int(idx.kv_indices.max()) + 1 if len(idx.kv_indices) else 0)
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


def _dense_attention(torch, c, ub, q, k, v, causal, slopes=None):
    """SDPA with the ubatch's KQ mask over every K/V row (each token's stream's columns); with
    slopes, ALiBi as llama.cpp's softmax applies it: head h adds slopes[h] times the mask of
    alibi=True (-|distance|, -inf hidden)."""
    m, streams = mask_rows(c, ub, causal, alibi=slopes is not None)
    full = np.full((ub.n_tokens, k.shape[0]), False if slopes is None else -np.inf, dtype=m.dtype)
    for t in range(ub.n_tokens):
        base = int(streams[t]) * c.size
        full[t, base:base + m.shape[1]] = m[t]
    mask = torch.from_numpy(full)
    if slopes is not None:
        mask = torch.where(torch.isinf(mask), mask, slopes[:, None, None] * mask)[None]
    F = torch.nn.functional
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def _random_kv(torch, cfg, seed):
    """A seeded generator and random K / V rows (2 heads) for every cell of the config's cache."""
    gen = torch.Generator().manual_seed(seed)
    n_rows = 256 * (N_SEQ if cfg[1] else 1)
    return gen, torch.randn(n_rows, 2, 16, generator=gen), torch.randn(n_rows, 2, 8, generator=gen)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda cfg: "-".join(map(str, cfg)))
def test_attention_through_indices_is_attention_through_the_mask(cfg):
    torch = need_module("torch", "torch")
    from kvcache.torch_attention import attention_from_indices

    gen, k, v = _random_kv(torch, cfg, 5)

    def each(c, ub):
        for causal in (True, False):
            idx = c.attention_indices(ub, causal=causal)
            q = torch.randn(ub.n_tokens, 4, 16, generator=gen)
            want = _dense_attention(torch, c, ub, q, k, v, causal)
            for dense_at in (0.0, float("inf")):
                got = attention_from_indices(q, k, v, idx, dense_at=dense_at)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    drive(cfg, 23, 40, each)


def alibi_slopes(torch, n_head, max_bias=8.0):
    """llama.cpp's ALiBi slopes for n_head heads (a power of two here)."""
    return torch.tensor([2.0 ** (-max_bias * (h + 1) / n_head) for h in range(n_head)])


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda cfg: "-".join(map(str, cfg)))
def test_alibi_through_indices_is_alibi_through_the_mask(cfg):
    torch = need_module("torch", "torch")
    from kvcache.torch_attention import attention_from_indices

    gen, k, v = _random_kv(torch, cfg, 7)
    slopes = alibi_slopes(torch, 4)

    def each(c, ub):
        for causal in (True, False):
            idx = c.attention_indices(ub, causal=causal, positions=True)
            np.testing.assert_array_equal(idx.q_pos, ub.pos)
            q = torch.randn(ub.n_tokens, 4, 16, generator=gen)
            want = _dense_attention(torch, c, ub, q, k, v, causal, slopes)
            for dense_at in (0.0, float("inf")):
                got = attention_from_indices(q, k, v, idx, dense_at=dense_at, alibi_slopes=slopes)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            if not cfg[1]:
                # the dense path with the cache's own float mask of alibi=True
                got = attention_from_indices(q, k, v, idx, dense_at=0.0, alibi_slopes=slopes,
                                             mask=lambda: c.kq_mask(ub, causal=causal, alibi=True, pad=False))
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    drive(cfg, 29, 30, each)


def cells_reference(c, ub):
    """The rows each token of a decode step (one token per group, causal, no window, 1-D)
    attends to, found from the cells' table alone (positions and sequence bits of every cell,
    no per-sequence index): the cells of its stream holding its sequence at its position or
    before, below the mask's width, ordered by position, then cell."""
    tables = c.stream_cells()
    streams = [g for g, cells in c.slot_info() for _ in cells]
    n_kv = np.asarray(c.kq_mask(ub, dtype="bool", pad=False)).shape[-1]
    out = []
    for t in range(ub.n_tokens):
        st, s, p = streams[t], int(ub.seq_id[t][0]), int(ub.pos[t])
        cells = tables[st]
        has = (cells.seq_mask[:n_kv, s // 64] >> np.uint64(s % 64)) & np.uint64(1) == 1
        pos = cells.pos[:n_kv]
        pick = np.flatnonzero(has & (pos >= 0) & (pos <= p))
        pick = pick[np.lexsort((pick, pos[pick]))]
        out.append(pick + st * c.size)
    return out


@pytest.mark.parametrize("semantics,per_seq", [("2025", False), ("2026", False), ("2026", True)])
def test_decode_steps_into_reused_buffers_equal_a_build_from_scratch(semantics, per_seq):
    """A server's loop: decode steps of many sequences into the same out= buffers, with
    sequence operations between them (holes, shared prefixes, shifts applied by update(),
    sequences dropped and started again); after every step the indices equal a fresh call and a
    build from the cells' table alone."""
    n_seq = 16
    rng = np.random.default_rng(3)
    c = UnifiedCache(kv_size=1024, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=n_seq, n_pad=1,
                     buffers=None, semantics=semantics, kv_unified=not per_seq)
    for s in range(n_seq):
        n = int(rng.integers(1, 30))
        assert c.find_slot(UBatch(list(range(n)), [s] * n))
        if semantics == "2025":
            c.commit()
    buf = AttentionIndices.buffers(n_seq, c.size * c.n_stream, positions=True)
    steps = 0
    for step in range(60):
        op = int(rng.integers(0, 6))
        s, d = (int(x) for x in rng.integers(0, n_seq, size=2))
        top = c.seq_pos_max(s)
        if op == 0 and top > 2:
            p = int(rng.integers(0, top))
            c.seq_rm(s, p, p + int(rng.integers(1, 4)))
        elif op == 1 and not per_seq and s != d and top >= 0:
            c.seq_rm(d, -1, -1)
            c.seq_cp(s, d, 0, int(rng.integers(0, top + 1)))
        elif op == 2 and top > 0:
            c.seq_add(s, int(rng.integers(0, top + 1)), -1, int(rng.integers(-2, 3)))
            c.update()
        elif op == 3 and rng.random() < 0.2:
            c.seq_rm(s, -1, -1)
        seqs = sorted(int(x) for x in rng.permutation(n_seq)[:int(rng.integers(1, n_seq + 1))])
        if per_seq:
            seqs = list(range(seqs[0], seqs[0] + len(seqs)))
        ub = UBatch([c.seq_pos_max(s) + 1 for s in seqs], seqs)
        if not c.find_slot(ub):
            continue
        if semantics == "2025":
            c.commit()
        steps += 1
        got = c.attention_indices(ub, out=buf, positions=True)
        assert np.shares_memory(got.kv_indices, buf.kv_indices)
        fresh = c.attention_indices(ub, positions=True)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "causal", "stream", "kv_pos", "q_pos"):
            np.testing.assert_array_equal(getattr(got, name), getattr(fresh, name), err_msg=name)
        ref = cells_reference(c, ub)
        assert len(got.causal) == ub.n_tokens
        for t in range(ub.n_tokens):
            np.testing.assert_array_equal(got.kv_indices[got.kv_indptr[t]:got.kv_indptr[t + 1]], ref[t],
                                          err_msg=f"step {step}, token {t}")
    assert steps > 40


def test_hybrid_attention_part():
    """HybridCache.attention_indices: the attention part's, exactly the cells of the hybrid's
    KQ mask (the attention layers'), across prompts, decode steps and sequence operations."""
    torch = need_module("torch", "torch")
    from kvcache.torch_attention import attention_from_indices

    h = HybridCache(kv_size=512, n_layer=4, recurrent_layers=[0, 2], n_embd_k_gqa=32, n_embd_v_gqa=32,
                    n_embd_r=16, n_seq_max=4, buffers=None)
    gen = torch.Generator().manual_seed(9)
    k, v = torch.randn(512, 2, 16, generator=gen), torch.randn(512, 2, 16, generator=gen)
    buf = AttentionIndices.buffers(64, 512, positions=True)
    checked = 0

    def check(ub):
        nonlocal checked
        idx = h.attention_indices(ub, out=buf, positions=True)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "causal", "kv_pos", "q_pos"):
            np.testing.assert_array_equal(getattr(idx, name), getattr(h.attn.attention_indices(ub, positions=True),
                                                                      name))
        m, _ = mask_rows(h, ub, True)
        rows = token_rows(idx)
        for t in range(ub.n_tokens):
            np.testing.assert_array_equal(np.sort(rows[t]), np.flatnonzero(m[t]))
        q = torch.randn(ub.n_tokens, 2, 16, generator=gen)
        want = _dense_attention(torch, h.attn, ub, q, k, v, True)
        torch.testing.assert_close(attention_from_indices(q, k, v, idx, dense_at=float("inf")), want,
                                   atol=1e-5, rtol=1e-5)
        checked += 1

    for s, n in enumerate([7, 20, 3, 12]):
        for ub in h.ubatches(list(range(n)), [s] * n, 8):
            assert h.find_slot(ub)
            check(ub)
    rng = np.random.default_rng(5)
    for step in range(12):
        if step == 4:
            h.seq_rm(2, -1, -1)               # a sequence ends; the recurrent part allows only whole ones
        if step == 8:
            h.seq_cp(1, 2)                    # a fork shares sequence 1's cells
        seqs = [s for s in range(4) if rng.random() < 0.8 or s == 0]
        ub = UBatch([h.seq_pos_max(s) + 1 for s in seqs], seqs)
        assert h.find_slot(ub)
        check(ub)
    assert checked > 15
    with pytest.raises(ValueError, match="not the one last placed"):
        h.attention_indices(UBatch([0], [3]))


def test_the_dense_path_is_chosen_by_the_documented_rule():
    torch = need_module("torch", "torch")
    from kvcache.torch_attention import DENSE_READ, GATHER_COPY, attention_from_indices, path_work, takes_dense_path

    def step(n_seq, held, span=1024):
        """A decode step of n_seq sequences, each in its own block of span // n_seq cells
        holding `held` of them (the last cell of the last block placed, so the mask spans all)."""
        c = make_cache("2025", kv_size=span + n_seq, n_seq=n_seq)
        block = span // n_seq
        for s in range(n_seq):
            assert c.find_slot(UBatch(list(range(block)), [s] * block))
            c.commit()
        for s in range(n_seq):
            c.seq_rm(s, max(int(held * block) - 1, 1), -1 if s < n_seq - 1 else block - 1)
        ub = UBatch([c.seq_pos_max(s) + 1 for s in range(n_seq)], list(range(n_seq)))
        assert c.find_slot(ub)
        c.commit()
        return c, ub, c.attention_indices(ub)

    c, ub, idx = step(4, 0.5)
    nnz, span = len(idx.kv_indices), int(idx.kv_indices.max()) + 1
    gather, dense = path_work(idx)
    assert (gather, dense) == (nnz * (GATHER_COPY + 1), span * (DENSE_READ + 4))
    assert takes_dense_path(idx, gather / dense) and not takes_dense_path(idx, gather / dense * 1.0001)
    assert takes_dense_path(idx, 0.0) and not takes_dense_path(idx, float("inf"))
    # one sequence: dense from about a third of the span on; 8: about a half; 64: never
    assert not takes_dense_path(step(1, 0.25)[2]) and takes_dense_path(step(1, 0.4)[2])
    assert not takes_dense_path(step(8, 0.45)[2]) and takes_dense_path(step(8, 0.6)[2])
    assert not takes_dense_path(step(64, 1.0)[2])
    # a prefill chunk of several tokens weighs its tokens on both sides
    c2 = make_cache("2025", kv_size=1024, n_seq=1)
    assert c2.find_slot(UBatch(list(range(500)), [0] * 500))
    c2.commit()
    chunk = UBatch(list(range(500, 564)), [0] * 64)
    assert c2.find_slot(chunk)
    pidx = c2.attention_indices(chunk)
    assert path_work(pidx) == (564 * (GATHER_COPY + 64), 564 * (DENSE_READ + 64))
    # the dense path taken is the dense kernel: the mask function is called exactly then
    calls = []

    def mask():
        calls.append(1)
        return c.kq_mask(ub, pad=False, dtype="bool")

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 2, 8, generator=gen), torch.randn(c.size, 2, 8, generator=gen)
    a = attention_from_indices(q, k, k, idx, dense_at=gather / dense, mask=mask)
    b = attention_from_indices(q, k, k, idx, dense_at=gather / dense * 1.0001, mask=mask)
    assert len(calls) == 1
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # one sequence holding every spanned row: the dense kernel without a mask (it would hide nothing)
    c1, ub1, idx1 = step(1, 1.0)
    assert takes_dense_path(idx1) and len(idx1.kv_indices) == int(idx1.kv_indices.max()) + 1
    q1 = torch.randn(1, 2, 8, generator=gen)
    got = attention_from_indices(q1, k, k, idx1, mask=mask)
    assert len(calls) == 1
    torch.testing.assert_close(got, _dense_attention(torch, c1, ub1, q1, k, k, True), atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="idx must be a kvcache.AttentionIndices"):
        takes_dense_path(tuple(idx))


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
    with pytest.raises(ValueError, match=r"mask\(\) must give a KQ mask \[n_tokens, n_kv\] of one stream"):
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
        assert got.n_kv == fresh.n_kv and got.span == fresh.span
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
    with pytest.raises(ValueError, match=r"out.q_pos must be a writable 1-D int32 array \(positions=True"):
        c.attention_indices(ub, positions=True, out=good._replace(kv_pos=np.zeros(16, np.int32)))
    with pytest.raises(ValueError, match=r"out.q_pos must be a writable contiguous 1-D int32 array, got int64"):
        c.attention_indices(ub, positions=True, out=AttentionIndices.buffers(4, 16, positions=True)._replace(
            q_pos=np.zeros(4, np.int64)))
    with pytest.raises(ValueError, match=r"out is too small for 2 groups and 3 indices of 3 tokens \(out.q_pos has 2 "
                                         r"entries, needs 3\)"):
        c.attention_indices(ub, positions=True, out=AttentionIndices.buffers(4, 16, positions=True, n_tokens=2))
    with pytest.raises(ValueError, match=r"n_indices"):
        AttentionIndices.buffers(4, -1)
    with pytest.raises(ValueError, match=r"n_tokens"):
        AttentionIndices.buffers(4, 4, positions=True, n_tokens=-1)
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
    with pytest.raises(ValueError, match=r"alibi_slopes needs the indices' positions \(attention_indices\(\.\.\., "
                                         r"positions=True\)\)"):
        attention_from_indices(q, k, k, idx, alibi_slopes=torch.ones(2))
    pidx = c.attention_indices(ub, positions=True)
    with pytest.raises(ValueError, match=r"alibi_slopes must be a 1-D tensor of one slope per head of q \(2\), "
                                         r"got \(3,\)"):
        attention_from_indices(q, k, k, pidx, alibi_slopes=torch.ones(3))
    for bad in (torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 1.0]), torch.ones(2, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"alibi_slopes must be finite floating-point slopes"):
            attention_from_indices(q, k, k, pidx, alibi_slopes=bad)
    with pytest.raises(ValueError, match=r"alibi_slopes must be a 1-D tensor of one slope per head of q \(2\), "
                                         r"got \(2,\)"):
        attention_from_indices(q, k, k, pidx, alibi_slopes=np.ones(2, dtype=np.float32))
    with pytest.raises(ValueError, match=r"with alibi_slopes, mask\(\) must give the float KQ mask of alibi=True"):
        attention_from_indices(q, k, k, pidx, alibi_slopes=torch.ones(2), dense_at=0.0,
                               mask=lambda: c.kq_mask(ub, pad=False, dtype="bool"))


@pytest.mark.parametrize("dense_at", [0.0, float("inf")])
def test_torch_reference_checks_the_indices_it_is_given(dense_at):
    """Indices built or changed by the caller are checked at the edge, on both paths alike: a
    ValueError naming the field, never garbage, a wrapped index or an IndexError from inside."""
    torch = need_module("torch", "torch")
    from kvcache.torch_attention import attention_from_indices, dense_mask, path_work, takes_dense_path

    c = make_cache("2025", n_seq=4)
    for s, n in enumerate([5, 3, 7, 2]):
        assert c.find_slot(UBatch(list(range(n)), [s] * n))
        c.commit()
    ub = UBatch([5, 3, 7, 2], [0, 1, 2, 3])
    assert c.find_slot(ub)
    idx = c.attention_indices(ub, positions=True)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 2, 8, generator=gen), torch.randn(c.size, 2, 8, generator=gen)
    want = attention_from_indices(q, k, k, idx, dense_at=dense_at)

    def edited(name, i, value):
        a = getattr(idx, name).copy()
        a[i] = value
        return idx._replace(**{name: a})

    for bad, match in (
            (edited("kv_indices", 0, -1), r"idx.kv_indices must name K/V rows \(>= 0\), got idx.kv_indices\[0\] = -1"),
            (edited("kv_indices", 0, 1000), r"idx.span must be max\(idx.kv_indices\) \+ 1 = 1001, got 21"),
            (idx._replace(span=2), r"idx.span must be max\(idx.kv_indices\) \+ 1 = 21, got 2"),
            (idx._replace(span=21.0), r"idx.span must be"),
            (idx._replace(qo_indptr=np.array([0, 2, 1, 3, 4], np.int32)),
             r"idx.qo_indptr must never decrease: idx.qo_indptr\[2\] = 1 follows 2"),
            (edited("qo_indptr", 0, 1), r"idx.qo_indptr must start at 0"),
            (idx._replace(kv_indptr=np.array([0, 6, 100, 18, 21], np.int32)), r"idx.kv_indptr must never decrease"),
            (edited("kv_indptr", 4, 20), r"idx.kv_indptr must end at len\(idx.kv_indices\) = 21, got 20"),
            (idx._replace(kv_indptr=idx.kv_indptr[:3]), r"idx.kv_indptr must be a 1-D integer array of 5 entries"),
            (idx._replace(causal=idx.causal[:2]), r"idx.causal must be a 1-D bool array of 4 entries, got bool \(2,\)"),
            (idx._replace(causal=idx.causal.astype(np.int32)), r"idx.causal must be a 1-D bool array"),
            (idx._replace(kv_indices=idx.kv_indices.tolist()), r"idx.kv_indices must be a 1-D integer array, got list"),
            (idx._replace(kv_indices=idx.kv_indices.astype(np.float32)), r"idx.kv_indices must be a 1-D integer array"),
            (idx._replace(qo_indptr=np.zeros(0, np.int32)), r"idx.qo_indptr must have one entry per group")):
        for call in (lambda: attention_from_indices(q, k, k, bad, dense_at=dense_at),
                     lambda: attention_from_indices(q, k, k, bad, dense_at=dense_at, alibi_slopes=torch.ones(2)),
                     lambda: dense_mask(bad), lambda: path_work(bad), lambda: takes_dense_path(bad)):
            with pytest.raises(ValueError, match=match):
                call()
    # a row past the K/V rows given
    big = edited("kv_indices", 0, c.size)._replace(span=c.size + 1)
    with pytest.raises(ValueError, match=rf"k and v must hold every row the indices name \(up to {c.size}\)"):
        attention_from_indices(q, k, k, big, dense_at=dense_at)
    # ALiBi's positions: one per row, one per token
    for name, n in (("kv_pos", 20), ("q_pos", 3)):
        with pytest.raises(ValueError, match=rf"idx.{name} must be a 1-D integer array of {n + 1} entries"):
            attention_from_indices(q, k, k, idx._replace(**{name: getattr(idx, name)[:n]}), dense_at=dense_at,
                                   alibi_slopes=torch.ones(2))
    # K/V without heads: the shapes, not a division by zero
    with pytest.raises(ValueError, match=r"q's heads must be a multiple of k's \(at least one\), got q \(4, 2, 8\), "
                                         r"k \(\d+, 0, 8\)"):
        attention_from_indices(q, k[:, :0], k[:, :0], idx, dense_at=dense_at)
    with pytest.raises(ValueError, match=r"n_rows must be an int of at least the indices' span \(21\), got 20"):
        dense_mask(idx, 20)
    # dense_at: a real number >= 0 (a NaN silently meant "never dense")
    for bad_at, err in ((float("nan"), ValueError), (-1.0, ValueError), ("1", TypeError), (None, TypeError),
                        (True, TypeError)):
        with pytest.raises(err, match="dense_at must be a real number >= 0"):
            attention_from_indices(q, k, k, idx, dense_at=bad_at)
        with pytest.raises(err, match="dense_at must be a real number >= 0"):
            takes_dense_path(idx, bad_at)
    # the indices as attention_indices gave them are unchanged by the checks and still work
    torch.testing.assert_close(attention_from_indices(q, k, k, idx, dense_at=dense_at), want)
    assert dense_mask(idx).shape == (4, 21)


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
    # f16: FlashInfer's paged kernels are built for 16-bit (and 8-bit) K/V; the reference stays f32
    w.plan(as_t(idx.kv_indptr), as_t(idx.kv_indices), as_t(np.ones(len(idx.causal), np.int32)), H, Hkv, D, 1,
           q_data_type=torch.float16, kv_data_type=torch.float16)
    half = lambda t: t.to(dev, torch.float16)   # noqa: E731
    got = w.run(half(q), (half(k)[:, None], half(v)[:, None]))
    torch.testing.assert_close(got.float().cpu(), want, atol=1e-2, rtol=1e-2)
