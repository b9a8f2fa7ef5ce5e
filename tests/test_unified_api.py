"""UnifiedCache's Python surface: construction, argument checks, data views, store, masks,
shifts, defrag, inspection and state."""
import inspect

import numpy as np
import pytest

import kvcache
from kvcache import Cells, StateError, UBatch, UnifiedCache, UnifiedCache2025, UnifiedCache2026


def make(**kw):
    args = dict(kv_size=64, n_layer=3, n_embd_k_gqa=[4, 2, 6], n_embd_v_gqa=[6, 3, 9],
                type_k="f32", type_v="f32", v_trans=False, n_seq_max=4)
    args.update(kw)
    return UnifiedCache(**args)


def snapshot(c):
    """Everything observable about a cache: counters, cells, K/V bytes."""
    kv = [(c.k(il).tobytes(), c.v(il).tobytes()) for il in c.layers]
    defrag = c.do_defrag if isinstance(c, UnifiedCache2025) else None     # today's cache does not defragment
    return (c.head, c.n, c.used, c.has_shift, defrag, c.cells(), kv)


def place(c, pos, seq_id, fill=None):
    ub = UBatch(pos, seq_id)
    assert c.find_slot(ub)
    if fill is not None:
        for il in c.layers:
            k = np.full((len(pos), c.k(il).shape[1] if not c.type_k.startswith("q") else 0), fill,
                        dtype=np.float32)
            v_cols = c.v(il).shape[0] if c.v_trans else c.v(il).shape[1]
            c.store(il, k, np.full((len(pos), v_cols), fill, dtype=np.float32))
    c.commit()
    return ub


# --- construction ----------------------------------------------------------------------------

def test_public_names():
    assert kvcache.UnifiedCache is UnifiedCache
    assert issubclass(kvcache.StateError, ValueError)
    assert kvcache.UBatch is UBatch and kvcache.Cells is Cells


@pytest.mark.parametrize("semantics, cls", [("2025", UnifiedCache2025), ("2026", UnifiedCache2026)])
def test_a_class_per_semantics(semantics, cls):
    """UnifiedCache(semantics=...) makes the class of that semantics (UnifiedCache2025 by
    default); each class can be made directly, with its own semantics or none, and is a
    UnifiedCache."""
    made = [UnifiedCache(64, 1, 4, 4, semantics=semantics), cls(64, 1, 4, 4), cls(64, 1, 4, 4, semantics=semantics),
            UnifiedCache(64, 1, 4, 4, "f16", "f16", True, 1, 32, 0, "none", None, "owned", None, None, semantics)]
    for c in made:
        assert type(c) is cls and isinstance(c, UnifiedCache) and c.semantics == semantics
        assert repr(c).startswith(f"{cls.__name__}(kv_size=64")
    assert type(UnifiedCache(64, 1, 4, 4)) is UnifiedCache2025
    other = "2026" if semantics == "2025" else "2025"
    with pytest.raises(ValueError, match=f"semantics = '{other}': a {cls.__name__} is a cache of semantics"):
        cls(64, 1, 4, 4, semantics=other)
    with pytest.raises(TypeError, match="semantics must be a str"):
        cls(64, 1, 4, 4, semantics=2025)
    with pytest.raises(TypeError, match=r"^UnifiedCache2025\(\) missing"):
        UnifiedCache2025(64)
    assert inspect.signature(UnifiedCache).parameters["semantics"].default == "2025"
    assert inspect.signature(cls).parameters["semantics"].default is None


def test_the_factory_refuses_what_is_no_semantics():
    with pytest.raises(ValueError, match="semantics = '2027': expected one of 2025, 2026"):
        UnifiedCache(64, 1, 4, 4, semantics="2027")
    with pytest.raises(TypeError, match="semantics must be a str"):
        UnifiedCache(64, 1, 4, 4, semantics=2026)
    with pytest.raises(TypeError, match=r"^UnifiedCache\(\) missing"):
        UnifiedCache(64)

    class Mine(UnifiedCache):
        __slots__ = ()
    with pytest.raises(TypeError, match="UnifiedCache2025 or a UnifiedCache2026"):
        Mine(64, 1, 4, 4)

    class Mine2026(UnifiedCache2026):
        __slots__ = ()
    assert isinstance(Mine2026(64, 1, 4, 4), UnifiedCache2026)


def test_each_class_has_only_its_semantics_members():
    """What only one semantics has is absent from the other's class (AttributeError), not a
    method that refuses."""
    only_2025 = {"commit", "restore", "set_full", "prune_swa", "slot", "do_defrag", "defrag_sched", "defrag_prepare",
                 "defrag_ids", "defrag_runs", "defrag_move"}
    only_2026 = {"prepare", "pending_copies"}
    for name in only_2025:
        assert hasattr(UnifiedCache2025, name) and not hasattr(UnifiedCache2026, name), name
        assert not hasattr(UnifiedCache, name), name
    for name in only_2026:
        assert hasattr(UnifiedCache2026, name) and not hasattr(UnifiedCache2025, name), name
        assert not hasattr(UnifiedCache, name), name
    for name in ("find_slot", "place_seqs", "kq_mask", "update", "slot_info"):
        # every UnifiedCache has them, each semantics' class its own way
        assert hasattr(UnifiedCache, name), name
        assert getattr(UnifiedCache2025, name).__doc__ != getattr(UnifiedCache2026, name).__doc__, name


