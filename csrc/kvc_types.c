#include "kvc_types.h"

#include <string.h>

static const kvc_type_info kvc_type_table[] = {
    { KVC_TYPE_F32,    "f32",     1,  4 },
    { KVC_TYPE_F16,    "f16",     1,  2 },
    { KVC_TYPE_Q4_0,   "q4_0",   32, 18 },
    { KVC_TYPE_Q4_1,   "q4_1",   32, 20 },
    { KVC_TYPE_Q5_0,   "q5_0",   32, 22 },
    { KVC_TYPE_Q5_1,   "q5_1",   32, 24 },
    { KVC_TYPE_Q8_0,   "q8_0",   32, 34 },
    { KVC_TYPE_IQ4_NL, "iq4_nl", 32, 18 },
    { KVC_TYPE_BF16,   "bf16",    1,  2 },
};

#define KVC_N_TYPES (sizeof kvc_type_table / sizeof kvc_type_table[0])

size_t kvc_type_count(void) { return KVC_N_TYPES; }

const kvc_type_info *kvc_type_at(size_t i) { return i < KVC_N_TYPES ? &kvc_type_table[i] : NULL; }

const kvc_type_info *kvc_type_get(int32_t id) {
    for (size_t i = 0; i < KVC_N_TYPES; i++) {
        if (kvc_type_table[i].id == id) {
            return &kvc_type_table[i];
        }
    }
    return NULL;
}

const kvc_type_info *kvc_type_by_name(const char *name) {
    for (size_t i = 0; i < KVC_N_TYPES; i++) {
        if (strcmp(kvc_type_table[i].name, name) == 0) {
            return &kvc_type_table[i];
        }
    }
    return NULL;
}

size_t kvc_row_size(int32_t type, uint64_t n) {
    const kvc_type_info *t = kvc_type_get(type);
    uint64_t bytes;
    if (!t || n % t->blck_size != 0 || !kvc_size_mul(n / t->blck_size, t->type_size, &bytes)) {
        return 0;
    }
    return (size_t)bytes;
}

kvc_layer kvc_layer_geometry(int32_t il, int32_t type_k, int32_t type_v, uint32_t n_embd_k, uint32_t n_embd_v) {
    kvc_layer l;
    memset(&l, 0, sizeof l);
    l.il = il;
    l.n_embd_k = n_embd_k;
    l.n_embd_v = n_embd_v;
    l.k_row_bytes = kvc_row_size(type_k, n_embd_k);
    l.v_row_bytes = kvc_row_size(type_v, n_embd_v);
    return l;
}

static inline uint32_t kvc_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kvc_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float kvc_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp  = (h >> 10) & 0x1fu;
    const uint32_t man  = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 */
        const float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (exp == 31) {
        return kvc_bits_f32(sign | 0x7f800000u | (man << 13));
    }
    return kvc_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t kvc_f32_to_f16(float f) {
    const uint32_t x    = kvc_f32_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax   = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
        /* inf or nan (nan keeps a quiet payload bit) */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));
    }
    if (ax >= 0x477ff000u) {
        return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    }
    if (ax < 0x38800000u) {
        /* subnormal half (or zero): round ax * 2^24 to nearest even */
        const float v = kvc_bits_f32(ax) * 16777216.0f;
        /* v < 1024, exact in float; rint with ties-to-even via magic constant */
        const float r = (v + 8388608.0f) - 8388608.0f;
        return (uint16_t)(sign | (uint16_t)r);
    }
    /* normal: rebias exponent, round mantissa to nearest even */
    uint32_t m = ax + 0xc8000fffu + ((ax >> 13) & 1u); /* -(112 << 23) + 0xfff + lsb */
    return (uint16_t)(sign | (m >> 13));
}

float kvc_bf16_to_f32(uint16_t h) { return kvc_bits_f32((uint32_t)h << 16); }

uint16_t kvc_f32_to_bf16(float f) {
    uint32_t u = kvc_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((u >> 16) | 64u); /* force quiet nan, as ggml */
    }
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}
