"""The KQ mask's vector kernels against a numpy statement of the mask's definition.

Every output type (f32, f16, bool), with and without ALiBi, causal or not, every sliding-window
kind, output arrays at every byte offset within a 16-byte line (the kernels align their vector
stores and go scalar before and after), row lengths that are not multiples of the vector width,
and masks large enough that the rows are written with non-temporal stores."""
import numpy as np
import pytest

from kvcache import UBatch, UnifiedCache

NP_DTYPES = {"f32": np.float32, "f16": np.float16, "bool": np.bool_}


def expected_mask(c, ub_pos, ub_first_seq, causal, alibi, dtype):
    """The mask as the definition states it, from the cells' public snapshot."""
    cells = c.cells()
    pos = cells.pos.astype(np.int64)
    rows = -(-len(ub_pos) // 64) * 64
    out = np.full((rows, c.n), -np.inf, dtype=np.float64)
    for t, (p1, s) in enumerate(zip(ub_pos, ub_first_seq)):
        has = cells.holds(s)[: c.n]
        v = np.where(has & (pos[: c.n] >= 0), pos[: c.n], -1)
        lo = 0
        if c.swa_type == "standard":
            lo = max(p1 - c.n_swa + 1, 0)
        elif c.swa_type == "chunked":
            lo = (p1 // c.n_swa) * c.n_swa
        hi = p1 if causal else np.iinfo(np.int64).max
        seen = (v >= lo) & (v <= hi)
        out[t] = np.where(seen, -np.abs(v - p1) if alibi else 0.0, -np.inf)
    if dtype == "bool":
        return np.isfinite(out)
    return out.astype(NP_DTYPES[dtype])


def filled_cache(kv_size, n_seq, rng, swa_type="none", n_swa=0, holes=0.25):
    c = UnifiedCache(kv_size=kv_size, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=n_seq,
                     swa_type=swa_type, n_swa=n_swa, n_pad=32 if kv_size % 32 == 0 else 1)
    n = kv_size
    seqs = rng.integers(0, n_seq, size=n)
    pos = np.zeros(n, dtype=np.int64)
    nxt = [0] * n_seq
    for i, s in enumerate(seqs):
        pos[i] = nxt[s]
        nxt[s] += 1
    for a in range(0, n, 4096):
        ub = UBatch(pos[a:a + 4096].tolist(), seqs[a:a + 4096].tolist())
        assert c.find_slot(ub)
        c.commit()
    for _ in range(int(n * holes) // 4):
        s = int(rng.integers(0, n_seq))
        p = int(rng.integers(0, nxt[s] + 1))
        c.seq_rm(s, p, p + 4)
    return c, nxt


def offset_out(shape, dtype, offset):
    """A C-contiguous array of shape/dtype starting `offset` bytes past a 64-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start:start + nbytes].view(dtype).reshape(shape)
    out[...] = np.ones((), dtype=dtype)   # garbage the kernel must overwrite
    return out


@pytest.mark.parametrize("swa", [("none", 0), ("standard", 5), ("chunked", 7)])
@pytest.mark.parametrize("kv_size", [13, 64, 100, 257])
def test_small_masks_every_offset(kv_size, swa):
    rng = np.random.default_rng(kv_size)
    c, nxt = filled_cache(kv_size, 3, rng, swa_type=swa[0], n_swa=swa[1])
    n_tok = 9
    seq = [int(x) for x in rng.integers(0, 3, size=n_tok)]
    pos = [max(nxt[s] + int(rng.integers(-3, 3)), 0) for s in seq]
    ub = UBatch(pos, seq)
    for dtype in NP_DTYPES:
        itemsize = np.dtype(NP_DTYPES[dtype]).itemsize
        for alibi in (False, True):
            for causal in (True, False):
                want = expected_mask(c, pos, seq, causal, alibi, dtype)
                got = c.kq_mask(ub, causal=causal, alibi=alibi, dtype=dtype)
                assert got.tobytes() == want.tobytes(), (dtype, alibi, causal)
                for offset in range(0, 16, 1 if dtype == "bool" else itemsize // 2 or 1):
                    out = offset_out(want.shape, NP_DTYPES[dtype], offset)
                    c.kq_mask(ub, causal=causal, alibi=alibi, dtype=dtype, out=out)
                    assert out.tobytes() == want.tobytes(), (dtype, alibi, causal, offset)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("dtype,n_tokens", [("f32", 128), ("f16", 256), ("bool", 512)])
def test_streamed_masks(dtype, n_tokens, n_threads):
    """Masks of 16 MiB and more bypass the caches (non-temporal stores), their rows shared among
    the cache's n_threads threads: a share may start in the middle of a sequence's rows."""
    rng = np.random.default_rng(n_tokens)
    c, nxt = filled_cache(32768, 8, rng, holes=0.1)
    c.n_threads = n_threads
    seq = [i % 8 for i in range(n_tokens - 3)]
    pos = [nxt[s] + i // 8 for i, s in enumerate(seq)]
    ub = UBatch(pos, seq)
    want = expected_mask(c, pos, seq, True, False, dtype)
    assert want.nbytes >= 16 << 20
    assert c.kq_mask(ub, dtype=dtype).tobytes() == want.tobytes()
    # one sequence's rows, split among the threads
    one = [3] * (n_tokens - 3)
    pos1 = [nxt[3] + i for i in range(len(one))]
    want1 = expected_mask(c, pos1, one, True, False, dtype)
    assert c.kq_mask(UBatch(pos1, one), dtype=dtype).tobytes() == want1.tobytes()
    out = offset_out(want.shape, NP_DTYPES[dtype], 4 if dtype != "bool" else 3)
    c.kq_mask(ub, dtype=dtype, out=out)
    assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("swa", [("none", 0), ("standard", 5), ("chunked", 7)])
@pytest.mark.parametrize("spread", [4, 40, 400])
def test_many_tokens_per_sequence(swa, spread):
    """Sequences with many rows in the ubatch, each a copy of the row before with the window
    moved: by few cells (spread 4) or many (spread 400), back and forth (unsorted and repeated
    positions); causal or not."""
    rng = np.random.default_rng(spread)
    c, nxt = filled_cache(1000, 3, rng, swa_type=swa[0], n_swa=swa[1])
    n_tok = 70
    seq = [int(x) for x in rng.integers(0, 3, size=n_tok)]
    pos = [max(nxt[s] - int(rng.integers(0, spread)), 0) for s in seq]
    ub = UBatch(pos, seq)
    for dtype in NP_DTYPES:
        for causal in (True, False):
            want = expected_mask(c, pos, seq, causal, False, dtype)
            assert c.kq_mask(ub, causal=causal, dtype=dtype).tobytes() == want.tobytes(), (dtype, causal)
            out = offset_out(want.shape, NP_DTYPES[dtype], 1 if dtype == "bool" else 2)
            c.kq_mask(ub, causal=causal, dtype=dtype, out=out)
            assert out.tobytes() == want.tobytes(), (dtype, causal)