def test_defaults_and_properties():
    c = UnifiedCache(kv_size=128, n_layer=2, n_embd_k_gqa=8, n_embd_v_gqa=4)
    assert (c.size, c.n_layer, c.layers, c.n_seq_max, c.n_pad) == (128, 2, (0, 1), 1, 32)
    assert (c.type_k, c.type_v, c.v_trans, c.n_swa, c.swa_type) == ("f16", "f16", True, 0, "none")
    assert (c.head, c.n, c.used, c.has_shift, c.do_defrag) == (0, 0, 0, False, False)
    assert c.buffers == "owned"
    assert c.size_k_bytes == 2 * 128 * 8 * 2
    assert c.size_v_bytes == 2 * 128 * 4 * 2
    assert c.total_size == c.size_k_bytes + c.size_v_bytes
    assert "UnifiedCache" in repr(c)


@pytest.mark.parametrize("layers, kept", [
    (None, (0, 1, 2, 3)),
    ([1, 3], (1, 3)),
    ((0,), (0,)),
    ([], ()),
    (lambda il: il % 2 == 0, (0, 2)),
    (range(2, 4), (2, 3)),
])
def test_layer_filter(layers, kept):
    c = UnifiedCache(32, 4, [2, 4, 6, 8], 2, type_k="f32", layers=layers)
    assert c.layers == kept
    assert c.n_layer == 4
    for il in kept:
        assert c.k(il).shape == (32, [2, 4, 6, 8][il])
    for il in set(range(4)) - set(kept):
        with pytest.raises(IndexError, match="il"):
            c.k(il)
    assert c.size_k_bytes == sum(32 * 4 * [2, 4, 6, 8][il] for il in kept)


@pytest.mark.parametrize("n_layer", [64, 65, 66, 130])
def test_many_layers_widths_reach_c(n_layer):
    """Each kept layer's K and V widths reach C (the constructor's layer table: on the stack up
    to 64 kept layers, allocated beyond), including when a filter leaves a spare layer out."""
    wk = [2 * (1 + il % 5) for il in range(n_layer)]
    wv = [1 + il % 7 for il in range(n_layer)]
    c = UnifiedCache(32, n_layer, wk, wv, type_k="f32", type_v="f32", v_trans=False,
                     layers=lambda il: il != 1)
    assert len(c.layers) == n_layer - 1
    for il in c.layers:
        assert c.k(il).shape == (32, wk[il]) and c.v(il).shape == (32, wv[il])
    assert c.size_k_bytes == sum(32 * 4 * wk[il] for il in c.layers)
    assert c.size_v_bytes == sum(32 * 4 * wv[il] for il in c.layers)
    wk[n_layer - 1] = 0                     # refused by C, the table freed either way
    with pytest.raises(ValueError, match=f"layer {n_layer - 1}"):
        UnifiedCache(32, n_layer, wk, wv, type_k="f32", type_v="f32", v_trans=False)


BAD_ARGS = [
    (dict(n_swaa=4), TypeError, "n_swaa"),
    (dict(kv_size=0), ValueError, "kv_size"),
    (dict(kv_size=48), ValueError, "kv_size"),
    (dict(kv_size=2**40), ValueError, "kv_size"),
    (dict(kv_size="64"), TypeError, "kv_size"),
    (dict(kv_size=64.0), TypeError, "kv_size"),
    (dict(n_pad=0), ValueError, "n_pad"),
    (dict(n_layer=-1), ValueError, "n_layer"),
    (dict(n_seq_max=0), ValueError, "n_seq_max"),
    (dict(n_seq_max=257), ValueError, "n_seq_max"),
    (dict(type_k="f64"), ValueError, "type_k"),
    (dict(type_v="q9_9"), ValueError, "type_v"),
    (dict(type_k=1.0), TypeError, "type_k"),
    (dict(type_v=99), ValueError, "type_v"),
    (dict(type_v="q8_0", n_embd_v_gqa=32, v_trans=True), ValueError, "v_trans"),
    (dict(type_k="q8_0", n_embd_k_gqa=[32, 32, 48]), ValueError, "n_embd_k_gqa"),
    (dict(n_embd_k_gqa=[4, 2]), ValueError, "n_embd_k_gqa"),
    (dict(n_embd_v_gqa=[6, 0, 9]), ValueError, "n_embd_v_gqa"),
    (dict(n_embd_v_gqa=[6, -3, 9]), ValueError, "n_embd_v_gqa"),
    (dict(n_embd_k_gqa="4"), TypeError, "n_embd_k_gqa"),
    (dict(n_embd_k_gqa=[4, 2.5, 6]), TypeError, "n_embd_k_gqa"),
    (dict(swa_type="sliding"), ValueError, "swa_type"),
    (dict(swa_type=1), TypeError, "swa_type"),
    (dict(swa_type="standard"), ValueError, "n_swa"),
    (dict(swa_type="chunked", n_swa=0), ValueError, "n_swa"),
    (dict(n_swa=16), ValueError, "n_swa"),
    (dict(n_swa=-1, swa_type="standard"), ValueError, "n_swa"),
    (dict(layers=[2, 0]), ValueError, "layers"),
    (dict(layers=[0, 0]), ValueError, "layers"),
    (dict(layers=[3]), ValueError, "layers"),
    (dict(layers=[-1]), ValueError, "layers"),
    (dict(layers="02"), TypeError, "layers"),
    (dict(layers=5), TypeError, "layers"),
    (dict(buffers="borrowed"), ValueError, "buffers"),
    (dict(buffers=1), TypeError, "buffers"),
    (dict(v_trans="yes"), TypeError, "v_trans"),
]


