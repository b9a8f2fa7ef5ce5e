"""K/V memory: owned, borrowed and metadata-only caches (unified and recurrent), element
dtypes and views, DLPack in and out, and the plans a metadata-only cache hands over."""
import gc
import weakref

import numpy as np
import pytest

import kvcache
from kvcache import RecurrentCache, UBatch, UnifiedCache

from conftest import need, needs

try:
    import torch
except ImportError:  # pragma: no cover - depends on the environment
    torch = None
try:
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None

needs_torch = needs("torch", torch is None, "torch is not installed")

FLOAT_TYPES = ["f32", "f16", "bf16"]
QUANT_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
ROW_BYTES_32 = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}


def unified(**kw):
    args = dict(kv_size=32, n_layer=2, n_embd_k_gqa=[32, 64], n_embd_v_gqa=[32, 32], type_k="f16",
                type_v="f16", v_trans=True, n_seq_max=4)
    args.update(kw)
    return UnifiedCache(**args)


def needed(c, il, which):
    """Bytes of layer il's K or V memory."""
    ref = unified(kv_size=c.size, type_k=c.type_k, type_v=c.type_v, v_trans=c.v_trans,
                  n_embd_k_gqa=[32, 64], n_embd_v_gqa=[32, 32])
    return (ref.k(il) if which == "k" else ref.v(il)).nbytes


def rows(n, width, seed=0):
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


# --- dtypes and owned views ------------------------------------------------------------------

def test_view_dtype():
    assert kvcache.view_dtype("f32") == np.float32 and kvcache.view_dtype(1) == np.float16
    assert kvcache.view_dtype("q8_0") == np.uint8
    want = np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else np.dtype(np.uint16)
    assert kvcache.view_dtype("bf16") == want
    with pytest.raises(ValueError, match="type"):
        kvcache.view_dtype("f64")


