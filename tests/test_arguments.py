"""One argument layer: the bridge and the Python modules (iswa.py, plan.py, geometry.py) take
their arguments through the same helpers, so that where two layers must agree, they do."""
import math

import numpy as np
import pytest

import kvcache
from kvcache import _core, plan
from kvcache.geometry import ModelGeometry

SPELLINGS_OK = ["f16", "F16", "Q8_0", "q8_0", "bF16", 1, 8, np.int32(8)]
SPELLINGS_BAD = [("f17", ValueError), ("Q2_K", ValueError), (99, ValueError), (-1, ValueError), (2**40, ValueError),
                 (3.0, TypeError), (True, TypeError), (None, TypeError), (b"f16", TypeError)]


def _constructors(t):
    """Every public constructor (and function) that takes a ggml type, given type t."""
    width = 32
    return {
        "UnifiedCache": lambda: kvcache.UnifiedCache(64, 1, width, width, type_k=t, type_v=t, v_trans=False),
        "RecurrentCache": lambda: kvcache.RecurrentCache(1, 1, width, width, type_k=t, type_v=t),
        "ISWACache": lambda: kvcache.ISWACache(64, 2, width, width, swa_layers=[1], n_swa=4, type_k=t, type_v=t,
                                               v_trans=False),
        "plan_unified": lambda: plan.plan_unified(64, 1, width, type_k=t, type_v=t, flash_attn=True),
        "plan_recurrent": lambda: plan.plan_recurrent(1, width, width, type_k=t, type_v=t),
        "ggml_type": lambda: kvcache._core.ggml_type(t),
        "view_dtype": lambda: kvcache.view_dtype(t),
        "quantize": lambda: kvcache.quantize(np.zeros((1, width), np.float32), t),
        "rope_shift": lambda: kvcache.rope_shift(np.zeros((1, width), np.uint8), t, 1, width, [0],
                                                 kvcache.RopeParams(2)),
    }


@pytest.mark.parametrize("t", SPELLINGS_OK, ids=repr)
def test_every_constructor_accepts_the_same_type_spellings(t):
    name = _core.ggml_type(t).name
    for what, make in _constructors(t).items():
        try:
            got = make()
        except ValueError as e:
            # only a rule of the type itself may refuse (rows of 32 bytes of a quantized type)
            assert what == "rope_shift" and "row" in str(e), (what, e)
            continue
        if isinstance(got, (kvcache.UnifiedCache, kvcache.RecurrentCache)):
            assert got.type_k == name, what


@pytest.mark.parametrize("t,exc", SPELLINGS_BAD, ids=lambda v: repr(v))
def test_every_constructor_refuses_the_same_type_spellings(t, exc):
    for what, make in _constructors(t).items():
        with pytest.raises(exc):
            make()


@pytest.mark.parametrize("kv_size,n_swa,n_seq_max,n_batch,n_pad,swa_full", [
    (4096, 128, 1, 512, 32, False), (4096, 4096, 4, 512, 32, False), (512, 64, 3, 100, 256, False),
    (8192, 1024, 2, 2048, 256, True), (256, 1, 1, 1, 32, False)])
def test_swa_size_rule_is_what_iswa_builds(kv_size, n_swa, n_seq_max, n_batch, n_pad, swa_full):
    want = plan.swa_size(kv_size, n_swa, n_seq_max, n_batch, n_pad, swa_full)
    c = kvcache.ISWACache(kv_size, 2, 8, 8, swa_layers=[1], n_swa=n_swa, n_batch=n_batch, swa_full=swa_full,
                          n_seq_max=n_seq_max, n_pad=n_pad, buffers=None)
    assert c.size_swa == want
    p = plan.plan_iswa(kv_size, 2, 8, swa_layers=[1], n_swa=n_swa, n_batch=n_batch, swa_full=swa_full,
                       n_seq_max=n_seq_max, flash_attn=n_pad == 256)
    assert p.cache("swa").kv_size == want