@pytest.mark.parametrize("kw, exc, name", BAD_ARGS, ids=[f"{e.__name__}-{k}" for k, e, _ in BAD_ARGS])
def test_bad_constructor_args(kw, exc, name):
    with pytest.raises(exc, match=name):
        make(**kw)


def test_byte_counts_that_do_not_fit_are_refused():
    # 4096 cells x 2**20 layers x 5.5 GB rows: more bytes than 2**64 (they wrapped around)
    with pytest.raises(ValueError, match="more bytes of K/V memory or state than a size_t can count"):
        UnifiedCache(4096, 2**20, 1375679233, 1, "f32", v_trans=False, buffers=None)
    with pytest.raises(ValueError, match="size_t"):
        UnifiedCache(2**31 - 2**10, 1, 2**32 - 1, 1, "f32", v_trans=False, buffers=None, n_pad=2**10)


def test_huge_metadata_only_byte_counts_are_exact():
    c = UnifiedCache(4096, 2**10, 2**28, 1, "f32", "f32", v_trans=False, buffers=None)
    assert c.size_k_bytes == 4096 * 2**10 * 2**30 == 2**52
    assert c.size_v_bytes == 4096 * 2**10 * 4
    assert c.total_size == 2**52 + 2**24
    assert c.state_size(layout="2025") == 4 + 8 + 2**10 * 24
    assert c.find_slot(UBatch(list(range(8)), [0] * 8))
    assert c.state_size(layout="2025") == 4 + 8 * 12 + 8 + 2**10 * (24 + 8 * 2**30 + 8 * 4)


def test_dropped_layers_widths_are_not_checked_against_the_block():
    c = UnifiedCache(32, 2, [32, 3], [32, 5], type_k="q8_0", type_v="q4_0", v_trans=False, layers=[0])
    assert c.layers == (0,)


def test_swa_settings():
    c = make(n_swa=8, swa_type="standard")
    assert (c.n_swa, c.swa_type) == (8, "standard")
    c = make(n_swa=32, swa_type="chunked")
    assert c.swa_type == "chunked"


# --- K/V memory ------------------------------------------------------------------------------

@pytest.mark.parametrize("tk, tv, v_trans, kdt, vdt", [
    ("f32", "f32", False, np.float32, np.float32),
    ("f16", "f16", True, np.float16, np.float16),
    ("bf16", "f32", True, kvcache.view_dtype("bf16"), np.float32),
    ("F16", "BF16", False, np.float16, kvcache.view_dtype("bf16")),
    (0, 1, True, np.float32, np.float16),
])
def test_views_float_types(tk, tv, v_trans, kdt, vdt):
    c = make(type_k=tk, type_v=tv, v_trans=v_trans, n_embd_k_gqa=[4, 2, 6], n_embd_v_gqa=[6, 4, 8])
    for il in c.layers:
        k, v = c.k(il), c.v(il)
        assert k.dtype == kdt and v.dtype == vdt
        assert k.shape == (64, [4, 2, 6][il])
        assert v.shape == (([6, 4, 8][il], 64) if v_trans else (64, [6, 4, 8][il]))
        assert k.flags.c_contiguous and v.flags.c_contiguous
        assert k.ctypes.data % 64 == 0 and v.ctypes.data % 64 == 0
        assert not k.any() and not v.any()
    assert c.size_k_bytes == sum(k.nbytes for k in map(c.k, c.layers))


def test_views_quantized_types():
    c = UnifiedCache(32, 2, [64, 32], [32, 96], type_k="q8_0", type_v="q4_0", v_trans=False)
    assert c.k(0).shape == (32, 2 * 34) and c.k(0).dtype == np.uint8
    assert c.k(1).shape == (32, 34)
    assert c.v(1).shape == (32, 3 * 18)
    assert (c.type_k, c.type_v) == ("q8_0", "q4_0")