@pytest.mark.parametrize("tk", FLOAT_TYPES + QUANT_TYPES)
@pytest.mark.parametrize("v_trans", [False, True])
def test_owned_views(tk, v_trans):
    tv = tk if not v_trans else "f16"
    c = unified(type_k=tk, type_v=tv, v_trans=v_trans)
    assert c.buffers == "owned"
    for il, wk in zip(c.layers, [32, 64]):
        k, v = c.k(il), c.v(il)
        assert k.dtype == kvcache.view_dtype(tk) and v.dtype == kvcache.view_dtype(tv)
        if tk in QUANT_TYPES:
            assert k.shape == (32, wk // 32 * ROW_BYTES_32[tk])
        else:
            assert k.shape == (32, wk)
        if tv in QUANT_TYPES:
            assert v.shape == (32, ROW_BYTES_32[tv])
        else:
            assert v.shape == ((32, 32) if v_trans else (32, 32))
        for a in (k, v):
            assert a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % 64 == 0
            assert not a.view(np.uint8).any()
    assert c.size_k_bytes == sum(c.k(il).nbytes for il in c.layers)


def test_bf16_views_hold_bfloat16():
    if ml_dtypes is None:
        need("test", "ml_dtypes is not installed")
    c = unified(type_k="bf16", type_v="bf16", v_trans=False)
    assert c.find_slot(UBatch([0, 1], [0, 0]))
    k = np.array([[1.5] * 32, [-2.25] * 32], dtype=np.float32)
    c.store(0, k, k)
    assert c.k(0).dtype == ml_dtypes.bfloat16 and np.array_equal(c.k(0)[:2].astype(np.float32), k)
    c.store(0, k.astype(ml_dtypes.bfloat16), None)      # bfloat16 rows go in as they are
    assert np.array_equal(c.k(0)[:2].view(np.uint16), k.astype(ml_dtypes.bfloat16).view(np.uint16))


@needs_torch
@pytest.mark.parametrize("t, tdt", [("f32", "float32"), ("f16", "float16"), ("bf16", "bfloat16"),
                                    ("q8_0", "uint8")])
def test_dlpack_into_torch_is_zero_copy(t, tdt):
    c = unified(type_k=t, type_v="f32" if t == "q8_0" else t, v_trans=t != "q8_0")
    for view in (c.k(1), c.v(0)):
        tt = torch.from_dlpack(view)
        if view is c.k(1):
            expect = tdt if t != "bf16" or ml_dtypes is not None else "uint16"
            assert str(tt.dtype) == "torch." + expect
        assert tt.data_ptr() == view.ctypes.data and tuple(tt.shape) == view.shape
        tt[3, 1] = 7
        assert view.view(np.uint8).any()                  # written through to the cache memory
    if t == "bf16" and ml_dtypes is not None:
        tt = torch.from_dlpack(c.k(1)[10:13, 8:])        # strided slices of a bf16 view export too
        tt.fill_(1.0)
        assert (c.k(1)[10:13, 8:].astype(np.float32) == 1.0).all() and not c.k(1)[10:13, :8].astype(bool).any()


@needs_torch
def test_bf16_export_keeps_the_memory_alive():
    if ml_dtypes is None:
        need("test", "ml_dtypes is not installed")
    c = unified(type_k="bf16", type_v="f16")
    c.k(0)[0, 0] = 3.0
    tt = torch.from_dlpack(c.k(0))
    del c
    gc.collect()
    assert float(tt[0, 0]) == 3.0
    cap = unified(type_k="bf16").k(0).__dlpack__()       # a capsule never consumed is released
    del cap
    gc.collect()


# --- borrowed memory -------------------------------------------------------------------------

def borrowed_pairs(tk="f16", tv="f16", v_trans=True, kind="numpy", kv_size=32):
    """One (K, V) pair per layer of unified(...) in the requested container."""
    out = {}
    for il, (wk, wv) in enumerate(zip([32, 64], [32, 32])):
        ref = unified(kv_size=kv_size, type_k=tk, type_v=tv, v_trans=v_trans)
        k, v = np.zeros_like(ref.k(il)), np.zeros_like(ref.v(il))
        if kind == "memoryview":
            k, v = memoryview(bytearray(k.nbytes)), memoryview(bytearray(v.nbytes))
        elif kind == "uint8":
            k, v = np.zeros(k.nbytes, np.uint8), np.zeros(v.nbytes, np.uint8)
        elif kind == "torch":
            tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
            k = torch.zeros(tuple(k.shape), dtype=tdt.get(tk, torch.uint8))
            v = torch.zeros(tuple(v.shape), dtype=tdt.get(tv, torch.uint8))
        out[il] = (k, v)
    return out


def as_bytes(obj):
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.view(torch.uint8).numpy().tobytes() if obj.dtype != torch.uint8 else obj.numpy().tobytes()
    return bytes(memoryview(obj).cast("B")) if not isinstance(obj, np.ndarray) else obj.tobytes()


@pytest.mark.parametrize("kind", ["numpy", "memoryview", "uint8", "torch"])
@pytest.mark.parametrize("tk, tv, v_trans", [("f16", "f16", True), ("f32", "bf16", False),
                                             ("bf16", "f32", True), ("q8_0", "q4_0", False)])
def test_borrowed_memory_is_the_callers(kind, tk, tv, v_trans):
    if kind == "torch" and torch is None:
        need("torch", "torch is not installed")
    bufs = borrowed_pairs(tk, tv, v_trans, kind)
    c = unified(type_k=tk, type_v=tv, v_trans=v_trans, buffers=bufs)
    own = unified(type_k=tk, type_v=tv, v_trans=v_trans)
    assert c.buffers == "borrowed"
    ub = UBatch([0, 1, 2], [0, 1, 0])
    for cache in (c, own):
        assert cache.find_slot(ub)
        for il, (wk, wv) in zip(cache.layers, zip([32, 64], [32, 32])):
            k = rows(3, wk, il)
            v = rows(3, wv, il + 7)
            if tk in QUANT_TYPES:
                k = kvcache.quantize(k, tk)
            if tv in QUANT_TYPES:
                v = kvcache.quantize(v, tv)
            cache.store(il, k, v)
        cache.commit()
    for il in c.layers:
        assert as_bytes(bufs[il][0]) == own.k(il).tobytes()
        assert as_bytes(bufs[il][1]) == own.v(il).tobytes()
        assert c.k(il).dtype == own.k(il).dtype and c.k(il).shape == own.k(il).shape
    assert c.state_write() == own.state_write()
    c.clear()                                            # clear zeroes the caller's memory too
    assert not any(as_bytes(x).strip(b"\0") for pair in bufs.values() for x in pair)


def test_borrowed_list_larger_buffers_and_views():
    k0, v0 = np.zeros((32, 32), np.float16), np.zeros(32 * 32 + 100, np.float16)   # V larger: fine
    k1, v1 = np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16)
    c = unified(buffers=[(k0, v0), (k1, v1)])
    c.k(1)[4, 5] = 2.5
    assert k1[4, 5] == 2.5
    assert c.v(0).shape == (32, 32) and np.shares_memory(c.v(0), v0)
    c.v(0)[:] = 1
    assert (v0[:1024] == 1).all() and not v0[1024:].any()


