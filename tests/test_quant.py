"""Row quantizers against an independent numpy model of ggml's reference quantizers.

The model below is written from the block formats and rounding rules (float32
arithmetic throughout, f16 scales rounded to nearest even); kvcache's C encoders
must produce the same bytes and decode to exactly the same values."""
import numpy as np
import pytest

import kvcache

F32 = np.float32
QK = 32
IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34, "iq4_nl": 18}
QUANT_TYPES = list(BLOCK_BYTES)


def f16_bytes(v):
    return np.asarray(v, dtype=F32).astype("<f2").view(np.uint8).reshape(-1, 2)


def f16(v):
    return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def trunc_cap(v, hi):
    """C's float -> int truncation, capped at hi (v >= 0 here)."""
    return np.minimum(np.trunc(v), hi).astype(np.int32)


def signed_absmax(xb):
    """Per block, the first element of largest magnitude, sign kept (+0 when all are zero)."""
    pick = xb[np.arange(xb.shape[0]), np.argmax(np.abs(xb), axis=1)]
    return np.where(pick != 0, pick, F32(0)).astype(F32)


def nibbles(q):
    """Byte j holds element j (low nibble) and element j+16 (high nibble)."""
    return (q[:, :16] & 0x0F | (q[:, 16:] & 0x0F) << 4).astype(np.uint8)


def high_bits(q):
    bits = (q >> 4) & 1
    word = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype("<u4")
    return word.view(np.uint8).reshape(-1, 4)


def model(x, t):
    """(block bytes, decoded values) of float32 rows x (n a multiple of 32) in type t."""
    xb = np.asarray(x, dtype=F32).reshape(-1, QK)
    nb = xb.shape[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        if t in ("q4_0", "q5_0"):
            half = F32(8) if t == "q4_0" else F32(16)
            d = (signed_absmax(xb) / -half).astype(F32)
            idv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)[:, None]
            hi = 15 if t == "q4_0" else 31
            q = trunc_cap(((xb * idv).astype(F32) + (half + F32(0.5))).astype(F32), hi)
            dec = ((q - int(half)).astype(F32) * f16(d)[:, None]).astype(F32)
            parts = [f16_bytes(d)] + ([nibbles(q)] if t == "q4_0" else [high_bits(q), nibbles(q)])
        elif t in ("q4_1", "q5_1"):
            lv = F32(15) if t == "q4_1" else F32(31)
            rows = np.arange(nb)  # first occurrences: the sign of a zero extreme is kept
            mn, mx = xb[rows, np.argmin(xb, axis=1)], xb[rows, np.argmax(xb, axis=1)]
            d = ((mx - mn) / lv).astype(F32)
            idv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)[:, None]
            v = (((xb - mn[:, None]).astype(F32) * idv).astype(F32) + F32(0.5)).astype(F32)
            q = trunc_cap(v, int(lv))
            dec = ((q.astype(F32) * f16(d)[:, None]).astype(F32) + f16(mn)[:, None]).astype(F32)
            parts = [f16_bytes(d), f16_bytes(mn)] + ([nibbles(q)] if t == "q4_1" else [high_bits(q), nibbles(q)])
        elif t == "q8_0":
            d = (np.abs(xb).max(axis=1) / F32(127)).astype(F32)
            idv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)[:, None]
            v = (xb * idv).astype(F32).astype(np.float64)
            q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int32)  # halves away from zero
            dec = (q.astype(F32) * f16(d)[:, None]).astype(F32)
            parts = [f16_bytes(d), q.astype(np.int8).view(np.uint8)]
        elif t == "iq4_nl":
            d, q = iq4nl_model(xb)
            dec = (f16(d)[:, None] * IQ4NL[q].astype(F32)).astype(F32)
            parts = [f16_bytes(d), nibbles(q)]
        else:
            raise AssertionError(t)
    raw = np.concatenate(parts, axis=1).astype(np.uint8)
    assert raw.shape == (nb, BLOCK_BYTES[t])
    return raw.reshape(-1), dec.reshape(-1)


