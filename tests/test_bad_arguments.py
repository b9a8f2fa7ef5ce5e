"""Bad-argument matrix: every public method of every public class, called with each class of
bad argument, raises the specific exception and leaves the object exactly as it was.

Each method is described by the kinds of its parameters (a sequence id, a position, a layer,
a ubatch, a buffer...); each kind has its bad values and the exception each one must raise.
A row of the matrix is (class, method, parameter, bad value, expected exception); the cache
is compared with a snapshot (cells, counters, placement, flags, sequence ranges, every K/V
byte) after the call.
"""
import io
import mmap

import numpy as np
import pytest

import kvcache
from cache_state import busy_iswa, busy_recurrent, busy_unified, snapshot

BIG = 2**70


def _noncontig(dtype=np.uint8, n=64):
    return np.zeros(2 * n, dtype=dtype)[::2]


def _released():
    m = memoryview(bytearray(64))
    m.release()
    return m


def _closed_file():
    f = io.BytesIO()
    f.close()
    return f


# bad values per kind of parameter: (label, value, exception)
def _seq(n_seq_max, allow_any):
    out = [("str", "0", TypeError), ("float", 1.0, TypeError), ("none", None, TypeError),
           ("bool", True, TypeError), ("list", [0], TypeError),
           ("too-big", n_seq_max, ValueError), ("huge", BIG, ValueError), ("very-negative", -2, ValueError),
           ("negative-huge", -BIG, ValueError)]
    if not allow_any:
        out.append(("minus-one", -1, ValueError))
    return out


POS = [("str", "1", TypeError), ("float", 1.5, TypeError), ("none", None, TypeError),
       ("above-int32", 2**31, ValueError), ("below-int32", -2**31 - 1, ValueError), ("huge", BIG, ValueError)]
LAYER = [("str", "0", TypeError), ("float", 0.0, TypeError), ("none", None, TypeError),
         ("absent", 99, IndexError), ("negative", -1, IndexError)]
COUNT = [("str", "8", TypeError), ("float", 8.0, TypeError), ("huge", BIG, ValueError)]
DATA = [("int", 3, TypeError), ("str", "abc", TypeError), ("none", None, TypeError),
        ("noncontiguous", _noncontig(), ValueError), ("released", _released(), ValueError),
        ("empty", b"", kvcache.StateError), ("short", b"\x01\x00", kvcache.StateError),
        ("garbage", b"\xff" * 64, kvcache.StateError)]
BUF = [("int", 3, TypeError), ("bytes", b"\0" * 4096, TypeError), ("too-small", bytearray(1), ValueError),
       ("noncontiguous", _noncontig(n=8192), ValueError), ("released", _released(), ValueError),
       ("closed-file", _closed_file(), ValueError), ("none", None, TypeError)]


def _ub_bad(n_seq_max):
    return [("none", None, TypeError), ("list", [0, 1], TypeError), ("batch", kvcache.Batch([0], [0]), TypeError),
            ("seq-too-big", kvcache.UBatch([0], [n_seq_max]), ValueError)]


# --- the methods: name -> (valid arguments, {parameter index: bad values}) ----------------------------