def test_borrowed_with_dropped_layers_and_dict():
    k, v = np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16)
    c = unified(layers=[1], buffers={1: (k, v)})
    assert c.layers == (1,) and np.shares_memory(c.k(1), k)


def test_borrowed_buffers_stay_alive():
    k, v = np.zeros((32, 32), np.float16), np.zeros((32, 32), np.float16)
    refs = [weakref.ref(k), weakref.ref(v)]
    c = unified(layers=[0], buffers=[(k, v)])
    del k, v
    gc.collect()
    assert all(r() is not None for r in refs)
    c.k(0)[0, 0] = 1.0
    del c
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("kind", ["array", "view", "subclass"])
def test_borrowed_numpy_memory_cannot_be_resized_away(kind):
    # numpy's resize(refcheck=False) frees an array's memory whatever else holds it: while a cache
    # borrows the memory, the array that owns it refuses (else the cache writes freed memory)
    class Sub(np.ndarray):
        pass

    k = np.zeros((32, 32), np.float16)
    owner = np.zeros(32 * 32 + 64, np.float16) if kind == "view" else np.zeros((32, 32), np.float16)
    v = owner[64:].reshape(32, 32) if kind == "view" else owner.view(Sub) if kind == "subclass" else owner
    c = unified(layers=[0], buffers=[(k, v)])
    for arr in (k, owner):
        shape = arr.shape
        with pytest.raises(ValueError, match="cannot resize"):
            arr.resize(arr.size * 64, refcheck=False)
        assert arr.shape == shape
    assert c.find_slot(UBatch([0, 1], [0, 0]))
    c.store(0, np.ones((2, 32), np.float32), np.full((2, 32), 2.0, np.float32))
    assert (k[c.slot_indices()] == 1).all() and (c.v(0)[:, c.slot_indices()] == 2).all()
    assert np.shares_memory(c.v(0), v)
    del c
    gc.collect()
    owner.resize(owner.size * 2, refcheck=False)   # the cache gone, the memory is the owner's again


@needs_torch
def test_borrowed_torch_memory_cannot_be_resized_away():
    k, v = torch.zeros((32, 32), dtype=torch.float16), torch.zeros((32, 32), dtype=torch.float16)
    c = unified(layers=[0], buffers=[(k, v)])
    with pytest.raises(RuntimeError, match="not resizable"):
        k.resize_(1 << 20)
    assert c.find_slot(UBatch([0], [0]))
    c.store(0, np.ones((1, 32), np.float32), np.ones((1, 32), np.float32))
    assert k[c.slot_indices()[0]].eq(1).all()


def test_recurrent_borrowed_numpy_memory_cannot_be_resized_away():
    bufs = [(np.zeros((2, 8), np.float32), np.zeros((2, 32), np.float16)),
            (np.zeros(2 * 16 * 4, np.uint8), np.zeros((2, 64), np.float16))]
    c = recurrent(buffers=bufs)
    with pytest.raises(ValueError, match="cannot resize"):
        bufs[1][0].resize(1 << 20, refcheck=False)
    assert c.find_slot(UBatch([0, 0], [0, 1]))


def test_defrag_moves_borrowed_rows():
    bufs = {il: (np.zeros((4096, 32 if il == 0 else 64), np.float32), np.zeros((32, 4096), np.float32))
            for il in (0, 1)}
    c = unified(kv_size=4096, type_k="f32", type_v="f32", n_seq_max=2, buffers=bufs)
    assert c.find_slot(UBatch(list(range(8)), [0, 1] * 4))
    for il in c.layers:
        c.store(il, np.repeat(np.arange(8, dtype=np.float32)[:, None], c.k(il).shape[1], 1),
                np.repeat(np.arange(8, dtype=np.float32)[:, None], 32, 1))
    c.commit()
    c.seq_rm(1)
    c.defrag_sched(-1.0)
    plan = c.update()
    assert plan.moved and plan.defrag_runs.tolist() == [[4, 3, 1], [6, 1, 1]]
    assert bufs[1][0][:4, 0].tolist() == [0, 6, 2, 4] and bufs[0][1][0, :4].tolist() == [0, 6, 2, 4]