def iq4nl_nearest(v):
    """Index of the nearest table value; exact midpoints go to the upper value."""
    tab = IQ4NL.astype(F32)
    hi = np.clip(np.searchsorted(tab, v, side="right"), 1, 15)
    lo = hi - 1
    pick = np.where((v - tab[lo]).astype(F32) < (tab[hi] - v).astype(F32), lo, hi)
    return np.where(v <= tab[0], 0, np.where(v >= tab[15], 15, pick))


def iq4nl_model(xb):
    nb = xb.shape[0]
    mx = signed_absmax(xb)
    d = np.zeros(nb, dtype=F32)
    q = np.full(xb.shape, 8, dtype=np.int64)  # an all-zero block: scale 0, index of value 1
    live = np.abs(mx) >= F32(1e-15)
    d0 = (mx[live] / F32(-127)).astype(F32)
    idv = (F32(1) / d0).astype(F32)[:, None]
    xl = xb[live]
    ql = iq4nl_nearest((idv * xl).astype(F32))
    qv = IQ4NL[ql].astype(F32)
    w = (xl * xl).astype(F32)
    wq = (w * qv).astype(F32)
    tqx, tq2 = (wq * xl).astype(F32), (wq * qv).astype(F32)
    sqx = np.zeros(len(d0), dtype=F32)
    sq2 = np.zeros(len(d0), dtype=F32)
    for j in range(QK):  # sequential float32 sums, as the reference
        sqx = (sqx + tqx[:, j]).astype(F32)
        sq2 = (sq2 + tq2[:, j]).astype(F32)
    d[live] = (sqx / sq2).astype(F32)
    q[live] = ql
    return d, q


def samples(seed):
    rng = np.random.default_rng(seed)
    yield rng.standard_normal((3, 64)).astype(F32)
    yield (rng.standard_normal((2, 96)) * 1e4).astype(F32)
    yield (rng.standard_normal((2, 32)) * 1e-4).astype(F32)
    yield (rng.uniform(5.0, 5.5, (2, 64))).astype(F32)          # offset data (q4_1 / q5_1 minimum)
    yield (rng.integers(-8, 8, (2, 64)) * 0.25).astype(F32)     # many exact ties
    yield (rng.standard_normal((1, 128)) * np.repeat([0, 1, 1e3, 1e-3], 32)).astype(F32)
    # scale 1 blocks (extreme -127 / 127): half-integers and iq4_nl midpoints round exactly at ties
    ties = np.concatenate([[-127.0], rng.integers(-120, 120, 31) + 0.5, [127.0], rng.integers(-126, 126, 31) + 0.5,
                           [-127.0], rng.choice([-115.5, -93.5, -74.0, -4.5, 7.0, 19.0, 101.0], 31)])
    yield ties.astype(F32).reshape(1, 96)


@pytest.mark.parametrize("t", QUANT_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_quantize_matches_model(t, seed):
    for x in samples(seed):
        raw = kvcache.quantize(x, t)
        want_raw, want_dec = model(x, t)
        assert raw.shape == (x.shape[0], x.shape[1] // QK * BLOCK_BYTES[t])
        np.testing.assert_array_equal(raw.reshape(-1), want_raw)
        got = kvcache.dequantize(raw, t, x.shape[1])
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(got.reshape(-1), want_dec)


def step_of(raw, t, n_rows):
    """Per element, the quantization step of its block (|d| of the f16 scale)."""
    d = raw.reshape(-1, BLOCK_BYTES[t])[:, :2].copy().view("<f2").astype(np.float64)
    return np.repeat(np.abs(d), QK).reshape(n_rows, -1)


@pytest.mark.parametrize("t", QUANT_TYPES)
def test_error_within_one_step(t):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 256)).astype(F32)
    raw = kvcache.quantize(x, t)
    err = np.abs(kvcache.dequantize(raw, t, 256).astype(np.float64) - x)
    step = step_of(raw, t, 8)
    if t in ("q4_1", "q5_1"):
        # the block minimum is stored as f16: its rounding adds to the step
        mn = x.reshape(-1, QK).min(axis=1)
        step = step + np.repeat(np.abs(f16(mn) - mn), QK).reshape(8, -1)
    if t == "iq4_nl":
        step = step * 24  # the widest gap of the non-linear table (89 -> 113)
    assert (err <= step * 1.001 + 1e-30).all()


