"""RoPE K-shift: rotation properties, an independent float64 model, layouts and errors."""
import math

import numpy as np
import pytest

import kvcache
from kvcache import RopeParams, rope_shift

F32 = np.float32


def keys(n_rows, n_head, head_dim, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n_rows, n_head * head_dim)) * scale).astype(F32)


def shifted(k, shift, params, type_k="f32", n_head=1, head_dim=None, layer=None):
    out = k.copy()
    rope_shift(out, type_k, n_head, head_dim or k.shape[1] // n_head, np.asarray(shift), params, layer=layer)
    return out


# ---- an independent model of the rotation (float64, straight from the definition) ----

def model_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow):
    def dim(turns):
        return n_rot * math.log(n_ctx_orig / (turns * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_rot - 1.0, math.ceil(dim(beta_slow)))


def model_rope(k, shift, n_head, head_dim, p):
    """Rotate f32 rows in float64: pair i of a head turns by shift * base^(-2i/n_rot) (YaRN-mixed)."""
    n_rot, half = p.n_rot, p.n_rot // 2
    i = np.arange(half, dtype=np.float64)
    ff = np.ones(half) if p.freq_factors is None else p.freq_factors.astype(np.float64)
    ramp = np.zeros(half)
    mscale = p.attn_factor
    if p.ext_factor != 0:
        lo, hi = model_corr_dims(n_rot, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
        ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
        mscale *= 1 + 0.1 * math.log(1 / p.freq_scale)
    mix = ramp * p.ext_factor
    out = k.astype(np.float64).reshape(k.shape[0], n_head, head_dim)
    for r, s in enumerate(np.asarray(shift, dtype=np.float64)):
        extrap = s * p.freq_base ** (-2 * i / n_rot) / ff
        theta = p.freq_scale * extrap * (1 - mix) + extrap * mix
        c, sn = np.cos(theta) * mscale, np.sin(theta) * mscale
        h = out[r]
        a = h[:, 0:n_rot:2] if p.mode == 0 else h[:, :half]
        b = h[:, 1:n_rot:2] if p.mode == 0 else h[:, half:n_rot]
        a_new, b_new = a * c - b * sn, a * sn + b * c
        if p.mode == 0:
            h[:, 0:n_rot:2], h[:, 1:n_rot:2] = a_new, b_new
        else:
            h[:, :half], h[:, half:n_rot] = a_new, b_new
    return out.reshape(k.shape)


PARAM_SETS = [
    dict(n_rot=16, mode=0),
    dict(n_rot=16, mode=2),
    dict(n_rot=8, mode=0, freq_base=500000.0, freq_scale=0.25),
    dict(n_rot=12, mode=2, freq_base=80000.0, attn_factor=1.25, freq_factors=[1, 2, 0.5, 4, 1.5, 8]),
    dict(n_rot=64, mode=0, n_ctx_orig=4096, freq_scale=0.25, ext_factor=1.0, beta_fast=32, beta_slow=1),
    dict(n_rot=64, mode=2, n_ctx_orig=4096, freq_scale=0.5, ext_factor=0.5, attn_factor=0.875),
]


@pytest.mark.parametrize("kw", PARAM_SETS)
def test_matches_float64_model(kw):
    p = RopeParams(**kw)
    head_dim = max(kw["n_rot"], 16) + 4
    k = keys(40, 2, head_dim, seed=1)
    shift = np.arange(-20, 20) * 7
    got = shifted(k, shift, p, n_head=2)
    want = model_rope(k, shift, 2, head_dim, p)
    # the allowance of the golden traces: relative 1e-5 plus one ulp of the frequency step
    m, s = float(np.abs(k).max()), float(np.abs(shift).max())
    g = p.attn_factor * ((1 + 0.1 * math.log(1 / p.freq_scale)) if p.ext_factor else 1.0)
    f = 1 / min(1.0, float(p.freq_factors.min())) if p.freq_factors is not None else 1.0
    atol = 1e-5 * max(1, m * g) + 4e-7 * (1 + s * f) * 2 * m * g
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def test_corr_dims_match_definition():
    for n_rot, n_ctx, base, bf, bs in [(64, 4096, 10000.0, 32, 1), (128, 32768, 500000.0, 32, 1),
                                       (8, 2048, 80000.0, 16, 2)]:
        p = RopeParams(n_rot, n_ctx_orig=n_ctx, freq_base=base, beta_fast=bf, beta_slow=bs)
        assert p.corr_dims() == model_corr_dims(n_rot, n_ctx, base, bf, bs)


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("kw", [dict(), dict(freq_base=500000.0, freq_scale=0.5),
                                dict(freq_factors=[1.0, 2.0, 4.0, 1.5, 1.0, 8.0, 1.0, 1.0])])
def test_shift_composes_with_position(mode, kw):
    """A key computed at position p and shifted by d equals the key computed at p + d."""
    p = RopeParams(16, mode=mode, **kw)
    base = keys(1, 1, 16, seed=5)
    rng = np.random.default_rng(2)
    pos = rng.integers(0, 60, 30)
    d = rng.integers(-30, 30, 30)
    at_p = shifted(np.repeat(base, 30, axis=0), pos, p)
    moved = shifted(at_p, d, p)
    direct = shifted(np.repeat(base, 30, axis=0), pos + d, p)
    np.testing.assert_allclose(moved, direct, rtol=0, atol=2e-4)
    assert np.abs(moved - at_p).max() > 1e-2  # the shift did rotate


def test_pairing_normal_and_neox():
    p0, p2 = RopeParams(8, mode=0), RopeParams(8, mode="neox")
    x = np.zeros((1, 8), dtype=F32)
    x[0, 0], x[0, 1], x[0, 4] = 1.0, 2.0, 3.0
    c, s = math.cos(1.0), math.sin(1.0)
    a = shifted(x, [1], p0)[0]      # pair 0 is (0, 1); element 4 is pair 2 (with 5)
    np.testing.assert_allclose(a[:2], [c - 2 * s, s + 2 * c], atol=1e-6)
    assert a[2] == 0 and a[3] == 0
    b = shifted(x, [1], p2)[0]      # pair 0 is (0, 4); element 1 is pair 1 (with 5)
    np.testing.assert_allclose([b[0], b[4]], [c - 3 * s, s + 3 * c], atol=1e-6)


@pytest.mark.parametrize("type_k", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("mode", [0, 2])
def test_tail_dims_unchanged(type_k, mode):
    n_head, head_dim, n_rot = 3, 20, 6
    x = keys(16, n_head, head_dim, seed=4)
    raw = kvcache.quantize(x, type_k)
    out = raw.copy()
    rope_shift(out, type_k, n_head, head_dim, np.arange(16) * 3 + 1, RopeParams(n_rot, mode=mode))
    esize = raw.shape[1] // (n_head * head_dim)
    before = raw.reshape(16, n_head, head_dim * esize)
    after = out.reshape(16, n_head, head_dim * esize)
    np.testing.assert_array_equal(after[:, :, n_rot * esize:], before[:, :, n_rot * esize:])
    assert (after[:, :, :n_rot * esize] != before[:, :, :n_rot * esize]).any()


def test_zero_shift_is_identity_without_magnitude():
    x = keys(8, 2, 16, seed=6)
    np.testing.assert_array_equal(shifted(x, np.zeros(8, int), RopeParams(16), n_head=2), x)
    # the magnitude factor applies to shift-0 rows too
    y = shifted(x, np.zeros(8, int), RopeParams(8, attn_factor=2.0), n_head=2)
    yh, xh = y.reshape(8, 2, 16), x.reshape(8, 2, 16)
    np.testing.assert_array_equal(yh[:, :, :8], xh[:, :, :8] * 2)
    np.testing.assert_array_equal(yh[:, :, 8:], xh[:, :, 8:])


def test_heads_rotate_alike():
    x = keys(10, 3, 16, seed=8)
    shift = np.arange(10) * 5
    p = RopeParams(16, mode=2)
    whole = shifted(x, shift, p, n_head=3)
    for h in range(3):
        one = shifted(np.ascontiguousarray(x[:, h * 16:(h + 1) * 16]), shift, p)
        np.testing.assert_array_equal(whole[:, h * 16:(h + 1) * 16], one)


@pytest.mark.parametrize("type_k", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"])
def test_quantized_is_decode_rotate_encode(type_k):
    n_head, head_dim = 2, 64
    x = keys(12, n_head, head_dim, seed=9, scale=3.0)
    raw = kvcache.quantize(x, type_k)
    shift = np.arange(12) * 11 - 30
    shift[::4] = 0   # shift-0 rows are re-encoded too
    p = RopeParams(40, mode=2, freq_base=80000.0)
    got = raw.copy()
    rope_shift(got, type_k, n_head, head_dim, shift, p)
    f = kvcache.dequantize(raw, type_k, n_head * head_dim)
    rope_shift(f, "f32", n_head, head_dim, shift, p)
    np.testing.assert_array_equal(got, kvcache.quantize(f, type_k))


def test_layer_overrides():
    x = keys(6, 1, 16, seed=10)
    shift = np.arange(6) * 9
    p = RopeParams(16, layer_freq_base={1: 500.0}, layer_freq_scale=[None, None, 0.5])
    np.testing.assert_array_equal(shifted(x, shift, p, layer=0), shifted(x, shift, RopeParams(16)))
    np.testing.assert_array_equal(shifted(x, shift, p, layer=1), shifted(x, shift, RopeParams(16, freq_base=500.0)))
    np.testing.assert_array_equal(shifted(x, shift, p, layer=2), shifted(x, shift, RopeParams(16, freq_scale=0.5)))
    np.testing.assert_array_equal(shifted(x, shift, p), shifted(x, shift, RopeParams(16)))
    assert p.freq_base_for(1) == 500.0 and p.freq_scale_for(2) == 0.5 and p.freq_base_for(3) == 10000.0


def test_layouts_strided_rows_and_byte_views():
    big = keys(8, 2, 16, seed=11).reshape(8, 2, 16)
    orig = big.copy()
    view = big[:, 0, :]                       # rows 128 bytes apart, 64 bytes each
    rope_shift(view, "f32", 1, 16, np.arange(8), RopeParams(16))
    np.testing.assert_array_equal(view, shifted(np.ascontiguousarray(orig[:, 0, :]), np.arange(8), RopeParams(16)))
    np.testing.assert_array_equal(big[:, 1, :], orig[:, 1, :])
    # the same f16 rows as float16, uint16 and raw bytes
    h = keys(4, 1, 16, seed=12).astype(np.float16)
    a, b, c = h.copy(), h.view(np.uint16).copy(), h.view(np.uint8).copy()
    for arr in (a, b, c):
        rope_shift(arr, "f16", 1, 16, [1, 2, 3, 4], RopeParams(16))
    np.testing.assert_array_equal(a.view(np.uint8), c)
    np.testing.assert_array_equal(b.view(np.uint8), c)
    # rows given as [rows, heads, head_dim]
    d3 = keys(4, 2, 8, seed=13)
    e = d3.reshape(4, 2, 8).copy()
    rope_shift(e, "f32", 2, 8, [0, 1, 2, 3], RopeParams(8))
    np.testing.assert_array_equal(e.reshape(4, 16), shifted(d3, [0, 1, 2, 3], RopeParams(8), n_head=2))


def test_errors_leave_k_unchanged():
    k = keys(4, 1, 16, seed=14)
    orig = k.copy()
    p = RopeParams(16)
    bad = [
        (dict(type_k="q3_k"), ValueError),
        (dict(type_k="f16"), TypeError),                      # float32 array cannot hold f16
        (dict(shift=[1, 2, 3]), ValueError),
        (dict(shift=[0.5, 1, 2, 3]), TypeError),
        (dict(shift=[2**31, 0, 0, 0]), ValueError),
        (dict(head_dim=8), ValueError),                       # n_rot 16 > head_dim 8
        (dict(n_head=2), ValueError),                         # row too short
        (dict(head_dim=0), ValueError),
        (dict(n_head=1.0), TypeError),
    ]
    for change, exc in bad:
        args = dict(type_k="f32", n_head=1, head_dim=16, shift=[1, 2, 3, 4])
        args.update(change)
        with pytest.raises(exc):
            rope_shift(k, args["type_k"], args["n_head"], args["head_dim"], args["shift"], p)
        np.testing.assert_array_equal(k, orig)
    with pytest.raises(ValueError, match="block size"):
        rope_shift(np.zeros((2, 34), np.uint8), "q8_0", 2, 16, [0, 0], RopeParams(16))
    ro = k.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rope_shift(ro, "f32", 1, 16, [1, 2, 3, 4], p)
    with pytest.raises(ValueError, match="contiguous"):
        rope_shift(np.zeros((4, 32), F32)[:, ::2], "f32", 1, 16, [1, 2, 3, 4], p)
    with pytest.raises(TypeError):
        rope_shift(k, "f32", 1, 16, [1, 2, 3, 4], None)


def test_params_validation_and_defaults():
    p = RopeParams(8)
    assert (p.mode, p.freq_base, p.freq_scale, p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow,
            p.n_ctx_orig, p.freq_factors) == (0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 0, None)
    assert "n_rot=8" in repr(p)
    for kw, exc in [(dict(n_rot=7), ValueError), (dict(n_rot=8, mode=1), ValueError),
                    (dict(n_rot=8, mode="yarn"), ValueError), (dict(n_rot=8, freq_base=0), ValueError),
                    (dict(n_rot=8, freq_scale=-1), ValueError), (dict(n_rot=8, freq_factors=[1, 2]), ValueError),
                    (dict(n_rot=8, layer_freq_base={0: 0.0}), ValueError), (dict(n_rot="8"), TypeError),
                    (dict(n_rot=8, layer_freq_scale=3), TypeError)]:
        with pytest.raises(exc):
            RopeParams(**kw)
    c, s = RopeParams(4, attn_factor=2.0).angles(3)
    np.testing.assert_allclose(c, 2 * np.cos([3.0, 3.0 / 100]), rtol=1e-6)
    np.testing.assert_allclose(s, 2 * np.sin([3.0, 3.0 / 100]), rtol=1e-6)
