/* Tests of the KQ mask (csrc/kvc_mask.c) against its definition computed cell by cell: a token
 * sees a cell when the cell holds the token's first sequence id, is not in its future (causal)
 * and not outside the sliding window (standard or chunked); visible is 0 (f32, f16), -|p0 - p1|
 * with ALiBi, or 1 (bool); everything else and the padding rows are -inf / 0; with and without
 * padding rows, dense or with a row stride (the gaps untouched). Random tables of
 * up to 256 sequences and ubatches of few and many tokens per sequence (the rows built from a
 * base row and its edges, and the rows computed directly), every output type. */
#include "kvc_mask.h"
#include "kvc_slot.h"
#include "kvc_unified.h"
#include "kvc_types.h"
#include "kvc_unified_ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define SIZE 256

static bool naive_masked_swa(int32_t swa_type, uint32_t n_swa, int64_t p0, int64_t p1) {
    if (swa_type == KVC_SWA_STANDARD) {
        return p1 - p0 >= (int64_t)n_swa;
    }
    if (swa_type == KVC_SWA_CHUNKED) {
        return p0 < (p1 / n_swa) * n_swa;
    }
    return false;
}

/* The expected element (t, i) as bytes of dtype. */
static void expect(const kvc_unified *c, const kvc_ubatch *ub, uint32_t t, uint32_t i, bool causal, bool alibi,
                   int dtype, uint8_t *out) {
    bool seen = false;
    int32_t p0 = 0, p1 = 0;
    if (t < ub->n_tokens) {
        const int32_t s = ub->seq_ids[ub->seq_off[t / ub->n_seq_tokens]];
        p0 = c->cells.pos[i];
        p1 = ub->pos[t];
        seen = p0 != -1 && kvc_cells_seq_has(&c->cells, i, s) && !(causal && p0 > p1) &&
               !naive_masked_swa(c->swa_type, c->n_swa, p0, p1);
    }
    /* the distance negated as an integer: distance 0 is +0.0, as the reference has it */
    const float f = seen ? (alibi ? (float)(-abs(p0 - p1)) : 0.0f) : -INFINITY;
    if (dtype == KVC_MASK_F32) {
        memcpy(out, &f, 4);
    } else if (dtype == KVC_MASK_F16) {
        const uint16_t h = kvc_f32_to_f16(f);
        memcpy(out, &h, 2);
    } else {
        out[0] = seen;
    }
}

static int make(kvc_unified *c, uint32_t n_seq_max, int32_t swa_type, uint32_t n_swa) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { 4 };
    const kvc_unified_params p = {
        .kv_size = SIZE, .n_seq_max = n_seq_max, .n_pad = 1, .n_swa = n_swa, .swa_type = swa_type,
        .type_k = KVC_TYPE_F16, .type_v = KVC_TYPE_F16, .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    return kvc_unified_init(c, &p, NULL);
}

/* Random cells: each position of each of n_seq sequences in one cell, some cells shared, holes. */
static void fill(kvc_unified *c, uint32_t n_seq, const int32_t *ids) {
    int32_t next[8] = { 0 };
    for (uint32_t i = 0; i < SIZE; i++) {
        if (check_rand(5) == 0) {
            continue;
        }
        const uint32_t k = check_rand(n_seq);
        kvc_cells_pos_set(&c->cells, i, next[k]);
        next[k] += 1 + (int32_t)check_rand(2);
        kvc_cells_seq_add(&c->cells, i, ids[k]);
        if (check_rand(6) == 0) {
            kvc_cells_seq_add(&c->cells, i, ids[(k + 1) % n_seq]);
        }
    }
    c->n = SIZE - 8 * check_rand(3);   /* the attended span, as a find_slot leaves it */
}

/* The mask with pad (rows padded to KVC_KQ_MASK_PAD) or without, rows `gap` elements apart
 * beyond c->n (0: dense); the gaps and the byte past the last row keep their 0xab. */