class _FakeDevice:
    """A tensor-like object living on a device other than the CPU."""

    def __dlpack__(self, **kw):
        raise AssertionError("must not be called")

    def __dlpack_device__(self):
        return (2, 0)


BAD_BORROWED = [
    ("too small", lambda: {0: (np.zeros((31, 32), np.float16), np.zeros((32, 32), np.float16)),
                           1: (np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16))},
     ValueError, r"buffers\[0\] K holds 1984 bytes; the layer needs 2048"),
    ("read-only", lambda: {0: (np.zeros((32, 32), np.float16), bytes(2048)),
                           1: (np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16))},
     ValueError, r"buffers\[0\] V is read-only"),
    ("frozen array", lambda: {0: (np.zeros((32, 32), np.float16), np.zeros((32, 32), np.float16)),
                              1: (np.zeros((32, 64), np.float16), _frozen((32, 32)))},
     ValueError, r"buffers\[1\] V is read-only"),
    ("non-contiguous", lambda: {0: (np.zeros((32, 64), np.float16)[:, ::2], np.zeros((32, 32), np.float16)),
                                1: (np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16))},
     ValueError, r"buffers\[0\] K must be C-contiguous"),
    ("dtype", lambda: {0: (np.zeros((32, 32), np.float32), np.zeros((32, 32), np.float16)),
                       1: (np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16))},
     TypeError, r"buffers\[0\] K has dtype float32, which cannot hold f16"),
    ("overlap", lambda: _overlapping(), ValueError, r"buffers\[0\] V and buffers\[1\] K overlap"),
    ("missing layer", lambda: {0: (np.zeros((32, 32), np.float16), np.zeros((32, 32), np.float16))},
     ValueError, r"no entry for layer\(s\) \[1\]"),
    ("extra layer", lambda: {0: None, 1: None, 5: None}, ValueError, "layer 5"),
    ("list length", lambda: [(np.zeros(1), np.zeros(1))], ValueError, "1 entries"),
    ("not a pair", lambda: [np.zeros(4), np.zeros(4)], TypeError, r"buffers\[0\] must be a \(K, V\) pair"),
    ("not a buffer", lambda: {0: ([0.0] * 1024, np.zeros((32, 32), np.float16)),
                              1: (np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16))},
     TypeError, r"buffers\[0\] K must support the buffer protocol or __dlpack__"),
    ("device", lambda: {0: (_FakeDevice(), np.zeros((32, 32), np.float16)),
                        1: (np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16))},
     TypeError, r"buffers\[0\] K is on DLPack device \(2, 0\), not the CPU"),
    ("misaligned", lambda: {0: (np.zeros(4097, np.uint8)[1:].view(np.float16), np.zeros((32, 32), np.float16)),
                            1: (np.zeros((32, 64), np.float16), np.zeros((32, 32), np.float16))},
     ValueError, r"buffers\[0\] K is not aligned"),
]


def _frozen(shape):
    a = np.zeros(shape, np.float16)
    a.flags.writeable = False
    return a


def _overlapping():
    arena = np.zeros(32 * 32 * 3 + 32 * 64, np.float16)
    return {0: (arena[:1024], arena[1024:2048]), 1: (arena[2000:2000 + 2048], arena[-1024:])}


@pytest.mark.parametrize("make, exc, msg", [b[1:] for b in BAD_BORROWED], ids=[b[0] for b in BAD_BORROWED])
def test_bad_borrowed_buffers(make, exc, msg):
    with pytest.raises(exc, match=msg):
        unified(buffers=make())