def _unified_methods(c):
    ub = kvcache.UBatch([40, 41], [0, 1])
    seq, seq_any = _seq(c.n_seq_max, False), _seq(c.n_seq_max, True)
    n = c.n
    il = c.layers[0]
    if c.buffers == "none":
        kd = vd = np.dtype(np.float16)
        wk = wv = 8
    else:
        kd, vd = c.k(il).dtype, c.v(il).dtype
        wk = c.k(il).shape[1]
        wv = c.v(il).shape[0] if c.v_trans else c.v(il).shape[1]
    mask_out = [("list", [0.0], TypeError), ("shape", np.zeros((63, n), np.float32), ValueError),
                ("dtype", np.zeros((64, n), np.float64), ValueError),
                ("noncontiguous", np.zeros((64, 2 * n), np.float32)[:, ::2], ValueError),
                ("readonly", np.lib.stride_tricks.as_strided(np.zeros((64, n), np.float32), writeable=False),
                 ValueError)]
    return {
        "find_slot": ((ub,), {0: _ub_bad(c.n_seq_max)}),
        "place_seqs": ((40, 2, 2), {0: POS + [("negative", -1, ValueError)],
                                    1: COUNT + [("zero", 0, ValueError), ("past-int32", 2**31 - 40, ValueError)],
                                    2: COUNT + [("zero", 0, ValueError), ("too-many", c.n_seq_max + 1, ValueError)]}),
        "seq_rm": ((0, 0, 5), {0: seq_any, 1: POS, 2: POS}),
        "seq_cp": ((0, 1, 0, 5), {0: seq, 1: seq, 2: POS, 3: POS}),
        "seq_keep": ((0,), {0: seq}),
        "seq_add": ((0, 0, 5, 2), {0: seq, 1: POS, 2: POS, 3: POS}),
        "seq_div": ((0, 0, 5, 2), {0: seq, 1: POS, 2: POS,
                                   3: POS + [("zero", 0, ValueError), ("negative", -3, ValueError)]}),
        "seq_pos_min": ((0,), {0: seq}),
        "seq_pos_max": ((0,), {0: seq}),
        "k": ((c.layers[0],), {0: LAYER}),
        "v": ((c.layers[0],), {0: LAYER}),
        "store": ((il, None, None), {
            0: LAYER,
            1: [("list", [[0.0]], TypeError), ("dtype", np.zeros((2, wk), np.int64), TypeError),
                ("shape", np.zeros((2, wk + 1), kd), ValueError),
                ("noncontiguous", np.zeros((2, 2 * wk), kd)[:, ::2], ValueError)],
            2: [("str", "rows", TypeError), ("shape", np.zeros((3, wv), vd), ValueError)]}),
        "kq_mask": ((ub,), {0: _ub_bad(c.n_seq_max)}),
        "kq_mask#out": ((ub, True, False, None), {3: mask_out}),
        "kq_mask#dtype": ((ub, True, False, None, "f32"), {4: [("unknown", "f64", ValueError),
                                                             ("list", ["f32"], ValueError)]}),
        "pos_bucket": ((ub, 32), {0: _ub_bad(c.n_seq_max), 1: COUNT + [("one", 1, ValueError)]}),
        "defrag_sched": ((0.5,), {0: [("str", "0.5", TypeError), ("none", None, TypeError),
                                      ("bool", True, TypeError)]}),
        "defrag_prepare": ((8,), {0: COUNT}),
        "update": ((None, 64), {0: [("str", "rope", TypeError), ("int", 3, TypeError)], 1: COUNT}),
        "prune_swa": ((0, 5, 9), {0: seq, 1: POS, 2: POS}),
        "state_size": ((0,), {0: seq_any}),
        "state_write": ((0,), {0: seq_any}),
        "state_write_into": ((bytearray(1 << 16), 0), {0: BUF, 1: seq_any}),
        "state_read": ((b"", 0), {0: DATA, 1: seq_any}),
    }


def _iswa_methods(c):
    methods = _unified_methods(c.base)
    for name in ("prune_swa", "defrag_prepare", "pos_bucket", "place_seqs"):
        del methods[name]
    layer = [(l, v, IndexError if isinstance(v, int) else e) for l, v, e in LAYER]
    for name in ("k", "v"):
        methods[name] = ((0,), {0: layer})
    args, bad = methods["store"]
    methods["store"] = ((0,) + args[1:], {0: layer, **{k: v for k, v in bad.items() if k != 0}})
    n_base, n_swa = c.base.n, c.swa.n
    methods["kq_mask#out"] = ((kvcache.UBatch([40], [0]), True, False, None), {3: [
        ("not-pair", np.zeros((64, n_base), np.float32), TypeError),
        ("triple", (None, None, None), TypeError),
        ("shape", (np.zeros((63, n_base), np.float32), None), ValueError),
        ("swa-shape", (None, np.zeros((63, n_swa), np.float32)), ValueError)]})
    methods["find_slot_each"] = methods["find_slot"]
    methods["sbatch_init"] = (([0, 1], [0, 1]), {0: [("none", None, TypeError), ("float-pos", [0.5, 1.5], TypeError)],
                                                 1: [("seq-too-big", [0, c.n_seq_max], ValueError),
                                                     ("str", "ab", TypeError)]})
    methods["cache_of"] = ((0,), {0: layer})
    methods["ubatches"] = ((kvcache.Batch([0], [0]), 2), {0: [("list", [0], TypeError),
                                                              ("seq-batch", kvcache.Batch([0], [0], simple_split=False),
                                                               ValueError)],
                                                          1: [("zero", 0, ValueError), ("str", "2", TypeError)]})
    return methods