def test_views_share_memory_with_the_cache():
    c = make()
    c.k(0)[5, :] = 1.5
    assert (c.k(0)[5] == 1.5).all()
    place(c, [0], [0])
    c.clear()
    assert not c.k(0).any()


def test_store_rows_and_vtrans():
    c = make(type_k="f16", type_v="f16", v_trans=True, n_embd_k_gqa=4, n_embd_v_gqa=3)
    place(c, [0, 1], [0, 0])
    ub = UBatch([2, 3, 4], [1, 1, 1])
    assert c.find_slot(ub) and c.head == 2
    k = np.arange(12, dtype=np.float32).reshape(3, 4) / 4
    v = -np.arange(9, dtype=np.float16).reshape(3, 3)
    c.store(1, k, v)                           # float32 input converts to the f16 cache
    assert np.array_equal(c.k(1)[2:5], k.astype(np.float16))
    assert np.array_equal(c.v(1)[:, 2:5], v.T)  # transposed: element e of cell c at [e, c]
    assert not c.k(1)[:2].any() and not c.k(1)[5:].any()
    assert not c.v(1)[:, :2].any() and not c.v(1)[:, 5:].any()
    assert not c.k(0).any()
    c.store(0, None, v)
    assert not c.k(0).any() and np.array_equal(c.v(0)[:, 2:5], v.T)


def test_store_row_major_v_and_bf16():
    c = make(type_k="bf16", type_v="f32", v_trans=False, n_embd_k_gqa=2, n_embd_v_gqa=2)
    c.find_slot(UBatch([0, 1], [0, 1]))
    k = np.array([[1.0, -2.5], [3.0, 0.0078125]], dtype=np.float32)
    c.store(2, k, k)
    # bf16 keeps the upper 16 bits of these exactly representable values
    assert np.array_equal(c.k(2)[:2].view(np.uint16), (k.view(np.uint32) >> 16).astype(np.uint16))
    assert np.array_equal(c.v(2)[:2], k)
    c.store(2, np.zeros((2, 2), dtype=np.uint16), None)
    assert not c.k(2).any()


def test_store_quantized_rows():
    c = UnifiedCache(32, 1, 32, 32, type_k="q8_0", type_v="q8_0", v_trans=False)
    c.find_slot(UBatch([0], [0]))
    row = np.arange(34, dtype=np.uint8).reshape(1, 34)
    c.store(0, row, row)
    assert np.array_equal(c.k(0)[0], row[0]) and np.array_equal(c.v(0)[0], row[0])
    with pytest.raises(TypeError, match="k_rows"):
        c.store(0, np.zeros((1, 32), np.float32), None)


@pytest.mark.parametrize("k, v, exc, name", [
    (np.zeros((2, 4), np.float64), None, TypeError, "k_rows"),
    (np.zeros((2, 4), np.float16), None, TypeError, "k_rows"),
    (np.zeros((3, 4), np.float32), None, ValueError, "k_rows"),
    (np.zeros((2, 5), np.float32), None, ValueError, "k_rows"),
    (np.zeros(8, np.float32), None, ValueError, "k_rows"),
    (np.zeros((4, 2), np.float32).T, None, ValueError, "k_rows"),
    ([[0.0] * 4] * 2, None, TypeError, "k_rows"),
    (None, np.zeros((2, 5), np.float32), ValueError, "v_rows"),
    (None, np.zeros((2, 6), np.int32), TypeError, "v_rows"),
])
def test_store_bad_rows(k, v, exc, name):
    c = make()
    c.find_slot(UBatch([0, 1], [0, 0]))
    before = snapshot(c)
    with pytest.raises(exc, match=name):
        c.store(0, k, v)
    assert snapshot(c) == before


def test_store_needs_a_placed_ubatch():
    c = make()
    with pytest.raises(RuntimeError):
        c.store(0, None, None)
    c.find_slot(UBatch([0], [0]))
    c.store(0, None, None)
    c.seq_rm(0, 0, 1)                        # may move head: the placement is gone
    with pytest.raises(RuntimeError):
        c.store(0, np.zeros((1, 4), np.float32), None)
    assert c.find_slot(UBatch([0], [0]))
    with pytest.raises(IndexError, match="il"):
        c.store(7, None, None)
    with pytest.raises(TypeError, match="il"):
        c.store("0", None, None)


# --- sequence operations and argument checks ------------------------------------------------