@needs_torch
def test_borrowed_torch_errors():
    with pytest.raises(ValueError, match="C-contiguous"):
        unified(layers=[0], buffers=[(torch.zeros(32, 32, dtype=torch.float16).t(), torch.zeros(32, 32, dtype=torch.float16))])
    with pytest.raises(TypeError, match="bfloat16"):
        unified(layers=[0], buffers=[(torch.zeros(32, 32, dtype=torch.bfloat16), torch.zeros(32, 32, dtype=torch.float16))])
    with pytest.raises(BufferError, match=r"buffers\[0\] K: .*gradient"):
        unified(layers=[0], buffers=[(torch.zeros(32, 32, dtype=torch.float16, requires_grad=True),
                                      torch.zeros(32, 32, dtype=torch.float16))])


# --- metadata only ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [None, "none"])
def test_metadata_only_refuses_data_calls(mode):
    c = unified(buffers=mode)
    assert c.buffers == "none" and c.size_k_bytes == 32 * 2 * (32 + 64)   # the sizes it would need
    assert c.find_slot(UBatch([0, 1], [0, 0]))
    assert c.slot == (0, 2)
    for call in (lambda: c.k(0), lambda: c.v(1), lambda: c.store(0, None, None)):
        with pytest.raises(RuntimeError, match="no K/V memory"):
            call()
    with pytest.raises(IndexError):
        c.k(7)                                         # argument errors still come first
    assert c.kq_mask(UBatch([2], [0])).shape == (64, 32)
    c.commit()
    c.seq_add(0, 0, -1, 3)
    with pytest.raises(ValueError, match="metadata-only"):
        c.update(rope=kvcache.RopeParams(16))
    assert c.has_shift
    plan = c.update()
    assert plan and plan.k_shift[:2].tolist() == [3, 3] and not plan.rotated and not plan.moved
    assert not c.has_shift and not c.update()


def test_bad_buffers_argument():
    with pytest.raises(ValueError, match="buffers"):
        unified(buffers="borrowed")
    with pytest.raises(TypeError, match="buffers"):
        unified(buffers=3)


def test_slot_tracks_the_placement():
    c = unified(buffers=None)
    assert c.slot is None and c.slot_indices().tolist() == []
    assert c.find_slot(UBatch([0, 1, 2], [0, 0, 0]))
    assert c.slot == (0, 3)
    idx = c.slot_indices()
    assert idx.dtype == np.int32 and idx.tolist() == [0, 1, 2]
    c.commit()
    assert c.slot == (0, 3)                            # commit keeps it
    assert c.find_slot(UBatch([3], [0]))
    assert c.slot == (3, 1) and c.slot_indices().tolist() == [3]
    c.restore()
    assert c.slot is None and c.slot_indices().tolist() == []
    assert not c.find_slot(UBatch(list(range(33)), [0] * 33))   # no room: nothing placed
    assert c.slot is None


@pytest.mark.parametrize("op", [
    lambda c: c.restore(), lambda c: c.seq_rm(1), lambda c: c.seq_rm(0, 50, 60), lambda c: c.seq_cp(0, 1),
    lambda c: c.seq_keep(0), lambda c: c.seq_add(0, 0, -1, 1), lambda c: c.seq_div(0, 0, -1, 2),
    lambda c: c.clear(), lambda c: c.set_full(), lambda c: c.defrag_prepare(65536),
    lambda c: c.state_read(c.state_write()), lambda c: c.state_read(c.state_write(0), 0),
])
def test_every_operation_that_changes_the_cells_drops_the_placement(op):
    c = unified(buffers=None)
    assert c.find_slot(UBatch([0, 1], [0, 1]))
    c.commit()
    assert c.find_slot(UBatch([2, 3], [0, 0]))
    op(c)
    assert c.slot is None and c.slot_indices().tolist() == []


def test_whole_state_read_drops_the_undo_log():
    """A find_slot before a whole-cache read was still pending; restore() afterwards must not
    empty the cells the read filled."""
    src = unified()
    assert src.find_slot(UBatch([0, 1, 2], [0, 0, 0]))
    src.commit()
    blob = src.state_write()
    c = unified()
    assert c.find_slot(UBatch([7, 8, 9], [1, 1, 1]))   # uncommitted
    c.state_read(blob)
    c.restore()
    assert c.cells().nonempty() == src.cells().nonempty()