def _recurrent_methods(c):
    seq, seq_any = _seq(c.n_seq_max, False), _seq(c.n_seq_max, True)
    rlayer = [(l, v, e) for l, v, e in LAYER]
    return {
        "find_slot": ((kvcache.UBatch([5], [3]),), {0: _ub_bad(c.n_seq_max)}),
        "seq_rm": ((0, 0, 5), {0: seq_any, 1: POS, 2: POS}),
        "seq_cp": ((0, 1), {0: seq, 1: seq}),
        "seq_keep": ((0,), {0: seq}),
        "seq_add": ((0, 0, 5, 2), {0: seq, 1: POS, 2: POS, 3: POS}),
        "seq_div": ((0, 0, 5, 2), {0: seq, 1: POS, 2: POS, 3: POS + [("zero", 0, ValueError)]}),
        "seq_pos_min": ((0,), {0: seq}),
        "seq_pos_max": ((0,), {0: seq}),
        "k": ((0,), {0: rlayer}),
        "v": ((0,), {0: rlayer}),
        "store": ((0, None, None), {0: rlayer, 1: [("shape", np.zeros((1, 3), np.float32), ValueError),
                                                   ("str", "rows", TypeError),
                                                   ("past-the-end", np.zeros((99, 6), np.float32), ValueError)]}),
        "state_size": ((0,), {0: seq_any}),
        "state_write": ((0,), {0: seq_any}),
        "state_write_into": ((bytearray(1 << 16), 0), {0: BUF, 1: seq_any}),
        "state_read": ((b"", 0), {0: DATA, 1: seq_any}),
        "ubatches": ((kvcache.Batch([0], [0], simple_split=False), 2),
                     {0: [("list", [0], TypeError), ("simple-batch", kvcache.Batch([0], [0]), ValueError)],
                      1: [("zero", 0, ValueError), ("str", "2", TypeError)]}),
    }


def _placed(cache):
    """The cache with a current (uncommitted) placement, for store."""
    assert cache.find_slot(kvcache.UBatch([30, 31], [1, 1]))
    return cache


MAKERS = {
    "unified": (lambda: busy_unified(), _unified_methods),
    "unified-q8": (lambda: busy_unified(type_k="q8_0", type_v="q8_0", v_trans=False, widths=(32, 64)),
                   _unified_methods),
    "unified-meta": (lambda: busy_unified(buffers=None), _unified_methods),
    "iswa": (lambda: _placed(busy_iswa()), _iswa_methods),
    "recurrent": (lambda: busy_recurrent(), _recurrent_methods),
}


def _rows():
    rows = []
    for cls, (make, methods) in MAKERS.items():
        for name, (args, bad) in methods(make()).items():
            for i, values in bad.items():
                for label, value, exc in values:
                    rows.append(pytest.param(cls, name, i, label, exc, id=f"{cls}-{name}-arg{i}-{label}"))
    return rows


def _call(cache, name, args):
    method = getattr(cache, name.split("#")[0])
    return method(*args)


@pytest.mark.parametrize("cls,name,index,label,exc", _rows())
def test_bad_argument_raises_and_changes_nothing(cls, name, index, label, exc):
    make, methods = MAKERS[cls]
    cache = make()
    args, bad = methods(cache)[name]
    value = next(v for l, v, _ in bad[index] if l == label)
    args = list(args)
    args[index] = value
    if cache_kind_has_no_memory(cache) and name.split("#")[0] in ("k", "v", "store"):
        exc = RuntimeError if index != 0 or exc is None else exc
    before = snapshot(cache)
    with pytest.raises(exc):
        _call(cache, name, args)
    assert snapshot(cache) == before, f"{name} with a bad argument {index} ({label}) changed the cache"


