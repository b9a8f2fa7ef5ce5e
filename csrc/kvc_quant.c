#include "kvc_quant.h"
#include "kvc_le.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* Results must match ggml's reference quantizers bit for bit: no fused multiply-adds. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(_MSC_VER)
#pragma fp_contract(off)
#endif

#define KVC_QK 32 /* elements per block of every quantized type here */

const int8_t kvc_iq4nl_values[16] = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
};

/* The reference converts `v` to an integer by truncation toward zero and caps it at
 * `hi`; in range that is exactly this, and out of range (inf, nan from a degenerate
 * scale) it stays defined instead of overflowing the cast. */
static inline uint8_t kvc_trunc_cap(float v, int hi) {
    if (!(v > 0.0f)) {
        return 0;
    }
    if (v >= (float)hi) {
        return (uint8_t)hi;
    }
    return (uint8_t)(int)v;
}

/* The element of largest magnitude (the first one on ties), sign kept. */
static inline float kvc_signed_absmax(const float *x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < KVC_QK; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

static inline void kvc_min_max(const float *x, float *mn, float *mx) {
    float lo = FLT_MAX, hi = -FLT_MAX;
    for (int j = 0; j < KVC_QK; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo;
    *mx = hi;
}

/* ---- q4_0 ------------------------------------------------------------------ */

static void kvc_quantize_row_q4_0(const float *x, uint8_t *y, int64_t n) {
    for (int64_t b = 0; b < n / KVC_QK; b++, x += KVC_QK, y += 18) {
        /* the extreme element maps to -8, so the opposite side gets the full 7.5 steps */
        const float d = kvc_signed_absmax(x) / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        kvc_le_put_u16(y, kvc_f32_to_f16(d));
        for (int j = 0; j < KVC_QK / 2; j++) {
            const uint8_t lo = kvc_trunc_cap(x[j] * id + 8.5f, 15);
            const uint8_t hi = kvc_trunc_cap(x[j + KVC_QK / 2] * id + 8.5f, 15);
            y[2 + j] = (uint8_t)(lo | (hi << 4));
        }
    }
}

static void kvc_dequantize_row_q4_0(const uint8_t *x, float *y, int64_t n) {
    for (int64_t b = 0; b < n / KVC_QK; b++, x += 18, y += KVC_QK) {
        const float d = kvc_f16_to_f32(kvc_le_get_u16(x));
        for (int j = 0; j < KVC_QK / 2; j++) {
            y[j] = (float)((x[2 + j] & 0x0f) - 8) * d;
            y[j + KVC_QK / 2] = (float)((x[2 + j] >> 4) - 8) * d;
        }
    }
}

/* ---- q4_1 ------------------------------------------------------------------ */

static void kvc_quantize_row_q4_1(const float *x, uint8_t *y, int64_t n) {
    for (int64_t b = 0; b < n / KVC_QK; b++, x += KVC_QK, y += 20) {
        float mn, mx;
        kvc_min_max(x, &mn, &mx);
        const float d = (mx - mn) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        kvc_le_put_u16(y, kvc_f32_to_f16(d));
        kvc_le_put_u16(y + 2, kvc_f32_to_f16(mn));
        for (int j = 0; j < KVC_QK / 2; j++) {
            const uint8_t lo = kvc_trunc_cap((x[j] - mn) * id + 0.5f, 15);
            const uint8_t hi = kvc_trunc_cap((x[j + KVC_QK / 2] - mn) * id + 0.5f, 15);
            y[4 + j] = (uint8_t)(lo | (hi << 4));
        }
    }
}

static void kvc_dequantize_row_q4_1(const uint8_t *x, float *y, int64_t n) {
    for (int64_t b = 0; b < n / KVC_QK; b++, x += 20, y += KVC_QK) {
        const float d = kvc_f16_to_f32(kvc_le_get_u16(x));
        const float m = kvc_f16_to_f32(kvc_le_get_u16(x + 2));
        for (int j = 0; j < KVC_QK / 2; j++) {
            const float p0 = (float)(x[4 + j] & 0x0f) * d;
            const float p1 = (float)(x[4 + j] >> 4) * d;
            y[j] = p0 + m;
            y[j + KVC_QK / 2] = p1 + m;
        }
    }
}

/* ---- q5_0 ------------------------------------------------------------------ */

/* Nibbles and high bits of a 5-bit block; q[] holds 32 values in [0, 31]. */
static inline void kvc_pack5(const uint8_t *q, uint8_t *qh, uint8_t *qs) {
    uint32_t h = 0;
    for (int j = 0; j < KVC_QK / 2; j++) {
        qs[j] = (uint8_t)((q[j] & 0x0f) | ((q[j + KVC_QK / 2] & 0x0f) << 4));
        h |= (uint32_t)(q[j] >> 4) << j;
        h |= (uint32_t)(q[j + KVC_QK / 2] >> 4) << (j + KVC_QK / 2);
    }
    kvc_le_put_u32(qh, h);
}

static inline void kvc_unpack5(const uint8_t *qh, const uint8_t *qs, int *q) {
    const uint32_t h = kvc_le_get_u32(qh);
    for (int j = 0; j < KVC_QK / 2; j++) {
        q[j] = (qs[j] & 0x0f) | (int)(((h >> j) & 1u) << 4);
        q[j + KVC_QK / 2] = (qs[j] >> 4) | (int)(((h >> (j + KVC_QK / 2)) & 1u) << 4);
    }
}

static void kvc_quantize_row_q5_0(const float *x, uint8_t *y, int64_t n) {
    uint8_t q[KVC_QK];
    for (int64_t b = 0; b < n / KVC_QK; b++, x += KVC_QK, y += 22) {
        const float d = kvc_signed_absmax(x) / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        kvc_le_put_u16(y, kvc_f32_to_f16(d));
        for (int j = 0; j < KVC_QK; j++) {
            q[j] = kvc_trunc_cap(x[j] * id + 16.5f, 31);
        }
        kvc_pack5(q, y + 2, y + 6);
    }
}

static void kvc_dequantize_row_q5_0(const uint8_t *x, float *y, int64_t n) {
    int q[KVC_QK];
    for (int64_t b = 0; b < n / KVC_QK; b++, x += 22, y += KVC_QK) {
        const float d = kvc_f16_to_f32(kvc_le_get_u16(x));
        kvc_unpack5(x + 2, x + 6, q);
        for (int j = 0; j < KVC_QK; j++) {
            y[j] = (float)(q[j] - 16) * d;
        }
    }
}

/* ---- q5_1 ------------------------------------------------------------------ */

static void kvc_quantize_row_q5_1(const float *x, uint8_t *y, int64_t n) {
    uint8_t q[KVC_QK];
    for (int64_t b = 0; b < n / KVC_QK; b++, x += KVC_QK, y += 24) {
        float mn, mx;
        kvc_min_max(x, &mn, &mx);
        const float d = (mx - mn) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        kvc_le_put_u16(y, kvc_f32_to_f16(d));
        kvc_le_put_u16(y + 2, kvc_f32_to_f16(mn));
        for (int j = 0; j < KVC_QK; j++) {
            q[j] = kvc_trunc_cap((x[j] - mn) * id + 0.5f, 31);
        }
        kvc_pack5(q, y + 4, y + 8);
    }
}

static void kvc_dequantize_row_q5_1(const uint8_t *x, float *y, int64_t n) {
    int q[KVC_QK];
    for (int64_t b = 0; b < n / KVC_QK; b++, x += 24, y += KVC_QK) {
        const float d = kvc_f16_to_f32(kvc_le_get_u16(x));
        const float m = kvc_f16_to_f32(kvc_le_get_u16(x + 2));
        kvc_unpack5(x + 4, x + 8, q);
        for (int j = 0; j < KVC_QK; j++) {
            const float p = (float)q[j] * d;
            y[j] = p + m;
        }
    }
}

/* ---- q8_0 ------------------------------------------------------------------ */

static void kvc_quantize_row_q8_0(const float *x, uint8_t *y, int64_t n) {
    for (int64_t b = 0; b < n / KVC_QK; b++, x += KVC_QK, y += 34) {
        float amax = 0.0f;
        for (int j = 0; j < KVC_QK; j++) {
            const float a = fabsf(x[j]);
            amax = amax > a ? amax : a;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        kvc_le_put_u16(y, kvc_f32_to_f16(d));
        for (int j = 0; j < KVC_QK; j++) {
            float r = roundf(x[j] * id); /* halves away from zero */
            /* |x * id| <= 127 up to rounding; the caps only guard degenerate scales */
            if (r != r) {
                r = 0.0f;
            } else if (r > 127.0f) {
                r = 127.0f;
            } else if (r < -128.0f) {
                r = -128.0f;
            }
            y[2 + j] = (uint8_t)(int8_t)(int)r;
        }
    }
}

static void kvc_dequantize_row_q8_0(const uint8_t *x, float *y, int64_t n) {
    for (int64_t b = 0; b < n / KVC_QK; b++, x += 34, y += KVC_QK) {
        const float d = kvc_f16_to_f32(kvc_le_get_u16(x));
        for (int j = 0; j < KVC_QK; j++) {
            y[j] = (float)(int8_t)x[2 + j] * d;
        }
    }
}

/* ---- iq4_nl ---------------------------------------------------------------- */

/* Index of the table value nearest to v (the upper one on an exact tie). */
static inline int kvc_iq4nl_nearest(float v) {
    const int8_t *t = kvc_iq4nl_values;
    if (v <= (float)t[0]) return 0;
    if (v >= (float)t[15]) return 15;
    int lo = 0, hi = 15; /* t[lo] <= v < t[hi] */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (v < (float)t[mid]) hi = mid; else lo = mid;
    }
    return v - (float)t[lo] < (float)t[hi] - v ? lo : hi;
}

/* ggml's reference iq4_nl quantizer: first scale from the extreme element
 * (mapped onto -127), then the scale refitted by weighted least squares
 * (weights x^2) for those indices; the indices are kept. */
static void kvc_quantize_row_iq4_nl(const float *x, uint8_t *y, int64_t n) {
    uint8_t L[KVC_QK];
    for (int64_t b = 0; b < n / KVC_QK; b++, x += KVC_QK, y += 18) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < KVC_QK; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        float d = 0.0f;
        if (amax < 1e-15f) {
            /* scale 0: every index decodes to 0; take the one nearest 0 */
            memset(L, 8, sizeof L);
        } else {
            const float d0 = max / (float)kvc_iq4nl_values[0];
            const float id = 1.0f / d0;
            float sumqx = 0.0f, sumq2 = 0.0f;
            for (int j = 0; j < KVC_QK; j++) {
                const int l = kvc_iq4nl_nearest(id * x[j]);
                const float q = (float)kvc_iq4nl_values[l];
                const float w = x[j] * x[j];
                const float wq = w * q;
                const float wqx = wq * x[j];
                const float wqq = wq * q;
                L[j] = (uint8_t)l;
                sumqx += wqx;
                sumq2 += wqq;
            }
            d = sumqx / sumq2;
        }
        kvc_le_put_u16(y, kvc_f32_to_f16(d));
        for (int j = 0; j < KVC_QK / 2; j++) {
            y[2 + j] = (uint8_t)(L[j] | (L[j + KVC_QK / 2] << 4));
        }
    }
}

static void kvc_dequantize_row_iq4_nl(const uint8_t *x, float *y, int64_t n) {
    for (int64_t b = 0; b < n / KVC_QK; b++, x += 18, y += KVC_QK) {
        const float d = kvc_f16_to_f32(kvc_le_get_u16(x));
        for (int j = 0; j < KVC_QK / 2; j++) {
            y[j] = d * (float)kvc_iq4nl_values[x[2 + j] & 0x0f];
            y[j + KVC_QK / 2] = d * (float)kvc_iq4nl_values[x[2 + j] >> 4];
        }
    }
}

/* ---- dispatch -------------------------------------------------------------- */

int kvc_type_is_quantized(int32_t type) {
    const kvc_type_info *t = kvc_type_get(type);
    return t != NULL && t->blck_size > 1;
}

int kvc_dequantize_row(int32_t type, const void *src, float *dst, int64_t n) {
    const kvc_type_info *t = kvc_type_get(type);
    const uint8_t *s = (const uint8_t *)src;
    if (!t || n < 0 || n % t->blck_size != 0) {
        return KVC_E_ARG;
    }
    switch (type) {
    case KVC_TYPE_F32:
        memcpy(dst, s, (size_t)n * sizeof(float));
        break;
    case KVC_TYPE_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = kvc_f16_to_f32(kvc_le_get_u16(s + 2 * i));
        break;
    case KVC_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = kvc_bf16_to_f32(kvc_le_get_u16(s + 2 * i));
        break;
    case KVC_TYPE_Q4_0:   kvc_dequantize_row_q4_0(s, dst, n); break;
    case KVC_TYPE_Q4_1:   kvc_dequantize_row_q4_1(s, dst, n); break;
    case KVC_TYPE_Q5_0:   kvc_dequantize_row_q5_0(s, dst, n); break;
    case KVC_TYPE_Q5_1:   kvc_dequantize_row_q5_1(s, dst, n); break;
    case KVC_TYPE_Q8_0:   kvc_dequantize_row_q8_0(s, dst, n); break;
    case KVC_TYPE_IQ4_NL: kvc_dequantize_row_iq4_nl(s, dst, n); break;
    default:
        return KVC_E_ARG;
    }
    return KVC_OK;
}

int kvc_quantize_row(int32_t type, const float *src, void *dst, int64_t n) {
    const kvc_type_info *t = kvc_type_get(type);
    uint8_t *d = (uint8_t *)dst;
    if (!t || n < 0 || n % t->blck_size != 0) {
        return KVC_E_ARG;
    }
    switch (type) {
    case KVC_TYPE_F32:
        memcpy(d, src, (size_t)n * sizeof(float));
        break;
    case KVC_TYPE_F16:
        for (int64_t i = 0; i < n; i++) kvc_le_put_u16(d + 2 * i, kvc_f32_to_f16(src[i]));
        break;
    case KVC_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) kvc_le_put_u16(d + 2 * i, kvc_f32_to_bf16(src[i]));
        break;
    case KVC_TYPE_Q4_0:   kvc_quantize_row_q4_0(src, d, n); break;
    case KVC_TYPE_Q4_1:   kvc_quantize_row_q4_1(src, d, n); break;
    case KVC_TYPE_Q5_0:   kvc_quantize_row_q5_0(src, d, n); break;
    case KVC_TYPE_Q5_1:   kvc_quantize_row_q5_1(src, d, n); break;
    case KVC_TYPE_Q8_0:   kvc_quantize_row_q8_0(src, d, n); break;
    case KVC_TYPE_IQ4_NL: kvc_quantize_row_iq4_nl(src, d, n); break;
    default:
        return KVC_E_ARG;
    }
    return KVC_OK;
}
