#include "kvc_rope.h"
#include "kvc_quant.h"

#include <math.h>
#include <string.h>

/* The reference evaluates these expressions unfused; keep the roundings it has. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(_MSC_VER)
#pragma fp_contract(off)
#endif

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

void kvc_rope_params_init(kvc_rope_params *p, int32_t n_rot) {
    p->n_rot = n_rot;
    p->mode = KVC_ROPE_NORMAL;
    p->n_ctx_orig = 0;
    p->freq_base = 10000.0f;
    p->freq_scale = 1.0f;
    p->ext_factor = 0.0f;
    p->attn_factor = 1.0f;
    p->beta_fast = 32.0f;
    p->beta_slow = 1.0f;
    p->freq_factors = NULL;
}

int kvc_rope_params_check(const kvc_rope_params *p, uint32_t head_dim) {
    if (p == NULL || p->n_rot < 0 || p->n_rot % 2 != 0 || (uint32_t)p->n_rot > head_dim) {
        return KVC_E_ARG;
    }
    if (p->mode != KVC_ROPE_NORMAL && p->mode != KVC_ROPE_NEOX) {
        return KVC_E_ARG;
    }
    if (p->n_ctx_orig < 0 || !(p->freq_base > 0.0f) || !(p->freq_scale > 0.0f)) {
        return KVC_E_ARG;
    }
    return KVC_OK;
}

/* Pair index at which the rotation of n_rot dims completes n_rot_turns turns over
 * n_ctx_orig positions (YaRN's correction dimension). */
static float kvc_rope_corr_dim(int32_t n_rot, int32_t n_ctx_orig, float n_turns, float base) {
    const float turns = n_turns * 2.0f * (float)M_PI;
    return (float)n_rot * logf((float)n_ctx_orig / turns) / (2.0f * logf(base));
}

void kvc_rope_corr_dims(int32_t n_rot, int32_t n_ctx_orig, float freq_base,
                        float beta_fast, float beta_slow, float dims[2]) {
    const float start = floorf(kvc_rope_corr_dim(n_rot, n_ctx_orig, beta_fast, freq_base));
    const float end = ceilf(kvc_rope_corr_dim(n_rot, n_ctx_orig, beta_slow, freq_base));
    const float last = (float)(n_rot - 1);
    /* comparisons written the reference's way round, so -0 and nan pass alike */
    dims[0] = 0.0f > start ? 0.0f : start;
    dims[1] = last < end ? last : end;
}

/* YaRN ramp: 1 below the correction range, 0 above it, linear in between. */
static inline float kvc_rope_ramp(float low, float high, int32_t pair) {
    const float width = high - low;
    const float y = ((float)pair - low) / (0.001f > width ? 0.001f : width);
    const float lo = 0.0f > y ? 0.0f : y;
    return 1.0f - (1.0f < lo ? 1.0f : lo);
}

/* Everything about the angles that does not depend on the position. */
typedef struct kvc_rope_consts {
    float theta_scale; /* per-pair frequency step freq_base^(-2/n_rot) */
    float corr[2];     /* YaRN ramp range */
    float mscale;      /* magnitude of cos / sin */
} kvc_rope_consts;

static void kvc_rope_consts_init(const kvc_rope_params *p, kvc_rope_consts *c) {
    c->theta_scale = powf(p->freq_base, -2.0f / (float)p->n_rot);
    kvc_rope_corr_dims(p->n_rot, p->n_ctx_orig, p->freq_base, p->beta_fast, p->beta_slow, c->corr);
    c->mscale = p->attn_factor;
    if (p->ext_factor != 0.0f) {
        const float boost = 0.1f * logf(1.0f / p->freq_scale);
        c->mscale *= 1.0f + boost;
    }
}

static void kvc_rope_angles_c(const kvc_rope_params *p, const kvc_rope_consts *c, int32_t pos, float *cs) {
    /* the step is applied by repeated multiplication, as the reference does: the
     * rounding of the recurrence is part of the result */
    float theta = (float)pos;
    for (int32_t i = 0; i < p->n_rot / 2; i++) {
        const float extrap = p->freq_factors ? theta / p->freq_factors[i] : theta;
        const float interp = p->freq_scale * extrap;
        float angle = interp;
        if (p->ext_factor != 0.0f) {
            const float mix = kvc_rope_ramp(c->corr[0], c->corr[1], i) * p->ext_factor;
            const float a = interp * (1.0f - mix);
            const float b = extrap * mix;
            angle = a + b;
        }
        cs[2 * i + 0] = cosf(angle) * c->mscale;
        cs[2 * i + 1] = sinf(angle) * c->mscale;
        theta *= c->theta_scale;
    }
}