def _drive(c, rng, mirror=None):
    """Random placements, removals and shifts; with mirror, apply the slot plans to it."""
    for step in range(60):
        op = rng.integers(0, 4)
        if op <= 1:
            n = int(rng.integers(1, 6))
            s = int(rng.integers(0, 4))
            p0 = c.seq_pos_max(s) + 1
            ub = UBatch(list(range(p0, p0 + n)), [s] * n)
            if c.find_slot(ub):
                k = rows(n, 32, step)
                if mirror is None:
                    c.store(0, k, None)
                else:
                    head, nt = c.slot
                    mirror[head:head + nt] = k
                c.commit()
            else:
                c.restore()
        elif op == 2:
            s = int(rng.integers(0, 4))
            c.seq_rm(s, int(rng.integers(0, 10)), int(rng.integers(10, 30)))
        else:
            c.seq_add(int(rng.integers(0, 4)), 0, -1, int(rng.integers(-3, 4)))
        if step % 20 == 19:
            c.defrag_sched(-1.0)
            plan = c.update()
            if mirror is not None and plan.defrag_runs is not None:
                for src, dst, cnt in plan.defrag_runs.tolist():
                    mirror[dst:dst + cnt] = mirror[src:src + cnt]


def test_metadata_plans_reproduce_the_owned_cache():
    """Applying a metadata-only cache's plans (slots, defrag runs) to one's own memory gives the
    bytes an owned cache holds after the same calls."""
    kw = dict(kv_size=4096, n_layer=1, n_embd_k_gqa=32, n_embd_v_gqa=32, type_k="f32", type_v="f32",
              v_trans=False, n_seq_max=4, n_pad=256)
    own, meta = UnifiedCache(**kw), UnifiedCache(**kw, buffers=None)
    mirror = np.zeros((4096, 32), np.float32)
    _drive(own, np.random.default_rng(11))
    _drive(meta, np.random.default_rng(11), mirror)
    assert own.cells() == meta.cells()
    used = own.cells().pos != -1
    assert np.array_equal(own.k(0)[used], mirror[used])


def test_defrag_runs_are_independent():
    rng = np.random.default_rng(5)
    for trial in range(20):
        c = UnifiedCache(64, 1, 1, 1, type_k="f32", type_v="f32", n_seq_max=4, buffers=None)
        c.find_slot(UBatch(list(range(64)), rng.integers(0, 4, 64).tolist()))
        c.commit()
        c.seq_rm(int(rng.integers(0, 4)))
        c.seq_rm(int(rng.integers(0, 4)), int(rng.integers(0, 64)), -1)
        moved = c.defrag_prepare(65536)
        runs = c.defrag_runs()
        ids = c.defrag_ids
        assert moved == (len(runs) > 0)
        assert runs.dtype == np.uint32 and runs.shape == (len(runs), 3)
        src = {s + i for s, _, n in runs.tolist() for i in range(n)}
        dst = {d + i for _, d, n in runs.tolist() for i in range(n)}
        assert not src & dst                           # no run reads what another writes
        want = {i: int(t) for i, t in enumerate(ids) if t != i and t != len(ids)}
        got = {s + i: d + i for s, d, n in runs.tolist() for i in range(n)}
        assert got == want


# --- recurrent -------------------------------------------------------------------------------

def recurrent(**kw):
    args = dict(n_seq_max=2, n_layer=2, n_embd_k_gqa=[8, 16], n_embd_v_gqa=[32, 64], type_k="f32", type_v="f16")
    args.update(kw)
    return RecurrentCache(**args)


def test_recurrent_owned_is_aligned():
    c = recurrent(type_v="bf16")
    assert c.buffers == "owned"
    for il in range(2):
        assert c.k(il).ctypes.data % 64 == 0 and c.v(il).ctypes.data % 64 == 0
        assert c.v(il).dtype == kvcache.view_dtype("bf16")