def test_sequence_ops():
    c = make()
    place(c, [0, 1, 2, 3], [0, 0, [0, 1], 1])
    assert (c.head, c.n, c.used) == (0, 32, 4)
    assert c.cells().nonempty() == [[0, 0, [0], 0], [1, 1, [0], 0], [2, 2, [0, 1], 0], [3, 3, [1], 0]]
    assert (c.seq_pos_min(0), c.seq_pos_max(0), c.seq_pos_min(1), c.seq_pos_max(1)) == (0, 2, 2, 3)
    assert c.seq_pos_max(2) == -1
    c.seq_cp(1, 2, 3, -1)
    assert c.cells().seq_ids(3) == [1, 2]
    assert c.seq_rm(0, 1, 2) is True
    assert c.used == 3 and c.seq_pos_max(0) == 2
    c.seq_add(0, 0, -1, 10)
    assert c.has_shift and c.seq_pos_max(0) == 12
    c.seq_div(1, 0, -1, 2)
    assert c.seq_pos_max(1) == 6
    c.seq_keep(1)
    assert c.used == 2 and c.seq_pos_max(0) == -1
    assert c.seq_rm(-1) and c.used == 0


def test_seq_rm_any_sequence():
    c = make()
    place(c, [0, 1, 2], [0, 1, [2, 3]])
    assert c.seq_rm(-1, 1, 3) is True
    assert c.cells().nonempty() == [[0, 0, [0], 0]]


def _bad_calls(n):
    bad_ub = UBatch([0, 1], [[0], [1, n]])
    return [
        ("seq_rm", (-2,)), ("seq_rm", (n,)), ("seq_rm", (64,)), ("seq_rm", (0, 2**31)),
        ("seq_rm", (0, 0, -2**31 - 1)), ("seq_rm", (2**70,)),
        ("seq_cp", (-1, 0)), ("seq_cp", (0, n)), ("seq_cp", (0, 1, 0, 2**31)),
        ("seq_keep", (-1,)), ("seq_keep", (n,)), ("seq_keep", (1000,)),
        ("seq_add", (-1, 0, -1, 1)), ("seq_add", (n, 0, -1, 1)), ("seq_add", (0, 0, -1, 2**31)),
        ("seq_div", (-1, 0, -1, 2)), ("seq_div", (n, 0, -1, 2)), ("seq_div", (0, 0, -1, 0)),
        ("seq_div", (0, 0, -1, -3)),
        ("seq_pos_min", (-1,)), ("seq_pos_max", (n,)),
        ("find_slot", (bad_ub,)), ("kq_mask", (bad_ub,)), ("pos_bucket", (bad_ub, 32)),
        ("pos_bucket", (UBatch([0], [0]), 1)),
        ("kq_mask", (UBatch([0], [0]),), {"dtype": "f64"}),
        ("state_size", (-2,)), ("state_write", (n,)), ("state_read", (b"\0" * 16, n)),
        ("state_read", (b"\0" * 16, -5)),
        ("defrag_prepare", (2**31,)), ("defrag_prepare", ("1",)), ("defrag_sched", ("0.5",)),
    ]


def test_bad_arguments_raise_and_change_nothing():
    c = make(v_trans=True, type_v="f16")
    place(c, [0, 1, 2, 3], [0, 1, [1, 2], 3], fill=1.25)
    c.seq_add(1, 0, 2, 3)
    ub = UBatch([9], [0])
    assert c.find_slot(ub)                   # uncommitted, so that restore() would show damage
    before = snapshot(c)
    for call in _bad_calls(c.n_seq_max):
        name, args = call[0], call[1]
        kw = call[2] if len(call) > 2 else {}
        with pytest.raises((ValueError, TypeError)) as ei:
            getattr(c, name)(*args, **kw)
        assert not isinstance(ei.value, StateError), name
        assert snapshot(c) == before, name
    c.restore()
    assert c.used == 4


def test_bad_seq_id_messages_name_the_argument():
    c = make()
    with pytest.raises(ValueError, match="seq_id"):
        c.seq_keep(4)
    with pytest.raises(ValueError, match="dst"):
        c.seq_cp(0, 4)
    with pytest.raises(ValueError, match="src"):
        c.seq_cp(-1, 0)
    with pytest.raises(ValueError, match="p1"):
        c.seq_rm(0, 0, 2**31)
    with pytest.raises(ValueError, match="d"):
        c.seq_div(0, 0, 1, 0)
    with pytest.raises(TypeError):
        c.seq_rm(0.5)
    with pytest.raises(TypeError):
        c.find_slot([0, 1])


def test_find_slot_full_cache_and_restore():
    c = make(kv_size=32)
    place(c, list(range(30)), [0] * 30)
    assert c.find_slot(UBatch([30, 31, 32], [0, 0, 0])) is False
    assert c.used == 30
    assert c.find_slot(UBatch([30, 31], [1, 1])) is True
    assert c.used == 32
    c.restore()
    assert c.used == 30
    c.set_full()
    assert (c.n, c.head) == (32, 0)