def cache_kind_has_no_memory(cache):
    parts = (cache.base, cache.swa) if isinstance(cache, kvcache.ISWACache) else (cache,)
    return all(p.buffers == "none" for p in parts)


@pytest.mark.parametrize("cls", sorted(MAKERS))
def test_the_valid_calls_work(cls):
    """The valid arguments of the matrix are valid: a failure above is the bad argument's."""
    make, methods = MAKERS[cls]
    for name, (args, _) in methods(make()).items():
        cache = make()
        if cache_kind_has_no_memory(cache) and name.split("#")[0] in ("k", "v", "store"):
            continue
        if name in ("store",) and getattr(cache, "slot", (0,)) is None:
            continue
        if name == "state_read":
            args = (cache.state_write(args[1]),) + tuple(args[1:])
        if name == "prune_swa" and getattr(cache, "n_swa", 0) == 0:
            continue
        _call(cache, name, args)


# --- the other public classes and functions -------------------------------------------------------

def test_batch_bad_arguments_leave_the_split_state():
    batch = kvcache.Batch([0, 1, 2, 3], [0, 0, 1, 1], output=[1, 0, 0, 1])
    first = batch.split_simple(1)
    state = (batch.n_tokens_left, batch.out_ids.tolist())
    for call, exc in [(lambda: batch.split_simple("2"), TypeError), (lambda: batch.split_simple(0), ValueError),
                      (lambda: batch.split_simple(-1), ValueError), (lambda: batch.split_simple(1.0), TypeError),
                      (lambda: batch.split_equal(2), ValueError), (lambda: batch.split_seq(2), ValueError),
                      (lambda: batch.ubatches(2, mode="zzz"), ValueError),
                      (lambda: batch.ubatches(2, mode="equal"), ValueError),
                      (lambda: batch.ubatches(None), TypeError)]:
        with pytest.raises(exc):
            call()
        assert (batch.n_tokens_left, batch.out_ids.tolist()) == state
    assert first.n_tokens == 1


@pytest.mark.parametrize("kwargs,exc", [
    (dict(pos=[0.5], seq_id=[0]), TypeError), (dict(pos=[[0]], seq_id=[0]), ValueError),
    (dict(pos=[-1], seq_id=[0]), ValueError), (dict(pos=[2**31], seq_id=[0]), ValueError),
    (dict(pos=[0], seq_id=[kvcache.MAX_SEQ]), ValueError), (dict(pos=[0], seq_id=[[]]), ValueError),
    (dict(pos=[0], seq_id=["a"]), TypeError), (dict(pos=[0], seq_id=5), TypeError),
    (dict(pos=[0, 1], seq_id=[0]), ValueError), (dict(pos=[0], seq_id=[0], output=[1, 1]), ValueError),
])
@pytest.mark.parametrize("cls", [kvcache.Batch, kvcache.UBatch])
def test_batch_constructors(cls, kwargs, exc):
    with pytest.raises(exc):
        cls(**kwargs)


@pytest.mark.parametrize("kwargs,exc", [
    (dict(n_rot="8"), TypeError), (dict(n_rot=7), ValueError), (dict(n_rot=-2), ValueError),
    (dict(n_rot=8, mode="sideways"), ValueError), (dict(n_rot=8, mode=1), ValueError),
    (dict(n_rot=8, freq_factors=np.ones(3, np.float32)), ValueError),
    (dict(n_rot=8, layer_freq_base={0: -1.0}), ValueError), (dict(n_rot=8, layer_freq_scale=5), TypeError),
])
def test_rope_params(kwargs, exc):
    with pytest.raises(exc):
        kvcache.RopeParams(**kwargs)