def test_recurrent_borrowed_and_metadata():
    bufs = [(np.zeros((2, 8), np.float32), np.zeros((2, 32), np.float16)),
            (np.zeros(2 * 16 * 4, np.uint8), np.zeros((2, 64), np.float16))]
    c, own, meta = recurrent(buffers=bufs), recurrent(), recurrent(buffers=None)
    assert (c.buffers, meta.buffers) == ("borrowed", "none")
    ub = UBatch([0, 0], [0, 1])
    for cache in (c, own, meta):
        assert cache.find_slot(ub)
    for cache in (c, own):
        cache.store(1, np.ones((2, 16), np.float32), np.full((2, 64), 2.0, np.float16))
    assert bufs[1][0].view(np.float32).tolist() == [1.0] * 32 and (bufs[1][1] == 2).all()
    assert c.state_write() == own.state_write()
    mc, oc = meta.cells(), own.cells()
    assert mc["pos"].tolist() == oc["pos"].tolist() and mc["seq_id"] == oc["seq_id"]
    with pytest.raises(RuntimeError, match="no K/V memory"):
        meta.k(0)
    with pytest.raises(RuntimeError, match="no K/V memory"):
        meta.store(0, np.zeros((1, 8), np.float32))
    assert np.array_equal(meta.s_copy(), own.s_copy())
    with pytest.raises(ValueError, match=r"buffers\[1\] V holds"):
        recurrent(buffers=[bufs[0], (bufs[1][0], np.zeros((1, 64), np.float16))])
    with pytest.raises(TypeError, match=r"buffers\[0\] K has dtype float16"):
        recurrent(buffers=[(np.zeros((2, 8), np.float16), bufs[0][1]), bufs[1]])


# --- iSWA --------------------------------------------------------------------------------------

def iswa(**kw):
    args = dict(kv_size=64, n_layer=4, n_embd_k_gqa=32, n_embd_v_gqa=32, swa_layers=[0, 2], n_swa=4,
                n_batch=8, n_seq_max=2, type_k="f32", type_v="f32", v_trans=False)
    args.update(kw)
    return kvcache.ISWACache(**args)


@pytest.mark.parametrize("as_list", [False, True])
def test_iswa_borrowed_buffers_go_to_their_caches(as_list):
    own = iswa()
    bufs = {il: (np.zeros(own.k(il).shape, np.float32), np.zeros(own.v(il).shape, np.float32)) for il in range(4)}
    c = iswa(buffers=[bufs[il] for il in range(4)] if as_list else bufs)
    assert (c.buffers, c.base.buffers, c.swa.buffers) == ("borrowed",) * 3
    assert c.base.layers == (1, 3) and c.swa.layers == (0, 2)
    for il in range(4):
        assert np.shares_memory(c.k(il), bufs[il][0]) and np.shares_memory(c.v(il), bufs[il][1])
    assert bufs[0][0].shape[0] == c.swa.size and bufs[1][0].shape[0] == c.base.size
    with pytest.raises(ValueError, match="one \\(K, V\\) pair per model layer"):
        iswa(buffers=[bufs[0], bufs[1]])
    with pytest.raises(ValueError, match=r"buffers\[2\] K holds"):
        iswa(buffers={**bufs, 2: (np.zeros((8, 32), np.float32), bufs[2][1])})


def test_iswa_metadata_only():
    c = iswa(buffers=None)
    assert (c.base.buffers, c.swa.buffers) == ("none", "none")
    with pytest.raises(RuntimeError, match="no K/V memory"):
        c.k(1)
    plan = c.update()
    assert not plan and plan.base.k_shift is None and plan.swa.k_shift is None


def test_metadata_only_state_holds_the_cells():
    own, meta = unified(type_k="f32", type_v="f32"), unified(type_k="f32", type_v="f32", buffers=None)
    ub = UBatch([0, 1, 2], [0, 0, 1])
    for c in (own, meta):
        assert c.find_slot(ub)
        c.commit()
    # nothing was stored: the owned cache holds zero K/V, the bytes a metadata-only cache writes
    assert meta.state_write() == own.state_write()
    other = unified(type_k="f32", type_v="f32", buffers=None)
    assert other.state_read(own.state_write()) == len(own.state_write())
    assert other.cells() == own.cells()


def test_large_owned_memory_starts_on_a_huge_page():
    """Owned K/V memory of 4 MiB or more starts on a 2 MiB boundary (huge pages requested on
    Linux: scattered defrag moves and gathers miss the TLB less); smaller on 64 bytes."""
    big = UnifiedCache(4096, 2, 512, 512, type_k="f16", type_v="f16")
    small = UnifiedCache(64, 1, 16, 16)
    for il in big.layers:
        assert big.k(il).nbytes >= 4 << 20
        assert big.k(il).ctypes.data % (2 << 20) == 0 and big.v(il).ctypes.data % (2 << 20) == 0
    assert small.k(0).ctypes.data % 64 == 0
    big.k(0)[:] = 1.5
    assert (big.k(0) == 1.5).all() and not big.v(0).any()
