/* Tests of the K-shift (csrc/kvc_rope.c) and the row codecs (csrc/kvc_quant.c) at the C
 * level: status codes, untouched data on every rejected call and on allocation failure,
 * caller scratch versus internal scratch, known block encodings and simple rotations. */
#include "kvc_quant.h"
#include "kvc_rope.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "check.h"

#define N_ROWS 6
#define N_HEAD 2
#define HEAD_DIM 32

/* deterministic pseudo-random keys in [-2, 2) */
static void fill_keys(float *x, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (float)(seed >> 8) / (float)(1u << 24) * 4.0f - 2.0f;
    }
}

static void test_rejections_leave_rows_unchanged(void) {
    float k[N_ROWS * N_HEAD * HEAD_DIM], orig[N_ROWS * N_HEAD * HEAD_DIM];
    int32_t shift[N_ROWS] = { 0, 1, 2, 3, 4, 5 };
    const size_t stride = sizeof(float) * N_HEAD * HEAD_DIM;
    kvc_rope_params p;
    fill_keys(k, sizeof k / sizeof k[0], 1);
    memcpy(orig, k, sizeof k);

    kvc_rope_params_init(&p, 34); /* n_rot > head_dim */
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride, shift, &p, NULL) == KVC_E_ARG, "n_rot");
    kvc_rope_params_init(&p, 7); /* odd */
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride, shift, &p, NULL) == KVC_E_ARG, "odd");
    kvc_rope_params_init(&p, 16);
    p.mode = 1;
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride, shift, &p, NULL) == KVC_E_ARG, "mode");
    kvc_rope_params_init(&p, 16);
    p.freq_scale = 0.0f;
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride, shift, &p, NULL) == KVC_E_ARG, "scale");
    kvc_rope_params_init(&p, 16);
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride - 4, shift, &p, NULL) == KVC_E_ARG, "stride");
    CHECK(kvc_rope_shift_rows(99, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride, shift, &p, NULL) == KVC_E_ARG, "type");
    CHECK(kvc_rope_shift_rows(KVC_TYPE_Q8_0, (uint8_t *)k, 2, 1, 16, 64, shift, &p, NULL) == KVC_E_ARG, "partial block");
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride, NULL, &p, NULL) == KVC_E_ARG, "shift");
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride, shift, NULL, NULL) == KVC_E_ARG, "params");

    kvc_fail_alloc_after = 1;
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)k, N_ROWS, N_HEAD, HEAD_DIM, stride, shift, &p, NULL) == KVC_E_NOMEM, "nomem");
    kvc_fail_alloc_after = 0;
    CHECK(memcmp(k, orig, sizeof k) == 0, "a rejected call changed the rows");
}

static void test_scratch_and_types(void) {
    const int32_t types[] = { KVC_TYPE_F32, KVC_TYPE_F16, KVC_TYPE_BF16, KVC_TYPE_Q8_0, KVC_TYPE_Q4_0,
                              KVC_TYPE_Q4_1, KVC_TYPE_Q5_0, KVC_TYPE_Q5_1, KVC_TYPE_IQ4_NL };
    const int64_t n = (int64_t)N_ROWS * N_HEAD * HEAD_DIM;
    float x[N_ROWS * N_HEAD * HEAD_DIM], back[N_ROWS * N_HEAD * HEAD_DIM];
    float scratch[64 + N_HEAD * HEAD_DIM];
    uint8_t a[N_ROWS * N_HEAD * HEAD_DIM * 4], b[sizeof a];
    int32_t shift[N_ROWS] = { 0, -3, 7, 7, 100, -1000 };
    const float factors[12] = { 1, 2, 0.5f, 4, 1, 1, 8, 1, 1, 1.5f, 1, 1 };
    kvc_rope_params p;
    kvc_rope_params_init(&p, 24);
    p.mode = KVC_ROPE_NEOX;
    p.ext_factor = 0.5f;
    p.freq_scale = 0.25f;
    p.n_ctx_orig = 4096;
    p.freq_factors = factors;
    CHECK(kvc_rope_scratch_floats(N_HEAD, HEAD_DIM, 24) <= sizeof scratch / sizeof scratch[0], "scratch size");
    fill_keys(x, (size_t)n, 2);
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const size_t row = kvc_row_size(types[t], N_HEAD * HEAD_DIM);
        CHECK(kvc_quantize_row(types[t], x, a, n) == KVC_OK, "quantize %d", types[t]);
        memcpy(b, a, row * N_ROWS);
        CHECK(kvc_rope_shift_rows(types[t], a, N_ROWS, N_HEAD, HEAD_DIM, row, shift, &p, NULL) == KVC_OK, "own scratch");
        CHECK(kvc_rope_shift_rows(types[t], b, N_ROWS, N_HEAD, HEAD_DIM, row, shift, &p, scratch) == KVC_OK, "caller scratch");
        CHECK(memcmp(a, b, row * N_ROWS) == 0, "scratch changes the result for type %d", types[t]);
        CHECK(kvc_dequantize_row(types[t], a, back, n) == KVC_OK, "dequantize %d", types[t]);
        /* a rotation keeps the norm of every rotated pair: compare whole-row norms loosely */
        double n0 = 0, n1 = 0;
        for (int64_t i = 0; i < HEAD_DIM * N_HEAD; i++) {
            n0 += (double)x[i] * x[i];
            n1 += (double)back[i] * back[i];
        }
        const double g = 1.0 + 0.1 * log(1.0 / 0.25); /* YaRN magnitude, row 0 has shift 0 */
        CHECK(fabs(sqrt(n1) - sqrt(n0)) < 0.2 * sqrt(n0) * g, "row norm of type %d: %g vs %g", types[t], n1, n0);
    }
}