@pytest.mark.parametrize("semantics", ["2025", "2026"])
@pytest.mark.parametrize("pos,n_tokens,n_seqs", [(0, 1, 1), (0, 5, 3), (7, 1, 4), (3, 2, 2), (0, 40, 2)])
def test_place_seqs_is_find_slot_of_the_index_major_ubatch_and_commit(semantics, pos, n_tokens, n_seqs):
    """place_seqs(pos, q, r) leaves the cache exactly as find_slot of the ubatch whose token
    j * r + s is sequence s at pos + j, then commit, would (2026: find_slot alone), on a cache
    already holding cells with holes; it returns the first cell when the cells run on."""
    def busy():
        c = make(kv_size=128, semantics=semantics)
        for p in range(12):
            assert c.find_slot(UBatch([p], [p % 3]))
            if semantics == "2025":
                c.commit()
        c.seq_rm(1, 0, 6)
        return c
    a, b = busy(), busy()
    ub = UBatch([pos + j for j in range(n_tokens) for _ in range(n_seqs)], list(range(n_seqs)) * n_tokens)
    assert b.find_slot(ub)
    if semantics == "2025":
        b.commit()
    cells = b.slot_indices().tolist()
    got = a.place_seqs(pos, n_tokens, n_seqs)
    assert got == (cells[0] if cells == list(range(cells[0], cells[0] + len(cells))) else -1)
    assert snapshot(a) == snapshot(b)
    assert a.slot_indices().tolist() == cells
    if semantics == "2025":
        assert a.slot == (cells[0], len(cells)) and got == cells[0]
        a.restore()                                 # committed: nothing to undo
        assert snapshot(a) == snapshot(b)


@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_place_seqs_without_room_returns_none_and_places_nothing(semantics):
    c = make(kv_size=32, semantics=semantics)
    assert c.place_seqs(0, 15, 2) == 0
    before = c.cells()
    assert c.place_seqs(15, 2, 2) is None           # 4 cells wanted, 2 free
    assert c.cells() == before and c.used == 30
    assert c.place_seqs(15, 1, 2) == 30


def test_place_seqs_then_store_and_mask():
    """The placement is current, as after find_slot: store writes its rows, kq_mask sees it."""
    c = make()
    assert c.place_seqs(0, 2, 2) == 0
    k = np.arange(4 * 4, dtype=np.float32).reshape(4, 4)
    c.store(0, k, np.zeros((4, 6), np.float32))
    assert np.array_equal(c.k(0)[:4], k)
    mask = c.kq_mask(UBatch([0, 0, 1, 1], [0, 1, 0, 1]), pad=False)
    assert mask.shape[0] == 4 and np.isfinite(mask[3, [1, 3]]).all() and np.isinf(mask[3, [0, 2]]).all()


def test_place_seqs_of_a_cache_with_a_stream_per_sequence():
    """One token per sequence goes to each sequence's stream (cells of different streams: -1);
    several tokens per sequence, interleaved, are refused as find_slot refuses them."""
    c = make(semantics="2026", kv_unified=False, n_seq_max=2)
    assert c.place_seqs(0, 1, 2) == -1
    assert [c.seq_cells(s)[0].tolist() for s in range(2)] == [[0], [0]]
    before = c.stream_cells()
    with pytest.raises(ValueError):
        c.place_seqs(1, 2, 2)
    assert c.stream_cells() == before


def test_clear_keeps_n():
    c = make()
    place(c, [0, 1], [0, 0], fill=2.0)
    assert c.k(0).any()
    n = c.n
    c.clear()
    assert (c.head, c.n, c.used) == (0, n, 0)
    assert not any(c.k(il).any() or c.v(il).any() for il in c.layers)


# --- attention inputs ------------------------------------------------------------------------

def test_kq_mask_values():
    c = make(n_seq_max=2)
    place(c, [0, 1, 2], [0, 0, 1])
    ub = UBatch([3, 4], [0, 1])
    assert c.find_slot(ub)
    m = c.kq_mask(ub)
    assert m.shape == (64, 32) and m.dtype == np.float32
    inf = -np.inf
    assert m[0, :6].tolist() == [0, 0, inf, 0, inf, inf]     # seq 0 at pos 3
    assert m[1, :6].tolist() == [inf, inf, 0, inf, 0, inf]   # seq 1 at pos 4
    assert np.isneginf(m[2:]).all() and np.isneginf(m[:, 6:]).all()
    nc = c.kq_mask(UBatch([0], [0]), causal=False)
    assert nc[0, :4].tolist() == [0, 0, inf, 0]
    assert c.kq_mask(UBatch([0], [0]), causal=True)[0, :4].tolist() == [0, inf, inf, inf]
    al = c.kq_mask(ub, alibi=True)
    assert al[0, :4].tolist() == [-3, -2, inf, 0] and not np.signbit(al[0, 3])


