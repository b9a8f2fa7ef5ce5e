"""Inputs for attention kernels that keep K/V elsewhere: the unpadded mask in caller buffers
with a row stride (numpy and torch), the bool mask as torch's SDPA reads it, the placed cells
into caller index buffers, and a sequence's cells ordered by position."""
import numpy as np
import pytest

from kvcache import ISWACache, UBatch, UnifiedCache

from conftest import need_module
from test_mask_kernels import NP_DTYPES, expected_mask, filled_cache


def _ub(c, rng, n_seq, n_tokens):
    seqs = rng.integers(0, n_seq, size=n_tokens)
    pos = [c.seq_pos_max(int(s)) + 1 + int(rng.integers(0, 3)) for s in seqs]
    return UBatch(pos, seqs.tolist()), pos, seqs.tolist()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bool"])
@pytest.mark.parametrize("swa", [("none", 0), ("standard", 40)])
def test_unpadded_mask_is_the_padded_one_without_its_padding_rows(dtype, swa):
    rng = np.random.default_rng(7)
    c, _ = filled_cache(512, 5, rng, swa_type=swa[0], n_swa=swa[1])
    for n_tokens in (1, 3, 64, 70):
        ub, pos, seqs = _ub(c, rng, 5, n_tokens)
        m = c.kq_mask(ub, pad=False, dtype=dtype)
        assert m.shape == (n_tokens, c.n) and m.dtype == NP_DTYPES[dtype]
        want = expected_mask(c, pos, seqs, True, False, dtype)[:n_tokens]
        np.testing.assert_array_equal(m, want)
        np.testing.assert_array_equal(m, c.kq_mask(ub, dtype=dtype)[:n_tokens])


@pytest.mark.parametrize("dtype", ["f32", "f16", "bool"])
@pytest.mark.parametrize("pad", [False, True])
def test_mask_into_a_larger_buffer_writes_only_its_block(dtype, pad):
    rng = np.random.default_rng(3)
    c, _ = filled_cache(256, 3, rng)
    ub, pos, seqs = _ub(c, rng, 3, 5)
    rows = 64 if pad else 5
    sentinel = np.array(True if dtype == "bool" else 7.0).astype(NP_DTYPES[dtype])
    buf = np.full((rows + 3, c.n + 11), sentinel, dtype=NP_DTYPES[dtype])
    got = c.kq_mask(ub, out=buf, dtype=dtype, pad=pad)
    assert got.shape == (rows, c.n) and np.shares_memory(got, buf)
    np.testing.assert_array_equal(buf[:rows, :c.n], expected_mask(c, pos, seqs, True, False, dtype)[:rows])
    assert (buf[rows:] == sentinel).all() and (buf[:, c.n:] == sentinel).all()
    exact = np.empty((rows, c.n), dtype=NP_DTYPES[dtype])
    assert c.kq_mask(ub, out=exact, dtype=dtype, pad=pad) is exact
    np.testing.assert_array_equal(exact, buf[:rows, :c.n])


def test_one_buffer_serves_as_n_grows():
    c = UnifiedCache(kv_size=512, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=2, buffers=None)
    buf = np.empty((8, 512), dtype=np.float32)
    for p in range(0, 200, 4):
        ub = UBatch([p, p + 1, p + 2, p + 3], [0] * 4)
        assert c.find_slot(ub)
        c.commit()
        m = c.kq_mask(ub, out=buf, pad=False)
        np.testing.assert_array_equal(m, c.kq_mask(ub)[:4])


def test_mask_out_that_does_not_fit_is_refused_untouched():
    rng = np.random.default_rng(1)
    c, _ = filled_cache(256, 2, rng)
    ub, _, _ = _ub(c, rng, 2, 4)
    bad = [
        np.zeros((3, c.n), np.float32),                 # too few rows
        np.zeros((4, c.n - 1), np.float32),             # too few columns
        np.zeros((4, 2 * c.n), np.float32)[:, ::2],     # a row's elements not contiguous
        np.zeros((8, c.n), np.float32)[::-2],           # rows running backwards
        np.zeros((4, c.n), np.float16),                 # wrong dtype
        np.zeros(4 * c.n, np.float32),                  # not 2-D
    ]
    for b in bad:
        before = b.copy()
        with pytest.raises(ValueError, match="out must be"):
            c.kq_mask(ub, out=b, pad=False)
        np.testing.assert_array_equal(b, before)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros((4, c.n), np.float32)
        ro.flags.writeable = False
        c.kq_mask(ub, out=ro, pad=False)


def test_iswa_masks_unpadded():
    c = ISWACache(kv_size=256, n_layer=2, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=1, n_swa=8,
                  swa_layers=[0], buffers=None, n_batch=32)
    ub = UBatch(list(range(20)), [0] * 20)
    assert c.find_slot(ub)
    c.commit()
    base, swa = c.kq_mask(ub, pad=False, dtype="bool")
    assert base.shape[0] == swa.shape[0] == 20
    assert base[19].sum() == 20 and swa[19].sum() == 8