static void test_rotation_and_pairing(void) {
    float x[8] = { 1, 2, 0, 0, 3, 0, 0, 0 }, y[8];
    const int32_t shift = 1;
    kvc_rope_params p;
    kvc_rope_params_init(&p, 8);
    memcpy(y, x, sizeof x);
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)y, 1, 1, 8, sizeof y, &shift, &p, NULL) == KVC_OK, "normal");
    CHECK(fabsf(y[0] - (cosf(1) - 2 * sinf(1))) < 1e-6f && fabsf(y[1] - (sinf(1) + 2 * cosf(1))) < 1e-6f,
          "pair (0, 1): %g %g", y[0], y[1]);
    p.mode = KVC_ROPE_NEOX;
    memcpy(y, x, sizeof x);
    CHECK(kvc_rope_shift_rows(KVC_TYPE_F32, (uint8_t *)y, 1, 1, 8, sizeof y, &shift, &p, NULL) == KVC_OK, "neox");
    CHECK(fabsf(y[0] - (cosf(1) - 3 * sinf(1))) < 1e-6f && fabsf(y[4] - (sinf(1) + 3 * cosf(1))) < 1e-6f,
          "pair (0, 4): %g %g", y[0], y[4]);

    float dims[2];
    kvc_rope_corr_dims(64, 4096, 10000.0f, 32.0f, 1.0f, dims);
    CHECK(dims[0] == 10.0f && dims[1] == 23.0f, "corr dims %g %g", dims[0], dims[1]);
}

static void test_known_blocks(void) {
    float x[32] = { 0 }, y[32];
    uint8_t q[34];
    x[0] = 127.0f;
    x[1] = 2.5f;
    x[2] = -2.5f;
    kvc_quantize_row(KVC_TYPE_Q8_0, x, q, 32);
    CHECK(q[0] == 0x00 && q[1] == 0x3c, "q8_0 scale 1.0 as f16: %02x %02x", q[0], q[1]);
    CHECK((int8_t)q[2] == 127 && (int8_t)q[3] == 3 && (int8_t)q[4] == -3, "q8_0 halves away from zero");
    kvc_dequantize_row(KVC_TYPE_Q8_0, q, y, 32);
    CHECK(y[1] == 3.0f && y[2] == -3.0f, "q8_0 decode");

    memset(x, 0, sizeof x);
    x[5] = -8.0f;  /* d = 1, so element j maps to nibble x + 8 */
    x[20] = 7.0f;
    kvc_quantize_row(KVC_TYPE_Q4_0, x, q, 32);
    CHECK(q[0] == 0x00 && q[1] == 0x3c, "q4_0 scale");
    CHECK(q[2 + 5] == (0x0 | 0x8 << 4) && q[2 + 4] == (0x8 | 0xf << 4), "q4_0 nibbles %02x %02x", q[7], q[6]);
    CHECK(kvc_quantize_row(KVC_TYPE_Q4_0, x, q, 31) == KVC_E_ARG, "partial block");
    CHECK(kvc_quantize_row(12345, x, q, 32) == KVC_E_ARG, "unknown type");
    CHECK(kvc_type_is_quantized(KVC_TYPE_IQ4_NL) == 1 && kvc_type_is_quantized(KVC_TYPE_BF16) == 0, "is_quantized");
}

int main(void) {
    test_rejections_leave_rows_unchanged();
    test_scratch_and_types();
    test_rotation_and_pairing();
    test_known_blocks();
    printf("%d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