@pytest.mark.parametrize("flash_attn", [False, True])
def test_geometry_and_plan_agree_on_the_attention_layout(flash_attn):
    g = ModelGeometry(arch="llama", n_layer=2, n_embd=64, n_ctx_train=4096, n_head=(4, 4), n_head_kv=(2, 2),
                      n_embd_head_k=16, n_embd_head_v=16)
    c = g.make_cache(1000, flash_attn=flash_attn, buffers=None)
    p = plan.plan_unified(1000, 2, 32, flash_attn=flash_attn)
    assert (c.n_pad, c.v_trans, c.size) == (p.caches[0].n_pad, p.caches[0].v_trans, p.kv_size)


def test_the_sequence_bound_comes_from_c():
    n = _core.MAX_SEQ
    assert plan.MAX_SEQ == n
    kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=n)
    for make in (lambda: kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=n + 1),
                 lambda: kvcache.RecurrentCache(n + 1, 1, 8, 8),
                 lambda: kvcache.UBatch([0], [n]), lambda: kvcache.Batch([0], [n]),
                 lambda: plan.plan_unified(64, 1, 8, n_seq_max=n + 1)):
        with pytest.raises(ValueError):
            make()


def test_semantic_checks_are_the_c_cores_message():
    with pytest.raises(ValueError, match=r"UnifiedCache: kv_size \(48\) must be a positive multiple of n_pad \(32\)"):
        kvcache.UnifiedCache(48, 1, 8, 8)
    with pytest.raises(ValueError, match="UnifiedCache: type_v q8_0 cannot be stored transposed"):
        kvcache.UnifiedCache(64, 1, 32, 32, type_v="q8_0")
    with pytest.raises(ValueError, match="UnifiedCache: n_embd_k_gqa of layer 0 .16. must be a positive multiple of 32"):
        kvcache.UnifiedCache(64, 1, 16, 32, type_k="q8_0", type_v="f16", v_trans=False)
    with pytest.raises(ValueError, match=r"UnifiedCache: n_swa \(4\) needs a sliding window"):
        kvcache.UnifiedCache(64, 1, 8, 8, n_swa=4)
    with pytest.raises(ValueError, match="RecurrentCache: layer 0: row widths"):
        kvcache.RecurrentCache(1, 1, 16, 32, type_k="q8_0")


class _Lying(int):
    """An int whose comparisons lie: the argument layer reads the value itself."""

    def __lt__(self, other):
        return False

    def __gt__(self, other):
        return False

    def __le__(self, other):
        return True

    def __ge__(self, other):
        return True


def test_int_arguments_are_read_once_from_their_value():
    c = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2)
    with pytest.raises(ValueError):
        c.seq_rm(_Lying(5))
    with pytest.raises(ValueError):
        c.pos_bucket(kvcache.UBatch([0], [0]), _Lying(2**40))
    with pytest.raises(ValueError):
        kvcache.UBatch([0], [_Lying(kvcache.MAX_SEQ)])
    with pytest.raises(ValueError):
        kvcache.UnifiedCache(_Lying(2**40), 1, 8, 8, n_pad=1)
    assert c.seq_rm(_Lying(1)) is True


def test_ubatch_owns_its_values():
    pos = np.arange(4, dtype=np.int32)
    ub = kvcache.UBatch(pos, [0, 0, 0, 0])
    pos[:] = -5
    assert ub.pos.tolist() == [0, 1, 2, 3]
    c = kvcache.UnifiedCache(64, 1, 8, 8)
    assert c.find_slot(ub)