def test_placed_cells_into_caller_buffers():
    c = UnifiedCache(kv_size=64, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=2, buffers=None)
    assert c.find_slot(UBatch([0, 1, 2], [0, 0, 0]))
    c.commit()
    assert c.find_slot(UBatch([3, 0], [0, 1]))
    for dt in (np.int32, np.int64):
        exact = np.full(2, -5, dt)
        assert c.slot_indices(out=exact) is exact and exact.tolist() == [3, 4]
        big = np.full(6, -5, dt)
        got = c.slot_indices(out=big)
        assert got.tolist() == [3, 4] and np.shares_memory(got, big) and big[2:].tolist() == [-5] * 4
    for b in (np.zeros(1, np.int64), np.zeros(4, np.uint32), np.zeros((2, 2), np.int64), np.zeros(8, np.int64)[::2]):
        with pytest.raises(ValueError, match="out"):
            c.slot_indices(out=b)


def test_seq_cells_in_position_order():
    c = UnifiedCache(kv_size=64, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=3, buffers=None)
    assert c.find_slot(UBatch([0, 1, 2, 3, 0, 1], [0, 0, 0, 0, 1, 1]))
    c.commit()
    cells, pos = c.seq_cells(0)
    assert cells.dtype == pos.dtype == np.int32
    assert cells.tolist() == [0, 1, 2, 3] and pos.tolist() == [0, 1, 2, 3]
    c.seq_rm(0, 1, 2)                                   # cell 1 frees
    assert c.find_slot(UBatch([10], [0]))               # ... and takes a later position
    c.commit()
    assert c.seq_cells(0)[0].tolist() == [0, 2, 3, 1]
    assert c.seq_cells(0)[1].tolist() == [0, 2, 3, 10]
    c.seq_cp(1, 0)                                      # shared cells, equal positions: by cell
    assert c.seq_cells(0)[0].tolist() == [0, 4, 5, 2, 3, 1]
    assert c.seq_cells(0)[1].tolist() == [0, 0, 1, 2, 3, 10]
    assert [a.tolist() for a in c.seq_cells(2)] == [[], []]
    with pytest.raises(ValueError):
        c.seq_cells(3)


def test_seq_cells_tell_where_a_metadata_only_read_put_the_sequence():
    src = UnifiedCache(kv_size=64, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=2, buffers=None)
    assert src.find_slot(UBatch(list(range(5)), [1] * 5))
    src.commit()
    blob = src.state_write(1)
    dst = UnifiedCache(kv_size=64, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=2, buffers=None)
    assert dst.find_slot(UBatch([0, 1, 2], [1, 1, 1]))
    dst.commit()
    dst.state_read(blob, 0)
    cells, pos = dst.seq_cells(0)
    assert pos.tolist() == [0, 1, 2, 3, 4] and cells.tolist() == [3, 4, 5, 6, 7]



def _torch():
    return need_module("torch", "torch")


@pytest.mark.parametrize("dtype", ["f32", "f16", "bool"])
def test_mask_into_torch_tensors(dtype):
    torch = _torch()
    tdt = {"f32": torch.float32, "f16": torch.float16, "bool": torch.bool}[dtype]
    rng = np.random.default_rng(5)
    c, _ = filled_cache(256, 3, rng)
    ub, pos, seqs = _ub(c, rng, 3, 6)
    buf = torch.zeros((16, 300), dtype=tdt)
    got = c.kq_mask(ub, out=buf, dtype=dtype, pad=False)
    assert isinstance(got, torch.Tensor) and tuple(got.shape) == (6, c.n)
    assert got.data_ptr() == buf.data_ptr()
    want = expected_mask(c, pos, seqs, True, False, dtype)[:6]
    np.testing.assert_array_equal(got.numpy(), want)
    assert not buf[6:].any() and not buf[:, c.n:].any()


def test_bool_mask_is_what_sdpa_attends():
    torch = _torch()
    rng = np.random.default_rng(11)
    c, _ = filled_cache(128, 3, rng)
    ub, _, _ = _ub(c, rng, 3, 7)
    keep = torch.from_numpy(c.kq_mask(ub, pad=False, dtype="bool"))
    add = torch.from_numpy(c.kq_mask(ub, pad=False, dtype="f32"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 7, 8, generator=g)
    k = torch.randn(1, 2, c.n, 8, generator=g)
    v = torch.randn(1, 2, c.n, 8, generator=g)
    by_bool = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)   # [q, k] -> [1, 1, q, k]
    by_add = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=add)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    manual = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v
    torch.testing.assert_close(by_bool, manual)
    torch.testing.assert_close(by_add, manual)


def test_slot_indices_into_torch_for_index_copy():
    torch = _torch()
    c = UnifiedCache(kv_size=64, n_layer=1, n_embd_k_gqa=4, n_embd_v_gqa=4, n_seq_max=2, buffers=None)
    assert c.find_slot(UBatch([0, 1, 2], [0, 1, 1]))
    idx = torch.empty(8, dtype=torch.long)
    got = c.slot_indices(out=idx)
    assert isinstance(got, torch.Tensor) and got.tolist() == [0, 1, 2]
    k = torch.zeros(64, 4)
    k.index_copy_(0, got, torch.ones(3, 4))
    assert k.sum().item() == 12
    with pytest.raises(TypeError, match="device"):
        c.slot_indices(out=torch.empty(8, dtype=torch.long, device="meta"))