static void check_layout(const kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype, bool pad,
                         uint32_t gap, const char *what) {
    const size_t el = dtype == KVC_MASK_F32 ? 4 : dtype == KVC_MASK_F16 ? 2 : 1;
    const uint32_t rows = pad ? (ub->n_tokens + KVC_KQ_MASK_PAD - 1) / KVC_KQ_MASK_PAD * KVC_KQ_MASK_PAD : ub->n_tokens;
    const size_t stride = ((size_t)c->n + gap) * el;
    const size_t n = (size_t)rows * stride;
    uint8_t *got = malloc(n + 1), *want = malloc(n + 1);
    memset(got, 0xab, n + 1);
    memset(want, 0xab, n + 1);
    REQUIRE(kvc_unified_kq_mask(c, ub, causal, alibi, dtype, pad, gap ? stride : 0, got) == KVC_OK, "%s: mask", what);
    for (uint32_t t = 0; t < rows; t++) {
        for (uint32_t i = 0; i < c->n; i++) {
            expect(c, ub, t, i, causal, alibi, dtype, want + (size_t)t * stride + (size_t)i * el);
        }
    }
    size_t at = 0;
    while (at < n && got[at] == want[at]) {
        at++;
    }
    CHECK(at == n, "%s, pad %d, gap %u: first difference at byte %zu (row %zu, byte %zu)", what, pad, gap, at,
          at / stride, at % stride);
    CHECK(got[n] == 0xab, "%s: written past the mask", what);
    free(got);
    free(want);
}

static void check_one(const kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype,
                      const char *what) {
    check_layout(c, ub, causal, alibi, dtype, true, 0, what);
    check_layout(c, ub, causal, alibi, dtype, false, 0, what);
    check_layout(c, ub, causal, alibi, dtype, false, 7, what);
    check_layout(c, ub, causal, alibi, dtype, true, 16, what);
}

static void run(uint32_t n_seq_max, int32_t swa_type, uint32_t n_swa) {
    kvc_unified c;
    char what[128];
    REQUIRE(make(&c, n_seq_max, swa_type, n_swa) == KVC_OK, "init");
    /* sequences from every word of the set */
    int32_t ids[4] = { 0, (int32_t)n_seq_max - 1, (int32_t)(n_seq_max / 2), n_seq_max > 64 ? 64 : 1 };
    const uint32_t n_seq = n_seq_max < 4 ? n_seq_max : 4;
    if (n_seq_max < 4) {
        for (uint32_t k = 0; k < 4; k++) {
            ids[k] = (int32_t)(k % n_seq_max);
        }
    }
    fill(&c, n_seq, ids);
    static int32_t pos[600], sid[600];
    static uint32_t off[601];
    for (int shape = 0; shape < 8; shape++) {
        /* decode (one token per sequence), a prompt chunk of one sequence, interleaved long rows;
         * shapes 6 and 7 continue the sequences past every cell, so that most of a sequence's
         * rows share one base row (the edge path) */
        const uint32_t n_tokens = shape < 2 ? n_seq : shape < 4 ? 40 + check_rand(30) : shape < 6 ? 300 + check_rand(200) : 64 + check_rand(64);
        for (uint32_t t = 0; t < n_tokens; t++) {
            const uint32_t k = shape == 2 || shape == 6 ? 1 % n_seq : t % n_seq;
            sid[t] = ids[k];
            pos[t] = (int32_t)(shape >= 6 ? 400 + t / n_seq : shape >= 4 ? t / n_seq + check_rand(3) : check_rand(150));
            off[t] = t;
        }
        off[n_tokens] = n_tokens;
        const kvc_ubatch ub = { n_tokens, 1, n_tokens, pos, off, sid, NULL, NULL, NULL };
        for (int dtype = 0; dtype < 3; dtype++) {
            for (int flags = 0; flags < 4; flags++) {
                snprintf(what, sizeof what, "%u seqs, swa %d/%u, shape %d, dtype %d, causal %d, alibi %d", n_seq_max,
                         swa_type, n_swa, shape, dtype, !(flags & 1), (flags >> 1) & 1);
                check_one(&c, &ub, !(flags & 1), (flags >> 1) & 1, dtype, what);
            }
        }
    }
    /* groups of tokens (an equal split): a group's rows use its first id */
    for (uint32_t g = 0; g < 4; g++) {
        for (uint32_t j = 0; j < 5; j++) {
            pos[g * 5 + j] = 20 + (int32_t)j;
        }
        off[g] = 2 * g;
        sid[2 * g] = ids[g % n_seq];
        sid[2 * g + 1] = ids[(g + 1) % n_seq];
    }
    off[4] = 8;
    const kvc_ubatch eq = { 20, 5, 4, pos, off, sid, NULL, NULL, NULL };
    check_one(&c, &eq, true, false, KVC_MASK_F32, "equal split");
    kvc_unified_free(&c);
}

int main(void) {
    run(1, KVC_SWA_NONE, 0);
    run(4, KVC_SWA_STANDARD, 16);
    run(64, KVC_SWA_CHUNKED, 32);
    run(65, KVC_SWA_NONE, 0);
    run(200, KVC_SWA_STANDARD, 5);
    run(256, KVC_SWA_CHUNKED, 7);
    printf("test_mask: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