def test_q8_0_rounds_halves_away_from_zero():
    x = np.zeros(32, dtype=F32)
    x[0] = 127.0   # scale exactly 1
    x[1:5] = [2.5, -2.5, 0.5, -1.5]
    raw = kvcache.quantize(x, "q8_0")
    q = raw[2:].view(np.int8)
    assert q[:5].tolist() == [127, 3, -3, 1, -2]


def test_iq4_nl_midpoints_go_to_the_upper_value():
    x = np.zeros(32, dtype=F32)
    x[0] = -127.0  # first scale exactly 1
    x[1:5] = [7.0, -4.5, 101.0, -115.5]  # midpoints of (1, 13), (-10, 1), (89, 113), (-127, -104)
    raw = kvcache.quantize(x, "iq4_nl")
    idx = np.concatenate([raw[2:] & 0x0F, raw[2:] >> 4])
    assert idx[:5].tolist() == [0, 9, 8, 15, 1]


def test_q4_0_extreme_maps_to_minus_eight():
    x = np.linspace(-1.0, 3.0, 32).astype(F32)  # largest magnitude is positive
    raw = kvcache.quantize(x, "q4_0")
    d = raw[:2].view("<f2")[0]
    assert d == np.float16(3.0 / -8)
    assert (raw[2 + 15] >> 4) == 0             # element 31 (= 3.0) -> nibble 0 -> -8 * d
    assert kvcache.dequantize(raw, "q4_0", 32)[31] == F32(-8) * F32(np.float16(-0.375))


@pytest.mark.parametrize("t", QUANT_TYPES)
def test_zero_block(t):
    raw = kvcache.quantize(np.zeros((2, 64), dtype=F32), t)
    assert not kvcache.dequantize(raw, t, 64).any()
    if t == "iq4_nl":
        assert (raw.reshape(-1, 18)[:, 2:] == 0x88).all()


@pytest.mark.parametrize("t", ["f32", "f16", "bf16"])
def test_float_rows(t):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 10)) * 100).astype(F32)
    raw = kvcache.quantize(x, t)
    got = kvcache.dequantize(raw, t, 10)
    if t == "f32":
        assert raw.shape == (3, 40)
        np.testing.assert_array_equal(got, x)
    elif t == "f16":
        np.testing.assert_array_equal(raw.view("<f2"), x.astype(np.float16))
        np.testing.assert_array_equal(got, x.astype(np.float16).astype(F32))
    else:
        # bf16: the top half of the float32 bits, rounded to nearest even
        bits = x.view(np.uint32).astype(np.uint64)
        want = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        np.testing.assert_array_equal(raw.view("<u2"), want)
        np.testing.assert_array_equal(got, (want.astype(np.uint32) << 16).view(F32))


def test_types_by_id_and_bytes_input():
    x = np.arange(32, dtype=F32)
    a = kvcache.quantize(x, "q8_0")
    b = kvcache.quantize(x, 8)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kvcache.dequantize(a.tobytes(), "q8_0", 32), kvcache.dequantize(a, 8, 32))


def test_bad_arguments():
    x = np.zeros(48, dtype=F32)
    with pytest.raises(ValueError, match="block size"):
        kvcache.quantize(x, "q4_0")
    with pytest.raises(ValueError, match="type"):
        kvcache.quantize(np.zeros(32, F32), "q3_k")
    with pytest.raises(TypeError, match="type"):
        kvcache.quantize(np.zeros(32, F32), 1.5)
    with pytest.raises(ValueError, match="bytes"):
        kvcache.dequantize(np.zeros(33, np.uint8), "q8_0", 32)
    with pytest.raises(ValueError, match="block size"):
        kvcache.dequantize(np.zeros(34, np.uint8), "q8_0", 16)
    with pytest.raises(TypeError, match="n must be"):
        kvcache.dequantize(np.zeros(34, np.uint8), "q8_0", 32.0)