void kvc_rope_angles(const kvc_rope_params *p, int32_t pos, float *cs) {
    kvc_rope_consts c;
    kvc_rope_consts_init(p, &c);
    kvc_rope_angles_c(p, &c, pos, cs);
}

/* Rotate the first n_rot elements of one head held as f32. */
static inline void kvc_rope_rotate(float *x, int32_t n_rot, int32_t mode, const float *cs) {
    const int32_t half = n_rot / 2;
    /* normal mode pairs (2i, 2i+1); neox pairs (i, i + half) */
    const int32_t step = mode == KVC_ROPE_NEOX ? 1 : 2;
    const int32_t off = mode == KVC_ROPE_NEOX ? half : 1;
    for (int32_t i = 0; i < half; i++) {
        float *a = x + i * step;
        const float x0 = a[0], x1 = a[off];
        const float c = cs[2 * i], s = cs[2 * i + 1];
        const float c0 = x0 * c, s1 = x1 * s, s0 = x0 * s, c1 = x1 * c;
        a[0] = c0 - s1;
        a[off] = s0 + c1;
    }
}

size_t kvc_rope_scratch_floats(uint32_t n_head, uint32_t head_dim, int32_t n_rot) {
    /* angles of one row, then one decoded row */
    return (size_t)(n_rot > 0 ? n_rot : 0) + (size_t)n_head * head_dim;
}

int kvc_rope_shift_rows(int32_t type, uint8_t *k, uint32_t n_rows, uint32_t n_head,
                        uint32_t head_dim, size_t row_stride_bytes, const int32_t *shift,
                        const kvc_rope_params *p, float *scratch) {
    const kvc_type_info *t = kvc_type_get(type);
    if (t == NULL || kvc_rope_params_check(p, head_dim) != KVC_OK) {
        return KVC_E_ARG;
    }
    if (head_dim == 0 || head_dim % t->blck_size != 0) {
        return KVC_E_ARG;
    }
    const size_t head_bytes = kvc_row_size(type, head_dim);
    const size_t row_bytes = head_bytes * n_head;
    if (n_rows == 0 || n_head == 0) {
        return KVC_OK;
    }
    if (k == NULL || shift == NULL || row_stride_bytes < row_bytes) {
        return KVC_E_ARG;
    }

    float *owned = NULL;
    if (scratch == NULL) {
        owned = (float *)kvc_malloc_n(kvc_rope_scratch_floats(n_head, head_dim, p->n_rot), sizeof(float));
        if (owned == NULL) {
            return KVC_E_NOMEM;
        }
        scratch = owned;
    }
    float *cs = scratch;
    float *row = scratch + (p->n_rot > 0 ? p->n_rot : 0);
    const int32_t n_rot = p->n_rot;
    const int quantized = t->blck_size > 1;

    kvc_rope_consts c;
    kvc_rope_consts_init(p, &c);

    for (uint32_t r = 0; r < n_rows; r++) {
        uint8_t *dst = k + (size_t)r * row_stride_bytes;
        /* rows sharing a shift share the angles */
        if (r == 0 || shift[r] != shift[r - 1]) {
            kvc_rope_angles_c(p, &c, shift[r], cs);
        }
        if (quantized) {
            const int64_t n = (int64_t)n_head * head_dim;
            kvc_dequantize_row(type, dst, row, n);
            for (uint32_t h = 0; h < n_head; h++) {
                kvc_rope_rotate(row + (size_t)h * head_dim, n_rot, p->mode, cs);
            }
            kvc_quantize_row(type, row, dst, n);
            continue;
        }
        /* float types: only the rotated elements are read and written back, so the
         * other dimensions keep their exact bytes */
        for (uint32_t h = 0; h < n_head; h++) {
            uint8_t *head = dst + (size_t)h * head_bytes;
            kvc_dequantize_row(type, head, row, n_rot);
            kvc_rope_rotate(row, n_rot, p->mode, cs);
            kvc_quantize_row(type, row, head, n_rot);
        }
    }
    kvc_free(owned);
    return KVC_OK;
}
