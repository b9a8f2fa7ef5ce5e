"""update() with RoPE: shifted keys are rotated in place (float and quantized K), per layer,
before the scheduled defrag; errors change nothing; metadata-only caches hand the shift over."""
import numpy as np
import pytest

import kvcache
from kvcache import RopeParams, UBatch, UnifiedCache, dequantize, quantize, rope_shift

QUANT = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
HEAD = 32           # head size (a whole quantization block)
N_HEAD = [2, 1]     # KV heads of layers 0 and 1


def cache(type_k, rope=None, **kw):
    args = dict(kv_size=64, n_layer=2, n_embd_k_gqa=[HEAD * h for h in N_HEAD], n_embd_v_gqa=8,
                type_k=type_k, type_v="f32", v_trans=False, n_seq_max=4, n_embd_head_k=HEAD, rope=rope)
    args.update(kw)
    return UnifiedCache(**args)


def raw_keys(n, n_head, seed):
    return np.random.default_rng(seed).standard_normal((n, n_head * HEAD)).astype(np.float32)


def at(k, pos, params, n_head, layer=None):
    """Keys k rotated to positions pos (f32 arithmetic)."""
    out = k.copy()
    rope_shift(out, "f32", n_head, HEAD, np.asarray(pos), params, layer=layer)
    return out


def encode(x, type_k):
    return quantize(x, type_k) if type_k in QUANT else x