@pytest.mark.parametrize("kwargs", [
    dict(freq_base=math.inf), dict(freq_scale=math.inf), dict(freq_scale=math.nan), dict(ext_factor=math.nan),
    dict(ext_factor=math.inf), dict(attn_factor=math.inf), dict(beta_fast=math.nan), dict(beta_slow=-math.inf),
    dict(freq_base=1e39), dict(freq_factors=[1.0, math.nan, 1.0, 1.0]), dict(freq_factors=[1.0, 0.0, 1.0, 1.0]),
    dict(freq_factors=[1.0, math.inf, 1.0, 1.0]), dict(layer_freq_base={0: math.inf}),
    dict(layer_freq_scale=[1.0, math.nan])])
def test_rope_params_refuse_non_finite_values(kwargs):
    with pytest.raises(ValueError):
        kvcache.RopeParams(8, **kwargs)


def test_rope_params_finite_values_rotate_to_finite_keys():
    c = kvcache.UnifiedCache(64, 1, 16, 16, type_k="f32", type_v="f32", n_embd_head_k=16,
                             rope=kvcache.RopeParams(16, ext_factor=0.5, freq_scale=0.25, n_ctx_orig=64))
    assert c.find_slot(kvcache.UBatch(list(range(8)), [0] * 8))
    c.store(0, np.ones((8, 16), np.float32), None)
    c.commit()
    c.seq_add(0, 0, -1, 3)
    assert c.update().rotated
    assert np.isfinite(c.k(0)).all()


# --- UBatch: the direct paths (lists of ints, int32 / int64 arrays) and the general one agree -----

def _spellings(values):
    """The same integers as each kind of argument UBatch takes: the direct paths (a list or tuple of
    plain ints, native int32 / int64 arrays, strided views) and the general one (other dtypes,
    non-native byte order, numpy scalars in a list, a generator)."""
    a = np.asarray(values, dtype=np.int64)
    strided = np.zeros(2 * len(values), dtype=np.int32)[::2]
    strided[:] = a
    return {
        "list": list(values), "tuple": tuple(values), "int32": a.astype(np.int32), "int64": a,
        "strided": strided, "reversed": a[::-1].copy()[::-1], "uint32": a.astype(np.uint32), "big-endian": a.astype(">i8"),
        "np-scalars": [np.int64(v) for v in values], "generator": (int(v) for v in values),
    }


def _ubatch_facts(ub):
    return ub.n_tokens, ub.n_seqs, ub.pos.tolist(), ub.seq_id, ub.max_seq


@pytest.mark.parametrize("pos_kind", list(_spellings([0]).keys()))
@pytest.mark.parametrize("seq_kind", list(_spellings([0]).keys()))
def test_ubatch_is_the_same_however_its_values_are_given(pos_kind, seq_kind):
    pos = [7, 2**31 - 1, 0, 40000]
    seq = [kvcache.MAX_SEQ - 1, 0, 3, 3]
    ub = kvcache.UBatch(_spellings(pos)[pos_kind], _spellings(seq)[seq_kind])
    assert _ubatch_facts(ub) == (4, 4, pos, [[s] for s in seq], kvcache.MAX_SEQ - 1)
    grouped = kvcache.UBatch(_spellings(pos)[pos_kind], _spellings(seq[:2])[seq_kind], n_seq_tokens=2)
    assert _ubatch_facts(grouped) == (4, 2, pos, [[s] for s in seq[:2]], kvcache.MAX_SEQ - 1)


@pytest.mark.parametrize("kind", ["list", "tuple", "int32", "int64", "strided", "reversed", "np-scalars"])
def test_ubatch_refuses_bad_values_the_same_way_on_every_path(kind):
    with pytest.raises(ValueError, match=r"^pos\[1\] holds -1, outside \[0, 2147483648\)$"):
        kvcache.UBatch(_spellings([0, -1])[kind], [0, 0])
    if kind not in ("strided", "int32"):      # int32 cannot hold 2**31
        with pytest.raises(ValueError, match=r"^pos\[1\] holds 2147483648, outside \[0, 2147483648\)$"):
            kvcache.UBatch(_spellings([0, 2**31])[kind], [0, 0])
    with pytest.raises(ValueError, match=rf"seq_id\[1\] holds {kvcache.MAX_SEQ}, outside \[0, {kvcache.MAX_SEQ}\)"):
        kvcache.UBatch([0, 1], _spellings([0, kvcache.MAX_SEQ])[kind])
    with pytest.raises(ValueError, match=r"seq_id\[0\] holds -2, outside"):
        kvcache.UBatch([0, 1], _spellings([-2, 0])[kind])
    with pytest.raises(ValueError, match=r"seq_id has 1 entries, expected one per token \(2\)"):
        kvcache.UBatch([0, 1], _spellings([0])[kind])