def test_rope_shift_and_quantize_leave_their_inputs():
    k = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float16)
    before = k.copy()
    p = kvcache.RopeParams(8)
    shift = np.zeros(4, np.int32)
    for call, exc in [(lambda: kvcache.rope_shift(k, "f17", 2, 8, shift, p), ValueError),
                      (lambda: kvcache.rope_shift(k, "f16", 3, 8, shift, p), ValueError),
                      (lambda: kvcache.rope_shift(k, "f16", 2, 8, np.zeros(3, np.int32), p), ValueError),
                      (lambda: kvcache.rope_shift(k, "f16", 2, 8, shift, None), TypeError),
                      (lambda: kvcache.rope_shift(k.tolist(), "f16", 2, 8, shift, p), TypeError),
                      (lambda: kvcache.rope_shift(k[:, ::2], "f16", 1, 8, shift, p), ValueError),
                      (lambda: kvcache.quantize(np.ones((2, 31), np.float32), "q8_0"), ValueError),
                      (lambda: kvcache.quantize(np.ones((2, 32), np.float32), "q9"), ValueError),
                      (lambda: kvcache.dequantize(b"\0" * 33, "q8_0", 32), ValueError)]:
        with pytest.raises(exc):
            call()
        assert k.tobytes() == before.tobytes()


@pytest.mark.parametrize("build,exc", [
    (lambda: kvcache.UnifiedCache(0, 1, 8, 8), ValueError),
    (lambda: kvcache.UnifiedCache(48, 1, 8, 8), ValueError),          # not a multiple of n_pad
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=kvcache.MAX_SEQ + 1), ValueError),
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, type_k="f17"), ValueError),
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, type_k=3.0), TypeError),
    (lambda: kvcache.UnifiedCache("64", 1, 8, 8), TypeError),
    (lambda: kvcache.UnifiedCache(2**40, 1, 8, 8, n_pad=1), ValueError),
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, buffers=3), TypeError),
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, buffers={0: (np.zeros(10, np.float16),) * 2}), ValueError),
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, buffers={0: (bytes(1024),) * 2}), ValueError),
    (lambda: kvcache.UnifiedCache(64, 1, 8, 8, buffers={0: (_noncontig(np.float16, 512),) * 2}), ValueError),
    (lambda: kvcache.RecurrentCache(kvcache.MAX_SEQ + 1, 1, 8, 8), ValueError),
    (lambda: kvcache.RecurrentCache(2, 1, 8, 8, kv_size=1), ValueError),
    (lambda: kvcache.RecurrentCache(2, 1, -8, 8), ValueError),
    (lambda: kvcache.ISWACache(64, 2, 8, 8, swa_layers=[5], n_swa=4), ValueError),
    (lambda: kvcache.ISWACache(64, 2, 8, 8, swa_layers=[1], n_swa=0), ValueError),
    (lambda: kvcache.ISWACache(64, 2, 8, 8, swa_layers=[1], n_swa=4, swa_type="none"), ValueError),
])
def test_constructors(build, exc):
    with pytest.raises(exc):
        build()


def test_mmap_and_file_targets_for_state():
    cache = busy_unified()
    blob = cache.state_write()
    with mmap.mmap(-1, len(blob)) as m:
        m[:] = blob
        assert cache.state_read(m) == len(blob)
    ro = np.frombuffer(blob, dtype=np.uint8)     # read-only data is fine for reading
    assert cache.state_read(ro) == len(blob)


class _ClaimsHugeLength(list):
    """A list whose __len__ claims far more items than it holds."""

    def __len__(self):
        return 2**62


def test_a_claimed_length_is_not_trusted():
    # the values are what iteration gives: nothing is preallocated from what __len__ claims (a
    # MemoryError before)
    assert kvcache.UBatch(_ClaimsHugeLength([0, 1]), [0, 0]).pos.tolist() == [0, 1]
    h = kvcache.HybridCache(16, 2, [1], 4, 4, _ClaimsHugeLength([4, 4]), 4, type_k="f32", type_v="f32")
    assert h.recr.n_embd_k == [4]
    h.enable_prefix_reuse()
    assert h.prefix_match(_ClaimsHugeLength([1, 2, 3])) == 0
    assert h.prepare(_ClaimsHugeLength([kvcache.UBatch([0], [0])])) is not None
    r = kvcache.RecurrentCache(2, 1, 4, 4, semantics="2026")
    assert r.prepare(_ClaimsHugeLength([kvcache.UBatch([0], [0])]))