def decode(rows, type_k, width):
    if type_k in QUANT:
        return dequantize(rows, type_k, width)
    a = np.asarray(rows)
    if a.dtype == np.uint16:  # bf16 bits (without ml_dtypes the views are uint16)
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def as_view_dtype(x, dtype):
    """f32 values rounded to a float view dtype (bf16 as uint16 bits: round to nearest even)."""
    if np.dtype(dtype) == np.uint16:
        u = np.ascontiguousarray(x, np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(dtype)


def snapshot(c):
    return (c.head, c.n, c.used, c.has_shift, c.do_defrag, c.cells(),
            [(c.k(il).tobytes(), c.v(il).tobytes()) for il in c.layers])


def fill(c, pos, seq, params, seed=0):
    """Place tokens and store keys computed at their positions; returns the raw keys per layer."""
    assert c.find_slot(UBatch(pos, seq))
    raw = {}
    for il, nh in zip(c.layers, N_HEAD):
        raw[il] = raw_keys(len(pos), nh, seed + il)
        c.store(il, encode(at(raw[il], pos, params, nh, il), c.type_k), np.zeros((len(pos), 8), np.float32))
    c.commit()
    return raw


# largest error relative to the key's magnitude: float rounding, or two rounds of quantization
# (the key is stored quantized, then decoded, rotated and encoded again)
TOL = {"f32": 1e-6, "f16": 1e-3, "bf16": 1e-2, "q8_0": 2e-2, "q4_0": 0.25, "q4_1": 0.2, "q5_0": 0.15,
       "q5_1": 0.12, "iq4_nl": 0.25}


@pytest.mark.parametrize("type_k", ["f32", "f16", "bf16"] + QUANT)
@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_shifted_key_equals_the_key_at_the_new_position(type_k, mode):
    p = RopeParams(HEAD, mode=mode, freq_base=10000.0)
    c = cache(type_k, p)
    pos = list(range(10))
    raw = fill(c, pos, [0] * 5 + [1] * 5, p)
    c.seq_add(0, 2, -1, 9)             # seq 0's tokens at 2..4 move to 11..13
    c.seq_add(1, 0, -1, -3)            # seq 1's tokens at 5..9 move to 2..6 (5,6,7 -> 2..4)
    want_pos = [0, 1, 11, 12, 13, 2, 3, 4, 5, 6]
    before = [c.k(il)[:10].copy() for il in c.layers]
    plan = c.update()
    assert plan and plan.rotated and plan.k_shift[:10].tolist() == [0, 0, 9, 9, 9, -3, -3, -3, -3, -3]
    assert not c.has_shift
    for il, nh, old in zip(c.layers, N_HEAD, before):
        width = nh * HEAD
        got = decode(c.k(il)[:10], type_k, width)
        want = at(raw[il], want_pos, p, nh, il)
        err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
        assert err <= TOL[type_k], err
        # exactly what decoding, rotating in f32 and encoding each row gives
        ref = decode(old, type_k, width)
        rope_shift(ref, "f32", nh, HEAD, plan.k_shift[:10], p, layer=il)
        if type_k in QUANT:
            assert np.array_equal(c.k(il)[:10], quantize(ref, type_k))
        elif type_k == "f32":
            assert np.array_equal(c.k(il)[:10], ref)
        else:
            np.testing.assert_array_equal(decode(c.k(il)[:10], type_k, width), decode(as_view_dtype(ref, c.k(il).dtype), type_k, width))
        assert np.abs(decode(c.k(il)[2:5], type_k, width) - decode(old[2:5], type_k, width)).max() > 0.05


def test_per_layer_frequency_overrides():
    p = RopeParams(HEAD, mode="neox", freq_base=10000.0, layer_freq_base={1: 500.0}, layer_freq_scale={1: 0.5})
    c = cache("f32", p)
    raw = fill(c, [0, 1, 2], [0, 0, 0], p)
    c.seq_add(0, 0, -1, 20)
    c.update()
    for il, nh in zip(c.layers, N_HEAD):
        np.testing.assert_allclose(c.k(il)[:3], at(raw[il], [20, 21, 22], p, nh, il), atol=2e-5)
    # layer 1 used its own base: the default base would give other keys
    assert np.abs(c.k(1)[:3] - at(raw[1], [20, 21, 22], p, 1)).max() > 1e-2


def test_partial_rotation_keeps_the_other_dimensions():
    p = RopeParams(8, mode="normal")
    c = cache("f16", p)
    fill(c, [0, 1], [0, 0], RopeParams(8))
    before = c.k(0)[:2].reshape(2, 2, HEAD).copy()
    c.seq_add(0, 0, -1, 5)
    c.update()
    after = c.k(0)[:2].reshape(2, 2, HEAD)
    assert np.array_equal(after[:, :, 8:], before[:, :, 8:])
    assert not np.array_equal(after[:, :, :8], before[:, :, :8])


def test_explicit_rope_overrides_and_none_drops():
    p = RopeParams(HEAD)
    c = cache("f32")                      # no model RoPE: the shift is forgotten
    fill(c, [0, 1], [0, 0], p)
    k = c.k(0).copy()
    c.seq_add(0, 0, -1, 4)
    plan = c.update()
    assert not plan.rotated and plan.k_shift[:2].tolist() == [4, 4] and np.array_equal(c.k(0), k)
    c.seq_add(0, 0, -1, 4)
    assert c.update(rope=p).rotated and not np.array_equal(c.k(0), k)


def test_rotation_applies_before_the_defrag():
    p = RopeParams(HEAD)
    c = cache("f32", p, kv_size=4096, n_pad=256)
    raw = fill(c, list(range(8)), [0, 1] * 4, p)
    c.seq_rm(1)                                  # cells 1, 3, 5, 7 empty
    c.seq_add(0, 0, -1, 100)
    c.defrag_sched(-1.0)
    plan = c.update()
    assert plan.rotated and plan.moved and plan.defrag_runs.tolist() == [[4, 3, 1], [6, 1, 1]]
    assert c.cells().pos[:4].tolist() == [100, 106, 102, 104]
    for il, nh in zip(c.layers, N_HEAD):
        want = at(raw[il][[0, 6, 2, 4]], [100, 106, 102, 104], p, nh, il)
        np.testing.assert_allclose(c.k(il)[:4], want, atol=5e-5)


def test_rope_checks_before_anything_changes():
    p = RopeParams(HEAD)
    c = cache("f32")
    fill(c, [0, 1, 2], [0, 0, 0], p)
    c.seq_add(0, 0, -1, 2)
    before = snapshot(c)
    with pytest.raises(ValueError, match="n_rot = 64 exceeds head_dim = 32"):
        c.update(rope=RopeParams(64))
    with pytest.raises(TypeError, match="rope"):
        c.update(rope="neox")
    with pytest.raises(TypeError, match="n_max_nodes"):
        c.update(rope=p, n_max_nodes=1.5)
    assert snapshot(c) == before
    assert c.update(rope=p).rotated


def test_constructor_checks_the_rope():
    with pytest.raises(ValueError, match="n_embd_head_k"):
        cache("f32", RopeParams(16), n_embd_head_k=None)
    with pytest.raises(ValueError, match="layer 0: n_rot = 48 exceeds head_dim = 32"):
        cache("f32", RopeParams(48))
    with pytest.raises(TypeError, match="rope"):
        cache("f32", {"n_rot": 16})
    with pytest.raises(ValueError, match="n_embd_head_k = 24"):
        cache("f32", n_embd_head_k=24)
    with pytest.raises(ValueError, match="n_rot"):
        RopeParams(15)
    c = cache("f32", RopeParams(16), n_embd_head_k=[32, 16])      # per-layer head sizes
    assert c.n_embd_head_k == (32, 16)
    with pytest.raises(ValueError, match="layer 1: n_rot = 32 exceeds head_dim = 16"):
        cache("f32", RopeParams(32), n_embd_head_k=[32, 16])


def test_quantized_head_smaller_than_a_block_is_refused_unchanged():
    p = RopeParams(16)
    c = UnifiedCache(64, 1, 32, 8, type_k="q8_0", type_v="f32", v_trans=False, n_embd_head_k=16)
    assert c.find_slot(UBatch([0, 1], [0, 0]))
    c.store(0, quantize(raw_keys(2, 1, 0), "q8_0"), None)
    c.commit()
    c.seq_add(0, 0, -1, 3)
    before = snapshot(c)
    with pytest.raises(ValueError, match="block size"):
        c.update(rope=p)
    assert snapshot(c) == before


def test_metadata_only_hands_the_shift_over():
    c = cache("f16", RopeParams(HEAD), buffers=None)
    assert c.find_slot(UBatch([0, 1, 2, 3], [0, 0, 1, 1]))
    c.commit()
    c.seq_add(1, 0, -1, 5)
    want = c.k_shift()
    before = c.cells()
    with pytest.raises(ValueError, match="metadata-only"):
        c.update(rope=RopeParams(HEAD))
    assert c.cells() == before and c.has_shift
    plan = c.update()                             # the model RoPE is the caller's to apply
    assert plan and not plan.rotated and np.array_equal(plan.k_shift, want)
    assert plan.k_shift[:4].tolist() == [0, 0, 5, 5]
    assert not c.has_shift and not c.k_shift().any()
    assert c.update().k_shift is None


def test_update_plan_repr_and_fields():
    plan = kvcache.UpdatePlan()
    assert not plan and plan.k_shift is None and plan.defrag_runs is None
    assert "UpdatePlan" in repr(cache("f32").update())


# --- iSWA ----------------------------------------------------------------------------------------

def iswa(rope=None, **kw):
    args = dict(kv_size=64, n_layer=4, n_embd_k_gqa=[64, 32, 64, 32], n_embd_v_gqa=8, swa_layers=[0, 2],
                n_swa=4, n_batch=8, n_seq_max=2, type_k="f32", type_v="f32", v_trans=False, swa_full=True,
                n_embd_head_k=HEAD, rope=rope)
    args.update(kw)
    return kvcache.ISWACache(**args)


def iswa_fill(c, p, pos):
    raw = {}
    c.sbatch_init(pos, [0] * len(pos))
    assert c.find_slot(UBatch(pos, [0] * len(pos)))
    for il in range(c.n_layer):
        nh = [2, 1, 2, 1][il]
        raw[il] = raw_keys(len(pos), nh, il)
        c.store(il, at(raw[il], pos, p, nh, il), np.zeros((len(pos), 8), np.float32))
    c.commit()
    return raw


def test_iswa_rotates_both_caches_with_their_layer_rope():
    # Gemma 3 style: the windowed layers rotate with their own base
    p = RopeParams(HEAD, mode="neox", freq_base=1000000.0, layer_freq_base={0: 10000.0, 2: 10000.0})
    c = iswa(p)
    raw = iswa_fill(c, p, [0, 1, 2])
    c.seq_add(0, 0, -1, 6)
    plan = c.update()
    assert plan and plan.base.rotated and plan.swa.rotated and not c.has_shift
    for il in range(4):
        want = at(raw[il], [6, 7, 8], p, [2, 1, 2, 1][il], il)
        np.testing.assert_allclose(c.k(il)[:3], want, atol=3e-5)


def test_iswa_update_checks_both_caches_first():
    p = RopeParams(HEAD)
    c = iswa(n_embd_head_k=[32, 32, 16, 32])          # layer 2 (SWA cache) has 16-element heads
    iswa_fill(c, p, [0, 1])
    c.seq_add(0, 0, -1, 3)
    before = [(sub.cells(), [sub.k(il).tobytes() for il in sub.layers]) for sub in (c.base, c.swa)]
    with pytest.raises(ValueError, match="layer 2: n_rot = 32 exceeds head_dim = 16"):
        c.update(rope=p)
    assert [(sub.cells(), [sub.k(il).tobytes() for il in sub.layers]) for sub in (c.base, c.swa)] == before
    assert c.base.has_shift and c.swa.has_shift


def test_iswa_cannot_shift_with_a_smaller_window_cache():
    p = RopeParams(HEAD)
    c = iswa(p, swa_full=False)
    assert c.size_swa < c.size_base and not c.can_shift
    iswa_fill(c, p, [0, 1])
    c.seq_add(0, 0, -1, 3)
    with pytest.raises(RuntimeError, match="cannot shift"):
        c.update()
    assert c.has_shift