def test_kq_mask_out_and_dtypes():
    c = make()
    place(c, [0, 1, 2], [0, 0, 0])
    ub = UBatch([3], [0])
    ref = c.kq_mask(ub)
    out = np.full((64, 32), 7.0, dtype=np.float32)
    assert c.kq_mask(ub, out=out) is out
    assert np.array_equal(out, ref)
    h = c.kq_mask(ub, dtype="f16")
    assert h.dtype == np.float16 and np.array_equal(h.astype(np.float32), ref)
    b = c.kq_mask(ub, dtype="bool")
    assert b.dtype == np.bool_ and np.array_equal(b, np.isfinite(ref))
    for bad in (np.zeros((64, 31), np.float32), np.zeros((64, 32), np.float64),
                np.zeros((32, 64), np.float32).T, np.zeros((1, 32), np.float32)):
        with pytest.raises(ValueError, match="out"):
            c.kq_mask(ub, out=bad)
    ro = np.zeros((64, 32), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        c.kq_mask(ub, out=ro)
    with pytest.raises(TypeError, match="out"):
        c.kq_mask(ub, out=[[0.0] * 32] * 64)
    with pytest.raises(ValueError, match="dtype"):
        c.kq_mask(ub, dtype="f64")


def test_kq_mask_sliding_window():
    c = make(n_swa=2, swa_type="standard")
    place(c, [0, 1, 2, 3], [0] * 4)
    m = c.kq_mask(UBatch([3], [0]))
    assert np.isfinite(m[0, :4]).tolist() == [False, False, True, True]


def test_kq_mask_empty_cache_and_grouped_ubatch():
    c = make()
    assert c.kq_mask(UBatch([0], [0])).shape == (64, 0)
    ub = UBatch([0, 1, 0, 1], [0, 1], n_seq_tokens=2)
    assert c.find_slot(ub)
    m = c.kq_mask(ub)
    assert np.isfinite(m[:4, :4]).tolist() == [[True, False, False, False], [True, True, False, False],
                                                [False, False, True, False], [False, False, True, True]]


def test_pos_bucket():
    c = make()
    place(c, [0, 1, 2, 40], [0, 0, 0, 0])
    b = c.pos_bucket(UBatch([2, 200], [0, 0]), 32)
    assert b.dtype == np.int32 and b.shape == (2, 32)
    assert b[0, :4].tolist() == [2, 1, 0, 0]
    assert b[1, :3].tolist() == [31, 31, 31]
    assert 16 <= b[1, 3] < 32


def test_k_shift_and_reset():
    c = make()
    place(c, [0, 1, 2], [0, 0, 1])
    k = c.k_shift()
    assert k.dtype == np.int32 and k.shape == (64,) and not k.any() and not c.has_shift
    c.seq_add(0, 1, -1, 5)
    assert c.has_shift
    assert c.k_shift()[:3].tolist() == [0, 5, 0]
    assert c.cells().shift[1] == 5
    c.reset_shift()
    assert not c.has_shift and not c.k_shift().any()
    assert c.cells().pos[:3].tolist() == [0, 6, 2]


def test_update_without_rope_drops_the_shift():
    c = make()
    place(c, [0, 1], [0, 0])
    c.seq_add(0, 0, -1, 3)
    before = snapshot(c)
    with pytest.raises(TypeError, match="rope"):
        c.update(rope=object())
    assert snapshot(c) == before
    plan = c.update()
    assert not plan and not plan.rotated and plan.k_shift[:2].tolist() == [3, 3]
    assert not c.has_shift and c.seq_pos_max(0) == 4


# --- defragmentation -------------------------------------------------------------------------

def _holey(c):
    place(c, list(range(8)), [0, 1, 0, 1, 0, 1, 0, 1])
    for il in c.layers:
        k = np.repeat(np.arange(8, dtype=np.float32)[:, None], c.k(il).shape[1], axis=1)
        c.k(il)[:8] = k
        if c.v_trans:
            c.v(il)[:, :8] = k[:, :1].T
        else:
            c.v(il)[:8] = k[:, :1]
    c.seq_rm(1)                               # empties cells 1, 3, 5, 7


@pytest.mark.parametrize("v_trans", [False, True])
def test_defrag_moves_cells_and_data(v_trans):
    c = make(v_trans=v_trans, n_embd_v_gqa=1)
    _holey(c)
    assert c.defrag_prepare(65536) is True
    ids = c.defrag_ids
    assert ids.dtype == np.uint32 and ids.tolist() == [0, 7, 2, 7, 3, 7, 1]
    assert c.defrag_ids is not c.defrag_ids          # a copy each time
    c.defrag_move()
    assert c.cells().nonempty() == [[0, 0, [0], 0], [1, 6, [0], 0], [2, 2, [0], 0], [3, 4, [0], 0]]
    for il in c.layers:
        assert c.k(il)[:4, 0].tolist() == [0, 6, 2, 4]
        v = c.v(il)[0, :4] if v_trans else c.v(il)[:4, 0]
        assert v.tolist() == [0, 6, 2, 4]
    c.defrag_move()                                   # the plan is applied once
    assert c.k(0)[:4, 0].tolist() == [0, 6, 2, 4]
    assert c.defrag_prepare(65536) is False


def test_defrag_sched_and_update():
    c = UnifiedCache(4096, 1, 1, 1, n_seq_max=2, n_pad=256)
    c.defrag_sched(0.5)
    assert not c.do_defrag                            # n < 2048: never fragmented
    c.defrag_sched(-1.0)
    assert c.do_defrag
    place(c, list(range(8)), [0, 1] * 4)
    c.seq_rm(1)
    plan = c.update()
    assert plan and plan.moved and plan.k_shift is None
    assert plan.defrag_runs.tolist() == [[4, 3, 1], [6, 1, 1]]
    assert not c.do_defrag and c.used == 4 and c.cells().pos[:4].tolist() == [0, 6, 2, 4]
    assert not c.update()


def test_fragmentation_is_what_defrag_sched_measures():
    c = UnifiedCache(8192, 1, 1, 1, n_seq_max=2, n_pad=256)
    assert c.fragmentation == 0.0                     # n = 0
    place(c, list(range(3000)), [0, 1] * 1500)
    c.seq_rm(1)
    n, used = c.n, c.used
    assert (n, used) == (3072, 1500)
    frag = float(np.float32(1) - np.float32(used + 256) / np.float32(n))
    assert c.fragmentation == frag
    c.defrag_sched(frag)                              # scheduled only above it
    assert not c.do_defrag
    c.defrag_sched(float(np.nextafter(np.float32(frag), np.float32(0))))
    assert c.do_defrag
    small = make()
    place(small, list(range(8)), [0, 1] * 4)
    small.seq_rm(1)
    assert small.fragmentation == pytest.approx(max(0.0, 1 - (4 + small.n_pad) / small.n))
    small.defrag_sched(0.0)                           # n < 2048: counted as 0
    assert not small.do_defrag


# --- inspection ------------------------------------------------------------------------------

def test_cells_snapshot():
    c = make()
    place(c, [5, 6], [[0, 3], 2])
    cells = c.cells()
    assert isinstance(cells, Cells) and len(cells) == 64
    assert cells.pos.dtype == np.int32 and cells.seq_mask.dtype == np.uint64
    assert cells.seq_ids(0) == [0, 3] and cells.seq_ids(2) == []
    assert cells.nonempty() == [[0, 5, [0, 3], 0], [1, 6, [2], 0]]
    c.seq_rm(0)
    assert cells.pos[0] == 5                           # a snapshot, not a view
    assert c.cells() != cells


# --- state -----------------------------------------------------------------------------------

def _filled(**kw):
    c = make(type_k="f16", type_v="f16", v_trans=True, **kw)
    rng = np.random.default_rng(3)
    for pos, seq in (([0, 1, 2], [0, 0, [0, 1]]), ([0, 1], [2, 2]), ([3], [1])):
        ub = UBatch(pos, seq)
        assert c.find_slot(ub)
        for il in c.layers:
            c.store(il, rng.standard_normal((len(pos), c.k(il).shape[1])).astype(np.float32),
                    rng.standard_normal((len(pos), c.v(il).shape[0])).astype(np.float32))
        c.commit()
    return c


def test_state_round_trip_whole_cache():
    a = _filled()
    blob = a.state_write(layout="2025")
    assert isinstance(blob, bytes) and len(blob) == a.state_size(layout="2025")
    b = make(type_k="f16", type_v="f16", v_trans=True)
    for data in (blob, bytearray(blob), memoryview(blob), np.frombuffer(blob, np.uint8), blob + b"\x01" * 9):
        assert b.state_read(data, layout="2025") == len(blob)
        assert b.cells() == a.cells()
        for il in a.layers:
            assert np.array_equal(a.k(il), b.k(il)) and np.array_equal(a.v(il), b.v(il))
        assert b.state_write(layout="2025") == blob


def test_state_round_trip_one_sequence():
    a = _filled()
    blob = a.state_write(1, layout="2025")
    assert len(blob) == a.state_size(1, layout="2025") < a.state_size(layout="2025")
    b = make(type_k="f16", type_v="f16", v_trans=True)
    assert b.state_read(blob, 3, layout="2025") == len(blob)
    assert [cell[1:3] for cell in b.cells().nonempty()] == [[2, [3]], [3, [3]]]
    assert (b.seq_pos_min(3), b.seq_pos_max(3)) == (2, 3)


def test_state_read_failure_changes_nothing():
    a = _filled()
    blob = a.state_write(layout="2025")
    b = _filled()
    b.seq_rm(2)
    ub = UBatch([7], [3])
    assert b.find_slot(ub)
    before = snapshot(b)
    for bad in (blob[:-1], blob[:3], b"", blob[:4] + b"\xff" * (len(blob) - 4)):
        with pytest.raises(StateError):
            b.state_read(bad, layout="2025")
        assert snapshot(b) == before
    other = make(type_k="f32", type_v="f16", v_trans=True)
    with pytest.raises(StateError):
        other.state_read(blob, layout="2025")
    with pytest.raises(TypeError):
        b.state_read(12345, layout="2025")