def test_ubatch_reads_list_ints_exactly_on_both_sides_of_a_digit():
    # an int of one internal digit (below 2**30) is read inline, a larger one by the C API:
    # both give the value, and the range check sees ints of any size
    pos = [0, 1, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 1]
    tok = [2**30 + 7, 2**30 - 7, 0, 5, 2**31 - 1, 2**30]
    ub = kvcache.UBatch(pos, [0, 1, 2, 3, 2**7, kvcache.MAX_SEQ - 1], tokens=tok)
    assert ub.pos.tolist() == pos and ub.tokens.tolist() == tok and ub.max_seq == kvcache.MAX_SEQ - 1
    for bad in (-(2**30) + 1, -(2**30), -(2**31), 2**63, -(2**63), 2**100):
        with pytest.raises(ValueError, match=rf"^pos\[2\] holds {bad}, outside \[0, 2147483648\)$"):
            kvcache.UBatch([0, 1, bad], [0, 0, 0])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_ubatch_reads_arrays_of_any_length_whole_and_names_the_first_bad_entry(dtype):
    # a contiguous array is copied and its range taken in one pass: every length (the vector
    # loop's remainders), and the first entry out of range named however many there are
    rng = np.random.default_rng(0)
    for n in list(range(1, 40)) + [255, 256, 257, 512]:
        pos = rng.integers(0, 2**31 - 1, n).astype(dtype)
        tok = rng.integers(0, 2**31 - 1, n).astype(dtype)
        ub = kvcache.UBatch(pos, [3], n_seq_tokens=n, tokens=tok)
        assert ub.pos.tolist() == pos.tolist() and ub.tokens.tolist() == tok.tolist()
        bad = pos.copy()
        bad[n // 2] = -5
        bad[n - 1] = -6
        k = n // 2 if n > 1 else 0
        with pytest.raises(ValueError, match=rf"^pos\[{k}\] holds {bad[k]}, outside \[0, 2147483648\)$"):
            kvcache.UBatch(bad, [3], n_seq_tokens=n)
    # token ids outside [0, 2**31) leave the direct path for the general one, which decides
    tok = np.array([1, -1, 2, 7], dtype=dtype)[:3]
    assert kvcache.UBatch([0, 1, 2], [0, 0, 0], tokens=tok).tokens.tolist() == [1, -1, 2]
    if dtype is np.int64:
        with pytest.raises(ValueError, match="^tokens values must be int32$"):
            kvcache.UBatch([0, 1, 2], [0, 0, 0], tokens=np.array([1, 2, 2**32, -1], dtype=np.int64)[:3])


def test_ubatch_values_are_copied_once():
    pos = np.array([1, 2, 3], dtype=np.int64)
    seq = np.array([4, 5, 6], dtype=np.int32)
    ub = kvcache.UBatch(pos, seq)
    pos[:] = 9
    seq[:] = 9
    assert _ubatch_facts(ub) == (3, 3, [1, 2, 3], [[4], [5], [6]], 6)
    with pytest.raises(ValueError, match="seq_id"):
        kvcache.UBatch([0, 1], [2**64, 0])          # beyond long long: refused, not wrapped
    with pytest.raises(TypeError):
        kvcache.UBatch([0, 1], [True, 0])           # bools are not sequence ids
